"""Hyper-connections (mHC): mixes, Sinkhorn split, collapse (pre) and expand (post). All fp32 math."""
from typing import Optional

import torch
import torch.nn.functional as F

from . import kernels
from .config import RuntimeOptions


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
             iters: int, hc_eps: float, norm_eps: float, opts: RuntimeOptions, prepared=None):
    """x [B, S, hc, D] bf16 -> (pre, post, comb) from one rsqrt over all hc*D values per token."""
    u = x.flatten(2).float()                                        # [B, S, hc*D]
    if kernels.is_invariant(opts):
        mixes = kernels.invariant.hc_mixes_linear(u, fn, norm_eps, prepared)
        return kernels.hc_split_sinkhorn(opts, mixes, scale, base, hc, iters, hc_eps)
    rsqrt = torch.rsqrt(u.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(u, fn) * rsqrt                                 # GEMM first, then the scalar
    return kernels.hc_split_sinkhorn(opts, mixes, scale, base, hc, iters, hc_eps)


def _sum_streams(t: torch.Tensor, opts: Optional[RuntimeOptions]) -> torch.Tensor:
    """Sum over the hc streams (dim 2): torch's order, or the invariant tree."""
    if opts is not None and kernels.is_invariant(opts):
        return kernels.invariant.tree_sum(t, dim=2)
    return torch.sum(t, dim=2)


def hc_pre(x: torch.Tensor, pre: torch.Tensor, opts: Optional[RuntimeOptions] = None) -> torch.Tensor:
    """Collapse [B, S, hc, D] with weights [B, S, hc] -> [B, S, D] in x's dtype."""
    return _sum_streams(pre.unsqueeze(-1) * x.float(), opts).to(x.dtype)


def hc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            opts: Optional[RuntimeOptions] = None) -> torch.Tensor:
    """out_k = post_k * y + sum_j comb[j, k] * R_j  -> [B, S, hc, D] (sum over comb's first index)."""
    out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + \
        _sum_streams(comb.unsqueeze(-1) * residual.float().unsqueeze(-2), opts)
    return out.to(y.dtype)
