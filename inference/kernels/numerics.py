"""The one interface of everything whose numbers depend on the numerics mode.

A model module calls `nx.<op>` (nx: the `Numerics` its ModelContext carries) for each operation whose result
depends on the summation order or on the rounding points, and plain torch for everything else. The choice is
made once, where the model is built (`inference.kernels.numerics_for`), along two axes:

    rounding points   reference: bf16 activations, FP8 activations before FP8/FP4 GEMMs, the caches'
                      FP8/FP4 round trips, as DeepSeek's code;  golden: fp32 everywhere, no fake quantization
    summation order   one subclass per order, each in the file of its kernels:
                      Exact (reference.py)      the reference's order, bit for bit on CPU
                      Fast (fast.py)            loop-free torch, the same rounding points
                      Invariant (invariant.py)  an order fixed by the shapes alone (same bits everywhere)
                      TileLang (tilelang_ops.py) the fused GPU kernels

This base class is the interface and holds what every order shares: torch's own elementwise functions and
reductions, the dispatch of a Linear by weight kind, the golden rounding points, and the collectives of the
rank-split operations. Subclasses override only what their order does differently.

What is derived from a weight (a dequantised copy, the invariant layout, a stacked GPU layout) lives with the
module that owns the weight, in its `Derived`, and is dropped by one call on the model (drop_derived).
"""
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..quant import CodeTables, dequant_fp4_weight, dequant_fp8_weight

BLOCK = 32


class Derived:
    """Layouts derived from one module's weights, built on first use and kept with the module: keyed by the
    layout's name and the weight tensor itself (a weight replaced by another, as the block streamer does, is
    never served a stale layout). `keep=False`: built for each call and never kept (weights streamed from
    disk, routed experts off the CPU: what one call uses once must not pile up)."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self._items = {}

    def get(self, weight: torch.Tensor, layout: str, make: Callable[[], object], keep: bool = True):
        key = (layout, id(weight))
        hit = self._items.get(key)
        if hit is not None and hit[0] is weight:
            return hit[1]
        value = make()
        if keep and self.keep:
            self._items[key] = (weight, value)
        return value

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def drop_derived(module: torch.nn.Module) -> None:
    """Empty the Derived of `module` and of every module below it."""
    for m in module.modules():
        d = getattr(m, "derived", None)
        if isinstance(d, Derived):
            d.clear()


class Held(NamedTuple):
    """A Linear's weight as stored, handed to the numerics per call (never the module itself): the weight,
    its block scales (None: a bf16 / fp32 weight), its kind (fp8, fp4, bf16, fp32) and the Derived where an
    order keeps what it lays out from it."""
    weight: torch.Tensor
    scale: Optional[torch.Tensor]
    kind: str
    derived: Derived


def exact_weight(held: Held) -> torch.Tensor:
    """The exact fp32 value of a held weight (FP8 / FP4 codes times their scales)."""
    if held.scale is None:
        return held.weight.float()
    fn = dequant_fp8_weight if held.kind == "fp8" else dequant_fp4_weight
    return fn(held.weight, held.scale, BLOCK)


class Numerics:
    """The interface (see the module docstring). Methods group as: weights, GEMMs, elementwise functions
    and reductions, RoPE and sampling, the fused kernels, the caches' round trips, the MoE's experts."""

    name = "?"
    # Whether every row's result is independent of the others in its call (then a verification extend needs
    # no per-position evaluation to equal decoding, see ForwardCall.per_position).
    rows_independent = False
    # Whether batched GEMMs on dequantised stacked experts give this order's numbers (experts.StackedExperts).
    gathers_experts = False
    # How the output head's weight (stored in bf16) is held: widened to fp32 once, for the fp32 GEMM.
    head_dtype = torch.float32

    def __init__(self, golden: bool = False, device="cpu"):
        self.golden = golden
        self.device = torch.device(device)
        self.tables = CodeTables(self.device)      # the formats' decode tables on this device, made once

    def __repr__(self) -> str:
        return f"{type(self).__name__}(golden={self.golden}, device={self.device})"

    @property
    def rounds_caches(self) -> bool:
        """Whether values are rounded to the caches' FP8 / FP4 formats before they are cached (not golden)."""
        return not self.golden

    @property
    def act_dtype(self) -> torch.dtype:
        """Activations and caches: bf16 as in DeepSeek's code, fp32 in golden numerics."""
        return torch.float32 if self.golden else torch.bfloat16

    # ---- weights ----

    def dequantized(self, held: Held, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact value of an FP8/FP4 Linear weight in `dtype`, kept in the layer's Derived on the CPU (off
        the CPU the fp32 value is recomputed per call: memory is the constraint there)."""
        return held.derived.get(held.weight, f"dequantized:{dtype}", lambda: exact_weight(held).to(dtype),
                                 keep=held.weight.device.type == "cpu")

    # ---- GEMMs ----

    def linear(self, held: Held, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T for a Linear at these rounding points: FP8/FP4 weights quantise x per 32 and give bf16;
        bf16 / fp32 weights a plain GEMM in their dtype; golden: fp32, the weight's exact value."""
        if self.golden:
            w = held.weight if held.scale is None else self.dequantized(held)
            return self.dense(x.float(), w.float(), held.derived, key=held.weight)
        if held.scale is None:
            return self.dense(x, held.weight, held.derived)
        return self.quant_linear(held, x)

    def linears(self, helds, x: torch.Tensor, a=None):
        """Several Linears that read the same x -> their outputs, in order. An order may quantise x once for
        all of them (act_quant works per row: the same numbers as each Linear alone); `a`: this order's
        expert_activations(x), when the MoE layer made it."""
        return tuple(self.linear(h, x) for h in helds)

    def quant_linear(self, held: Held, x: torch.Tensor) -> torch.Tensor:
        """The FP8/FP4 GEMM: act_quant(x) per 32, the weight's exact products, bf16 out."""
        raise NotImplementedError

    def row_parallel_linear(self, held: Held, x: torch.Tensor, par) -> torch.Tensor:
        """A Linear whose input features are split over the ranks of `par`: the partial products of every
        rank summed (bf16 partials widened to fp32 and all-reduced)."""
        y = self.linear(held, x)
        if par.world_size > 1:
            y = par.all_reduce(y.float()).to(x.dtype)
        return y

    def dense(self, x: torch.Tensor, w: torch.Tensor, derived: Derived, key: Optional[torch.Tensor] = None):
        """x [..., K] @ w [N, K]^T in x's dtype for a stored bf16 / fp32 weight (the router, the head, the
        hyper-connection mixes, bf16 and fp32 Linears). `derived` keeps what an order lays out from w, under
        `key` (default w itself: a weight computed per call, like a dequantised one, names its source)."""
        return F.linear(x, w.to(x.dtype))

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor, derived: Derived) -> torch.Tensor:
        """The router's fp32 logits: x [N, D] widened to fp32 times its bf16 weight [E, D] widened to fp32
        (the copy cast once and kept in `derived`) -> [N, E] fp32."""
        w = derived.get(weight, "float32", weight.float)                    # [E, D] fp32
        return self.dense(x.float(), w, derived)

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor, groups: int, derived: Derived):
        """The grouped low-rank output projection: x [B, S, G, d] and weight [G * r, d] -> [B, S, G, r], group
        g multiplied by rows g*r..(g+1)*r of the weight, in x's dtype."""
        w = weight.to(x.dtype).view(groups, -1, x.shape[-1])             # [G, r, d]
        return torch.einsum("bsgd,grd->bsgr", x, w)

    # ---- normalisations and the hyper-connections' stream sums ----

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, derived: Derived) -> torch.Tensor:
        """weight * x / sqrt(mean(x^2) + eps) over the last dim, in fp32, x's dtype out. `derived`: where an
        order keeps what it lays out from the weight (its fp32 copy)."""
        u = x.float()
        u = u * self.rsqrt(self.mean(u * u, -1, keepdim=True) + eps)
        return (weight.float() * u).to(x.dtype)

    def hc_mix_logits(self, u: torch.Tensor, fn: torch.Tensor, eps: float, derived: Derived) -> torch.Tensor:
        """A token's flattened streams u [..., hc * D] -> (u . fn^T) / sqrt(mean(u^2) + eps) in fp32: the GEMM
        first, then the scalar (fn [(2 + hc) * hc, hc * D] fp32, laid out in `derived`)."""
        u = u.float()
        rsqrt = self.rsqrt(self.mean(u * u, dim=-1, keepdim=True) + eps)
        return self.dense(u, fn, derived) * rsqrt

    def hc_pre(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Collapse streams x [B, S, hc, D] with weights pre [B, S, hc]: sum_j pre_j x_j in fp32 -> [B, S, D]
        in x's dtype."""
        return self.sum(pre.unsqueeze(-1) * x.float(), dim=2).to(x.dtype)

    def hc_post(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
        """Expand: stream k = post_k y + sum_j comb[j, k] R_j in fp32 (the sum over comb's first index) ->
        [B, S, hc, D] in y's dtype. y [B, S, D], residual [B, S, hc, D], post [B, S, hc], comb
        [B, S, hc, hc]."""
        out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + \
            self.sum(comb.unsqueeze(-1) * residual.float().unsqueeze(-2), dim=2)
        return out.to(y.dtype)

    # ---- elementwise functions and reductions ----

    def sum(self, x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
        return x.sum(dim=dim, keepdim=keepdim)

    def mean(self, x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
        return x.mean(dim=dim, keepdim=keepdim)

    def rsqrt(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x)

    def softmax(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.softmax(dim=dim)

    # ---- RoPE and sampling ----

    def pow(self, base: float, e: torch.Tensor) -> torch.Tensor:
        """base ** e for an fp32 tensor e (the RoPE frequencies)."""
        return base ** e

    def rope_table(self, freqs: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """Rotations e^{i t f} for positions t < max_seq_len: complex64 [max_seq_len, len(freqs)]. A meta
        `freqs` gives the table's shape only (a memory plan)."""
        if freqs.is_meta:
            return torch.empty(max_seq_len, freqs.shape[0], dtype=torch.complex64, device="meta")
        t = torch.arange(max_seq_len, dtype=torch.float32, device=freqs.device)
        angles = torch.outer(t, freqs)
        return torch.polar(torch.ones_like(angles), angles)

    def rotate(self, pairs: torch.Tensor, table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """(x0 + i x1) * e^{+-i theta}: pairs [..., n, 2] fp32, table broadcastable to [..., n]
        -> [..., n, 2]."""
        z = torch.view_as_complex(pairs.contiguous())
        return torch.view_as_real(z * (table.conj() if inverse else table))

    def exponential_like(self, p: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Exp(1) noise of p's shape (Gumbel-max sampling)."""
        return torch.empty_like(p).exponential_(1, generator=generator)

    # ---- fused kernels ----

    def sparse_attn(self, q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                    scale: float) -> torch.Tensor:
        """q [B, M, H, D], kv [B, N, D], sink [H] fp32, idx [B, M, T] int32 (-1 = none) -> [B, M, H, D]."""
        raise NotImplementedError

    def hc_split_sinkhorn(self, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                          iters: int, eps: float):
        """mixes [..., (2 + hc) * hc] fp32 -> pre [..., hc], post [..., hc], comb [..., hc, hc]."""
        raise NotImplementedError

    def index_scores(self, q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, par,
                     visible: Optional[torch.Tensor] = None) -> torch.Tensor:
        """sum_h ReLU(q_h . k) * w_h over the heads of every rank (this rank holds q and w of its heads):
        q [B, S, H_l, D], keys [B, T, D], w [B, S, H_l] -> [B, S, T] bf16, bf16 partials all-reduced.
        `visible` [S]: the keys each query may see (its first ones); an order may leave the scores past them
        unmade (0), which the caller masks."""
        return par.all_reduce(self.local_index_scores(q, keys, w, visible))

    def local_index_scores(self, q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor,
                           visible: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError

    # ---- the caches' round trips (golden numerics skip them) ----

    def act_quant(self, x: torch.Tensor, block: int = BLOCK):
        """x [..., K] -> (e4m3 [..., K], fp32 power-of-two scales [..., K/block])."""
        raise NotImplementedError

    def fp8_qdq_(self, x: torch.Tensor, block: int = 32) -> torch.Tensor:
        """In place: x <- e4m3(x / s) * s per `block` (window KV)."""
        return x if self.golden else self._fp8_qdq_(x, block)

    def fp4_qdq_e8m0_(self, x: torch.Tensor, block: int = 32) -> torch.Tensor:
        """In place: FP4 round trip with power-of-two scales per `block` (indexer queries and keys)."""
        return x if self.golden else self._fp4_qdq_e8m0_(x, block)

    def fp4_qdq_e4m3_(self, x: torch.Tensor, block: int = 16) -> torch.Tensor:
        """In place: FP4 round trip with E4M3 scales per `block` (compressed KV latents)."""
        return x if self.golden else self._fp4_qdq_e4m3_(x, block)

    def _fp8_qdq_(self, x, block):
        raise NotImplementedError

    def _fp4_qdq_e8m0_(self, x, block):
        raise NotImplementedError

    def _fp4_qdq_e4m3_(self, x, block):
        raise NotImplementedError

    # ---- the MoE's routed experts ----

    def expert_activations(self, x: torch.Tensor):
        """x [N, D] as this order's FP8/FP4 expert GEMMs read it, made once by an MoE layer for its routed and
        shared experts (selected_experts' and linears' `a`; each uses it only where it quantises), or None
        where each makes its own."""
        return None

    def selected_experts(self, stacked, kind: str, start: int, n_local: int, n_experts: int, x: torch.Tensor,
                         weights: torch.Tensor, idx: torch.Tensor, swiglu, a=None) -> torch.Tensor:
        """The routed experts of a decode step (or a small call) with every shape fixed by the batch and the
        top-k, no host sync (orders with gathers_experts): stacked {projection: (weights [E, ...], scales
        [E, ...] or None)} this rank's experts start..start + n_local (of n_experts) of `kind`; x [N, D],
        weights and idx [N, k]; swiglu(gate, up, weights) the expert activation -> [N, k, D] in x's dtype,
        zero for other ranks' experts."""
        raise NotImplementedError


    def combine_experts(self, out: torch.Tensor, idx: torch.Tensor, par) -> torch.Tensor:
        """Each selection's expert output out [N, k, D] (zero where another rank's expert was chosen) and the
        expert indices [N, k] -> [N, D] fp32 over every rank: per token, this rank's outputs added in fp32 in
        increasing expert index (the reference's loop order), then the ranks' sums all-reduced."""
        out = out.gather(1, idx.argsort(dim=1).unsqueeze(-1).expand(-1, -1, out.shape[-1]))
        y = torch.zeros(out.shape[0], out.shape[-1], dtype=torch.float32, device=out.device)
        for j in range(idx.shape[1]):                                # top-k: a constant of the model
            y += out[:, j]
        return par.all_reduce(y)
