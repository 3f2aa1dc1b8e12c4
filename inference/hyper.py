"""Hyper-connections (mHC): mixes, Sinkhorn split, collapse (pre) and expand (post). All fp32 math; `nx` is
the model's numerics (the GEMM, the reductions and Sinkhorn depend on the summation order)."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixWeights:
    """One site's mix weights: fn [(2 + hc) * hc, hc * D] fp32, base [(2 + hc) * hc], scale [3]."""
    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class MixConfig:
    """The mix's constants: streams, Sinkhorn iterations and epsilon, the RMS epsilon."""
    hc: int
    iters: int
    hc_eps: float
    norm_eps: float


def hc_mixes(x: torch.Tensor, w: MixWeights, cfg: MixConfig, nx, derived):
    """x [B, S, hc, D] bf16 -> (pre, post, comb) from one rsqrt over all hc*D values per token. `derived`:
    where the layouts of w.fn are kept (its block's)."""
    mixes = nx.hc_mix_logits(x.flatten(2), w.fn, cfg.norm_eps, derived)   # [B, S, (2 + hc) * hc]
    return nx.hc_split_sinkhorn(mixes, w.scale, w.base, cfg.hc, cfg.iters, cfg.hc_eps)


def hc_pre(x: torch.Tensor, pre: torch.Tensor, nx) -> torch.Tensor:
    """Collapse [B, S, hc, D] with weights [B, S, hc] -> sum_j pre_j X_j [B, S, D] in x's dtype (fp32
    sums)."""
    return nx.hc_pre(x, pre)


def hc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            nx) -> torch.Tensor:
    """out_k = post_k * y + sum_j comb[j, k] * R_j  -> [B, S, hc, D] (sum over comb's first index, fp32)."""
    return nx.hc_post(y, residual, post, comb)
