"""How a MoE layer applies its routed experts: one method object per placement of their weights, chosen once
where the model is built (kernels.routed_experts_for) and shared by every MoE layer of the model.

    StackedExperts   this rank's experts in one stacked layout per projection on the model's device (the CPU
                     included): each active expert on its own tokens, or on a GPU in a fixed-shape order,
                     the selected experts indexed with shapes fixed by the batch (no host sync)
    StreamedExperts  the weights stream from disk block by block (engine/offload.py): each expert holds its
                     own tensors, replaced as the blocks stream
    HostExperts      the experts stay in host memory at their stored precision (--experts-on host): the
                     host-expert kernel computes them from their bytes (host_experts.py)

A method reads what it needs from the layer it is given (`moe`: its experts, stacked layout, rank's range and
numerics) and returns each selection's expert output, [N, k, D], zero for other ranks' experts; the layer
combines them (numerics.combine_experts).
"""
from typing import Optional

import torch

from . import host_experts
from .host_experts import PinnedStage
from .numerics import Derived, Held


def active_counts(idx: torch.Tensor, n_experts: int):
    """How many selections each expert has, read on the host (a sync: one per MoE layer and call)."""
    return torch.bincount(idx.flatten(), minlength=n_experts).tolist()


def local_selections(moe, idx: torch.Tensor):
    """This rank's selections grouped by expert (increasing index; each expert's rows in token order):
    (active experts, increasing; rows: indices into idx.flatten() [M]; rows per active expert). One sync."""
    counts = active_counts(idx, moe.n_experts)
    active = [e for e in range(moe.start, moe.start + moe.n_local) if counts[e]]
    order = idx.flatten().argsort(stable=True)                  # selections grouped by expert, increasing
    lo = sum(counts[:moe.start])
    rows = order[lo:lo + sum(counts[moe.start:moe.start + moe.n_local])]              # [M]
    return active, rows, [counts[e] for e in active]


def looped_experts(moe, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, selections=None,
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

    def check_kind(self, kind: str) -> None:
        """Any stored format runs here."""

    def hold(self, stacked) -> None:
        """Nothing to arrange for weights on the model's device."""

    def apply(self, moe, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, decode: bool,
              a: Optional[torch.Tensor] = None) -> torch.Tensor:
        """-> [N, k, D], each selection's expert output (zero for other ranks' experts). `a`: the numerics'
        expert_activations(x), when made."""
        if self.fixed_shapes and (decode or x.shape[0] <= 16):
            first = next(e for e in moe.experts if e is not None)
            return moe.nx.selected_experts(moe.stacked, first.w1.kind, moe.start, moe.n_local, moe.n_experts,
                                           x, weights, idx, first.swiglu, a)
        return looped_experts(moe, x, weights, idx)


class StreamedExperts:
    """How the routed experts are applied when their weights stream from disk (engine/offload.py): each
    expert holds its own tensors, replaced as the blocks stream; each active one runs on its tokens."""

    def check_kind(self, kind: str) -> None:
        """Any stored format streams."""

    def hold(self, stacked) -> None:
        """Streamed experts have no stacked layout."""

    def apply(self, moe, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, decode: bool,
              a: Optional[torch.Tensor] = None) -> torch.Tensor:
        return looped_experts(moe, x, weights, idx)


class HostExperts:
    """How the routed experts are applied when they stay in host memory at their stored precision
    (--experts-on host): the host-expert kernel computes each active expert on its own tokens from the stored
    bytes (kernels/host_experts.py: the reference's products, summed in its own order), the SwiGLU and the
    routing weight between its two calls. On a GPU the inputs cross to the host and the outputs come back:
    one round trip per MoE layer and call. A GPU call with many tokens copies the active experts' bytes to
    the device instead, one at a time for this call only, and runs them there (looped_experts: the device's
    numerics, as if they lived there), when moving the bytes is estimated to take less time than the kernel
    (prefers_copy). `stage`: pinned host buffers for the copies when the model is on a GPU (one sync for the
    three copies of a call), None on the CPU."""

    def __init__(self, stage: Optional[PinnedStage] = None):
        self.stage = stage

    def check_kind(self, kind: str) -> None:
        """The host kernel reads FP4 and FP8 bytes only."""
        if kind not in host_experts.FORMATS:
            raise ValueError(f"--experts-on host computes FP4 / FP8 experts; these are {kind}")

    def hold(self, stacked) -> None:
        """The stacked weights are streamed from host memory every step: ask for 2 MB pages."""
        for w, _ in stacked.values():
            host_experts.advise_huge_pages(w)

    def apply(self, moe, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, decode: bool,
              a: Optional[torch.Tensor] = None) -> torch.Tensor:
        """-> [N, k, D], each selection's expert output (zero for other ranks' experts), on x's device (`a`
        unused: the host kernel quantises on the host)."""
        n, k = idx.shape
        stage = self.stage                        # pinned buffers beside a GPU: one sync for the three copies
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
# docs/benchmarks.md §6) against host-to-GPU copies from pageable memory (PCIe 4.0 x16, an assumption: the
# device check's speed phase measures the link).
HOST_MACS_PER_THREAD = {"avx512": 40e9, "avx2": 25e9, "scalar": 1e9, "torch": 0.25e9}
LINK_BYTES_PER_S = 16e9


def prefers_copy(moe, active, selections: int, variant: Optional[str] = None) -> bool:
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
