"""Attention: low-rank q, one shared KV head with a window ring, compressed KV picked by the indexer,
sparse attention with sink, inverse RoPE on the output and the grouped low-rank output
(docs/architecture.md §6)."""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
import torch.nn as nn

from .compressor import Compressor
from .config import ModelArgs
from .indexer import Indexer
from .kv_cache import PackedCache, gather_rows, register_cache
from .layers import ColumnParallelLinear, Linear, RMSNorm, RowParallelLinear
from .rope import apply_rotary_
from .state import ForwardCall, Handoff, Kind, ModelContext, PublishedKeys


@dataclass(frozen=True)
class KVSource:
    """The layer whose compressed KV a layer reads: itself (a KV source) or the last KV source before it. A
    reference, not a submodule: the compressor's weights and the cache are the source's."""
    attention: "Attention"


class Attention(nn.Module):
    def __init__(self, layer_id: int, ctx: ModelContext, kv_source: Optional[KVSource] = None,
                 published: Optional[PublishedKeys] = None):
        """`kv_source`: where a layer with a compression ratio that does not compress reads its compressed KV
        (the model gives it the last KV source before it); `published`: the model's published index keys,
        which an index source reads (and an index-key owner writes)."""
        super().__init__()
        args: ModelArgs = ctx.args
        w = ctx.par.world_size
        self.ctx, self.nx, self.layer_id = ctx, ctx.numerics, layer_id
        self.dim, self.n_heads, self.n_local_heads = args.dim, args.n_heads, args.n_heads // w
        self.head_dim, self.rope_dim = args.head_dim, args.rope_head_dim
        self.n_local_groups, self.o_lora_rank = args.o_groups // w, args.o_lora_rank
        self.window = args.window_size
        self.ratio = args.compress_ratios[layer_id]
        self.softmax_scale = args.head_dim ** -0.5
        self.is_backbone = layer_id < args.n_layers
        self.wq_a = Linear(args.dim, args.q_lora_rank, args.dtype, ctx)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps, ctx)
        self.wq_b = ColumnParallelLinear(args.q_lora_rank, args.n_heads * args.head_dim, args.dtype, ctx)
        self.wkv = Linear(args.dim, args.head_dim, args.dtype, ctx)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps, ctx)
        self.wo_a = ColumnParallelLinear(args.n_heads * args.head_dim // args.o_groups,
                                         args.o_groups * args.o_lora_rank, "bf16", ctx)
        self.wo_b = RowParallelLinear(args.o_groups * args.o_lora_rank, args.dim, args.dtype, ctx)
        self.attn_sink = nn.Parameter(torch.empty(self.n_local_heads, dtype=torch.float32),
                                      requires_grad=False)
        # Caches hold already-rounded values: packed FP8 / FP4 codes and scales (fp32 activations: plain).
        register_cache(self, "kv_cache", (args.max_batch_size, self.window, args.head_dim), "fp8", ctx)
        self.journal = None      # an extend call's overwritten ring slots, for rollback
        self.compressor = self.indexer = None
        self.kv_source = kv_source
        if self.is_backbone and layer_id in args.kv_source_layers:
            self.compressor = Compressor(self.ratio, ctx)
            register_cache(self, "compress_cache", (args.max_batch_size, args.max_seq_len // self.ratio,
                                                    args.head_dim), "fp4_e4m3", ctx)
            self.kv_source = KVSource(self)
        if self.ratio > 0 and self.is_backbone and self.kv_source is None:
            raise ValueError(f"layer {layer_id} (compression ratio {self.ratio}) needs the KV source it "
                             f"reads")
        if self.is_backbone and layer_id in args.index_source_layers:
            self.indexer = Indexer(layer_id, ctx, published)

    def rollback(self, keep_until: int) -> None:
        """Undo the ring writes of a verification call for positions > keep_until (slots it overwrote that
        positions <= keep_until still need get the values they held before the call)."""
        if self.journal is None:
            return
        start, s, ring = self.journal
        b = ring.shape[0]
        for pos in range(max(start, keep_until + 1), start + s):
            self.kv_cache[:b, pos % self.window] = ring[:, pos % self.window]
        if self.compressor is not None:
            self.compressor.rollback(keep_until)
        self.journal = None

    def freqs(self) -> torch.Tensor:
        return self.ctx.freqs_for(self.layer_id)

    def project(self, x: torch.Tensor, rope: torch.Tensor, rounded_kv: bool = True):
        """x [B, S, D] -> (q [B, S, H_l, hd], qr [B, S, q_lora], kv [B, S, hd]): wq_a and wkv read the same x
        (the numerics may quantise it once for both). `rope`: the table's rows at the positions [S, ...]."""
        q_lat, kv = self.nx.linears((self.wq_a.held(), self.wkv.held()), x)
        q, qr = self.project_q(q_lat, rope)
        return q, qr, self.project_kv(kv, rope, rounded_kv)

    def project_q(self, q_lat: torch.Tensor, rope: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """wq_a's output [B, S, q_lora] -> (q [B, S, H_l, hd] rotated, qr [B, S, q_lora])."""
        qr = self.q_norm(q_lat)                                                 # [B, S, q_lora]
        q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.head_dim))   # [B, S, H_l, hd]
        apply_rotary_(q[..., -self.rope_dim:], rope, self.nx)
        return q, qr

    def project_kv(self, kv: torch.Tensor, rope: torch.Tensor, rounded: bool = True) -> torch.Tensor:
        """wkv's output [B, S, hd] -> the window KV, normed, rotated and rounded as the cache holds it
        (`rounded=False`: left for the packed ring to round as it stores it)."""
        kv = self.kv_norm(kv)                                                   # [B, S, hd]
        apply_rotary_(kv[..., -self.rope_dim:], rope, self.nx)
        return self.nx.fp8_qdq_(kv) if rounded else kv                         # the cache's rounding

    def output(self, o: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s = o.shape[:2]
        apply_rotary_(o[..., -self.rope_dim:], rope, self.nx, inverse=True)
        o = o.view(b, s, self.n_local_groups, -1)                              # [B, S, G_l, 8*hd]
        o = self.nx.grouped_linear(o, self.wo_a.weight, self.n_local_groups,
                                   self.wo_a.derived)                          # [B, S, G_l, o_lora]
        return self.wo_b(o.flatten(2))                                          # [B, S, D]

    def forward(self, x: torch.Tensor, call: ForwardCall, handoff: Handoff) -> Tuple[torch.Tensor, Handoff]:
        """x [B, S, D] -> (y [B, S, D], the handoff with what this layer adds to it: an index source's
        selection, a decode step's gathered compressed rows)."""
        b, s, _ = x.shape
        rope = call.rope(self.freqs())                                         # [S, rope_dim / 2]
        # a decode step's row is rounded by a packed ring as it is stored: the rounding's codes are what the
        # ring keeps (the same values as rounding the row, then encoding it, with no round trip to check)
        packed_row = call.kind == Kind.DECODE and isinstance(self.kv_cache, PackedCache)
        q, qr, kv = self.project(x, rope, rounded_kv=not packed_row)
        kv_all = self.window_rows(kv, call, rounded=not packed_row)           # [B, n_win, hd]
        idx = call.window.expand(b, s, -1)                                      # [B, S, n_win] into kv_all
        if self.ratio > 0:
            handoff = self.compressed_path(x, qr, call, handoff)               # the selection made or taken
            rows, rows_idx, handoff = self.compressed_rows(handoff, call, kv_all.shape[1])
            kv_all = torch.cat([kv_all, rows], dim=1)                          # [B, n_win + T', hd]
            idx = torch.cat([idx, rows_idx], dim=-1)                           # [B, S, n_win + k]
        o = self.nx.sparse_attn(q, kv_all, self.attn_sink, idx, self.softmax_scale)   # [B, S, H_l, hd]
        return self.output(o, rope), handoff

    def compressed_rows(self, handoff: Handoff, call: ForwardCall, offset: int):
        """The compressed KV rows of the KV source that this call attends to, placed after the `offset` window
        rows, and where each query's top-k list (handoff.topk) finds them: (rows [B, T', hd], indices
        [B, S, k] into [window rows | rows], -1 = none, the handoff). A decode step gathers and decodes only
        the listed rows (its work does not grow with the context), once for all the layers that share the
        cache and the list (handoff.rows); other calls read every row."""
        cache, topk = self.kv_source.attention.compress_cache, handoff.topk
        batch = call.batch_rows(topk.shape[0])
        if call.kind != Kind.DECODE:
            keys = call.ratios[self.ratio].keys
            return cache[batch, :keys], torch.where(topk >= 0, topk + offset, -1), handoff
        if handoff.rows is None or handoff.rows[0] is not cache or handoff.rows[1] is not topk:
            k = topk.shape[-1]
            rows = gather_rows(cache, batch, topk[:, 0].long().clamp_min(0))               # [B, k, hd]
            at = torch.arange(offset, offset + k, dtype=topk.dtype, device=topk.device)
            handoff = replace(handoff, rows=(cache, topk, rows, torch.where(topk >= 0, at, -1)))
        return handoff.rows[2], handoff.rows[3], handoff

    def window_rows(self, kv: torch.Tensor, call: ForwardCall, rounded: bool = True) -> torch.Tensor:
        """Write the call's window KV into the ring and return the rows its window lists index (`rounded`
        False: a decode step's row, which the packed ring rounds as it stores it)."""
        b, s, _ = kv.shape
        batch = call.batch_rows(b)
        if call.kind == Kind.PREFILL:                # the call's own rows; the ring keeps the last window
            keep = min(s, self.window)
            self.kv_cache[batch, call.ring_slots[s - keep:]] = kv[:, s - keep:]
            return kv
        if call.kind == Kind.DECODE:                 # the ring, this position written first (each row's slot)
            if rounded:
                self.kv_cache[call.ring_key(b)] = kv
            else:
                self.kv_cache.store_rounding(call.ring_key(b), kv)
            return self.kv_cache[batch]
        # CHUNK or VERIFY (docs/architecture.md §11.6): every row sees, in a decode step's layout, the ring as
        # it was before the call, then the call's own rows. The ring keeps the call's last window positions;
        # a verification (at most window positions) journals what it held, for rollback.
        rows = torch.cat([self.kv_cache[batch], kv], dim=1)                  # [B, W + S, hd]
        self.journal = (call.start, s, rows[:, :self.window].clone()) if call.kind == Kind.VERIFY else None
        keep = min(s, self.window)
        self.kv_cache[batch, call.ring_slots[s - keep:]] = kv[:, s - keep:]
        return rows

    def compressed_path(self, x, qr, call: ForwardCall, handoff: Handoff) -> Handoff:
        """The compressor's new entries written, the index selection made (an index source: handed on as
        handoff.topk, with the candidate blocks of the candidate source) or taken from the handoff."""
        b, s, _ = x.shape
        plan = call.ratios[self.ratio]
        latent: Optional[torch.Tensor] = None
        if self.compressor is not None:
            latent = self.compressor(x, call)                                  # [B, n, hd], unrotated
        if self.indexer is not None:
            if plan.keys == 0:                                                 # no group complete yet
                handoff = replace(handoff, topk=torch.empty(b, s, 0, dtype=torch.int32, device=x.device))
            else:
                topk, candidates = self.indexer(x, qr, latent, call, handoff)   # [B, S, k], [B, S, T]
                handoff = replace(handoff, topk=topk, candidates=handoff.candidates if candidates is None
                                  else candidates)
        if latent is not None:
            apply_rotary_(latent[..., -self.rope_dim:], self.freqs()[plan.rope_pos], self.nx)
            self.nx.fp4_qdq_e4m3_(latent)                                      # the cache's rounding
            self.compress_cache[call.compressed_key(self.ratio, b)] = latent
        return handoff
