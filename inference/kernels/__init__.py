"""Kernels and the choice of numerics: `numerics_for(opts, device)` gives the model its Numerics
(numerics.py), made once where the model is built and carried by its ModelContext.

Orders (one Numerics subclass each, in the file of its kernels):
    exact     reference.py: CPU-exact torch, the reference's rounding points and summation order.
    fast      fast.py: loop-free torch, the same rounding points, another summation order.
    invariant invariant.py: the same rounding points, every reduction in an order fixed by the shapes alone
              (the same bits on every CPU, with any thread count, batch, chunking and world size).
    tilelang  tilelang_ops.py: the fused GPU kernels (imported only when this route is taken).

How the order is picked, from RuntimeOptions and the model's device:
    kernel_backend = tilelang   tilelang; a device that is not a CUDA GPU of compute capability >= 9.0 is an
                                error
    kernel_backend = auto       tilelang on such a GPU when `import tilelang` works, else torch
    kernel_backend = torch      torch
    torch, order = exact|fast|invariant   that order; order = auto: exact on CPU, fast on CUDA
    order = invariant           invariant, whatever the backend (it is a definition of the numbers)
Golden numerics (fp32 everywhere, no quantization) always run the torch kernels.
cpu_linears = stored (CPU only, with the experts on the host) gives exact or fast with their FP8/FP4 Linears
computed from the stored bytes by the host-expert kernel (host_experts.py StoredLinears).
"""
import functools
import importlib.util
from typing import Callable, Optional

import torch

from ..config import ORDERS, ConfigError, RuntimeOptions
from .fast import Fast
from .host_experts import ExactStoredLinears, FastStoredLinears
from .invariant import Invariant
from .numerics import Derived, Numerics, drop_derived
from .reference import Exact


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


def route(opts: RuntimeOptions, where) -> str:
    """The route ('exact', 'fast', 'invariant' or 'tilelang') for tensors on `where` (a device or a
    tensor)."""
    device = where.device if torch.is_tensor(where) else torch.device(where)
    backend = opts.kernel_backend
    if opts.order == "invariant":
        if backend == "tilelang":
            check_backend(opts, device)
        return "invariant"
    if backend == "tilelang":
        check_backend(opts, device)
        return "tilelang"
    if backend == "auto" and not opts.golden and _hopper_or_newer(device) and _tilelang_imports():
        return "tilelang"
    if backend not in ("auto", "torch"):
        check_backend(opts, device)                               # names the unknown value
    if opts.order == "auto":
        return "exact" if device.type == "cpu" else "fast"
    if opts.order not in ORDERS:
        check_backend(opts, device)
    return opts.order


def numerics_for(opts: RuntimeOptions, device) -> Numerics:
    """The model's numerics: the order `route` picks for `device`, at the rounding points `opts` asks for
    (reference, or golden). Made once, where the model is built; a meta device (a memory plan) gets one
    that is never asked to compute."""
    if torch.device(device).type == "meta":          # a memory plan: shapes only, never a kernel call
        return (Invariant if opts.order == "invariant" else Fast)(opts.golden, device)
    if opts.cpu_linears == "stored" and torch.device(device).type != "cpu":
        raise ConfigError(f"--cpu-linears stored computes the Linears held on the CPU; this model is on "
                          f"{device}")
    check_backend(opts, device)
    path = route(opts, device)
    if path == "tilelang":
        from .tilelang_ops import TileLang     # compiles kernels on first use: only when the route is taken
        return TileLang(opts.golden, device, opts.kernel_build)
    if opts.cpu_linears == "stored":           # golden and invariant are refused with it (RuntimeOptions)
        return {"exact": ExactStoredLinears, "fast": FastStoredLinears}[path](opts.golden, device)
    return {"exact": Exact, "fast": Fast, "invariant": Invariant}[path](opts.golden, device)
