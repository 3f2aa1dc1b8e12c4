"""Attention: low-rank q, one shared KV head with a window ring, compressed KV picked by the indexer,
sparse attention with sink, inverse RoPE on the output and the grouped low-rank output
(docs/architecture.md §6)."""
from typing import Optional, Tuple

import torch
import torch.nn as nn

from .compressor import Compressor
from .config import ModelArgs
from .indexer import Indexer
from .kv_cache import register_cache
from .layers import ColumnParallelLinear, Linear, RMSNorm, RowParallelLinear
from .rope import apply_rotary_
from .state import ForwardCall, Kind, ModelContext


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

    def project_q(self, x: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        qr = self.q_norm(self.wq_a(x))                                          # [B, S, q_lora]
        q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.head_dim))   # [B, S, H_l, hd]
        apply_rotary_(q[..., -self.rope_dim:], self.freqs()[positions], self.nx)
        return q, qr

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kv = self.kv_norm(self.wkv(x))                                          # [B, S, hd]
        apply_rotary_(kv[..., -self.rope_dim:], self.freqs()[positions], self.nx)
        return self.nx.fp8_qdq_(kv)                                            # the cache's rounding

    def output(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s = o.shape[:2]
        apply_rotary_(o[..., -self.rope_dim:], self.freqs()[positions], self.nx, inverse=True)
        o = o.view(b, s, self.n_local_groups, -1)                              # [B, S, G_l, 8*hd]
        o = self.nx.grouped_linear(o, self.wo_a.weight, self.n_local_groups,
                                   self.wo_a.derived)                          # [B, S, G_l, o_lora]
        return self.wo_b(o.flatten(2))                                          # [B, S, D]

    def forward(self, x: torch.Tensor, call: ForwardCall) -> torch.Tensor:
        b, s, _ = x.shape
        q, qr = self.project_q(x, call.positions)
        kv = self.project_kv(x, call.positions)
        kv_win = self.window_rows(kv, call)                                    # [B, n_win, hd]
        idx = call.window.expand(b, s, -1)                                      # [B, S, n] into kv_win
        if self.ratio > 0:
            plan = call.ratios[self.ratio]
            topk = self.compressed_path(x, qr, call, kv_win.shape[1])          # [B, S, k] past kv_win
            compressed = call.exchange.compress_kv[:b, :plan.keys]             # [B, T, hd]
            kv_win = torch.cat([kv_win, compressed], dim=1)                     # [B, n_win + T, hd]
            idx = torch.cat([idx, topk], dim=-1)
        o = self.nx.sparse_attn(q, kv_win, self.attn_sink, idx, self.softmax_scale)   # [B, S, H_l, hd]
        return self.output(o, call.positions)

    def window_rows(self, kv: torch.Tensor, call: ForwardCall) -> torch.Tensor:
        """Write the call's window KV into the ring and return the rows its window lists index."""
        b, s, _ = kv.shape
        if call.kind == Kind.PREFILL:                # the call's own rows; the ring keeps the last window
            keep = min(s, self.window)
            self.kv_cache[:b, call.positions[s - keep:] % self.window] = kv[:, s - keep:]
            return kv
        if call.kind == Kind.DECODE:                 # the ring, this position written first
            self.kv_cache[:b, call.positions % self.window] = kv
            return self.kv_cache[:b]
        # CHUNK or VERIFY (docs/architecture.md §11.6): every row sees, in a decode step's layout, the ring as
        # it was before the call, then the call's own rows. The ring keeps the call's last window positions;
        # a verification (at most window positions) journals what it held, for rollback.
        rows = torch.cat([self.kv_cache[:b], kv], dim=1)                      # [B, W + S, hd]
        self.journal = (call.start, s, rows[:, :self.window].clone()) if call.kind == Kind.VERIFY else None
        keep = min(s, self.window)
        self.kv_cache[:b, call.positions[s - keep:] % self.window] = kv[:, s - keep:]
        return rows

    def compressed_path(self, x, qr, call: ForwardCall, offset: int) -> torch.Tensor:
        """The compressor's new entries written (and handed on), the index selection made or taken:
        -> [B, S, k] rows of kv_all (past the `offset` window rows), -1 = none."""
        b, s, _ = x.shape
        ex, plan = call.exchange, call.ratios[self.ratio]
        latent: Optional[torch.Tensor] = None
        if self.compressor is not None:
            latent = self.compressor(x, call)                                  # [B, n, hd], unrotated
            ex.compress_kv = self.compress_cache
        if self.indexer is not None:
            if plan.keys == 0:                                                 # no group complete yet
                topk = torch.empty(b, s, 0, dtype=torch.int32, device=x.device)
            else:
                topk = self.indexer(x, qr, latent, call, offset)
            ex.topk_idxs = topk
        else:
            topk = ex.topk_idxs
        if latent is not None:
            apply_rotary_(latent[..., -self.rope_dim:], self.freqs()[plan.rope_pos], self.nx)
            self.nx.fp4_qdq_e4m3_(latent)                                      # the cache's rounding
            self.compress_cache[:b, plan.rows] = latent
        return topk
