"""Mixture of experts: sqrt-softplus router with bias / bias_vl, expert-parallel SwiGLU experts with clamps,
fp32 reduction, one shared expert (docs/architecture.md §8, docs/numerics.md §10)."""
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels
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
        self._inv = None   # the invariant order's layout of the weight

    def clear_cache(self):
        self._inv = None

    def forward(self, x: torch.Tensor, image_mask: Optional[torch.Tensor] = None):
        """x [N, D] bf16 -> (weights [N, k] fp32, expert indices [N, k])."""
        inv = kernels.invariant if kernels.is_invariant(self.ctx.opts) else None
        if inv and self._inv is None:
            self._inv = inv.PreparedWeight.of(self.weight.float())
        logits = (inv.linear(x.float(), None, prepared=self._inv) if inv
                  else F.linear(x.float(), self.weight.float()))
        if self.gate_temp != 1.0:
            logits = logits / self.gate_temp
        if self.score_func == "sqrtsoftplus":
            scores = (inv.softplus(logits) if inv else F.softplus(logits)).sqrt()
        elif self.score_func == "softmax":
            scores = inv.softmax(logits, -1) if inv else logits.softmax(dim=-1)
        else:
            scores = inv.sigmoid(logits) if inv else logits.sigmoid()
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.view(-1, 1), self.bias_vl, self.bias)   # [N, E]
        # Select with the biased scores, weight with the unbiased ones.
        idx = topk_indices(scores + bias, self.topk, self.ctx.opts.deterministic_topk)
        weights = scores.gather(1, idx)
        if self.norm_topk:
            total = inv.tree_sum(weights, -1, keepdim=True) if inv else weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + 1e-20)
        return weights * self.route_scale, idx


class Expert(nn.Module):
    def __init__(self, dim: int, inter_dim: int, kind: str, swiglu_limit: float):
        super().__init__()
        self.invariant = False   # set by the MoE: SiLU from the invariant elementary functions
        self.w1 = Linear(dim, inter_dim, kind)
        self.w2 = Linear(inter_dim, dim, kind)
        self.w3 = Linear(dim, inter_dim, kind)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.w2(self.swiglu(self.w1(x), self.w3(x), weights).to(x.dtype))

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        """bf16 GEMM outputs -> fp32 clamp(SiLU(gate)) * clamp(up), times the routing weight if given."""
        gate, up = gate.float(), up.float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)                        # one-sided on the gate branch
        h = (kernels.invariant.silu(gate) if self.invariant else F.silu(gate)) * up
        if weights is not None:
            h = weights * h                                          # routing weight before the bf16 cast
        return h


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
        for e in range(self.start, self.start + self.n_local):
            for lin in (self.experts[e].w1, self.experts[e].w2, self.experts[e].w3):
                lin.cache_off_cpu = False      # the fast route dequantizes only the experts a step selects
        self.shared_experts = Expert(a.dim, a.moe_inter_dim, a.dtype, a.swiglu_limit)
        for expert in [*self.experts, self.shared_experts]:
            if expert is not None:
                expert.invariant = kernels.is_invariant(ctx.opts)

    def forward(self, x: torch.Tensor, image_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])                                    # [N, D]
        mask = image_mask.reshape(-1) if image_mask is not None else None
        weights, idx = self.ctx.per_position(self.gate, x, mask, dim=0)
        y = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(idx.flatten(), minlength=self.n_experts).tolist()   # the one host sync
        if kernels.is_invariant(self.ctx.opts):
            y = self.routed_invariant(x, weights, idx, counts)
        elif not self.ctx.opts.golden and kernels.route(self.ctx.opts, x) == "fast":   # golden: no quant
            # decode (one position per sequence) and draft blocks gather their experts; prefill loops
            out = self.routed_fast(x, weights, idx, counts, shape[1] == 1 or x.shape[0] <= 16)   # [N, k, D]
            # fp32 sums in increasing expert index, as the loop below adds them (+0 for other ranks')
            out = out.gather(1, idx.argsort(dim=1).unsqueeze(-1).expand(-1, -1, out.shape[-1]))
            for j in range(idx.shape[1]):                            # top-k: a constant of the model
                y += out[:, j]
        else:
            for e in range(self.start, self.start + self.n_local):   # increasing global index
                if counts[e] == 0:
                    continue
                tok, slot = torch.where(idx == e)
                y[tok] += self.experts[e](x[tok], weights[tok, slot, None])
        if not kernels.is_invariant(self.ctx.opts):
            y = self.ctx.par.all_reduce(y)
        y += self.shared_experts(x)
        return y.to(x.dtype).view(shape)

    def routed_invariant(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                         counts: List[int]) -> torch.Tensor:
        """Routed experts in the invariant order: each selection's output in its own slot [N, k, D] fp32
        (zero where another rank's expert was chosen), summed over the ranks (exact: one rank holds each
        slot, the others add zeros), then over the slots by tree_sum in increasing expert index. No sum
        depends on the world size or on which tokens share an expert."""
        n, k = idx.shape
        out = torch.zeros(n, k, x.shape[-1], dtype=torch.float32, device=x.device)
        for e in range(self.start, self.start + self.n_local):
            if counts[e]:
                tok, slot = torch.where(idx == e)
                out[tok, slot] = self.experts[e](x[tok], weights[tok, slot, None]).float()
        out = self.ctx.par.all_reduce(out)
        out = out.gather(1, idx.argsort(dim=1).unsqueeze(-1).expand(-1, -1, out.shape[-1]))
        return kernels.invariant.tree_sum(out, dim=1)                                # [N, D]

    def routed_fast(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, counts: List[int],
                    gathered: bool) -> torch.Tensor:
        """Routed experts on the fast route: x [N, D], weights / idx [N, k] -> each selection's expert output
        [N, k, D] bf16 (zero for other ranks' experts). `gathered` (decode, draft blocks): the experts the
        call selects, stacked and dequantized together, one batched GEMM per projection (fast.moe_decode).
        Otherwise the selections sorted by expert and one GEMM per active expert (a loop over the active
        experts, for prefill and long extends)."""
        n, k = idx.shape
        active = [e for e in range(self.start, self.start + self.n_local) if counts[e]]   # increasing
        out = x.new_zeros(n, k, x.shape[-1])
        if not active:
            return out
        if gathered:
            slot_of = torch.full((self.n_experts,), -1, dtype=torch.long)
            slot_of[active] = torch.arange(len(active))
            slot = slot_of.to(x.device)[idx]                                           # [N, k]
            first, dtype = self.experts[active[0]], kernels.fast.compute_dtype(x.device)
            w1, w3, w2 = (self.stacked(active, p, dtype) for p in ("w1", "w3", "w2"))
            return kernels.fast.moe_decode(x, slot, weights, w1, w3, w2, first.w1.scale is not None,
                                           first.swiglu)
        order = idx.flatten().argsort(stable=True)                  # selections grouped by expert, increasing
        lo = sum(counts[:self.start])
        rows = order[lo:lo + sum(counts[self.start:self.start + self.n_local])]       # this rank's selections
        sizes = [counts[e] for e in active]
        parts = zip(active, x[rows // k].split(sizes), weights.flatten()[rows].split(sizes))
        outs = [self.experts[e](xe, we.unsqueeze(-1)) for e, xe, we in parts]        # [n_e, D] each
        out.view(n * k, -1)[rows] = torch.cat(outs)
        return out

    def stacked(self, active: List[int], name: str, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized weights [A, out, in] of projection `name` of the active experts, in `dtype`. On CPU
        from each Linear's cached value; elsewhere the stored bytes are stacked (one copy, no kernel per
        expert: the lists only collect references) and dequantized together."""
        lins = [getattr(self.experts[e], name) for e in active]
        if lins[0].scale is None:
            return torch.stack([lin.weight for lin in lins]).to(dtype)
        if lins[0].weight.device.type == "cpu":
            return torch.stack([lin.dequantized(dtype) for lin in lins])
        return kernels.fast.dequant_stacked([lin.weight for lin in lins], [lin.scale for lin in lins],
                                            lins[0].kind, dtype)
