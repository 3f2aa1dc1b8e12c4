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

How the routed experts are applied, `routed_experts_for(opts, device, numerics, streamed)` (experts.py):
    streamed from disk           StreamedExperts: each active expert on its tokens, its weights as streamed
    experts_on = host            HostExperts: the host-expert kernel on their stored bytes (pinned staging
                                 when the model is on a GPU)
    otherwise                    StackedExperts: on a GPU, in an order whose numbers batched GEMMs on
                                 dequantised weights give, fixed shapes for decode steps; else each expert
                                 on its tokens
"""
import functools
import importlib.util
from typing import Union

import torch

from ..config import ConfigError, RuntimeOptions
from .experts import HostExperts, StackedExperts, StreamedExperts
from .fast import Fast
from .host_experts import ExactStoredLinears, FastStoredLinears, PinnedStage
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


def _capability_of(device: torch.device):
    """(major, minor) of a CUDA device, or None where no CUDA device can be asked (no driver, no GPU)."""
    try:
        return _capability(device.index if device.index is not None else torch.cuda.current_device())
    except (RuntimeError, AssertionError):
        return None


def _where(device: torch.device) -> str:
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    capability = _capability_of(device)
    if capability is None:
        return f"{device} (CUDA is not available)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} (compute capability {capability[0]}.{capability[1]})"


def _hopper_or_newer(device: torch.device) -> bool:
    device = torch.device(device)
    capability = _capability_of(device) if device.type == "cuda" else None
    return capability is not None and capability >= (9, 0)


def check_device(opts: RuntimeOptions, device) -> None:
    """What the options ask of the model's device (RuntimeOptions validates the rest when it is made): the
    TileLang kernels need a CUDA GPU of compute capability >= 9.0, Linears from stored bytes the CPU. One line
    when they cannot run there."""
    if opts.kernel_backend == "tilelang" and not _hopper_or_newer(device):
        raise BackendError("--kernel-backend tilelang needs CUDA tensors on a GPU with compute "
                           f"capability >= 9.0; these are on {_where(device)}")
    if opts.cpu_linears == "stored" and torch.device(device).type not in ("cpu", "meta"):
        raise BackendError(f"--cpu-linears stored computes the Linears held on the CPU: not with --device "
                           f"{device}")


def route(opts: RuntimeOptions, where) -> str:
    """The route ('exact', 'fast', 'invariant' or 'tilelang') for tensors on `where` (a device or a
    tensor)."""
    device = where.device if torch.is_tensor(where) else torch.device(where)
    if opts.kernel_backend == "tilelang":
        check_device(opts, device)
    if opts.order == "invariant":
        return "invariant"
    if opts.kernel_backend == "tilelang":
        return "tilelang"
    if opts.kernel_backend == "auto" and not opts.golden and _hopper_or_newer(device) and _tilelang_imports():
        return "tilelang"
    if opts.order == "auto":
        return "exact" if device.type == "cpu" else "fast"
    return opts.order


def numerics_for(opts: RuntimeOptions, device) -> Numerics:
    """The model's numerics: the order `route` picks for `device`, at the rounding points `opts` asks for
    (reference, or golden). Made once, where the model is built; a meta device (a memory plan) gets one
    that is never asked to compute."""
    if torch.device(device).type == "meta":          # a memory plan: shapes only, never a kernel call
        if opts.cpu_linears == "stored":             # (but the weights held as the CPU run holds them)
            return (FastStoredLinears if opts.order == "fast" else ExactStoredLinears)(opts.golden, device)
        return (Invariant if opts.order == "invariant" else Fast)(opts.golden, device)
    check_device(opts, device)
    path = route(opts, device)
    if path == "tilelang":
        from .tilelang_ops import TileLang     # compiles kernels on first use: only when the route is taken
        return TileLang(opts.golden, device, opts.kernel_build)
    if opts.cpu_linears == "stored":           # golden and invariant are refused with it (RuntimeOptions)
        return {"exact": ExactStoredLinears, "fast": FastStoredLinears}[path](opts.golden, device)
    return {"exact": Exact, "fast": Fast, "invariant": Invariant}[path](opts.golden, device)


RoutedExperts = Union[StackedExperts, StreamedExperts, HostExperts]


def routed_experts_for(opts: RuntimeOptions, device, numerics: Numerics,
                       streamed: bool = False) -> RoutedExperts:
    """How the model's MoE layers apply their routed experts (one object, shared by every layer), chosen with
    its numerics where the model is built."""
    on_gpu = torch.device(device).type not in ("cpu", "meta")
    if streamed:
        return StreamedExperts()
    if opts.experts_on == "host":
        return HostExperts(PinnedStage() if on_gpu else None)
    return StackedExperts(fixed_shapes=on_gpu and numerics.gathers_experts)
