"""Attention: low-rank q, one shared KV head with a window ring, compressed KV picked by the indexer,
sparse attention with sink, inverse RoPE on the output and the grouped low-rank output
(docs/architecture.md §6)."""
from typing import Optional, Tuple

import torch
import torch.nn as nn

from .compressor import Compressor
from .config import ModelArgs
from .indexer import Indexer, compressed_rows
from .kv_cache import register_cache
from .layers import ColumnParallelLinear, Linear, RMSNorm, RowParallelLinear
from .rope import apply_rotary_
from .state import ModelContext


def window_prefill_idx(s: int, window: int, device=None) -> torch.Tensor:
    """[S, min(S, W)]: query t lists positions max(0, t-W+1) + e, -1 for positions after t."""
    n = min(s, window)
    t = torch.arange(s, device=device).unsqueeze(1)
    pos = (t - window + 1).clamp_min(0) + torch.arange(n, device=device)
    return torch.where(pos > t, -1, pos).to(torch.int32)


def window_decode_idx(pos: int, window: int, device=None) -> torch.Tensor:
    """[W]: ring slots oldest first, (pos mod W)+1 ... pos mod W; slots not yet written are -1."""
    slots = (torch.arange(window, device=device) + pos % window + 1) % window
    return torch.where(slots > pos, -1, slots).to(torch.int32)


def window_extend_idx(start_pos: int, s: int, window: int, device=None) -> torch.Tensor:
    """[S, W] decode-layout lists over [ring before the call (W rows) | chunk rows (S)]: for the query at
    position q, slot o stands for position pi = q - ((q - o) mod W); ring row if pi < start_pos, else
    row W + pi - start_pos; -1 if pi < 0."""
    q = torch.arange(start_pos, start_pos + s, device=device).unsqueeze(1)         # [S, 1]
    slots = (torch.arange(window, device=device) + q % window + 1) % window          # [S, W] oldest first
    pos = q - (q - slots) % window
    idx = torch.where(pos < start_pos, slots, window + pos - start_pos)
    return torch.where(pos < 0, -1, idx).to(torch.int32)


class Attention(nn.Module):
    def __init__(self, layer_id: int, ctx: ModelContext):
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
        if self.is_backbone and layer_id in args.kv_source_layers:
            self.compressor = Compressor(self.ratio, ctx)
            register_cache(self, "compress_cache", (args.max_batch_size, args.max_seq_len // self.ratio,
                                                    args.head_dim), "fp4_e4m3", ctx)
        if self.is_backbone and layer_id in args.index_source_layers:
            self.indexer = Indexer(layer_id, ctx)

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

    def project_q(self, x: torch.Tensor, positions: slice) -> Tuple[torch.Tensor, torch.Tensor]:
        qr = self.q_norm(self.wq_a(x))                                          # [B, S, q_lora]
        q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.head_dim))   # [B, S, H_l, hd]
        apply_rotary_(q[..., -self.rope_dim:], self.freqs()[positions], self.nx)
        return q, qr

    def project_kv(self, x: torch.Tensor, positions) -> torch.Tensor:
        kv = self.kv_norm(self.wkv(x))                                          # [B, S, hd]
        apply_rotary_(kv[..., -self.rope_dim:], self.freqs()[positions], self.nx)
        return self.nx.fp8_qdq_(kv)                                            # the cache's rounding

    def output(self, o: torch.Tensor, positions) -> torch.Tensor:
        b, s = o.shape[:2]
        apply_rotary_(o[..., -self.rope_dim:], self.freqs()[positions], self.nx, inverse=True)
        o = o.view(b, s, self.n_local_groups, -1)                              # [B, S, G_l, 8*hd]
        o = self.nx.grouped_linear(o, self.wo_a.weight, self.n_local_groups,
                                   self.wo_a.derived)                          # [B, S, G_l, o_lora]
        return self.wo_b(o.flatten(2))                                          # [B, S, D]

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        b, s, _ = x.shape
        end = start_pos + s
        step = self.ctx.step               # a CUDA graph's decode step: the position is the tensor step.pos
        pos = slice(start_pos, end) if step is None else step.pos.view(1)
        q, qr = self.project_q(x, pos)
        kv = self.project_kv(x, pos)
        if start_pos == 0:
            if s <= self.window:
                self.kv_cache[:b, :s] = kv
            else:
                keep = torch.arange(s - self.window, s, device=x.device)
                self.kv_cache[:b, keep % self.window] = kv[:, -self.window:]
            kv_win, offset = kv, s
            idx_win = window_prefill_idx(s, self.window, x.device).expand(b, s, -1)
        elif step is not None:
            self.kv_cache[:b, (step.pos % self.window).view(1)] = kv
            kv_win, offset = self.kv_cache[:b], self.window
            idx_win = window_decode_idx(step.pos, self.window, x.device).expand(b, 1, -1)
        elif s == 1:
            self.kv_cache[:b, start_pos % self.window] = kv[:, 0]
            kv_win, offset = self.kv_cache[:b], self.window
            idx_win = window_decode_idx(start_pos, self.window, x.device).expand(b, 1, -1)
        else:
            # Several positions at start_pos > 0 (a prefill continued in chunks, or speculative verification,
            # docs/architecture.md §11.6): every row sees, in a decode step's layout, the ring as it was
            # before the call (positions before the chunk), then the chunk's own rows. The ring keeps the
            # chunk's last window positions; a verification call (at most window positions) journals what
            # it held, for rollback.
            kv_win, offset = torch.cat([self.kv_cache[:b], kv], dim=1), self.window + s     # [B, W + S, hd]
            idx_win = window_extend_idx(start_pos, s, self.window, x.device).expand(b, s, -1)
            verify = self.ctx.decode_shapes
            self.journal = (start_pos, s, kv_win[:, :self.window].clone()) if verify else None
            keep = min(s, self.window)
            slots = torch.arange(end - keep, end, device=x.device) % self.window
            self.kv_cache[:b, slots] = kv[:, s - keep:]
        if self.ratio == 0:
            kv_all, idx = kv_win, idx_win
        else:
            topk = self.compressed_path(x, qr, start_pos, offset)
            length = end if step is None else step.length               # the bucket: rows past pos masked
            compressed = self.ctx.shared.compress_kv[:b, :length // self.ratio]
            kv_all = torch.cat([kv_win, compressed], dim=1)                     # [B, n_win + T, hd]
            idx = torch.cat([idx_win, topk], dim=-1)
        o = self.nx.sparse_attn(q, kv_all, self.attn_sink, idx, self.softmax_scale)   # [B, S, H_l, hd]
        return self.output(o, pos)

    def compressed_path(self, x, qr, start_pos: int, offset: int) -> torch.Tensor:
        b, s, _ = x.shape
        st, r, step = self.ctx.shared, self.ratio, self.ctx.step
        latent: Optional[torch.Tensor] = None
        if self.compressor is not None:
            latent = self.compressor(x, start_pos)                             # [B, n, hd], unrotated
            st.compress_kv = self.compress_cache
        if self.indexer is not None:
            if step is None and (start_pos + s) // r == 0:                    # (a decode step is past 0)
                topk = torch.empty(b, s, 0, dtype=torch.int32, device=x.device)
            else:
                topk = self.indexer(x, qr, latent, start_pos, offset)
            st.topk_idxs = topk
        else:
            topk = st.topk_idxs
        if latent is not None:
            rows, group_pos = compressed_rows(start_pos, latent.shape[1], r, step, x.device)
            apply_rotary_(latent[..., -self.rope_dim:], self.freqs()[group_pos], self.nx)
            self.nx.fp4_qdq_e4m3_(latent)                                      # the cache's rounding
            self.compress_cache[:b, rows] = latent
        return topk
