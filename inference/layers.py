"""Linear layers (bf16 / fp32 / FP8 / MXFP4), tensor-parallel variants, embeddings, head, RMSNorm.

Collectives are visible in the forward methods; the parallel context is passed in, never global.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels
from .config import RuntimeOptions
from .parallel import ParallelContext
from .quant import dequant_fp4_weight, dequant_fp8_weight

BLOCK = 32
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _param(shape, dtype):
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T without bias. `kind`: fp8 (E4M3 + 32x32 UE8M0 scales), fp4 (MXFP4, per-32 row scales),
    bf16 or fp32 (plain GEMM in that dtype)."""

    def __init__(self, in_features: int, out_features: int, kind: str = "bf16"):
        super().__init__()
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        if kind == "fp8":
            self.weight = _param((out_features, in_features), torch.float8_e4m3fn)
            self.scale = _param((-(-out_features // BLOCK), -(-in_features // BLOCK)), torch.float8_e8m0fnu)
        elif kind == "fp4":
            self.weight = _param((out_features, in_features // 2), torch.float4_e2m1fn_x2)
            self.scale = _param((out_features, in_features // BLOCK), torch.float8_e8m0fnu)
        elif kind in _TORCH_DTYPES:
            self.weight = _param((out_features, in_features), _TORCH_DTYPES[kind])
            self.scale = None
        else:
            raise ValueError(f"unknown Linear kind {kind!r}")
        self._deq: Optional[torch.Tensor] = None
        self._inv = None   # the invariant order's layout of the weight
        self.golden = False   # set by the Transformer: fp32 GEMM, no activation quantization
        self.opts = RuntimeOptions()   # set by the Transformer: kernel backend and summation order
        # Off CPU, keep the dequantized weight of the fast route (bf16, 2 bytes a weight) between calls; the
        # MoE clears this for routed experts, whose decode path dequantizes only the experts a step selects.
        self.cache_off_cpu = True
        # False for weights streamed from disk that one call uses once (routed experts): nothing derived from
        # them outlives the call, so a block's dequantized experts never pile up.
        self.keep_derived = True

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact value of an FP8/FP4 weight in `dtype` (fp32, or bf16: every E4M3 or E2M1 value times its
        power-of-two scale fits). Cached on CPU; off CPU the fp32 value of the exact route is recomputed per
        call (memory is the constraint there) and the bf16 one of the fast route is cached (cache_off_cpu)."""
        if self._deq is not None and self._deq.dtype == dtype:
            return self._deq
        if dtype == torch.float32:
            fn = dequant_fp8_weight if self.kind == "fp8" else dequant_fp4_weight
            w = fn(self.weight, self.scale, BLOCK)
        else:
            w = kernels.fast.dequant_weight(self.weight, self.scale, self.kind, dtype)
        if self.weight.device.type == "cpu" or (dtype != torch.float32 and self.cache_off_cpu):
            self._deq = w
        return w

    def invariant_weight(self):
        """The weight laid out once for the invariant order (fp64, 8 bytes a weight, kept instead of the
        fp32 dequantised copy)."""
        if self._inv is None:
            self._inv = kernels.invariant.PreparedWeight.of(
                self.weight.float() if self.scale is None else self.dequantized())
            self._deq = None
        return self._inv

    def clear_cache(self):
        self._deq = self._inv = None

    def forward(self, x: torch.Tensor, par: Optional[ParallelContext] = None) -> torch.Tensor:
        """par: a row-parallel layer's context, used by the invariant order only (see RowParallelLinear)."""
        invariant = kernels.is_invariant(self.opts)
        if invariant and (self.golden or self.scale is None):
            return kernels.invariant.linear(x.float() if self.golden else x, None,
                                            prepared=self.invariant_weight())
        if self.scale is None:
            return F.linear(x.float(), self.weight.float()) if self.golden else F.linear(x, self.weight)
        if self.golden:
            y = F.linear(x.float(), self.dequantized())
        else:
            y = kernels.quant_gemm(self.opts, x, self.weight, self.scale, self.kind, self.dequantized, par,
                                   self.invariant_weight)
        if not self.keep_derived:
            self._deq = self._inv = None
        return y


class ColumnParallelLinear(Linear):
    """Output features split over ranks; each rank's output slice is complete (no collective)."""

    def __init__(self, in_features: int, out_features: int, kind: str, ctx: ParallelContext):
        if out_features % ctx.world_size:
            raise ValueError(f"world size {ctx.world_size} does not divide {out_features} output features")
        super().__init__(in_features, out_features // ctx.world_size, kind)


class RowParallelLinear(Linear):
    """Input features split over ranks; bf16 partials are summed in fp32 across ranks."""

    def __init__(self, in_features: int, out_features: int, kind: str, ctx: ParallelContext):
        if in_features % ctx.world_size:
            raise ValueError(f"world size {ctx.world_size} does not divide {in_features} input features")
        super().__init__(in_features // ctx.world_size, out_features, kind)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.is_invariant(self.opts) and self.scale is not None and not self.golden:
            return super().forward(x, self.ctx)    # the sum over K continues across the ranks, in its tree
        y = super().forward(x)
        if self.ctx.world_size > 1:
            y = self.ctx.all_reduce(y.float()).to(x.dtype)
        return y


class ParallelEmbedding(nn.Module):
    """Vocabulary rows split over ranks; ids owned elsewhere give zero rows, then a bf16 all-reduce."""

    def __init__(self, vocab_size: int, dim: int, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.part = vocab_size // ctx.world_size
        self.start = ctx.rank * self.part
        self.weight = _param((self.part, dim), torch.bfloat16)
        self.golden = False   # set by the Transformer: fp32 rows (exact widening)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.world_size == 1:
            y = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.start) | (ids >= self.start + self.part)
            y = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
            y[outside] = 0
            y = self.ctx.all_reduce(y)   # exact: one rank holds each row, the others add zeros
        return y.float() if self.golden else y


class ParallelHead(nn.Module):
    """fp32 output head, vocabulary rows split over ranks, logits all-gathered in rank order."""

    def __init__(self, vocab_size: int, dim: int, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.weight = _param((vocab_size // ctx.world_size, dim), torch.float32)
        self.opts = RuntimeOptions()   # set by the Transformer
        self._inv = None               # the invariant order's layout of the weight

    def clear_cache(self):
        self._inv = None

    def forward(self, x: torch.Tensor, all_positions: bool = False,
                per_position: bool = False) -> torch.Tensor:
        """x [B, S, D] -> logits [B, V] of the last position, or [B, S, V] with all_positions.
        per_position: one GEMV per position (the shape a single-token decode uses, so each row is
        bit-identical to decoding it alone), still one all-gather."""
        if not all_positions:
            x = x[:, -1]
        if kernels.is_invariant(self.opts):
            if self._inv is None:
                self._inv = kernels.invariant.PreparedWeight.of(self.weight)
            logits = kernels.invariant.linear(x.float(), None, prepared=self._inv)   # rows independent
        elif per_position and all_positions:
            logits = torch.stack([F.linear(x[:, i].float(), self.weight) for i in range(x.shape[1])], dim=1)
        else:
            logits = F.linear(x.float(), self.weight)               # [B, V/W] or [B, S, V/W]
        return self.ctx.all_gather_cat(logits, dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_dtype=torch.bfloat16):
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), weight_dtype)
        self.opts = RuntimeOptions()   # set by the Transformer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.is_invariant(self.opts):
            return kernels.invariant.rms_norm(x, self.weight, self.eps)
        u = x.float()
        u = u * torch.rsqrt(u.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * u).to(x.dtype)
