"""The one dispatch of the hot paths: every model module calls these functions, and they pick per call.

Routes:
    exact     reference.py: CPU-exact torch, the reference's rounding points and summation order.
    fast      fast.py: loop-free torch, the same rounding points, another summation order.
    invariant invariant.py: the same rounding points, every reduction in an order fixed by the shapes alone
              (the same bits on every CPU, with any thread count, batch, chunking and world size).
    tilelang  tilelang_ops.py: the fused GPU kernels (imported only when this route is taken).

How a route is picked, from RuntimeOptions (passed in by the caller: ModelContext.opts, or the `opts` that the
Transformer hands to each Linear) and the tensors of the call:
    kernel_backend = tilelang   tilelang; tensors not on a CUDA GPU of compute capability >= 9.0 are an error
    kernel_backend = auto       tilelang when the tensors are on such a GPU and `import tilelang` works,
                                else torch
    kernel_backend = torch      torch
    torch, order = exact|fast|invariant   that order; order = auto: exact on CPU, fast on CUDA
    order = invariant           invariant, whatever the backend (it is a definition of the numbers)
Golden numerics (fp32 everywhere, no quantization) always run the torch kernels. On the tilelang route the
MoE loops over its active experts (each GEMM a kernel); on the fast route it gathers them (moe.py).
"""
import functools
import importlib.util
from typing import Callable, Optional

import torch

from ..config import ORDERS, ConfigError, RuntimeOptions
from . import fast, invariant, reference


class BackendError(ConfigError):
    """A kernel backend asked for where it cannot run (reported as one line)."""


@functools.lru_cache(maxsize=None)
def _tilelang_imports() -> bool:
    """Whether `import tilelang` works here (asked only for CUDA tensors on a capable GPU, once)."""
    if importlib.util.find_spec("tilelang") is None:
        return False
    try:
        importlib.import_module("tilelang")
    except Exception:   # installed but unusable (e.g. a CUDA mismatch): auto then means torch
        return False
    return True


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def _where(device: torch.device) -> str:
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = _capability(index)
    return f"cuda:{index} (compute capability {major}.{minor})"


def _hopper_or_newer(device: torch.device) -> bool:
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def check_backend(opts: RuntimeOptions, device) -> None:
    """Fail early, with one line, when the options cannot run on `device` (the model's device)."""
    if opts.kernel_backend not in ("auto", "torch", "tilelang"):
        raise ConfigError(f"unknown kernel backend {opts.kernel_backend!r} "
                          f"(expected auto, torch or tilelang)")
    if opts.order not in ORDERS:
        raise ConfigError(f"unknown summation order {opts.order!r} (expected one of {', '.join(ORDERS)})")
    if opts.order == "invariant" and opts.kernel_backend == "tilelang":
        raise BackendError("--numerics invariant runs the torch kernels: drop --kernel-backend tilelang")
    if opts.kernel_backend == "tilelang":
        if opts.golden:
            raise BackendError("--kernel-backend tilelang does not run golden numerics (fp32, no "
                               "quantization): use --kernel-backend torch")
        if not _hopper_or_newer(device):
            raise BackendError("--kernel-backend tilelang needs CUDA tensors on a GPU with compute "
                               f"capability >= 9.0; these are on {_where(device)}")


def route(opts: RuntimeOptions, t: torch.Tensor) -> str:
    """The route ('exact', 'fast', 'invariant' or 'tilelang') for a call whose main tensor is `t`."""
    backend = opts.kernel_backend
    if opts.order == "invariant":
        if backend == "tilelang":
            check_backend(opts, t.device)
        return "invariant"
    if backend == "tilelang":
        check_backend(opts, t.device)
        return "tilelang"
    if backend == "auto" and not opts.golden and _hopper_or_newer(t.device) and _tilelang_imports():
        return "tilelang"
    if backend not in ("auto", "torch"):
        check_backend(opts, t.device)                               # names the unknown value
    if opts.order == "auto":
        return "exact" if t.device.type == "cpu" else "fast"
    if opts.order not in ORDERS:
        check_backend(opts, t.device)
    return opts.order


def _tilelang():
    from . import tilelang_ops     # compiles kernels on first use: only when the route is taken
    return tilelang_ops


def _torch(path: str):
    return {"fast": fast, "invariant": invariant}.get(path, reference)


def _in_place(kernel, x: torch.Tensor, block: int) -> torch.Tensor:
    """Run an in-place kernel (contiguous operands only) on any x, writing the result into x."""
    y = x if x.is_contiguous() else x.contiguous()
    kernel(y, block)
    return x if y is x else x.copy_(y)


# ---- quantizers: bit-exact on the torch routes, which share one implementation ----

def act_quant(opts: RuntimeOptions, x: torch.Tensor, block: int = 32):
    """x [..., K] -> (e4m3 [..., K], fp32 power-of-two scales [..., K/block])."""
    if route(opts, x) == "tilelang":
        return _tilelang().act_quant(x.contiguous(), block)
    return reference.act_quant(x, block)


def fp8_qdq_(opts: RuntimeOptions, x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """In place: x <- e4m3(x / s) * s per `block` (window KV)."""
    if route(opts, x) == "tilelang":
        return _in_place(_tilelang().fp8_qdq_, x, block)
    return reference.fp8_qdq_(x, block)


def fp4_qdq_e8m0_(opts: RuntimeOptions, x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """In place: FP4 round trip with power-of-two scales per `block` (indexer queries and keys)."""
    if route(opts, x) == "tilelang":
        return _in_place(_tilelang().fp4_qdq_e8m0_, x, block)
    return reference.fp4_qdq_e8m0_(x, block)


def fp4_qdq_e4m3_(opts: RuntimeOptions, x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """In place: FP4 round trip with E4M3 scales per `block` (compressed KV latents)."""
    if route(opts, x) == "tilelang":
        return _in_place(_tilelang().fp4_qdq_e4m3_, x, block)
    return reference.fp4_qdq_e4m3_(x, block)


# ---- GEMM ----

def quant_gemm(opts: RuntimeOptions, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, kind: str,
               dequantized: Callable[[torch.dtype], torch.Tensor], par=None,
               prepared: Optional[Callable[[], "invariant.PreparedWeight"]] = None) -> torch.Tensor:
    """y = x W^T for an FP8 / FP4 weight at the reference rounding points: x [..., K] -> [..., N] bf16.
    `dequantized(dtype)` gives the weight's exact value in that dtype (the caller caches it). `par`: only on
    the invariant route, for a row-parallel weight whose K is split over the ranks (the sum over K then
    continues across them, and the caller does not all-reduce); `prepared`: the weight as the invariant route
    lays it out, kept by the caller."""
    path = route(opts, x)
    if path == "invariant":
        pw = prepared() if prepared is not None else invariant.PreparedWeight.of(dequantized(torch.float32))
        return invariant.quant_gemm(x, pw, reference.act_quant, par=par)
    if path == "tilelang":
        ops = _tilelang()
        x2 = x.reshape(-1, x.shape[-1]).contiguous()                # [M, K]
        y = (ops.fp8_gemm if kind == "fp8" else ops.fp4_gemm)(x2, weight, scale)
        return y.view(*x.shape[:-1], y.shape[-1])
    if path == "fast":
        return fast.gemm(x, dequantized(fast.compute_dtype(x.device)))
    return reference.block_scaled_gemm(x, dequantized(torch.float32))


# ---- attention, hyper-connections, indexer ----

def sparse_attn(opts: RuntimeOptions, q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor,
                idx: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, M, H, D], kv [B, N, D], sink [H] fp32, idx [B, M, T] int32 (-1 = none) -> [B, M, H, D]."""
    path = route(opts, q)
    if path == "invariant":
        return invariant.sparse_attn(q, kv, sink, idx, scale)
    if path == "tilelang":
        return _tilelang().sparse_attn(q.contiguous(), kv.contiguous(), sink, idx.contiguous(), scale)
    return _torch(path).sparse_attn(q, kv, sink, idx, scale)


def hc_split_sinkhorn(opts: RuntimeOptions, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                      hc: int, iters: int, eps: float):
    """mixes [..., (2 + hc) * hc] fp32 -> pre [..., hc], post [..., hc], comb [..., hc, hc]."""
    path = route(opts, mixes)
    if path == "tilelang":
        return _tilelang().hc_split_sinkhorn(mixes.contiguous(), scale, base, hc, iters, eps)
    if path == "invariant":
        return invariant.hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)
    return reference.hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)   # fixed loop: same on both


def index_scores(opts: RuntimeOptions, q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor,
                 par=None) -> torch.Tensor:
    """sum_h ReLU(q_h . k) * w_h: q [B, S, H, D], keys [B, T, D], w [B, S, H] -> [B, S, T] bf16. `par`: only
    on the invariant route, whose sum over the heads continues across the ranks (no all-reduce after)."""
    path = route(opts, q)
    if path == "invariant":
        return invariant.index_scores(q, keys, w, par)
    if path == "tilelang":
        return _tilelang().index_scores(q.contiguous(), keys.contiguous(), w.contiguous())
    return _torch(path).index_scores(q, keys, w)


def is_invariant(opts: RuntimeOptions) -> bool:
    """Whether the call sites outside this dispatch (norms, sums, exp, RoPE) take their invariant forms."""
    return opts.order == "invariant"
