"""Mixture of experts: sqrt-softplus router with bias / bias_vl, expert-parallel SwiGLU experts with clamps,
fp32 reduction, one shared expert (docs/architecture.md §8, docs/numerics.md §10)."""
from typing import Optional

import torch
import torch.nn as nn

from .indexer import topk_indices
from .kernels import Derived, host_experts
from .kernels.numerics import Held
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
        logits = nx.dense(x.float(), self.weight, self.derived)                      # [N, E] fp32
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

    def forward(self, x: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.apply_held(x, weights, self.w1.held(), self.w3.held(), self.w2.held())

    def apply_held(self, x: torch.Tensor, weights: Optional[torch.Tensor], w1: Held, w3: Held,
                   w2: Held) -> torch.Tensor:
        """The expert's formula on the given weights (its own, or a copy on the device of host experts)."""
        nx = self.nx
        gate, up = nx.linears((w1, w3), x)                             # one activation, quantised once
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
    """{projection: (weights [n, ...], scales [n, ...] or None)} for n SwiGLU experts of `kind`."""
    sizes = {"w1": (dim, inter_dim), "w2": (inter_dim, dim), "w3": (dim, inter_dim)}
    return {p: tuple(None if t is None else torch.empty(n, *t[0], dtype=t[1], device=device)
                     for t in linear_tensors(*io, kind)) for p, io in sizes.items()}


def active_counts(idx: torch.Tensor, n_experts: int):
    """How many selections each expert has, read on the host (a sync: one per MoE layer and call)."""
    return torch.bincount(idx.flatten(), minlength=n_experts).tolist()


def local_selections(moe: "MoE", idx: torch.Tensor):
    """This rank's selections grouped by expert (increasing index; each expert's rows in token order):
    (active experts, increasing; rows: indices into idx.flatten() [M]; rows per active expert). One sync."""
    counts = active_counts(idx, moe.n_experts)
    active = [e for e in range(moe.start, moe.start + moe.n_local) if counts[e]]
    order = idx.flatten().argsort(stable=True)                  # selections grouped by expert, increasing
    lo = sum(counts[:moe.start])
    rows = order[lo:lo + sum(counts[moe.start:moe.start + moe.n_local])]              # [M]
    return active, rows, [counts[e] for e in active]


def looped_experts(moe: "MoE", x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, selections=None,
                   held=None) -> torch.Tensor:
    """Each active local expert on its own tokens, one GEMM per projection: with the weights as held (no
    copy per call), or with held(e, projection) -> Held (a copy made for the call). `selections`:
    local_selections' answer when already read. x [N, D], weights and idx [N, k] -> [N, k, D] in x's dtype,
    zero for other ranks' experts."""
    n, k = idx.shape
    out = x.new_zeros(n, k, x.shape[-1])
    active, rows, sizes = selections or local_selections(moe, idx)
    if not active:
        return out
    rows = rows.to(x.device)
    parts = zip(active, x[rows // k].split(sizes), weights.flatten()[rows].split(sizes))
    if held is None:
        outs = [moe.experts[e](xe, we.unsqueeze(-1)) for e, xe, we in parts]         # [n_e, D] each
    else:
        outs = [moe.experts[e].apply_held(xe, we.unsqueeze(-1), held(e, "w1"), held(e, "w3"), held(e, "w2"))
                for e, xe, we in parts]
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
            return moe.nx.selected_experts(moe.stacked, first.w1.kind, moe.start, moe.n_local, moe.n_experts,
                                           x, weights, idx, first.swiglu)
        return looped_experts(moe, x, weights, idx)


class StreamedExperts:
    """How the routed experts are applied when their weights stream from disk (engine/offload.py): each
    expert holds its own tensors, replaced as the blocks stream; each active one runs on its tokens."""

    def apply(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
              decode: bool) -> torch.Tensor:
        return looped_experts(moe, x, weights, idx)


class HostExperts:
    """How the routed experts are applied when they stay in host memory at their stored precision
    (--experts-on host): the host-expert kernel computes each active expert on its own tokens from the stored
    bytes (kernels/host_experts.py: the reference's products, summed in its own order), the SwiGLU and the
    routing weight between its two calls. On a GPU the inputs cross to the host and the outputs come back:
    one round trip per MoE layer and call. A GPU call with many tokens copies the active experts' bytes to
    the device instead, one at a time for this call only, and runs them there (looped_experts: the device's
    numerics, as if they lived there), when moving the bytes is estimated to take less time than the kernel
    (prefers_copy)."""

    def apply(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
              decode: bool) -> torch.Tensor:
        """-> [N, k, D], each selection's expert output (zero for other ranks' experts), on x's device."""
        n, k = idx.shape
        stage = moe.ctx.host_stage                # pinned buffers beside a GPU: one sync for the three copies
        if stage is not None and x.device.type != "cpu":
            idx_h, w_h, x_h = (stage.to_host(name, t) for name, t in (("idx", idx), ("w", weights), ("x", x)))
            stage.synchronize(x.device)
        else:
            idx_h, w_h, x_h = idx.cpu(), weights.cpu(), x.cpu()
        active, rows, sizes = local_selections(moe, idx_h)             # the host reads the routing: a sync
        if x.device.type != "cpu" and prefers_copy(moe, active, len(rows)):
            def held(e: int, p: str) -> Held:         # local expert e's projection p, copied for this call
                w, s = (None if t is None else t[e - moe.start].to(x.device) for t in moe.stacked[p])
                return Held(w, s, moe.experts[e].w1.kind, Derived(keep=False))
            return looped_experts(moe, x, weights, idx, (active, rows, sizes), held)
        if stage is not None and x.device.type != "cpu":
            out = stage.buffer("out", (n, k, x.shape[-1]), x.dtype).zero_()   # [N, k, D] on the host
        else:
            out = torch.zeros(n, k, x.shape[-1], dtype=x.dtype)
        if active:
            first = next(e for e in moe.experts if e is not None)
            ws = w_h.flatten()[rows]                                   # [M] routing weights
            projections = [moe.stacked[p] for p in ("w1", "w3", "w2")]
            local = [e - moe.start for e in active]
            # x [N, D] with each row's token: each token's activations are quantised once, not k times
            out.view(n * k, -1)[rows] = host_experts.expert_swiglu(x_h, sizes, local, ws, *projections,
                                                                   first.w1.kind, first.swiglu,
                                                                   tokens=rows // k)
        # from pinned memory the copy back runs on the stream, not on the host (the next layer's copies to
        # the host wait for it before its output buffer is written again)
        return out.to(x.device, non_blocking=stage is not None)


# The estimate behind HostExperts' choice for a GPU call: the rate per host thread of the kernel variant that
# runs (512-token prefills of `python -m inference.tools.bench experts`, 2 threads: avx512 82-106 GMAC/s on
# Zen 5, avx2 51 on Zen 3, scalar 2.0; the torch path dequantises each expert first, 0.5-3.7;
# docs/benchmarks.md §6) against host-to-GPU copies from pageable memory (PCIe 4.0 x16: assumed, not yet
# measured on a GPU host).
HOST_MACS_PER_THREAD = {"avx512": 40e9, "avx2": 25e9, "scalar": 1e9, "torch": 0.25e9}
LINK_BYTES_PER_S = 16e9


def prefers_copy(moe: "MoE", active, selections: int, variant: Optional[str] = None) -> bool:
    """Whether copying the active experts' bytes to the GPU beats computing them on the host: bytes / link
    rate against multiply-adds / the host's rate with `variant` (host_experts.resolve's choice by default).
    Released geometry (18.8 MB and 3 x 5120 x 2304 MACs per expert and selection), 2 host threads: the copy
    wins from about 170 tokens of top-6 of 384 with avx512, 106 with avx2."""
    if not active:
        return False
    one = moe.experts[active[0]]
    nbytes = sum(w[0].nbytes + (0 if sc is None else sc[0].nbytes) for w, sc in moe.stacked.values())
    macs = sum(lin.in_features * lin.out_features for lin in (one.w1, one.w2, one.w3))
    rate = HOST_MACS_PER_THREAD[host_experts.kernel_variant(variant)]
    host_s = selections * macs / (rate * torch.get_num_threads())
    return len(active) * nbytes / LINK_BYTES_PER_S < host_s


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
        if ctx.opts.experts_on == "host" and expert_kind not in host_experts.FORMATS:
            raise ValueError(f"--experts-on host computes FP4 / FP8 experts; these are {expert_kind}")
        self.gate = Gate(a.dim, n_experts, topk, ctx, with_bias_vl)
        # This rank's experts live in one layout per projection, [n_local, ...] weights and scales, on the
        # model's device or in host memory (--experts-on host); each expert's Linears hold views of its row
        # (the checkpoint names stay per expert). A decode step on a GPU indexes the experts it selects
        # there, with shapes fixed by the batch: no host sync. (Weights streamed from disk replace each
        # expert's tensors: they keep their own.)
        self.stacked = (None if ctx.streamed else stacked_experts(a.dim, a.moe_inter_dim, expert_kind,
                                                                  self.n_local, ctx.experts_device))
        if ctx.opts.experts_on == "host" and self.stacked is not None:
            for w, _ in self.stacked.values():                     # streamed from host memory every step
                host_experts.advise_huge_pages(w)
        rows = self.rows()
        self.experts = nn.ModuleList([
            Expert(a.dim, a.moe_inter_dim, expert_kind, ctx, ctx.keep_expert_layouts, rows[i - self.start])
            if self.start <= i < self.start + self.n_local else None for i in range(n_experts)])
        self.shared_experts = Expert(a.dim, a.moe_inter_dim, a.dtype, ctx)
        on_gpu = torch.device(ctx.device).type not in ("cpu", "meta")
        if ctx.streamed:
            self.routed = StreamedExperts()
        elif ctx.opts.experts_on == "host":
            self.routed = HostExperts()
        else:
            self.routed = StackedExperts(fixed_shapes=on_gpu and self.nx.gathers_experts)

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
        out = self.routed.apply(self, x, weights, idx, decode=shape[1] == 1)             # [N, k, D]
        y = self.nx.combine_experts(out, idx, self.ctx.par)      # [N, D] fp32, every rank's, by expert index
        y += self.shared_experts(x)
        return y.to(x.dtype).view(shape)
