"""Hyper-connections (mHC): mixes, Sinkhorn split, collapse (pre) and expand (post). All fp32 math."""
import torch
import torch.nn.functional as F


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                      iters: int, eps: float):
    """mixes [..., (2 + hc) * hc] fp32 -> pre [..., hc], post [..., hc], comb [..., hc, hc]
    (numerics §10)."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mixes[..., 2 * hc:].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = comb.softmax(-1) + eps                                   # row softmax + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)                # column pass
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
             iters: int, hc_eps: float, norm_eps: float):
    """x [B, S, hc, D] bf16 -> (pre, post, comb) from one rsqrt over all hc*D values per token."""
    u = x.flatten(2).float()                                        # [B, S, hc*D]
    rsqrt = torch.rsqrt(u.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(u, fn) * rsqrt                                 # GEMM first, then the scalar
    return hc_split_sinkhorn(mixes, scale, base, hc, iters, hc_eps)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse [B, S, hc, D] with weights [B, S, hc] -> [B, S, D] in x's dtype."""
    return torch.sum(pre.unsqueeze(-1) * x.float(), dim=2).to(x.dtype)


def hc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_k = post_k * y + sum_j comb[j, k] * R_j  -> [B, S, hc, D] (sum over comb's first index)."""
    out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + \
        torch.sum(comb.unsqueeze(-1) * residual.float().unsqueeze(-2), dim=2)
    return out.to(y.dtype)
