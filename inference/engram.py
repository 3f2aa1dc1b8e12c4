"""Engram (docs/architecture.md §9): compressed token map, prime layout, n-gram row ids, sharded tables,
gate."""
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import nn
from tokenizers import Regex, Tokenizer, normalizers

from .config import ModelArgs
from .layers import Linear
from .parallel import ParallelContext
from .quant import ue8m0_to_float
from .state import ModelContext

DEAD = -1  # compressed id of a position that must not be hashed (image tokens, unwritten history)


class EngramError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------------------
# Compressed token map (docs/architecture.md §9.1)
# ---------------------------------------------------------------------------------------------------------

def engram_normalizer() -> normalizers.Normalizer:
    # The sentinel keeps a token that is exactly one space as " " instead of letting Strip empty it.
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), "\ue000"),
        normalizers.Strip(),
        normalizers.Replace("\ue000", " "),
    ])


def build_compressed_token_map(tokenizer: Tokenizer, expected_size: int = 0) -> Tuple[torch.Tensor, int]:
    """Map every token id to the index of its normalized text, numbered by first appearance.

    Returns (int64 map [len(tokenizer)], number of distinct keys). `expected_size` > 0 is asserted: a
    different count silently changes every hash, since the multipliers derive from it.
    """
    tok = getattr(tokenizer, "backend_tokenizer", tokenizer)  # accept a transformers fast tokenizer too
    n = tok.get_vocab_size(with_added_tokens=True)
    norm = engram_normalizer()
    keys = {}
    ids = []
    # One decode per id: measured as fast as decode_batch (the per-call cost is tiny) and identical.
    for t in range(n):
        text = tok.decode([t], skip_special_tokens=False)
        if "\ufffd" in text:  # partial UTF-8 byte token: key by the raw vocabulary string
            key = tok.id_to_token(t)
        else:
            key = norm.normalize_str(text) or text
        ids.append(keys.setdefault(key, len(keys)))
    if expected_size > 0 and len(keys) != expected_size:
        raise EngramError(f"Engram compressed token map has {len(keys)} distinct keys, but the config "
                          f"expects engram_compressed_vocab_size = {expected_size} (different tokenizer or "
                          f"tokenizers Unicode tables?)")
    return torch.tensor(ids, dtype=torch.int64), len(keys)


# ---------------------------------------------------------------------------------------------------------
# Layout: primes, offsets, multipliers (docs/architecture.md §9.2)
# ---------------------------------------------------------------------------------------------------------

def is_prime(n: int) -> bool:
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    # Miller-Rabin with these bases is deterministic for n < 3.3e24.
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


class EngramLayout:
    """Per Engram layer: primes [orders, heads], column offsets [cols] and odd multipliers [max_ngram].

    Column col = (n - 2) * n_heads + h for n-gram order n = 2..max_ngram and head h.
    """

    def __init__(self, args: ModelArgs, compressed_vocab_size: int):
        self.layer_ids: List[int] = list(args.engram_layer_ids)
        self.max_ngram = args.engram_max_ngram_size
        self.n_orders = self.max_ngram - 1
        self.n_heads = args.engram_n_heads
        self.n_cols = self.n_orders * self.n_heads
        self.pad_id = args.engram_pad_id
        self.compressed_vocab_size = compressed_vocab_size
        self.num_embeddings: List[int] = list(args.engram_num_embeddings)
        if len(self.num_embeddings) != len(self.layer_ids):
            raise EngramError(f"engram_num_embeddings has {len(self.num_embeddings)} entries but "
                              f"engram_layer_ids has {len(self.layer_ids)}")

        # Primes: one global `seen` set, so the search never hands out a prime twice across layers/orders.
        seen = set()
        primes = []
        for i, layer_id in enumerate(self.layer_ids):
            layer = []
            for _ in range(self.n_orders):
                c = args.engram_vocab_size - 1
                order = []
                for _ in range(self.n_heads):
                    c += 1
                    while c in seen or not is_prime(c):
                        c += 1
                    seen.add(c)
                    order.append(c)
                layer.append(order)
            total = sum(map(sum, layer))
            if total != self.num_embeddings[i]:
                raise EngramError(f"Engram layer {layer_id}: the primes sum to {total} rows, but "
                                  f"engram_num_embeddings[{i}] = {self.num_embeddings[i]}")
            primes.append(layer)
        # On the CPU even under a device context: a small host table (and a cumsum on the meta device would
        # go through a decomposition that imports torch._dynamo, a second of start-up).
        self.primes = torch.tensor(primes, dtype=torch.int64, device="cpu").view(len(self.layer_ids),
                                                                                 self.n_orders, self.n_heads)
        flat = self.primes.flatten(1)  # [n_layers, cols]
        self.offsets = torch.cumsum(flat, dim=1) - flat  # exclusive prefix sums

        # Multipliers: odd, and small enough that (compressed id) * m never overflows int64.
        bound = max(1, ((2**63 - 1) // compressed_vocab_size) // 2)
        mults = [np.random.default_rng(10007 * layer_id).integers(0, bound, size=self.max_ngram,
                                                                  dtype=np.int64) * 2 + 1
                 for layer_id in self.layer_ids]
        self.multipliers = torch.from_numpy(np.stack(mults)).to(torch.int64)  # [n_layers, max_ngram]

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)


# ---------------------------------------------------------------------------------------------------------
# Hashing (docs/architecture.md §9.3)
# ---------------------------------------------------------------------------------------------------------

class EngramHasher(nn.Module):
    """Turns token ids into Engram table rows, keeping each batch row's compressed ids across calls.

    All state lives in non-persistent buffers: it follows the model across devices and never appears in a
    state_dict. Unwritten history reads as DEAD, which blocks look-back like an image position.
    """

    def __init__(self, args: ModelArgs, token_map: torch.Tensor, compressed_vocab_size: int):
        super().__init__()
        expected = args.engram_compressed_vocab_size
        if expected > 0 and compressed_vocab_size != expected:
            raise EngramError(f"Engram compressed vocabulary is {compressed_vocab_size}, but the config "
                              f"expects engram_compressed_vocab_size = {expected}")
        self.layout = EngramLayout(args, compressed_vocab_size)
        self.max_batch_size = args.max_batch_size
        self.max_seq_len = args.max_seq_len
        self.vocab = token_map.numel()
        self.pad = int(token_map[args.engram_pad_id])
        lay = self.layout
        buffers = {
            "token_map": token_map.to(torch.int64).clone(),  # [vocab]
            "primes": lay.primes.flatten(1).clone(),  # [n_layers, cols]
            "offsets": lay.offsets.clone(),  # [n_layers, cols]
            "multipliers": lay.multipliers.clone(),  # [n_layers, max_ngram]
            "ids": torch.full((args.max_batch_size, args.max_seq_len), DEAD, dtype=torch.int64),  # [B, T]
        }
        for name, t in buffers.items():
            self.register_buffer(name, t, persistent=False)

    @classmethod
    def from_tokenizer(cls, args: ModelArgs, tokenizer: Tokenizer) -> "EngramHasher":
        token_map, size = build_compressed_token_map(tokenizer, args.engram_compressed_vocab_size)
        return cls(args, token_map, size)

    def reset(self) -> None:
        self.ids.fill_(DEAD)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, start_pos: int, token_mask: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, rows: Optional[slice] = None) -> torch.Tensor:
        """Rows [B, S, n_engram_layers, (max_ngram - 1) * n_heads] int64, offsets included. `positions` [S]:
        the call's positions as a device tensor (a CUDA graph's decode step), instead of start_pos; [B, 1]:
        each row's own. `rows`: the history's batch rows of the call's rows (default the first B)."""
        bsz, seqlen = input_ids.shape
        rows = rows or slice(0, bsz)
        end = start_pos + seqlen
        if bsz > self.max_batch_size:
            raise EngramError(f"batch of {bsz} rows exceeds max_batch_size = {self.max_batch_size}")
        if positions is None and (start_pos < 0 or end > self.max_seq_len):
            raise EngramError(f"positions {start_pos}..{end - 1} exceed max_seq_len = {self.max_seq_len}")
        if token_mask is None:
            token_mask = torch.ones_like(input_ids, dtype=torch.bool)
        bad = token_mask & ((input_ids < 0) | (input_ids >= self.vocab))
        message = f"token id out of range of the Engram token map (0..{self.vocab - 1})"
        if input_ids.device.type == "cpu":
            if bool(bad.any()):
                raise EngramError(message)
        else:       # on a GPU: checked without a host sync (the engine checks prompts' ids on the host)
            torch._assert_async(~bad.any(), message)

        # Masked positions may carry any id (image placeholder); look up a harmless 0 there.
        cur = self.token_map[torch.where(token_mask, input_ids, 0)]
        dev = self.ids.device
        per_row = positions is not None and positions.dim() == 2
        if positions is None:
            self.ids[rows, start_pos:end] = torch.where(token_mask, cur, DEAD)
            positions = torch.arange(start_pos, end, device=dev)
        elif per_row:
            at = torch.arange(rows.start, rows.stop, device=dev).view(-1, 1)
            self.ids[at, positions] = torch.where(token_mask, cur, DEAD)
        else:
            self.ids[rows, positions] = torch.where(token_mask, cur, DEAD)

        # Look-back window: shift s reads position p - s; blocked once it passes the start or a dead token.
        k = self.layout.max_ngram
        pos = positions[..., None] - torch.arange(k, device=dev)  # [S, k], or [B, 1, k] per row
        if per_row:
            src = self.ids[rows].gather(1, pos.clamp(min=0).flatten(1)).view(pos.shape)   # [B, 1, k]
        else:
            src = self.ids[rows][:, pos.clamp(min=0)]  # [B, S, k]
        blocked = (pos < 0) | (src == DEAD)
        blocked = blocked.cumsum(dim=-1) > 0  # once blocked, every older slot is blocked too
        tok = torch.where(blocked, self.pad, src)  # [B, S, k]

        # prod_s = tok_s * m[s]; R_n = XOR of prod_0..prod_{n-1}; m_0 multiplies the current token.
        prod = tok[:, :, None, :] * self.multipliers  # [B, S, n_layers, k]
        hashes = [prod[..., 0] ^ prod[..., 1]]
        for s in range(2, k):
            hashes.append(hashes[-1] ^ prod[..., s])
        h = torch.stack(hashes, dim=-1)  # [B, S, n_layers, n_orders]
        h = h.repeat_interleave(self.layout.n_heads, dim=-1)  # [B, S, n_layers, cols]
        return h % self.primes + self.offsets  # [B, S, n_layers, cols]

    hash = forward          # the hashing by its name (the model calls the module, so that hooks see it)


class ParallelEngramEmbedding(nn.Module):
    """Engram table, rows sharded ceil(rows/W) per rank (the last rank's padding is never addressed).
    E4M3 rows with one UE8M0 scale per 32 columns, dequantized only when looked up.

    `placement`: device (the tables live with the model), host (CPU memory, pinned when `pin`) or disk (left
    on the meta device here; the loader maps them from the shard file with `attach`). Off the device, the
    rows a call needs are gathered where the table lives and only those are copied to the model's device,
    then dequantized there exactly as on the device path, into `act_dtype` (fp32 rows in golden numerics).
    `bytes_moved` counts the copied bytes."""

    def __init__(self, rows: int, dim: int, par: ParallelContext, placement: str = "device",
                 pin: bool = False, act_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.par, self.placement, self.pin, self.act_dtype = par, placement, pin, act_dtype
        self.part = -(-rows // par.world_size)
        self.start = par.rank * self.part
        where = {"device": {}, "host": {"device": "cpu", "pin_memory": pin}, "disk": {"device": "meta"}}
        self.weight = nn.Parameter(torch.empty(self.part, dim, dtype=torch.float8_e4m3fn, **where[placement]),
                                   requires_grad=False)
        self.scale = nn.Parameter(torch.empty(self.part, dim // 32, dtype=torch.float8_e8m0fnu,
                                              **where[placement]), requires_grad=False)
        self.bytes_moved = 0

    def attach(self, name: str, tensor: torch.Tensor) -> None:
        """Use `tensor` (e.g. a memory-mapped view of the shard file) as the weight or scale table."""
        old = getattr(self, name)
        if tuple(tensor.shape) != tuple(old.shape) or tensor.dtype != old.dtype:
            raise ValueError(f"Engram {name}: got {tensor.dtype} {list(tensor.shape)}, expected {old.dtype} "
                             f"{list(old.shape)}")
        setattr(self, name, nn.Parameter(tensor, requires_grad=False))

    def dequantize(self, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """E4M3 rows [..., dim] and their UE8M0 scales [..., dim/32] -> values in the activation dtype."""
        y = w.float() * ue8m0_to_float(s).repeat_interleave(32, dim=-1)
        return y.to(self.act_dtype)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        local = rows - self.start
        outside = (local < 0) | (local >= self.part)
        if self.placement == "device":
            safe = local.masked_fill(outside, 0)
            # the rows' bytes gathered (torch before 2.10 indexes no float8 tensor on the CPU)
            y = self.dequantize(*(t.view(torch.uint8)[safe].view(t.dtype) for t in (self.weight, self.scale)))
            if self.par.world_size > 1:
                y = y.masked_fill(outside.unsqueeze(-1), 0)   # (a boolean index would sync with the host)
        else:
            inside = ~outside
            idx = local[inside].cpu()                                        # [m] rows this rank holds
            w = torch.empty(idx.numel(), self.weight.shape[1], dtype=self.weight.dtype, pin_memory=self.pin)
            s = torch.empty(idx.numel(), self.scale.shape[1], dtype=self.scale.dtype, pin_memory=self.pin)
            torch.index_select(self.weight, 0, idx, out=w)
            torch.index_select(self.scale, 0, idx, out=s)
            self.bytes_moved += w.numel() + s.numel()
            w, s = w.to(rows.device, non_blocking=True), s.to(rows.device, non_blocking=True)
            y = torch.zeros(*rows.shape, w.shape[1], dtype=self.act_dtype, device=rows.device)
            y[inside] = self.dequantize(w, s)                                # [..., dim]
        if self.par.world_size > 1:
            y = self.par.all_reduce(y)
        return y


class Engram(nn.Module):
    """Gated add of one hashed n-gram value into every hc stream, before the block
    (docs/architecture.md §9.5)."""

    def __init__(self, engram_index: int, ctx: ModelContext):
        super().__init__()
        args = ctx.args
        self.dim, self.hc, self.eps, self.nx = args.dim, args.hc_mult, args.norm_eps, ctx.numerics
        n_cols = (args.engram_max_ngram_size - 1) * args.engram_n_heads
        self.embed = ParallelEngramEmbedding(args.engram_num_embeddings[engram_index], args.engram_head_dim,
                                             ctx.par, ctx.opts.engram_on, str(ctx.device).startswith("cuda"),
                                             ctx.act_dtype)
        self.wkv = Linear(n_cols * args.engram_head_dim, (args.hc_mult + 1) * args.dim, args.dtype, ctx)
        self.q_weight = nn.Parameter(torch.empty(args.hc_mult, args.dim, dtype=torch.bfloat16),
                                     requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(args.hc_mult, args.dim, dtype=torch.bfloat16),
                                     requires_grad=False)

    def forward(self, x: torch.Tensor, rows: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, S, hc, D] bf16 streams, rows [B, S, cols] table rows, mask [B, S] (False = image)."""
        e = self.embed(rows).flatten(2)                                     # [B, S, cols*head_dim]
        kv = self.wkv(e)                                                    # [B, S, (hc+1)*D]
        key = kv[..., :self.hc * self.dim].unflatten(-1, (self.hc, self.dim)).float()   # [B, S, hc, D]
        value = kv[..., self.hc * self.dim:].float()                        # [B, S, D]
        w = self.q_weight.float() * self.k_weight.float()                   # [hc, D]
        xf, nx = x.float(), self.nx
        # Per token and stream (over D only): not jointly over the hc copies.
        rstd = nx.rsqrt(nx.mean(xf * xf, dim=-1) + self.eps) * nx.rsqrt(nx.mean(key * key, dim=-1) + self.eps)
        dot = nx.sum(xf * w * key, dim=-1) * rstd * self.dim ** -0.5          # [B, S, hc]
        gate = nx.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if mask is not None:
            gate = gate * mask.unsqueeze(-1)
        return (xf + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(x.dtype)
