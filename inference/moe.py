"""Mixture of experts: sqrt-softplus router with bias / bias_vl, expert-parallel SwiGLU experts with clamps,
fp32 reduction, one shared expert (docs/architecture.md §8, docs/numerics.md §10)."""
from typing import Optional

import torch
import torch.nn as nn

from .indexer import topk_indices
from .kernels import Derived
from .kernels.fast import fixed_shape_experts
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
        logits = nx.dense(x.float(), self.weight, self.derived) / self.gate_temp     # [N, E] fp32
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

    def forward(self, x: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.w2(self.swiglu(self.w1(x), self.w3(x), weights).to(x.dtype))

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


def stacked_experts(dim: int, inter_dim: int, kind: str, n: int):
    """{projection: (weights [n, ...], scales [n, ...] or None)} for n SwiGLU experts of `kind`."""
    sizes = {"w1": (dim, inter_dim), "w2": (inter_dim, dim), "w3": (dim, inter_dim)}
    return {p: tuple(None if t is None else torch.empty(n, *t[0], dtype=t[1])
                     for t in linear_tensors(*io, kind)) for p, io in sizes.items()}


def active_counts(idx: torch.Tensor, n_experts: int):
    """How many selections each expert has, read on the host (a sync: one per MoE layer and call)."""
    return torch.bincount(idx.flatten(), minlength=n_experts).tolist()


def looped_experts(moe: "MoE", x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Each active local expert on its own tokens (the weights as held: no copy per call): the selections
    sorted by expert (increasing index; each expert's rows in token order), one GEMM per projection.
    x [N, D], weights and idx [N, k] -> [N, k, D] in x's dtype, zero for other ranks' experts."""
    n, k = idx.shape
    counts = active_counts(idx, moe.n_experts)
    out = x.new_zeros(n, k, x.shape[-1])
    active = [e for e in range(moe.start, moe.start + moe.n_local) if counts[e]]      # increasing
    if not active:
        return out
    order = idx.flatten().argsort(stable=True)                  # selections grouped by expert, increasing
    lo = sum(counts[:moe.start])
    rows = order[lo:lo + sum(counts[moe.start:moe.start + moe.n_local])]              # this rank's selections
    sizes = [counts[e] for e in active]
    parts = zip(active, x[rows // k].split(sizes), weights.flatten()[rows].split(sizes))
    outs = [moe.experts[e](xe, we.unsqueeze(-1)) for e, xe, we in parts]             # [n_e, D] each
    out.view(n * k, -1)[rows] = torch.cat(outs)
    return out


class StackedExperts:
    """How the routed experts are applied when this rank's experts live in one stacked layout per projection
    on the model's device (the CPU included). With `fixed_shapes` (off the CPU, in an order whose numbers
    batched GEMMs on dequantised weights give: numerics.gathers_experts), decode steps and small calls (draft
    blocks) index the stacked layout with shapes fixed by the batch and top-k, no host sync; otherwise each
    active expert runs on its own tokens (looped_experts, one sync for the counts)."""

    def __init__(self, fixed_shapes: bool):
        self.fixed_shapes = fixed_shapes

    def apply(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
              decode: bool) -> torch.Tensor:
        """-> [N, k, D], each selection's expert output (zero for other ranks' experts)."""
        if self.fixed_shapes and (decode or x.shape[0] <= 16):
            first = next(e for e in moe.experts if e is not None)
            return fixed_shape_experts(moe.stacked, first.w1.kind, moe.start, moe.n_local, x, weights, idx,
                                       first.swiglu)
        return looped_experts(moe, x, weights, idx)


class StreamedExperts:
    """How the routed experts are applied when their weights stream from disk (engine/offload.py): each
    expert holds its own tensors, replaced as the blocks stream; each active one runs on its tokens."""

    def apply(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
              decode: bool) -> torch.Tensor:
        return looped_experts(moe, x, weights, idx)


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
        self.gate = Gate(a.dim, n_experts, topk, ctx, with_bias_vl)
        # This rank's experts live in one layout per projection, [n_local, ...] weights and scales; each
        # expert's Linears hold views of its row (the checkpoint names stay per expert). A decode step on a
        # GPU indexes the experts it selects there, with shapes fixed by the batch: no host sync. (Weights
        # streamed from disk replace each expert's tensors: they keep their own.)
        self.stacked = (None if ctx.streamed
                        else stacked_experts(a.dim, a.moe_inter_dim, expert_kind, self.n_local))
        self.experts = nn.ModuleList([
            Expert(a.dim, a.moe_inter_dim, expert_kind, ctx, ctx.keep_expert_layouts,
                   self.row(i - self.start))
            if self.start <= i < self.start + self.n_local else None for i in range(n_experts)])
        self.shared_experts = Expert(a.dim, a.moe_inter_dim, a.dtype, ctx)
        on_gpu = torch.device(ctx.device).type not in ("cpu", "meta")
        self.routed = (StreamedExperts() if ctx.streamed
                       else StackedExperts(fixed_shapes=on_gpu and self.nx.gathers_experts))

    def row(self, e: int):
        """Local expert e's views of the stacked layout, {projection: (weight, scale)} (None: no layout)."""
        if self.stacked is None:
            return None
        return {p: (w[e], None if s is None else s[e]) for p, (w, s) in self.stacked.items()}

    def forward(self, x: torch.Tensor, call: ForwardCall, image_mask: Optional[torch.Tensor] = None):
        shape = x.shape
        x = x.view(-1, shape[-1])                                    # [N, D]
        mask = image_mask.reshape(-1) if image_mask is not None else None
        weights, idx = call.per_position(self.gate, x, mask, dim=0)                      # [N, k] each
        out = self.routed.apply(self, x, weights, idx, decode=shape[1] == 1)             # [N, k, D]
        y = self.nx.combine_experts(out, idx, self.ctx.par)      # [N, D] fp32, every rank's, by expert index
        y += self.shared_experts(x)
        return y.to(x.dtype).view(shape)
