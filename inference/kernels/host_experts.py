"""Routed experts in host memory at their stored precision, computed on the CPU from their bytes.

A projection of a group of experts, each on its own tokens: x [M, K] bf16 whose rows come grouped by expert
(`counts[i]` rows for expert `experts[i]`), weights as stored, [E, N, K/2] MXFP4 bytes with [E, N, K/32]
UE8M0 scales, or [E, N, K] E4M3 with [E, ceil(N/32), K/32] block scales -> [M, N] bf16. The numbers are the
reference GEMM's (reference.block_scaled_gemm): x quantised by act_quant (E4M3 per 32, power-of-two fp32
scale), each product E4M3 x E2M1 (or E4M3) x power of two exact in fp32, the products summed in fp32, the sum
rounded to bf16; only the summation order differs (fast.py explains why the products are exact).

Two implementations of the same function:
    torch   the specification and the fallback: act_quant, each active expert dequantised to fp32, matmul.
    native  host_experts.c, built here with the C compiler (gcc -O3 -shared -fPIC, cached under the user's
            cache directory, keyed by a hash of the source, the compiler and its flags) and called through
            ctypes: act_quant in C (the same bits, written in the order the weights unpack in), the weights
            decoded in registers (avx512: the 16-entry E2M1 table looked up with vpermps, the block's power
            of two applied by a multiply; avx2: each code's two bf16 bytes, scale included, looked up with
            vpshufb in the tables of the block's scale byte, a decode step's blocks two at a time), fp32
            FMAs; weight rows in chunks over torch.get_num_threads() threads (a team started once, woken per
            call). Variants: avx512, avx2 (AVX2 + FMA) and scalar (portable C); auto picks by the CPU. The
            model's host experts ask for 2 MB pages (advise_huge_pages).
The choice: the `variant` argument, else $DSV4_HOST_EXPERTS (auto | torch | avx512 | avx2 | scalar), else
auto. A native variant beyond what the CPU runs (torch's view of it, as auto's) is refused in one line (a
ValueError) rather than dying of SIGILL. When the kernel cannot be built (no compiler: $CC, else cc or gcc),
one line on stderr says so, once per process (and variant asked for), and the torch path runs.

The same kernel computes the model's other FP8/FP4 Linears on the CPU with --cpu-linears stored
(stored_linear, one Linear as one expert; the StoredLinears orders at the end of this file), so no fp32 copy
of them is made, and, in the fast order, its GEMMs on bf16 weights (bf16_linear: the head, kept in bf16 as
stored, wo_a, the router, the bf16 Linears; a widened weight's fp32 products, another order of sums).

tests/test_host_experts.py holds the two together; `python -m inference.tools.bench experts` measures them.
Measured there (2 cores of an AMD EPYC Zen 5 shared with other jobs, 2 threads; the read bandwidth, a torch
sum over 2 GiB, 47-83 GB/s from run to run, mostly ~51): batch-1 decode of one released-geometry layer (6 of
128 MXFP4 experts of 5120 x 2304, 113 MB per step) 29.5-30.5 GB/s of expert bytes with avx512 (58-59 % of
51 GB/s; 4.0 ms per layer), 13-14 GB/s with avx2, 1.7 GB/s scalar. Prefill, 512 tokens over 128 experts
(24 rows per expert): 390-500 tokens/s (82-106 GMAC/s), against 5-27 tokens/s for dequantise-to-bf16 (98 %
of that time) + torch's bf16 GEMM (which alone runs 160-275 GMAC/s). Build: 0.2-0.7 s per variant, once.
(The avx2 figure there is an earlier AVX2 decode.) On 2 cores of an AMD EPYC with AVX2, no AVX-512 (Zen 3,
read bandwidth 28-38 GB/s read in turns with the decode), avx2 with scaled tables, two sums per row, the even
words moved up by a multiply, a decode step's blocks in pairs (the shuffle pipes are the limit: 4.9 cycles a
block) and huge pages: decode 15.8-17.6 GB/s (45-58 %; median 6.6-8.6 ms per layer); prefill, with tiles of
4 tokens, 229-253 tokens/s (49-54 GMAC/s); scalar 1.0 GB/s, 9.5 tokens/s. Those runs predate the FP8 and
bf16 tiles and the team of threads; docs/benchmarks.md section 6 has the details and the per-core ceiling,
section 2.4 the kernel inside the released widths' decode step.
"""
import ctypes
import functools
import math
import os
import sys
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import native
from .fast import Fast, dequant_weight, quant_act, sinkhorn_gates
from .numerics import Numerics
from .reference import Exact

BLOCK = 32
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_experts.c")
VARIANTS = ("avx512", "avx2", "scalar")
FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma"], "avx2": ["-mavx2", "-mfma"], "scalar": []}
BASE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread"]
LIBS = ["-lm"]
ENV = "DSV4_HOST_EXPERTS"
FORMATS = {"fp4": 4, "fp8": 8}

Projection = Tuple[torch.Tensor, torch.Tensor]   # (weight [E, N, ...], scale [E, ...]) as stored


# ---- the choice of implementation ----

def auto_variant() -> str:
    """The fastest native variant this CPU runs (torch's view of it: its own kernels' capability)."""
    cap = torch.backends.cpu.get_cpu_capability().upper()
    return "avx512" if "AVX512" in cap else "avx2" if "AVX2" in cap else "scalar"


def resolve(variant: Optional[str] = None) -> str:
    """`variant` (or $DSV4_HOST_EXPERTS, or auto) -> what runs: one of VARIANTS, or "torch" when the
    kernel cannot be built (after one notice)."""
    return _resolved(variant)[0]


def _resolved(variant: Optional[str]):
    """resolve(variant) and its loaded kernel (None for torch). Looked up once per setting: a decode step
    asks once per Linear."""
    return _resolved_for(variant or os.environ.get(ENV) or "auto", torch.backends.cpu.get_cpu_capability(),
                         native.compiler(), native.cache_dir())


@functools.lru_cache(maxsize=None)
def _resolved_for(name: str, capability: str, cc: Optional[str], cache_dir: str):
    v = name.lower()
    if v == "auto":
        v = auto_variant()
    if v == "torch":
        return v, None
    if v not in VARIANTS:
        raise ValueError(f"host experts: unknown variant {v!r} (auto, torch, {', '.join(VARIANTS)})")
    runs = VARIANTS[VARIANTS.index(auto_variant()):]
    if v not in runs:                                               # its instructions would kill us (SIGILL)
        raise ValueError(f"host experts: variant {v!r} needs a CPU with {v.upper()}; this one has "
                         f"{capability} (use {', '.join(runs)} or torch)")
    lib = _library(v, cc, cache_dir)
    return (v, lib) if lib is not None else ("torch", None)


@functools.lru_cache(maxsize=None)
def _library(variant: str, cc: Optional[str], cache_dir: str):
    """The loaded kernel of `variant` (built once per compiler and cache directory), or None after one line on
    stderr saying why the torch path runs instead (the cache makes it once per process and variant)."""
    def declare(lib):
        lib.he_run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.he_run.restype = ctypes.c_int
        lib.he_variant.restype = ctypes.c_char_p
        lib.he_act_quant.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int]
        lib.he_act_quant.restype = None
        lib.he_widen.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_int]
        lib.he_widen.restype = None
    return native.load(lambda: build(variant, cc, cache_dir), declare,
                       f"host experts: no native {variant} kernel ({{reason}}); routed experts run the torch "
                       "path")


def build(variant: str, cc: Optional[str] = None, cache_dir: Optional[str] = None) -> str:
    """Compile host_experts.c for `variant` unless the cache has it; returns the shared object's path."""
    return native.compile_shared(SOURCE, f"host_experts_{variant}", BASE_FLAGS + FLAGS[variant], LIBS, cc,
                                 cache_dir)


# ---- the projections ----

def _check(x: torch.Tensor, counts: Sequence[int], experts: Sequence[int], projections, kind: str,
           tokens: Optional[torch.Tensor] = None) -> None:
    """One line for each way the arguments can be wrong."""
    if kind not in FORMATS:
        raise ValueError(f"host experts: kind {kind!r} is not one of {sorted(FORMATS)}")
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"host experts: x must be [M, K] with K a multiple of {BLOCK}, got {list(x.shape)}")
    rows = x.shape[0] if tokens is None else tokens.numel()
    if tokens is not None and (tokens.dim() != 1 or tokens.dtype != torch.int64 or
                               (rows and not 0 <= int(tokens.min()) <= int(tokens.max()) < x.shape[0])):
        raise ValueError(f"host experts: tokens must be [M] int64 rows of x's {x.shape[0]}")
    if len(counts) != len(experts) or sum(counts) != rows or min(counts, default=0) < 0:
        raise ValueError(f"host experts: counts {list(counts)} for experts {list(experts)} do not cover the "
                         f"{rows} rows")
    k = x.shape[1]
    for w, s in projections:
        e, n = w.shape[0], w.shape[1]
        want_w = (e, n, k // 2 if kind == "fp4" else k)
        want_s = (e, n, k // BLOCK) if kind == "fp4" else (e, -(-n // BLOCK), k // BLOCK)
        if tuple(w.shape) != want_w or tuple(s.shape) != want_s or w.element_size() != 1 \
                or s.element_size() != 1:
            raise ValueError(f"host experts: {kind} weight {list(w.shape)} / scale {list(s.shape)} do not "
                             f"fit x {list(x.shape)} (want {list(want_w)} / {list(want_s)}, one byte each)")
        if any(not 0 <= i < e for i in experts):
            raise ValueError(f"host experts: expert ids {list(experts)} outside the {e} stored experts")


def linear_torch(x: torch.Tensor, counts: Sequence[int], experts: Sequence[int], weight: torch.Tensor,
                 scale: torch.Tensor, kind: str) -> torch.Tensor:
    """The specification, fp32 sums before the bf16 rounding: x [M, K] bf16 -> [M, N] fp32. Each active expert
    dequantised exactly to fp32 [N, K] and multiplied with its rows of act_quant(x), dequantised (exact)."""
    a = quant_act(x, torch.float32)                                 # [M, K]
    if kind == "fp8":
        weight = weight.view(torch.float8_e4m3fn)                   # bytes read as E4M3 values
    y = a.new_zeros(x.shape[0], weight.shape[1])                    # [M, N]
    start = 0
    for e, c in zip(experts, counts):
        if c:
            w = dequant_weight(weight[e], scale[e], kind, torch.float32)     # [N, K]
            y[start:start + c] = a[start:start + c] @ w.t()
        start += c
    return y


MADV_HUGEPAGE, HUGE_PAGE = 14, 2 << 20


@functools.lru_cache(maxsize=None)
def _libc():
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back t's memory with 2 MB pages (transparent huge pages in their usual 'madvise' mode),
    before its first touch. A decode step streams each selected expert once (18.8 MB at the released
    geometry): through 4 KB pages that is a TLB miss every 4 KB, about 8 % of the AVX2 kernel's rate.
    False where it cannot apply (not Linux, not a CPU tensor, under 2 MB, or the kernel said no)."""
    libc = _libc()
    if libc is None or t.device.type != "cpu" or t.nbytes < HUGE_PAGE:
        return False
    start = t.data_ptr()
    lo, hi = -(-start // 4096) * 4096, (start + t.nbytes) // 4096 * 4096      # whole pages inside t
    return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE) == 0


def _order(kind: str, variant: str, one_row: bool = False) -> int:
    """The kernel's activation order: 0 as is (fp8), 1 each 32 as its even then odd elements (fp4: the low
    and high nibbles of the block's 16 bytes), 2 each 128 as [8, 16] (fp4 on avx512: element 8 d + q at
    16 q + d, nibble q of the 64-byte load's dword d), K padded with zeros to a multiple of 128, 3 each 32 as
    [4, 2, 4] (fp4 on avx2: element 16 h + 4 d + 2 i + p at 8 (2 h + i) + 4 p + d, lane 4 p + d of vector
    2 h + i, p the nibble), 4 each 64 as [2, 2, 2, 2, 4] (fp4 on avx2 when every expert has one row, a decode
    step: two blocks l = 0, 1 in one load, element 16 h + 4 d + 2 i + p of block l at 8 (4 p + 2 h + i) +
    4 l + d, lane 4 l + d of vector 4 p + 2 h + i; a last 32 of an odd count as in 3), 5 each 32 as [4, 8]
    (fp8 on avx2 when every job has one row: element 4 i + q at 8 q + i, lane i of vector q)."""
    if kind == "fp8":
        return 5 if variant == "avx2" and one_row else 0
    return {"avx512": 2, "avx2": 4 if one_row else 3}.get(variant, 1)


def activations_torch(x: torch.Tensor, order: int) -> torch.Tensor:
    """act_quant(x) dequantised to fp32 in the kernel's `order`: [M, K], or [M, K padded to 128] for 2.
    The specification of he_act_quant (host_experts.c), which makes the same numbers in one pass."""
    return _reordered(quant_act(x, torch.float32), order)           # [M, K]


def _reordered(a: torch.Tensor, order: int) -> torch.Tensor:
    """a [M, K] in the kernel's `order` (_order)."""
    m = a.shape[0]
    if order == 2:
        a = F.pad(a, (0, -a.shape[1] % 128))                        # [M, Kx]
        a = a.view(m, -1, 16, 8).transpose(-1, -2)                  # [M, Kx/128, 8, 16]
    elif order == 1:
        a = a.view(m, -1, BLOCK // 2, 2).transpose(-1, -2)          # [M, K/32, 2, 16]
    elif order == 3:
        a = a.view(m, -1, 2, 4, 2, 2).permute(0, 1, 2, 4, 5, 3)     # [M, K/32, h, i, p, d]
    elif order == 5:
        a = a.view(m, -1, 8, 4).transpose(-1, -2)                   # [M, K/32, q, i]
    elif order == 4:
        pairs = a.shape[1] // 64 * 64
        head = a[:, :pairs].reshape(m, -1, 2, 2, 4, 2, 2)           # [M, K/64, l, h, d, i, p]
        head = head.permute(0, 1, 6, 3, 5, 2, 4).reshape(m, -1)     # [M, K/64, p, h, i, l, d]
        return torch.cat([head, _reordered(a[:, pairs:], 3)], dim=1)
    return a.contiguous().view(m, -1)


def _activations(lib, x: torch.Tensor, order: int) -> torch.Tensor:
    """activations_torch's numbers from the C kernel (bf16 x; other dtypes take the torch version)."""
    if x.dtype != torch.bfloat16:
        return activations_torch(x, order)
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, k + (-k % 128 if order == 2 else 0), dtype=torch.float32)
    lib.he_act_quant(x.data_ptr(), m, k, out.data_ptr(), out.shape[1], order)
    return out


def _native(lib, variant: str, x: torch.Tensor, counts, experts, projections, kind: str,
            tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All projections of all experts in one kernel call -> fp32 [M, sum of N]: projection p's outputs in
    its own columns."""
    order = _order(kind, variant, one_row=max(counts, default=0) <= 1)
    a = _activations(lib, x, order)                                 # [M, Kx], or [N, Kx] with tokens
    if tokens is not None and max(counts, default=0) > 1:          # an expert's rows must follow each other
        a, tokens = a[tokens], None                                 # [M, Kx]
    row = list(range(sum(counts))) if tokens is None else tokens.tolist()   # each row's row of a
    m, k, kx = len(row), x.shape[1], a.shape[1]
    widths = [w.shape[1] for w, _ in projections]
    y = torch.empty(m, sum(widths), dtype=torch.float32)            # [M, N1 + N2 + ...]
    jobs, start = [], 0
    for e, c in zip(experts, counts):
        col = 0
        for (w, s), n in zip(projections, widths):
            if c:
                jobs += [w.data_ptr() + e * w.stride(0), s.data_ptr() + e * s.stride(0),
                         a.data_ptr() + row[start] * kx * 4, y.data_ptr() + (start * y.shape[1] + col) * 4,
                         n, c, y.shape[1]]
            col += n
        start += c
    table = (ctypes.c_int64 * len(jobs))(*jobs)
    scratch = (ctypes.c_int64 * (len(jobs) // 7 + 1))()
    rc = lib.he_run(ctypes.addressof(table), len(jobs) // 7, ctypes.addressof(scratch), k, FORMATS[kind],
                    order, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"host experts: the kernel refused its arguments (k {k}, kind {kind}, order "
                           f"{order})")
    return y


def expert_linears_fp32(x: torch.Tensor, counts: Sequence[int], experts: Sequence[int],
                        projections: Sequence[Projection], kind: str, variant: Optional[str] = None,
                        tokens: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Several projections of the same inputs (w1 and w3) before the bf16 rounding: [M, N_p] fp32 each.
    x [M, K] bf16, rows grouped by expert (counts[i] rows for experts[i]); or, with tokens [M] int64 (row
    i is x[tokens[i]]), x [N, K] holding each token once, whose activations are then quantised once rather
    than once per expert that selected it. projections: (weight, scale) as stored, [E, ...] over the stored
    experts."""
    _check(x, counts, experts, projections, kind, tokens)
    projections = [(w.view(torch.uint8), s.view(torch.uint8)) for w, s in projections]
    for w, s in projections:                                       # rows at fixed strides per expert
        if not all(t.is_contiguous() or t[0].is_contiguous() for t in (w, s)):
            raise ValueError("host experts: each expert's weight and scale must be contiguous")
    v, lib = _resolved(variant)
    if v == "torch":
        x = x if tokens is None else x[tokens]                      # [M, K]
        return [linear_torch(x, counts, experts, w, s, kind) for w, s in projections]
    if _order(kind, v, True) != _order(kind, v, False) and 1 in counts and max(counts) > 1:
        y = _split_by_rows(lib, v, x, counts, experts, projections, kind, tokens)
    else:
        y = _native(lib, v, x, counts, experts, projections, kind, tokens)
    return [y] if len(projections) == 1 else list(y.split([w.shape[1] for w, _ in projections], dim=1))


def _split_by_rows(lib, variant: str, x, counts, experts, projections, kind: str, tokens=None):
    """_native's result in two calls where the experts of one row and those of several want activations in
    different orders (AVX2 MXFP4: one row reads its blocks in pairs, order 4): a batch of a few tokens, most
    experts chosen once, keeps the pairs for those."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    y = torch.empty(sum(counts), sum(w.shape[1] for w, _ in projections), dtype=torch.float32)
    for group in ([i for i, c in enumerate(counts) if c == 1], [i for i, c in enumerate(counts) if c > 1]):
        rows = torch.tensor([r for i in group for r in range(starts[i], starts[i] + counts[i])])
        sub_x, sub_tokens = (x[rows], None) if tokens is None else (x, tokens[rows])
        y[rows] = _native(lib, variant, sub_x, [counts[i] for i in group], [experts[i] for i in group],
                          projections, kind, sub_tokens)
    return y


def expert_linears(x: torch.Tensor, counts: Sequence[int], experts: Sequence[int],
                   projections: Sequence[Projection], kind: str, variant: Optional[str] = None,
                   tokens: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """expert_linears_fp32 rounded to bf16: [M, N_p] bf16 per projection (one kernel call for all)."""
    ys = expert_linears_fp32(x, counts, experts, projections, kind, variant, tokens)
    return [y.to(torch.bfloat16) for y in ys]


def expert_linear(x: torch.Tensor, counts: Sequence[int], experts: Sequence[int], weight: torch.Tensor,
                  scale: torch.Tensor, kind: str, variant: Optional[str] = None) -> torch.Tensor:
    """One projection: x [M, K] bf16 (counts[i] rows for experts[i]) -> [M, N] bf16."""
    return expert_linears(x, counts, experts, [(weight, scale)], kind, variant)[0]


def swiglu(gate: torch.Tensor, up: torch.Tensor, weights: Optional[torch.Tensor], limit: float,
           silu: Callable = F.silu) -> torch.Tensor:
    """moe.Expert.swiglu's arithmetic: bf16 gate / up -> fp32 clamp(SiLU(gate)) * clamp(up) [* weights]."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)                                 # one-sided on the gate branch
    h = silu(gate) * up
    return h if weights is None else weights * h


def expert_swiglu(x: torch.Tensor, counts: Sequence[int], experts: Sequence[int], route_weights: torch.Tensor,
                  w1: Projection, w3: Projection, w2: Projection, kind: str, act: Callable,
                  variant: Optional[str] = None, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A set of SwiGLU experts, each on its tokens: x [M, D] bf16 grouped by expert (or [N, D] and tokens
    [M], as expert_linears_fp32 takes them), route_weights [M] fp32 (each row's routing weight) -> [M, D]
    bf16, w2(bf16(act(w1 x, w3 x, weight))) per row. `act` is the expert activation (gate, up, weights
    [M, 1]) -> fp32: moe.Expert.swiglu, or functools.partial(swiglu, limit=...)."""
    gate, up = expert_linears(x, counts, experts, [w1, w3], kind, variant, tokens)  # [M, I] bf16 each
    h = act(gate, up, route_weights.view(-1, 1)).to(x.dtype)                        # [M, I] bf16
    return expert_linear(h, counts, experts, w2[0], w2[1], kind, variant)           # [M, D] bf16


# ---- bf16 weights (--cpu-linears stored: the head, wo_a, the bf16 Linears) ----

def bf16_linear_torch(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The specification: x [M, K] (or [M, G, K] with one weight per group) times each bf16 weight [N, K]
    widened to fp32 (exact), fp32 sums -> [M, N] fp32 (or [M, G, N])."""
    if x.dim() == 2:
        return F.linear(x.float(), weights[0].float())
    return torch.stack([F.linear(x[:, g].float(), w.float()) for g, w in enumerate(weights)], dim=1)


def bf16_linear(x: torch.Tensor, weights: Sequence[torch.Tensor],
                variant: Optional[str] = None) -> torch.Tensor:
    """x [M, K] bf16 or fp32 and one bf16 weight [N, K] -> x W^T [M, N] fp32; or x [M, G, K] and G weights
    (groups: wo_a) -> [M, G, N]. Each product a widened bf16 weight times an fp32 activation, summed in fp32:
    the numbers of a GEMM on the fp32 copy in another order, read at 2 bytes a weight."""
    k = x.shape[-1]
    if x.dim() not in (2, 3) or k % BLOCK or len(weights) != (1 if x.dim() == 2 else x.shape[1]) or any(
            w.dtype != torch.bfloat16 or w.dim() != 2 or w.shape[1] != k for w in weights):
        raise ValueError(f"host experts: bf16_linear takes x [M, K] or [M, G, K] (K a multiple of {BLOCK}) "
                         f"and bf16 weights [N, K], got {list(x.shape)} and "
                         f"{[list(w.shape) for w in weights]}")
    v, lib = _resolved(variant)
    if v == "torch" or x.dtype not in (torch.bfloat16, torch.float32):
        return bf16_linear_torch(x, weights)
    m, groups = x.shape[0], 1 if x.dim() == 2 else x.shape[1]
    x = x.contiguous() if x.dim() == 2 else x.transpose(0, 1).contiguous()     # [M, K] or [G, M, K]
    a = torch.empty(groups * m, k, dtype=torch.float32)                 # in order 1, a group's rows together
    lib.he_widen(x.data_ptr(), groups * m, k, a.data_ptr(), int(x.dtype == torch.bfloat16))
    n = weights[0].shape[0]
    y = torch.empty(groups, m, n, dtype=torch.float32)                  # [G, M, N]
    jobs = []
    for g, w in enumerate(weights):
        w = w.contiguous()
        jobs += [w.data_ptr(), 0, a.data_ptr() + g * m * k * 4, y.data_ptr() + g * m * n * 4, w.shape[0], m,
                 n]
    table = (ctypes.c_int64 * len(jobs))(*jobs)
    scratch = (ctypes.c_int64 * (len(jobs) // 7 + 1))()
    if lib.he_run(ctypes.addressof(table), len(jobs) // 7, ctypes.addressof(scratch), k, 16, 1,
                  torch.get_num_threads()):
        raise RuntimeError(f"host experts: the kernel refused a bf16 weight of k {k}")
    return y[0] if x.dim() == 2 else y.transpose(0, 1)                  # [M, N] or [M, G, N]


class PinnedStage:
    """Page-locked host buffers for a GPU's round trips to the host-expert kernel, one per name, reused by
    every MoE layer and call (grown when a call needs more): the copies run at the link's speed, several
    copies to the host wait for one synchronisation, and the outputs' trip back does not block the host."""

    def __init__(self):
        self.buffers = {}

    def buffer(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host tensor of `shape` and `dtype` (the buffer `name`, grown when too small)."""
        numel = max(1, math.prod(shape))
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            # (pinned where a GPU is there to pin for; plain memory on fake CUDA tensors in the tests)
            buf = self.buffers[name] = torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())
        return buf[:math.prod(shape)].view(shape)

    def to_host(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A device tensor's copy into the buffer `name`, issued without waiting (synchronize() before reading
        any of them)."""
        return self.buffer(name, t.shape, t.dtype).copy_(t, non_blocking=True)

    @staticmethod
    def synchronize(device: torch.device) -> None:
        """Wait for the copies issued on `device` (one host sync for all of them)."""
        torch.cuda.synchronize(device)


def kernel_variant(variant: Optional[str] = None) -> str:
    """What expert_linear runs with these settings: a native variant, or torch."""
    return resolve(variant)


# ---- the other Linears from their stored bytes (--cpu-linears stored) ----

def stored_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, kind: str,
                  variant: Optional[str] = None) -> torch.Tensor:
    """An FP8/FP4 Linear computed from its stored bytes, as one expert of expert_linear: x [..., K] bf16,
    weight [N, K] E4M3 or [N, K/2] MXFP4 bytes with their scales as stored -> [..., N] bf16."""
    return stored_linears(x, [(weight, scale)], kind, variant)[0]


def stored_linears(x: torch.Tensor, weights: Sequence[Projection], kind: str,
                   variant: Optional[str] = None) -> List[torch.Tensor]:
    """Several FP8/FP4 Linears of one kind that read the same x, in one kernel call (x quantised once):
    (weight [N_p, K], scale) each as stored -> [..., N_p] bf16 each."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)                                           # [M, K]
    ys = expert_linears(x2, [x2.shape[0]], [0], [(w.unsqueeze(0), s.unsqueeze(0)) for w, s in weights], kind,
                        variant)
    return [y.view(*lead, y.shape[-1]) for y in ys]                 # [..., N_p] each


class StoredLinears:
    """An order's FP8/FP4 Linears computed by the host-expert kernel from their stored bytes (a CPU model with
    RuntimeOptions.cpu_linears = "stored", numerics_for): no fp32 copy is made, a decode step reads 1 byte a
    weight (FP8) instead of the copy's 4, and the products are the order's own, summed in the kernel's order.
    Everything else is the order's (Exact or Fast, below)."""

    def quant_linear(self, held, x):
        return stored_linear(x, held.weight, held.scale, held.kind)

    def linears(self, helds, x, a=None):
        """FP8/FP4 Linears of one kind that read the same x (wq_a and wkv, an expert's w1 and w3): one kernel
        call, x quantised once (the same numbers as each alone: act_quant works per row)."""
        if len(helds) > 1 and all(h.scale is not None and h.kind == helds[0].kind for h in helds):
            return tuple(stored_linears(x, [(h.weight, h.scale) for h in helds], helds[0].kind))
        return Numerics.linears(self, helds, x)

    expert_activations = Numerics.expert_activations      # the kernel quantises its own activations


class ExactStoredLinears(StoredLinears, Exact):
    """The exact order's GEMMs on bf16 weights stay torch's on the widened weight (its bits: the head held in
    fp32, as the order holds it without the option)."""
    name = "exact"


# Calls of at most this many rows with fp32 activations (the head, the router) run their bf16 weight through
# the kernel, which reads each weight once per tile of 4 tokens (36 GMAC/s at 16 rows, 2 Zen 3 threads); a
# longer one (all-position logits) is torch's fp32 GEMM on the weight widened for the call (2.6 GB for the
# head), faster once bound by arithmetic. bf16 activations (wo_a, the bf16 Linears) take the kernel at every
# size: torch's bf16 GEMM on the CPU was 5.6 GMAC/s for wo_a at 128 rows.
BF16_KERNEL_ROWS = 64


class FastStoredLinears(StoredLinears, Fast):
    """The fast order's GEMMs on bf16 weights (the head, held in bf16 as stored: layers.ParallelHead; wo_a,
    the bf16 Linears, the router) from their 2 bytes a weight by the kernel (bf16_linear: the products of the
    fp32 GEMM, another summation order), for fp32 activations when a call has at most BF16_KERNEL_ROWS
    rows."""
    name = "fast"
    head_dtype = torch.bfloat16

    def dense(self, x, w, derived, key=None):
        rows = x.numel() // max(1, x.shape[-1])
        long = rows > BF16_KERNEL_ROWS and x.dtype != torch.bfloat16  # (torch's bf16 GEMM: slower, any size)
        if w.dtype != torch.bfloat16 or w.dim() != 2 or long or x.shape[-1] % BLOCK:
            return super().dense(x, w, derived, key)
        y = bf16_linear(x.reshape(rows, x.shape[-1]), [w])                          # [M, N] fp32
        return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])

    def hc_split_sinkhorn(self, mixes, scale, base, hc, iters, eps):
        """The gates and the row softmax in torch, the Sinkhorn passes in C (native.sinkhorn_passes: sums in
        index order, within float rounding of the torch loop's; its 80 operations a call took 0.5 ms)."""
        lib = native.sinkhorn_library() if mixes.device.type == "cpu" and hc <= 16 else None
        if lib is None:
            return super().hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)
        pre, post, comb = sinkhorn_gates(mixes, scale, base, hc, eps)
        return pre, post, native.sinkhorn_passes(lib, comb, iters, eps)

    def router_logits(self, x, weight, derived):
        """The fp32 products of the router's stored bf16 weight (no fp32 copy kept)."""
        return self.dense(x.float(), weight, derived)

    def grouped_linear(self, x, weight, groups, derived):
        b, s, g, d = x.shape
        if weight.dtype != torch.bfloat16 or d % BLOCK:
            return super().grouped_linear(x, weight, groups, derived)
        y = bf16_linear(x.reshape(b * s, g, d), weight.view(groups, -1, d).unbind(0))   # [M, G, r] fp32
        return y.to(x.dtype).view(b, s, g, -1)
