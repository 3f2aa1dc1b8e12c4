"""Compressor of the KV-source layers: one 512-d latent per `ratio` tokens (docs/architecture.md §6.4)."""
from typing import Optional

import torch
import torch.nn as nn

from .layers import Linear, RMSNorm
from .state import ForwardCall, Kind, ModelContext


class Compressor(nn.Module):
    """Ratio 2: fp32 projections, per-channel softmax pooling over disjoint token pairs, carried tail.
    Ratio 1: a bf16 projection per token. Returns the latent *before* RoPE (the indexer needs it)."""

    def __init__(self, ratio: int, ctx: ModelContext):
        super().__init__()
        args = ctx.args
        self.ratio, self.head_dim, self.ctx, self.nx = ratio, args.head_dim, ctx, ctx.numerics
        if ratio not in (1, 2):
            raise ValueError(f"compress ratio {ratio} is not supported (V4.1 uses 1 and 2)")
        kind = "fp32" if ratio == 2 else "bf16"
        self.wkv = Linear(args.dim, args.head_dim, kind, ctx)
        self.wgate = Linear(args.dim, args.head_dim, kind, ctx) if ratio == 2 else None
        self.norm = RMSNorm(args.head_dim, args.norm_eps, ctx)
        self.journal = None      # an extend call's tail and projections, for rollback
        if ratio == 2:
            # Tail of an incomplete group, carried across calls: [max_batch, ratio, head_dim] fp32.
            shape = (args.max_batch_size, ratio, args.head_dim)
            self.register_buffer("kv_state", torch.zeros(shape, dtype=torch.float32), persistent=False)
            self.register_buffer("score_state", torch.full(shape, float("-inf"), dtype=torch.float32),
                                 persistent=False)

    def forward(self, x: torch.Tensor, call: ForwardCall) -> Optional[torch.Tensor]:
        """x [B, S, D] -> the call's completed groups' latents [B, n, hd] (None if none completes)."""
        b, s, _ = x.shape
        if self.ratio == 1:
            return self.norm(self.wkv(x))                            # [B, S, hd]
        xf = x.float()
        kv = call.per_position(self.wkv, xf)                         # [B, S, hd] fp32 (verification: a
        score = call.per_position(self.wgate, xf)                    # decode step's shape per position)
        batch = call.batch_rows(b)
        if call.kind in (Kind.PREFILL, Kind.CHUNK):
            pooled = self._pool_groups(kv, score, call.start, batch)
        elif call.per_row:
            # rows at their own positions: each row's slot, every row's group pooled (a row whose group is
            # still open gets a latent past what it sees, written again when its group completes)
            at = call.row_index(b), call.positions % 2                                    # [B, 1] each
            self.kv_state[at], self.score_state[at] = kv, score
            pooled = self._pool(self.kv_state[batch], self.score_state[batch], 1).unsqueeze(1)   # [B, 1, hd]
        else:
            # DECODE, or a VERIFY processed position by position exactly as decode does (the group slot and
            # whether a group completes depend on the position's parity alone: all a graph's step knows).
            if s > 1:
                state = self.kv_state[:b].clone(), self.score_state[:b].clone()
                self.journal = (call.start, *state, kv, score)
            pooled = []
            for i in range(s):
                self._store(call.parity + i, kv[:, i], score[:, i], batch)
                if (call.parity + i + 1) % 2 == 0:
                    pooled.append(self._pool(self.kv_state[batch], self.score_state[batch], 1).unsqueeze(1))
            pooled = torch.cat(pooled, dim=1) if pooled else None  # [B, n, hd]
        if pooled is None:
            return None
        return self.norm(pooled.to(x.dtype))                         # bf16 first, then RMSNorm

    def _pool_groups(self, kv: torch.Tensor, score: torch.Tensor, start: int,
                     batch: slice) -> Optional[torch.Tensor]:
        """A prefill, or a chunk of one, of the batch rows `batch`: whole groups pooled at once. A group the
        last call left open (start odd) starts with the carried tail; an odd last token becomes the new tail.
        -> [B, n, hd] or None."""
        if start % 2:
            kv = torch.cat([self.kv_state[batch, :1], kv], dim=1)
            score = torch.cat([self.score_state[batch, :1], score], dim=1)
        m = kv.shape[1]
        n = m // 2
        if m % 2:
            self.kv_state[batch, 0] = kv[:, -1]
            self.score_state[batch, 0] = score[:, -1]
        self.journal = None
        if n == 0:
            return None
        kv = kv[:, :2 * n].unflatten(1, (n, 2))                      # [B, n, 2, hd]
        score = score[:, :2 * n].unflatten(1, (n, 2))
        return self._pool(kv, score, 2)                              # [B, n, hd]

    def _pool(self, kv: torch.Tensor, score: torch.Tensor, dim: int) -> torch.Tensor:
        """Per-channel softmax pooling over the group's tokens (`dim`)."""
        return self.nx.sum(kv * self.nx.softmax(score, dim), dim)

    def _store(self, pos: int, kv: torch.Tensor, score: torch.Tensor, batch: Optional[slice] = None) -> None:
        batch = batch or slice(0, kv.shape[0])
        self.kv_state[batch, pos % 2] = kv
        self.score_state[batch, pos % 2] = score

    def rollback(self, keep_until: int) -> None:
        """After an extend call: the tail as if only positions <= keep_until had been processed."""
        if self.ratio == 1 or self.journal is None:
            return
        start, kv_state, score_state, kv, score = self.journal
        b = kv_state.shape[0]
        self.kv_state[:b], self.score_state[:b] = kv_state, score_state
        for i in range(max(0, min(kv.shape[1], keep_until - start + 1))):
            self._store(start + i, kv[:, i], score[:, i])
        self.journal = None
