"""Compressor of the KV-source layers: one 512-d latent per `ratio` tokens (spec modules §7.4)."""
from typing import Optional

import torch
import torch.nn as nn

from .config import ModelArgs
from .layers import Linear, RMSNorm


class Compressor(nn.Module):
    """Ratio 2: fp32 projections, per-channel softmax pooling over disjoint token pairs, carried tail.
    Ratio 1: a bf16 projection per token. Returns the latent *before* RoPE (the indexer needs it)."""

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.ratio, self.head_dim = ratio, args.head_dim
        if ratio not in (1, 2):
            raise ValueError(f"compress ratio {ratio} is not supported (V4.1 uses 1 and 2)")
        kind = "fp32" if ratio == 2 else "bf16"
        self.wkv = Linear(args.dim, args.head_dim, kind)
        self.wgate = Linear(args.dim, args.head_dim, kind) if ratio == 2 else None
        self.norm = RMSNorm(args.head_dim, args.norm_eps)
        if ratio == 2:
            # Tail of an incomplete group, carried across calls: [max_batch, ratio, head_dim] fp32.
            self.register_buffer("kv_state", torch.zeros(args.max_batch_size, ratio, args.head_dim),
                                 persistent=False)
            self.register_buffer("score_state", torch.full((args.max_batch_size, ratio, args.head_dim),
                                                           float("-inf")), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int) -> Optional[torch.Tensor]:
        b, s, _ = x.shape
        if self.ratio == 1:
            return self.norm(self.wkv(x))                            # [B, S, hd]
        xf = x.float()
        kv, score = self.wkv(xf), self.wgate(xf)                     # [B, S, hd] fp32
        if start_pos == 0:
            n = s // 2
            if s % 2:
                self.kv_state[:b, 0] = kv[:, -1]
                self.score_state[:b, 0] = score[:, -1]
            if n == 0:
                return None
            kv = kv[:, :2 * n].unflatten(1, (n, 2))                  # [B, n, 2, hd]
            score = score[:, :2 * n].unflatten(1, (n, 2))
            pooled = (kv * score.softmax(dim=2)).sum(dim=2)          # [B, n, hd]
        else:
            if s != 1:
                raise ValueError("the ratio-2 compressor decodes one token per call")
            slot = start_pos % 2
            self.kv_state[:b, slot] = kv[:, 0]
            self.score_state[:b, slot] = score[:, 0]
            if (start_pos + 1) % 2:
                return None
            pooled = (self.kv_state[:b] * self.score_state[:b].softmax(dim=1)).sum(dim=1, keepdim=True)
        return self.norm(pooled.to(x.dtype))                         # bf16 first, then RMSNorm
