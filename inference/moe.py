"""Mixture of experts: sqrt-softplus router with bias / bias_vl, expert-parallel SwiGLU experts with clamps,
fp32 reduction, one shared expert (docs/architecture.md §8, docs/numerics.md §10)."""
from typing import Optional

import torch
import torch.nn as nn

from .indexer import topk_indices
from .kernels.numerics import Derived, Held      # the numerics interface's types, no kernel
from .layers import Linear, linear_tensors
from .state import ForwardCall, ModelContext


class Gate(nn.Module):
    def __init__(self, dim: int, n_experts: int, topk: int, ctx: ModelContext, with_bias_vl: bool):
        super().__init__()
        a = ctx.args
        self.topk, self.ctx, self.nx = topk, ctx, ctx.numerics
        self.score_func, self.route_scale, self.gate_temp = a.score_func, a.route_scale, a.gate_temp
        self.norm_topk = a.norm_topk_prob and topk > 1
        self.weight = nn.Parameter(torch.empty(n_experts, dim, dtype=torch.bfloat16), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_experts, dtype=torch.float32), requires_grad=False)
        self.bias_vl = (nn.Parameter(torch.empty(n_experts, dtype=torch.float32), requires_grad=False)
                        if with_bias_vl else None)
        self.derived = Derived()

    def forward(self, x: torch.Tensor, image_mask: Optional[torch.Tensor] = None):
        """x [N, D] bf16 -> (weights [N, k] fp32, expert indices [N, k])."""
        nx = self.nx
        logits = nx.router_logits(x, self.weight, self.derived)                     # [N, E] fp32
        if self.gate_temp != 1.0:                                   # (x / 1 is x: no division then)
            logits = logits / self.gate_temp
        if self.score_func == "sqrtsoftplus":
            scores = nx.softplus(logits).sqrt()
        elif self.score_func == "softmax":
            scores = nx.softmax(logits, -1)
        else:
            scores = nx.sigmoid(logits)
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.view(-1, 1), self.bias_vl, self.bias)   # [N, E]
        # Select with the biased scores, weight with the unbiased ones.
        idx = topk_indices(scores + bias, self.topk, self.ctx.opts.deterministic_topk)
        weights = scores.gather(1, idx)
        if self.norm_topk:
            weights = weights / (nx.sum(weights, -1, keepdim=True) + 1e-20)
        return weights * self.route_scale, idx


class Expert(nn.Module):
    """SwiGLU expert. `storage`: {projection: (weight, scale)} views to hold (a routed expert's row of the
    MoE's stacked layout)."""

    def __init__(self, dim: int, inter_dim: int, kind: str, ctx: ModelContext, keep_derived: bool = True,
                 storage=None):
        super().__init__()
        self.nx = ctx.numerics
        held = storage or {}
        self.w1 = Linear(dim, inter_dim, kind, ctx, keep_derived, held.get("w1"))
        self.w2 = Linear(inter_dim, dim, kind, ctx, keep_derived, held.get("w2"))
        self.w3 = Linear(dim, inter_dim, kind, ctx, keep_derived, held.get("w3"))
        self.limit = ctx.args.swiglu_limit

    def forward(self, x: torch.Tensor, weights: Optional[torch.Tensor] = None,
                a: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`a`: the numerics' expert_activations(x), when the MoE layer made it."""
        return self.apply_held(x, weights, self.w1.held(), self.w3.held(), self.w2.held(), a)

    def apply_held(self, x: torch.Tensor, weights: Optional[torch.Tensor], w1: Held, w3: Held,
                   w2: Held, a: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The expert's formula on the given weights (its own, or a copy on the device of host experts)."""
        nx = self.nx
        gate, up = nx.linears((w1, w3), x, a)                          # one activation, quantised once
        return nx.linear(w2, self.swiglu(gate, up, weights).to(x.dtype))

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        """bf16 GEMM outputs -> fp32 clamp(SiLU(gate)) * clamp(up), times the routing weight if given."""
        gate, up = gate.float(), up.float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)                        # one-sided on the gate branch
        h = self.nx.silu(gate) * up
        if weights is not None:
            h = weights * h                                          # routing weight before the bf16 cast
        return h


def stacked_experts(dim: int, inter_dim: int, kind: str, n: int, device=None):
    """{projection: (weights [n, ...], scales [n, ...] or None)} for n SwiGLU experts of `kind`. w1 and w3
    (read by the same tokens) are the halves of one [2, n, ...] allocation each (weights, scales), so that a
    decode step can gather and dequantise both with one operation each (fast.fixed_shape_experts)."""
    def empty(lead, io):
        return [None if t is None else torch.empty(*lead, *t[0], dtype=t[1], device=device)
                for t in linear_tensors(*io, kind)]
    gate_up = empty((2, n), (dim, inter_dim))                        # [2, n, ...]: w1's rows, then w3's
    return {"w1": tuple(None if t is None else t[0] for t in gate_up),
            "w2": tuple(empty((n,), (inter_dim, dim))),
            "w3": tuple(None if t is None else t[1] for t in gate_up)}


class MoE(nn.Module):
    def __init__(self, ctx: ModelContext, n_experts: int, topk: int, with_bias_vl: bool):
        super().__init__()
        a, w = ctx.args, ctx.par.world_size
        if n_experts % w:
            raise ValueError(f"world size {w} does not divide the {n_experts} routed experts")
        self.ctx, self.nx, self.n_experts = ctx, ctx.numerics, n_experts
        self.n_local = n_experts // w
        self.start = ctx.par.rank * self.n_local
        expert_kind = a.expert_dtype if a.expert_dtype == "fp4" else a.dtype
        self.routed = ctx.routed_experts          # how the routed experts are applied (kernels/experts.py)
        self.routed.check_kind(expert_kind)
        self.gate = Gate(a.dim, n_experts, topk, ctx, with_bias_vl)
        # This rank's experts live in one layout per projection, [n_local, ...] weights and scales (w1's and
        # w3's side by side in one allocation), on the model's device or in host memory (--experts-on host);
        # each expert's Linears hold views of its row (the checkpoint names stay per expert). A decode step on
        # a GPU indexes the experts it selects there, with shapes fixed by the batch: no host sync. (Weights
        # streamed from disk replace each expert's tensors: they keep their own.)
        self.stacked = (None if ctx.streamed else stacked_experts(a.dim, a.moe_inter_dim, expert_kind,
                                                                  self.n_local, ctx.experts_device))
        if self.stacked is not None:
            self.routed.hold(self.stacked)
        rows = self.rows()
        self.experts = nn.ModuleList([
            Expert(a.dim, a.moe_inter_dim, expert_kind, ctx, ctx.keep_expert_layouts, rows[i - self.start])
            if self.start <= i < self.start + self.n_local else None for i in range(n_experts)])
        self.shared_experts = Expert(a.dim, a.moe_inter_dim, a.dtype, ctx)

    def rows(self):
        """Each local expert's views of the stacked layout, [{projection: (weight, scale)}] (None: no layout),
        made by one unbind per tensor (the released model has 15,360 routed experts)."""
        if self.stacked is None:
            return [None] * self.n_local
        views = {p: (w.unbind(0), [None] * self.n_local if s is None else s.unbind(0))
                 for p, (w, s) in self.stacked.items()}
        return [{p: (w[e], s[e]) for p, (w, s) in views.items()} for e in range(self.n_local)]

    def forward(self, x: torch.Tensor, call: ForwardCall, image_mask: Optional[torch.Tensor] = None):
        shape = x.shape
        x = x.view(-1, shape[-1])                                    # [N, D]
        mask = image_mask.reshape(-1) if image_mask is not None else None
        weights, idx = call.per_position(self.gate, x, mask, dim=0)                      # [N, k] each
        a = self.nx.expert_activations(x)          # x as the expert GEMMs read it, made once (or None)
        out = self.routed.apply(self, x, weights, idx, shape[1] == 1, a)                 # [N, k, D]
        y = self.nx.combine_experts(out, idx, self.ctx.par)      # [N, D] fp32, every rank's, by expert index
        y += self.shared_experts(x, a=a)
        return y.to(x.dtype).view(shape)
