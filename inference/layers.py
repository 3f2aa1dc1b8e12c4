"""Linear layers (bf16 / fp32 / FP8 / MXFP4), tensor-parallel variants, embeddings, head, RMSNorm.

Each layer takes the model's ModelContext; its arithmetic is one call on the context's numerics (`nx`), which
keeps what it derives from a weight (a dequantised copy, an invariant layout) in the layer's `derived`.
Collectives are visible in the forward methods; the parallel context is passed in, never global.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels import Derived
from .kernels.numerics import Held
from .state import ModelContext

BLOCK = 32
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _param(shape, dtype):
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def linear_tensors(in_features: int, out_features: int, kind: str):
    """((shape, dtype) of the weight, (shape, dtype) of its scales or None) of a Linear of `kind`."""
    if kind == "fp8":
        return (((out_features, in_features), torch.float8_e4m3fn),
                ((-(-out_features // BLOCK), -(-in_features // BLOCK)), torch.float8_e8m0fnu))
    if kind == "fp4":
        return (((out_features, in_features // 2), torch.float4_e2m1fn_x2),
                ((out_features, in_features // BLOCK), torch.float8_e8m0fnu))
    if kind in _TORCH_DTYPES:
        return ((out_features, in_features), _TORCH_DTYPES[kind]), None
    raise ValueError(f"unknown Linear kind {kind!r}")


class Linear(nn.Module):
    """y = x W^T without bias. `kind`: fp8 (E4M3 + 32x32 UE8M0 scales), fp4 (MXFP4, per-32 row scales),
    bf16 or fp32 (plain GEMM in that dtype). `keep_derived=False`: nothing derived from the weight is kept
    between calls (routed experts whose weights are streamed, or live off the CPU). `storage`: the (weight,
    scale) tensors to hold, views into a larger layout (the MoE's stacked experts), instead of new ones."""

    def __init__(self, in_features: int, out_features: int, kind: str, ctx: ModelContext,
                 keep_derived: bool = True, storage=None):
        super().__init__()
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        if storage is None:
            (wshape, wdtype), scale = linear_tensors(in_features, out_features, kind)
            storage = (torch.empty(*wshape, dtype=wdtype),
                       None if scale is None else torch.empty(*scale[0], dtype=scale[1]))
        w, s = storage
        self.weight = nn.Parameter(w, requires_grad=False)
        self.scale = None if s is None else nn.Parameter(s, requires_grad=False)
        self.nx = ctx.numerics
        self.derived = Derived(keep_derived)

    def held(self) -> Held:
        """The weight as stored now (the block streamer may have replaced it), for the numerics."""
        return Held(self.weight, self.scale, self.kind, self.derived)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nx.linear(self.held(), x)


class ColumnParallelLinear(Linear):
    """Output features split over ranks; each rank's output slice is complete (no collective)."""

    def __init__(self, in_features: int, out_features: int, kind: str, ctx: ModelContext):
        w = ctx.par.world_size
        if out_features % w:
            raise ValueError(f"world size {w} does not divide {out_features} output features")
        super().__init__(in_features, out_features // w, kind, ctx)


class RowParallelLinear(Linear):
    """Input features split over ranks; the ranks' partial products are summed across them."""

    def __init__(self, in_features: int, out_features: int, kind: str, ctx: ModelContext):
        w = ctx.par.world_size
        if in_features % w:
            raise ValueError(f"world size {w} does not divide {in_features} input features")
        super().__init__(in_features // w, out_features, kind, ctx)
        self.par = ctx.par

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nx.row_parallel_linear(self.held(), x, self.par)   # the ranks' all-reduce included


class ParallelEmbedding(nn.Module):
    """Vocabulary rows split over ranks; ids owned elsewhere give zero rows, then a bf16 all-reduce. Rows come
    out in the activation dtype (fp32 in golden numerics: an exact widening)."""

    def __init__(self, vocab_size: int, dim: int, ctx: ModelContext):
        super().__init__()
        self.par, self.act_dtype = ctx.par, ctx.act_dtype
        self.part = vocab_size // ctx.par.world_size
        self.start = ctx.par.rank * self.part
        self.weight = _param((self.part, dim), torch.bfloat16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.par.world_size == 1:
            y = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.start) | (ids >= self.start + self.part)
            y = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
            y = y.masked_fill(outside.unsqueeze(-1), 0)        # (a boolean index would sync with the host)
            y = self.par.all_reduce(y)   # exact: one rank holds each row, the others add zeros
        return y.to(self.act_dtype)


class ParallelHead(nn.Module):
    """fp32 output head (the stored bf16 weight widened: exact), vocabulary rows split over ranks, logits
    all-gathered in rank order. The numerics say how the weight is held: in fp32, or in bf16 as stored (the
    fast order with --cpu-linears stored: half the bytes a decode step reads, the same fp32 products)."""

    def __init__(self, vocab_size: int, dim: int, ctx: ModelContext):
        super().__init__()
        self.ctx, self.nx = ctx, ctx.numerics
        self.weight = _param((vocab_size // ctx.par.world_size, dim), ctx.numerics.head_dtype)
        self.derived = Derived()

    def forward(self, x: torch.Tensor, all_positions: bool = False, call=None) -> torch.Tensor:
        """x [B, S, D] -> logits [B, V] of the last position, or [B, S, V] with all_positions. In a
        verification (`call`, a ForwardCall, one by one), one GEMV per position (the shape a decode step uses,
        so each row equals decoding it alone), still one all-gather."""
        if not all_positions:
            x = x[:, -1]
        logits_of = lambda u: self.nx.dense(u.float(), self.weight, self.derived)   # [B, (S,) V/W] fp32
        one_by_one = all_positions and call is not None
        logits = call.per_position(logits_of, x) if one_by_one else logits_of(x)
        return self.ctx.par.all_gather_cat(logits, dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ctx: ModelContext, weight_dtype=torch.bfloat16):
        super().__init__()
        self.eps, self.nx = eps, ctx.numerics
        self.weight = _param((dim,), weight_dtype)
        self.derived = Derived()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight * x / sqrt(mean(x^2) + eps) in fp32, x's dtype out."""
        return self.nx.rms_norm(x, self.weight, self.eps, self.derived)
