"""Native CPU kernels: a C file beside this one, compiled with the machine's C compiler into a shared object
(cached under the user's cache directory, keyed by a hash of the source, the compiler and its flags; written
under a temporary name and renamed, so concurrent builds never see half a file) and called through ctypes.
Each keeps a torch version as its specification and fallback: host_experts.c (host_experts.py) and
ordered_dot.c (below, for the exact order's attention scores, reference._dot_in_order).
"""
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildError(RuntimeError):
    """A native kernel could not be built or loaded here."""


def compiler() -> Optional[str]:
    return os.environ.get("CC") or _default_compiler()


@functools.lru_cache(maxsize=1)
def _default_compiler() -> Optional[str]:
    return shutil.which("cc") or shutil.which("gcc")             # searched once: a call costs 40 us


def cache_dir() -> str:
    return _cache_dir_of(os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=None)
def _cache_dir_of(xdg: Optional[str], home: Optional[str]) -> str:      # a call per kernel call: kept cheap
    base = xdg or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dsv41", "native")


def compile_shared(source: str, name: str, flags: List[str], libs: List[str], cc: Optional[str] = None,
                   cache: Optional[str] = None) -> str:
    """Compile `source` with `flags` unless the cache has it; -> the shared object's path. `name` names the
    build in the file name and in errors."""
    cc = cc or compiler()
    if not cc:
        raise BuildError("no C compiler (set CC, or install cc / gcc)")
    cache = cache or cache_dir()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"C compiler {cc!r} does not run: {e}") from None
    with open(source, "rb") as f:
        text = f.read()
    key = hashlib.sha256(b"\0".join([text, cc.encode(), version.encode(), " ".join(flags + libs).encode()]))
    path = os.path.join(cache, f"{name}_{key.hexdigest()[:16]}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, source, "-o", tmp, *libs], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode:
            lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
            raise BuildError(f"{cc} failed for the {name} kernel: {lines[0]}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cc} failed for the {name} kernel: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(build: Callable[[], str], declare: Callable[[ctypes.CDLL], None], fallback: str):
    """The shared object `build()` makes, loaded, its functions' signatures set by `declare`; or None after
    one line on stderr, `fallback` with {reason} filled in (why the torch version runs instead)."""
    try:
        lib = ctypes.CDLL(build())
        declare(lib)
        return lib
    except (BuildError, OSError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        print(fallback.format(reason=reason), file=sys.stderr, flush=True)
        return None


# ---- the exact order's attention scores ----

ORDERED_SOURCE = os.path.join(HERE, "ordered_dot.c")
ORDERED_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]
ORDERED_ENV = "DSV4_ORDERED_DOT"          # "torch": the specification runs instead


@functools.lru_cache(maxsize=None)
def _ordered_library(cc: Optional[str], cache: str, vector: str):
    """The loaded ordered_dot kernel, or None after one line on stderr saying why the torch loop runs."""
    flags = ORDERED_FLAGS + {"avx512": ["-mavx512f", "-mfma"], "avx2": ["-mavx2", "-mfma"]}.get(vector, [])

    def declare(lib):
        lib.od_scores.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        lib.od_scores.restype = ctypes.c_int
    return load(lambda: compile_shared(ORDERED_SOURCE, f"ordered_dot_{vector}", flags, ["-lm"], cc, cache),
                declare, "ordered dot: no native kernel ({reason}); the exact order's scores run the torch "
                "loop")


def ordered_library():
    """The native ordered-dot kernel for this CPU, or None (no compiler, or $DSV4_ORDERED_DOT=torch)."""
    if os.environ.get(ORDERED_ENV, "").lower() == "torch":
        return None
    cap = torch.backends.cpu.get_cpu_capability().upper()
    vector = "avx512" if "AVX512" in cap else "avx2" if "AVX2" in cap else "scalar"
    return _ordered_library(compiler(), cache_dir(), vector)


def ordered_scores(lib, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [R, H, D] fp32, k [R, C, D] fp32 (contiguous) -> s [R, H, C] fp32: each s[r, h, c] the products
    q[r, h, d] k[r, c, d] added one at a time from zero in increasing d, in fp32 (reference._dot_in_order's
    loop), on torch.get_num_threads() threads."""
    r, h, d = q.shape
    c = k.shape[1]
    s = torch.empty(r, h, c, dtype=torch.float32)
    if lib.od_scores(q.data_ptr(), k.data_ptr(), s.data_ptr(), r, h, c, d, torch.get_num_threads()):
        raise MemoryError(f"ordered dot: no memory for {torch.get_num_threads()} buffers of {c} x {d} floats")
    return s


# ---- the fast order's Sinkhorn passes (the CPU model with its Linears from stored bytes) ----

SINKHORN_SOURCE = os.path.join(HERE, "sinkhorn.c")
SINKHORN_FLAGS = ["-O2", "-std=gnu11", "-shared", "-fPIC", "-ffp-contract=off"]
SINKHORN_ENV = "DSV4_SINKHORN"            # "torch": the specification runs instead


@functools.lru_cache(maxsize=None)
def _sinkhorn_library(cc: Optional[str], cache: str):
    def declare(lib):
        lib.hc_sinkhorn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_float]
        lib.hc_sinkhorn.restype = None
    return load(lambda: compile_shared(SINKHORN_SOURCE, "sinkhorn", SINKHORN_FLAGS, [], cc, cache), declare,
                "sinkhorn: no native kernel ({reason}); the torch loop runs")


def sinkhorn_library():
    """The native Sinkhorn passes, or None (no compiler, or $DSV4_SINKHORN=torch)."""
    if os.environ.get(SINKHORN_ENV, "").lower() == "torch":
        return None
    return _sinkhorn_library(compiler(), cache_dir())


def sinkhorn_passes(lib, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., hc, hc] fp32, its rows softmaxed -> the doubly stochastic matrix of fast.sinkhorn's passes
    (a new contiguous tensor)."""
    hc = comb.shape[-1]
    if hc > 16:
        raise ValueError(f"sinkhorn: hc {hc} > 16")
    out = comb.contiguous().clone()
    lib.hc_sinkhorn(out.data_ptr(), out.numel() // (hc * hc), hc, iters, eps)
    return out
