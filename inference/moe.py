"""Mixture of experts: sqrt-softplus router with bias / bias_vl, expert-parallel SwiGLU experts with clamps,
fp32 reduction, one shared expert (spec modules §8, numerics §12)."""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .indexer import topk_indices
from .layers import Linear
from .state import ModelContext


class Gate(nn.Module):
    def __init__(self, dim: int, n_experts: int, topk: int, ctx: ModelContext, with_bias_vl: bool):
        super().__init__()
        a = ctx.args
        self.topk, self.ctx = topk, ctx
        self.score_func, self.route_scale, self.gate_temp = a.score_func, a.route_scale, a.gate_temp
        self.norm_topk = a.norm_topk_prob and topk > 1
        self.weight = nn.Parameter(torch.empty(n_experts, dim, dtype=torch.bfloat16), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_experts, dtype=torch.float32), requires_grad=False)
        self.bias_vl = (nn.Parameter(torch.empty(n_experts, dtype=torch.float32), requires_grad=False)
                        if with_bias_vl else None)

    def forward(self, x: torch.Tensor, image_mask: Optional[torch.Tensor] = None):
        """x [N, D] bf16 -> (weights [N, k] fp32, expert indices [N, k])."""
        logits = F.linear(x.float(), self.weight.float())
        if self.gate_temp != 1.0:
            logits = logits / self.gate_temp
        if self.score_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.view(-1, 1), self.bias_vl, self.bias)   # [N, E]
        # Select with the biased scores, weight with the unbiased ones.
        idx = topk_indices(scores + bias, self.topk, self.ctx.opts.deterministic_topk)
        weights = scores.gather(1, idx)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, idx


class Expert(nn.Module):
    def __init__(self, dim: int, inter_dim: int, kind: str, swiglu_limit: float):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, kind)
        self.w2 = Linear(inter_dim, dim, kind)
        self.w3 = Linear(dim, inter_dim, kind)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)                        # one-sided on the gate branch
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h                                          # routing weight before the bf16 cast
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, ctx: ModelContext, n_experts: int, topk: int, with_bias_vl: bool):
        super().__init__()
        a, w = ctx.args, ctx.par.world_size
        if n_experts % w:
            raise ValueError(f"world size {w} does not divide the {n_experts} routed experts")
        self.ctx, self.n_experts = ctx, n_experts
        self.n_local = n_experts // w
        self.start = ctx.par.rank * self.n_local
        expert_kind = a.expert_dtype if a.expert_dtype == "fp4" else a.dtype
        self.gate = Gate(a.dim, n_experts, topk, ctx, with_bias_vl)
        self.experts = nn.ModuleList([
            Expert(a.dim, a.moe_inter_dim, expert_kind, a.swiglu_limit)
            if self.start <= i < self.start + self.n_local else None for i in range(n_experts)])
        self.shared_experts = Expert(a.dim, a.moe_inter_dim, a.dtype, a.swiglu_limit)

    def forward(self, x: torch.Tensor, image_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])                                    # [N, D]
        mask = image_mask.reshape(-1) if image_mask is not None else None
        weights, idx = self.ctx.per_position(self.gate, x, mask, dim=0)
        y = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(idx.flatten(), minlength=self.n_experts).tolist()
        for e in range(self.start, self.start + self.n_local):       # increasing global index
            if counts[e] == 0:
                continue
            tok, slot = torch.where(idx == e)
            y[tok] += self.experts[e](x[tok], weights[tok, slot, None])
        y = self.ctx.par.all_reduce(y)
        y += self.shared_experts(x)
        return y.to(x.dtype).view(shape)
