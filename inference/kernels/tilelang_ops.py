"""TileLang GPU kernels for the hot paths, with the rounding points of the torch reference functions.

Each public function below has the signature and return convention of its torch reference (act_quant,
fp8_qdq_, fp4_qdq_e8m0_, fp4_qdq_e4m3_, the FP8/FP4 block-scaled GEMM, sparse_attn, hc_split_sinkhorn and
the indexer's head-weighted scores), so the TileLang numerics (the class at the end) can swap one for the
other. Arguments are checked (the build settings, dtype and shape first, then contiguity, then device)
before anything is compiled or launched; the factories check their sizes again.

Every kernel comes from a factory taking explicit sizes and returning a `T.prim_func`; batch-like sizes are
symbolic (`T.dynamic`), so one compiled kernel serves every row count. `compile_kernel(prim_func, target)`
builds one for an explicit target (no GPU needed); the wrappers compile for the current device on first use
and keep the result in `_compiled`, a `functools.lru_cache` keyed by the build settings (SETTINGS) and the
factory arguments: the only state. Rows ride on the grid's x axis, and a call whose tensors would reach 2^31
elements is cut into several launches (the wrappers' section says why).

How each kernel follows the reference, by construction (inference/tools/gpu_check/ runs them on a GPU
against the torch references; first run on an H200: docs/benchmarks.md §5):
* Quantisers: same operations in the same order (power-of-two scales from the exponent bits, IEEE division,
  saturating round-to-nearest-even E4M3 casts, the E2M1 tie table, signed zeros kept). Bit for bit on the
  H200.
* GEMMs: per 32-wide K block one tensor-core MMA into a fresh fp32 tile, scaled by the two power-of-two
  scales (exact) and added to an fp32 accumulator in increasing K order; no split-K, so that order holds;
  bf16 output. What is exact: each E4M3 x E4M3 product (and E2M1 x E4M3), the rescale, the order of the
  blocks. What is not: the sum of a block's 32 products inside the MMA. Hopper's FP8 MMA keeps about 14 bits
  of the partial sum (the DeepSeek-V3 report's "increasing accumulation precision"), not fp32's 24, so a
  block's sum can differ from the torch route's fp32 sum by an ulp of that width. Measured on an H200 at the
  released shapes: 1.3 to 2.7 % of the bf16 outputs differ from the torch route's, within the device
  check's tolerance (1/128 relative).
* Sparse attention: 64-entry chunks in list order, online softmax with the -1e30 floor, P rounded to bf16
  before P.V, sink only in the denominator. The q.k dot products and P.V use tensor-core order, and P.V is
  accumulated into the running sum by the MMA itself: fp32-ulp differences, rarely one bf16 ulp.
* Sinkhorn: one thread per token, every multiply-add written as separately rounded IEEE operations (no FMA
  contraction), sums in index order; exp comes from the CUDA math library.
* Index scores: q.k by tensor core, rounded to bf16, ReLU, times the head weight rounded to bf16, summed over
  heads in fp32 and rounded once to bf16. The MMA takes a multiple of 8 heads: fewer (4 per rank at W = 8)
  are padded with zero heads, which add +0 to each sum (pad_index_heads). Bit for bit on the H200.
"""
import concurrent.futures
import dataclasses
import functools
import os
import struct

import tilelang
import tilelang.language as T
import torch

from .fast import Fast

FP8_MAX = 448.0
FP4_MAX = 6.0
C448 = 1.0 / 448.0   # rounded to fp32 where it meets an fp32 operand, as in the reference
C6 = 1.0 / 6.0
GEMM_BLOCK = 32      # K block of the FP8/FP4 scales
ATTN_CHUNK = 64      # the reference's online-softmax chunk
SIMT_THREADS = 128   # threads per block of the one-thread-per-group kernels
BF16, FP32, E4M3, U8, I32 = "bfloat16", "float32", "float8_e4m3fn", "uint8", "int32"
_TORCH_TO_TL = {torch.bfloat16: BF16, torch.float32: FP32}


# ---------------------------------------------------------------------------------------------------------
# Scalar helpers (TileLang expressions)

def _f32(value: float):
    """An fp32 constant by its bit pattern (value rounded to fp32 as torch rounds a Python float), so no
    code generator's decimal printing can change it."""
    return T.reinterpret(T.uint32(struct.unpack("<I", struct.pack("<f", value))[0]), FP32)


def _abs(x):
    """|x| for comparisons and maxima (the sign of a zero does not matter there); plain max so that the
    kernels also lower for TileLang's C target, which lets the tests run some of them on the CPU."""
    return T.max(x, -x)


def _ceil_pow2(y):
    """Smallest power of two >= y (positive normal fp32), from the exponent and mantissa bits."""
    bits = T.reinterpret(y, "uint32")
    exp = ((bits >> 23) & T.uint32(0xFF)) + T.if_then_else((bits & T.uint32(0x7FFFFF)) != 0, T.uint32(1),
                                                            T.uint32(0))
    return T.reinterpret(exp << 23, FP32)


def _ue8m0(byte):
    """UE8M0 byte e -> 2^(e-127) as fp32; byte 0 is 2^-127 (an fp32 subnormal), not zero."""
    return T.if_then_else(byte == 0, _f32(2.0 ** -127),
                          T.reinterpret(T.Cast("uint32", byte) << 23, FP32))


def _e2m1_round(v):
    """Round fp32 v in [-6, 6] to the E2M1 grid, ties to the even code; the sign (also of zero) is kept."""
    a = _abs(v)
    r = T.if_then_else(a <= 0.25, T.float32(0.0),
        T.if_then_else(a < 0.75, T.float32(0.5),
        T.if_then_else(a <= 1.25, T.float32(1.0),
        T.if_then_else(a < 1.75, T.float32(1.5),
        T.if_then_else(a <= 2.5, T.float32(2.0),
        T.if_then_else(a < 3.5, T.float32(3.0),
        T.if_then_else(a <= 5.0, T.float32(4.0), T.float32(6.0))))))))
    return T.copysign(r, v)


def _e2m1_code_to_e4m3_bits(code):
    """4-bit E2M1 code (int32) -> the E4M3 byte (int32) of the same value (E2M1 values are exact in E4M3)."""
    mag = code & 7
    normal = (((mag >> 1) + 6) << 3) | ((mag & 1) << 2)          # exponent + 6 (bias 7 vs 1), mantissa
    bits = T.if_then_else(mag == 0, 0, T.if_then_else(mag == 1, 0x30, normal))   # 0.5 is subnormal in E2M1
    return bits | ((code & 8) << 4)


# ---------------------------------------------------------------------------------------------------------
# Quantisers: one thread per scale group (a T.Parallel lane), rows symbolic.

def _check_groups(k: int, block: int):
    if k % block:
        raise ValueError(f"last dimension {k} is not a multiple of the block {block}")


def act_quant_kernel(k: int, block: int = 32, dtype: str = BF16):
    """x [M, k] -> q E4M3 [M, k], s fp32 [M, k/block] (power-of-two scales)."""
    _check_groups(k, block)
    m, g = T.dynamic("M"), k // block

    @T.prim_func
    def act_quant_fp8(X: T.Tensor((m, k), dtype), Q: T.Tensor((m, k), E4M3), S: T.Tensor((m, g), FP32)):
        with T.Kernel(T.ceildiv(m * g, SIMT_THREADS), threads=SIMT_THREADS) as bx:
            xs = T.alloc_local((block,), FP32)
            amax = T.alloc_var(FP32)
            for t in T.Parallel(SIMT_THREADS):
                gid = bx * SIMT_THREADS + t
                if gid < m * g:
                    row, c0 = gid // g, (gid % g) * block
                    amax = T.float32(0.0)
                    for j in T.unroll(block):
                        xs[j] = T.Cast(FP32, X[row, c0 + j])
                        amax = T.max(amax, _abs(xs[j]))
                    s = _ceil_pow2(T.max(amax, _f32(1e-4)) * _f32(C448))
                    for j in T.unroll(block):
                        Q[row, c0 + j] = T.Cast(E4M3, T.clamp(xs[j] / s, -FP8_MAX, FP8_MAX))
                    S[row, gid % g] = s

    return act_quant_fp8


def qdq_kernel(kind: str, k: int, block: int, dtype: str = BF16):
    """In place on x [M, k], per group of `block`: kind "fp8" (x <- e4m3(x/s)*s, act_quant's scales),
    "fp4_e8m0" (x <- e2m1(x/s)*s, s the power of two >= max(amax, 6*2^-126)/6) or "fp4_e4m3"
    (s = e4m3(max(amax, 6*2^-9)/6), not a power of two)."""
    if kind not in ("fp8", "fp4_e8m0", "fp4_e4m3"):
        raise ValueError(f"unknown quantise-dequantise kind {kind!r}")
    _check_groups(k, block)
    m, g = T.dynamic("M"), k // block

    @T.prim_func
    def qdq_in_place(X: T.Tensor((m, k), dtype)):
        with T.Kernel(T.ceildiv(m * g, SIMT_THREADS), threads=SIMT_THREADS) as bx:
            xs = T.alloc_local((block,), FP32)
            amax = T.alloc_var(FP32)
            for t in T.Parallel(SIMT_THREADS):
                gid = bx * SIMT_THREADS + t
                if gid < m * g:
                    row, c0 = gid // g, (gid % g) * block
                    amax = T.float32(0.0)
                    for j in T.unroll(block):
                        xs[j] = T.Cast(FP32, X[row, c0 + j])
                        amax = T.max(amax, _abs(xs[j]))
                    if kind == "fp8":
                        s = _ceil_pow2(T.max(amax, _f32(1e-4)) * _f32(C448))
                        for j in T.unroll(block):
                            q = T.Cast(E4M3, T.clamp(xs[j] / s, -FP8_MAX, FP8_MAX))
                            X[row, c0 + j] = T.Cast(dtype, T.Cast(FP32, q) * s)      # exact in bf16
                    elif kind == "fp4_e8m0":
                        s = _ceil_pow2(T.max(amax, _f32(6 * 2.0 ** -126)) * _f32(C6))
                        for j in T.unroll(block):
                            v = T.clamp(xs[j] / s, -FP4_MAX, FP4_MAX)
                            X[row, c0 + j] = T.Cast(dtype, _e2m1_round(v) * s)
                    else:
                        a6 = T.min(T.max(amax, T.float32(6 * 2.0 ** -9)) / T.float32(6.0),
                                   T.float32(FP8_MAX))                            # IEEE division
                        s = T.Cast(FP32, T.Cast(E4M3, a6))
                        for j in T.unroll(block):
                            v = T.clamp(xs[j] / s, -FP4_MAX, FP4_MAX)             # IEEE division
                            X[row, c0 + j] = T.Cast(dtype, T.ieee_mul(_e2m1_round(v), s))

    return qdq_in_place


fp8_qdq_kernel = functools.partial(qdq_kernel, "fp8")
fp4_qdq_e8m0_kernel = functools.partial(qdq_kernel, "fp4_e8m0")
fp4_qdq_e4m3_kernel = functools.partial(qdq_kernel, "fp4_e4m3")


# ---------------------------------------------------------------------------------------------------------
# Block-scaled GEMM: C [M, N] bf16 = sum over 32-wide K blocks, in increasing order, of
# (A_blk . W_blk^T) * a_s * w_s, with A = act_quant(x) (E4M3 + fp32 power-of-two scales).

GEMM_CONFIGS = {
    # rows of x per call -> tile sizes. Decode (one 64-row tile) is bandwidth-bound and has no split-K (it
    # would reorder the K blocks), so it takes narrow N tiles: 16 columns unless that is over 4 waves of
    # 132 SMs' worth of blocks, then 32.
    "decode": dict(block_m=64, block_n=32, threads=128, stages=4),
    "prefill": dict(block_m=128, block_n=128, threads=256, stages=3),
}


def gemm_config(m: int) -> str:
    return "decode" if m <= 64 else "prefill"


def block_scaled_gemm_kernel(n: int, k: int, weight_format: str = "fp8", config: str = "decode"):
    """A E4M3 [M, k] with fp32 scales [M, k/32], weight [n, k] ("fp8": E4M3 with UE8M0 bytes
    [ceil(n/32), k/32], one per 32x32 block; "fp4": E2M1 pairs packed in bytes [n, k/2], low nibble first,
    with UE8M0 bytes [n, k/32], one per row and 32 inputs) -> C bf16 [M, n]."""
    if weight_format not in ("fp8", "fp4"):
        raise ValueError(f"weight_format must be 'fp8' or 'fp4', got {weight_format!r}")
    if k % GEMM_BLOCK or n % 16:
        raise ValueError(f"GEMM needs K % 32 == 0 and N % 16 == 0, got N={n}, K={k}")
    cfg = GEMM_CONFIGS[config]
    bm, threads, stages = cfg["block_m"], cfg["threads"], cfg["stages"]
    widest = 16 if config == "decode" and n // 16 <= 4 * 132 else cfg["block_n"]
    bn = next(b for b in (128, 64, 32, 16) if n % b == 0 and b <= widest)
    bk = next(b for b in (128, 64, 32) if k % b == 0)
    sub, gb = bk // GEMM_BLOCK, GEMM_BLOCK
    fp4 = weight_format == "fp4"
    m = T.dynamic("M")
    w_shape, w_dtype = ((n, k // 2), U8) if fp4 else ((n, k), E4M3)
    ws_shape = (n, k // gb) if fp4 else ((n + gb - 1) // gb, k // gb)

    @T.prim_func
    def block_scaled_gemm(A: T.Tensor((m, k), E4M3), SA: T.Tensor((m, k // gb), FP32),
                          W: T.Tensor(w_shape, w_dtype), WS: T.Tensor(ws_shape, U8),
                          C: T.Tensor((m, n), BF16)):
        with T.Kernel(T.ceildiv(m, bm), T.ceildiv(n, bn), threads=threads) as (by, bx):   # rows on x
            a_tile = T.alloc_shared((bm, bk), E4M3)
            w_tile = T.alloc_shared((bn, bk), E4M3)
            packed = T.alloc_shared((bn, bk // 2), U8)
            part = T.alloc_fragment((bm, bn), FP32)
            acc = T.alloc_fragment((bm, bn), FP32)
            T.clear(acc)
            for ko in T.Pipelined(k // bk, num_stages=stages):
                T.copy(A[by * bm, ko * bk], a_tile)
                if fp4:
                    T.copy(W[bx * bn, ko * (bk // 2)], packed)
                    for i, j in T.Parallel(bn, bk):
                        code = T.Cast("int32", packed[i, j // 2] >> T.Cast("uint8", (j % 2) * 4)) & 15
                        w_tile[i, j] = T.reinterpret(T.Cast(U8, _e2m1_code_to_e4m3_bits(code)), E4M3)
                else:
                    T.copy(W[bx * bn, ko * bk], w_tile)
                for kb in T.serial(sub):
                    # one 32-wide block: a fresh fp32 tile, then the exact power-of-two rescale
                    T.gemm(a_tile[:, kb * gb:(kb + 1) * gb], w_tile[:, kb * gb:(kb + 1) * gb], part,
                           transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(bm, bn):
                        if fp4:
                            w_s = _ue8m0(WS[bx * bn + j, ko * sub + kb])
                        else:
                            w_s = _ue8m0(WS[(bx * bn + j) // gb, ko * sub + kb])
                        acc[i, j] += part[i, j] * (SA[by * bm + i, ko * sub + kb] * w_s)
            T.copy(acc, C[by * bm, bx * bn])

    return block_scaled_gemm


# ---------------------------------------------------------------------------------------------------------
# The routed experts of a decode step: each selection's activation row through its own expert's weights, with
# the block-scaled GEMM's arithmetic (one MMA per 32-wide K block, power-of-two rescale, K order). The expert
# of selection p is read from a device tensor, so the launch's shape is fixed by the batch and the top-k (no
# host sync, CUDA-graph safe); the weights are read from their stored bytes, never dequantised to memory.

def expert_gemm_kernel(n: int, k: int, weight_format: str = "fp4", rows_per_token: int = 1):
    """A E4M3 [M, k] with fp32 scales [M, k/32] (the tokens' act_quant), Exp int32 [P] (selection p's expert,
    in [0, E)), weights W [E, n, k] E4M3 with UE8M0 [E, ceil(n/32), k/32] ("fp8") or [E, n, k/2] E2M1 pairs
    with UE8M0 [E, n, k/32] ("fp4") -> C bf16 [P, n]: C[p] = A[p // rows_per_token] W[Exp[p]]^T. One block per
    (selection, column tile) on the decode GEMM's tiles: the selection's row fills the MMA's 64 rows (the
    others compute the same and are not stored), so each block reads one tile of one expert's bytes."""
    if weight_format not in ("fp8", "fp4"):
        raise ValueError(f"weight_format must be 'fp8' or 'fp4', got {weight_format!r}")
    if k % GEMM_BLOCK or n % 16:
        raise ValueError(f"expert GEMM needs K % 32 == 0 and N % 16 == 0, got N={n}, K={k}")
    if rows_per_token < 1:
        raise ValueError(f"rows_per_token must be >= 1, got {rows_per_token}")
    cfg = GEMM_CONFIGS["decode"]
    bm, threads, stages = cfg["block_m"], cfg["threads"], cfg["stages"]
    bn = next(b for b in (128, 64, 32, 16) if n % b == 0 and b <= cfg["block_n"])
    bk = next(b for b in (128, 64, 32) if k % b == 0)
    sub, gb = bk // GEMM_BLOCK, GEMM_BLOCK
    fp4 = weight_format == "fp4"
    m, p_, e_ = T.dynamic("M"), T.dynamic("P"), T.dynamic("E")
    w_shape, w_dtype = ((e_, n, k // 2), U8) if fp4 else ((e_, n, k), E4M3)
    ws_shape = (e_, n, k // gb) if fp4 else (e_, (n + gb - 1) // gb, k // gb)

    @T.prim_func
    def expert_gemm(A: T.Tensor((m, k), E4M3), SA: T.Tensor((m, k // gb), FP32), Exp: T.Tensor((p_,), I32),
                    W: T.Tensor(w_shape, w_dtype), WS: T.Tensor(ws_shape, U8), C: T.Tensor((p_, n), BF16)):
        with T.Kernel(p_, T.ceildiv(n, bn), threads=threads) as (sel, bx):   # selections on x
            a_tile = T.alloc_shared((bm, bk), E4M3)
            w_tile = T.alloc_shared((bn, bk), E4M3)
            packed = T.alloc_shared((bn, bk // 2), U8)
            part = T.alloc_fragment((bm, bn), FP32)
            acc = T.alloc_fragment((bm, bn), FP32)
            row = sel // rows_per_token
            e = Exp[sel]
            T.clear(acc)
            for ko in T.Pipelined(k // bk, num_stages=stages):
                for i, j in T.Parallel(bm, bk):          # the selection's row in every row of the tile
                    a_tile[i, j] = A[row, ko * bk + j]
                if fp4:
                    T.copy(W[e, bx * bn:(bx + 1) * bn, ko * (bk // 2):(ko + 1) * (bk // 2)], packed)
                    for i, j in T.Parallel(bn, bk):
                        code = T.Cast("int32", packed[i, j // 2] >> T.Cast("uint8", (j % 2) * 4)) & 15
                        w_tile[i, j] = T.reinterpret(T.Cast(U8, _e2m1_code_to_e4m3_bits(code)), E4M3)
                else:
                    T.copy(W[e, bx * bn:(bx + 1) * bn, ko * bk:(ko + 1) * bk], w_tile)
                for kb in T.serial(sub):
                    T.gemm(a_tile[:, kb * gb:(kb + 1) * gb], w_tile[:, kb * gb:(kb + 1) * gb], part,
                           transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(bm, bn):
                        if fp4:
                            w_s = _ue8m0(WS[e, bx * bn + j, ko * sub + kb])
                        else:
                            w_s = _ue8m0(WS[e, (bx * bn + j) // gb, ko * sub + kb])
                        acc[i, j] += part[i, j] * (SA[row, ko * sub + kb] * w_s)
            for i, j in T.Parallel(bm, bn):
                if i == 0:
                    C[sel, bx * bn + j] = T.Cast(BF16, acc[i, j])

    return expert_gemm


# ---------------------------------------------------------------------------------------------------------
# Sparse attention with a sink: one block per (query row, 64 heads), walking the index list in 64-entry
# chunks in order (the chunking is part of the numerics: P is rounded to bf16 relative to the running max).

def sparse_attn_kernel(h: int, d: int, scale: float, head_block: int = 64, threads: int = 256):
    """q [B, M, h, d] bf16, kv [B, N, d] bf16, sink [h] fp32, idx [B, M, K] int32 (-1 = none)
    -> out [B, M, h, d] bf16; B, M, N and K are symbolic."""
    if d % 64:
        raise ValueError(f"sparse attention needs head_dim % 64 == 0, got {d}")
    b_, m_, n_, k_ = T.dynamic("B"), T.dynamic("M"), T.dynamic("N"), T.dynamic("K")
    hb, bi = head_block, ATTN_CHUNK

    @T.prim_func
    def sparse_attn_sink(Q: T.Tensor((b_, m_, h, d), BF16), KV: T.Tensor((b_, n_, d), BF16),
                         Sink: T.Tensor((h,), FP32), Idx: T.Tensor((b_, m_, k_), I32),
                         O: T.Tensor((b_, m_, h, d), BF16)):
        # query rows on x: y and z are capped at 65,535 blocks
        with T.Kernel(m_, T.ceildiv(h, hb), b_, threads=threads) as (mi, hx, bz):
            q_tile = T.alloc_shared((hb, d), BF16)
            kv_tile = T.alloc_shared((bi, d), BF16)
            p_tile = T.alloc_shared((hb, bi), BF16)
            rows = T.alloc_shared((bi,), I32)
            s = T.alloc_fragment((hb, bi), FP32)
            acc = T.alloc_fragment((hb, d), FP32)
            mx = T.alloc_fragment((hb,), FP32)
            mx_new = T.alloc_fragment((hb,), FP32)
            alpha = T.alloc_fragment((hb,), FP32)
            den = T.alloc_fragment((hb,), FP32)
            p_sum = T.alloc_fragment((hb,), FP32)
            h0 = hx * hb
            for i, e in T.Parallel(hb, d):   # heads past h (small head counts) are zero rows, never stored
                q_tile[i, e] = T.if_then_else(h0 + i < h, Q[bz, mi, h0 + i, e], T.bfloat16(0))
            T.fill(acc, 0)
            T.fill(den, 0)
            T.fill(mx, -1e30)
            for c in T.serial(T.ceildiv(k_, bi)):
                for j in T.Parallel(bi):    # past the list's end, or an index outside [0, N): no entry
                    rows[j] = T.if_then_else(c * bi + j < k_, T.if_then_else(
                        Idx[bz, mi, c * bi + j] < n_, Idx[bz, mi, c * bi + j], -1), -1)
                for j, e in T.Parallel(bi, d):   # gather; a missing entry reads row 0 and gets p = 0
                    kv_tile[j, e] = KV[bz, T.max(rows[j], 0), e]
                T.gemm(q_tile, kv_tile, s, transpose_B=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(hb, bi):
                    s[i, j] = T.if_then_else(rows[j] >= 0, T.ieee_mul(s[i, j], _f32(scale)),
                                             -T.infinity(FP32))
                T.reduce_max(s, mx_new, dim=1)
                for i in T.Parallel(hb):
                    mx_new[i] = T.max(mx[i], mx_new[i])
                    alpha[i] = T.exp(mx[i] - mx_new[i])
                for i, j in T.Parallel(hb, bi):
                    s[i, j] = T.exp(s[i, j] - mx_new[i])
                T.reduce_sum(s, p_sum, dim=1)
                for i in T.Parallel(hb):
                    den[i] = T.ieee_add(T.ieee_mul(den[i], alpha[i]), p_sum[i])
                    mx[i] = mx_new[i]
                for i, e in T.Parallel(hb, d):
                    acc[i, e] = T.ieee_mul(acc[i, e], alpha[i])
                T.copy(s, p_tile)                       # the bf16 rounding of P
                T.gemm(p_tile, kv_tile, acc, policy=T.GemmWarpPolicy.FullRow)
            for i in T.Parallel(hb):
                den[i] = T.ieee_add(den[i], T.exp(Sink[T.min(h0 + i, h - 1)] - mx[i]))
            for i, e in T.Parallel(hb, d):
                if h0 + i < h:
                    O[bz, mi, h0 + i, e] = T.Cast(BF16, acc[i, e] / den[i])

    return sparse_attn_sink


# ---------------------------------------------------------------------------------------------------------
# Hyper-connection split + Sinkhorn: one thread per token, fp32, every step separately rounded.

def hc_sinkhorn_kernel(hc: int = 4, iters: int = 20, eps: float = 1e-6, ieee: bool = True):
    """mixes [R, (2 + hc) * hc] fp32, scale [3], base [(2 + hc) * hc] -> pre [R, hc], post [R, hc],
    comb [R, hc, hc] (row softmax + eps, a column pass, then iters - 1 row/column passes).
    `ieee=False` writes plain + and * (TileLang's C target, used by the CPU tests, has no IEEE intrinsics;
    on CUDA they keep nvcc from fusing a multiply and an add into one FMA)."""
    if iters < 1:
        raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {iters}")
    add = T.ieee_add if ieee else (lambda x, y: x + y)
    mul = T.ieee_mul if ieee else (lambda x, y: x * y)
    eps32 = _f32(eps)
    r_, nm = T.dynamic("R"), (2 + hc) * hc

    @T.prim_func
    def hc_split_sinkhorn(Mix: T.Tensor((r_, nm), FP32), Scale: T.Tensor((3,), FP32),
                          Base: T.Tensor((nm,), FP32), Pre: T.Tensor((r_, hc), FP32),
                          Post: T.Tensor((r_, hc), FP32), Comb: T.Tensor((r_, hc, hc), FP32)):
        with T.Kernel(T.ceildiv(r_, SIMT_THREADS), threads=SIMT_THREADS) as bx:
            c = T.alloc_local((hc * hc,), FP32)
            top = T.alloc_var(FP32)
            tot = T.alloc_var(FP32)
            for t in T.Parallel(SIMT_THREADS):
                r = bx * SIMT_THREADS + t
                if r < r_:
                    for j in T.unroll(hc):
                        z = add(mul(Mix[r, j], Scale[0]), Base[j])
                        Pre[r, j] = add(T.sigmoid(z), eps32)
                        z2 = add(mul(Mix[r, hc + j], Scale[1]), Base[hc + j])
                        Post[r, j] = T.float32(2.0) * T.sigmoid(z2)
                    for i in T.unroll(hc * hc):
                        c[i] = add(mul(Mix[r, 2 * hc + i], Scale[2]), Base[2 * hc + i])
                    for j in T.unroll(hc):                  # row softmax, then + eps
                        top = c[j * hc]
                        for k in T.unroll(1, hc):
                            top = T.max(top, c[j * hc + k])
                        tot = T.float32(0.0)
                        for k in T.unroll(hc):
                            c[j * hc + k] = T.exp(c[j * hc + k] - top)
                            tot = add(tot, c[j * hc + k])
                        for k in T.unroll(hc):
                            c[j * hc + k] = add(c[j * hc + k] / tot, eps32)
                    for it in T.serial(2 * iters - 1):      # column pass, then (row, column) x (iters - 1)
                        if it % 2 == 0:
                            for k in T.unroll(hc):
                                tot = T.float32(0.0)
                                for j in T.unroll(hc):
                                    tot = add(tot, c[j * hc + k])
                                tot = add(tot, eps32)
                                for j in T.unroll(hc):
                                    c[j * hc + k] = c[j * hc + k] / tot
                        else:
                            for j in T.unroll(hc):
                                tot = T.float32(0.0)
                                for k in T.unroll(hc):
                                    tot = add(tot, c[j * hc + k])
                                tot = add(tot, eps32)
                                for k in T.unroll(hc):
                                    c[j * hc + k] = c[j * hc + k] / tot
                    for i in T.unroll(hc * hc):
                        Comb[r, i // hc, i % hc] = c[i]

    return hc_split_sinkhorn


# ---------------------------------------------------------------------------------------------------------
# Indexer scores: score[b, s, t] = bf16( sum_h bf16( relu(bf16(q[b, s, h] . k[b, t])) * w[b, s, h] ) ).
# One block per (query, 128 keys): the MMA puts keys on rows and heads on columns, so the head sum is a row
# reduction of the tile.

def index_scores_kernel(h: int, d: int, block_t: int = 128, threads: int = 128):
    """q [B, S, h, d] bf16, keys [B, T, d] bf16, w [B, S, h] bf16 -> scores [B, S, T] bf16."""
    if h % 8 or h > 256:
        raise ValueError(f"index scores need a head count that is a multiple of 8 (<= 256), got {h}")
    b_, s_, t_ = T.dynamic("B"), T.dynamic("S"), T.dynamic("T")
    bt = block_t

    @T.prim_func
    def index_scores(Q: T.Tensor((b_, s_, h, d), BF16), Kc: T.Tensor((b_, t_, d), BF16),
                     W: T.Tensor((b_, s_, h), BF16), O: T.Tensor((b_, s_, t_), BF16)):
        with T.Kernel(s_, T.ceildiv(t_, bt), b_, threads=threads) as (si, tx, bz):   # queries on x
            k_tile = T.alloc_shared((bt, d), BF16)
            q_tile = T.alloc_shared((h, d), BF16)
            dots = T.alloc_fragment((bt, h), FP32)
            total = T.alloc_fragment((bt,), FP32)
            t0 = tx * bt
            for i, e in T.Parallel(bt, d):
                k_tile[i, e] = T.if_then_else(t0 + i < t_, Kc[bz, t0 + i, e], T.bfloat16(0))
            T.copy(Q[bz, si, 0:h, 0:d], q_tile)
            T.gemm(k_tile, q_tile, dots, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(bt, h):
                score = T.max(T.Cast(FP32, T.Cast(BF16, dots[i, j])), T.float32(0.0))   # bf16, ReLU
                dots[i, j] = T.Cast(FP32, T.Cast(BF16, score * T.Cast(FP32, W[bz, si, j])))
            T.reduce_sum(dots, total, dim=1)
            for i in T.Parallel(bt):
                if t0 + i < t_:
                    O[bz, si, t0 + i] = T.Cast(BF16, total[i])

    return index_scores


# ---------------------------------------------------------------------------------------------------------
# Compilation. A kernel is named by (name, args): FACTORIES[name](*args) is its prim_func, and the wrappers
# look compiled kernels up by exactly that key, so `builds` and `precompile` warm what the wrappers use.

FACTORIES = {
    "act_quant": act_quant_kernel,                                  # (k, block, dtype)
    "fp8_qdq_": fp8_qdq_kernel,                                     # (k, block, dtype)
    "fp4_qdq_e8m0_": fp4_qdq_e8m0_kernel,                           # (k, block, dtype)
    "fp4_qdq_e4m3_": fp4_qdq_e4m3_kernel,                           # (k, block, dtype)
    "fp8_gemm": lambda n, k, config: block_scaled_gemm_kernel(n, k, "fp8", config),
    "fp4_gemm": lambda n, k, config: block_scaled_gemm_kernel(n, k, "fp4", config),
    "expert_gemm": expert_gemm_kernel,                              # (n, k, weight_format, rows_per_token)
    "sparse_attn": sparse_attn_kernel,                              # (heads, head_dim, scale)
    "hc_split_sinkhorn": hc_sinkhorn_kernel,                        # (hc, iters, eps)
    "index_scores": index_scores_kernel,                            # (heads, head_dim)
}


# How TileLang lowers the kernels, chosen in one place (RuntimeOptions.kernel_build, --kernel-build).
# "default": TileLang's own passes; every GEMM gets a TMA producer warpgroup with mbarriers, and the FP4 GEMM
# unpacks its nibbles inside that pipeline. "plain": warp specialization and TMA lowering off, the settings
# DeepSeek's own TileLang kernels use. The device check builds "default" and rebuilds a GEMM that fails or
# mismatches with "plain", reporting which one passed.
SETTINGS = {
    "default": {},
    "plain": {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
              tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True},
}


def _settings(name: str) -> str:
    if name not in SETTINGS:
        raise ValueError(f"unknown kernel build {name!r} (expected one of {', '.join(SETTINGS)})")
    return name


@dataclasses.dataclass(frozen=True)
class Build:
    """One kernel at fixed sizes: `shapes` says where it is used, `args` are FACTORIES[name]'s arguments,
    `settings` a key of SETTINGS."""
    name: str
    shapes: str = dataclasses.field(compare=False)   # a label: builds with equal (name, args) are one
    args: tuple = ()
    settings: str = "default"

    def prim_func(self):
        return FACTORIES[self.name](*self.args)


NVCC_HINT = ("install a CUDA 13 toolkit (nvcc on PATH, or CUDA_HOME) or "
             "`pip install nvidia-cuda-nvcc==13.0.88` (it brings the CUDA 13 runtime headers with it)")


def nvcc_path():
    """The nvcc TileLang will call (CUDA_HOME/bin/nvcc as TileLang resolves it), or None."""
    home = tilelang.env.CUDA_HOME
    path = os.path.join(home, "bin", "nvcc") if home else ""
    return path if os.path.isfile(path) else None


def compile_kernel(prim_func, target="auto", settings: str = "default"):
    """Lower and compile one prim_func with SETTINGS[settings]. `target`: "auto" (the current GPU) or a dict
    such as {"kind": "cuda", "arch": "sm_90a"}, which needs no GPU."""
    return tilelang.compile(prim_func, target=target, pass_configs=dict(SETTINGS[_settings(settings)]))


@functools.lru_cache(maxsize=None)
def _compiled(settings: str, name: str, *args):
    """The kernel FACTORIES[name](*args) compiled with SETTINGS[settings] for the current device, once per
    process."""
    return compile_kernel(FACTORIES[name](*args), settings=settings)


def precompile(builds, workers: int = 0):
    """Compile builds for the current device in parallel threads (TileLang lowers without the GIL and nvcc
    is a subprocess), filling the cache the wrappers use. Returns {build: error message} for failures."""
    todo = list(dict.fromkeys(builds))
    failed = {}

    def one(b: Build):
        try:
            _compiled(b.settings, b.name, *b.args)
        except Exception as e:   # collected and reported by the caller
            failed[b] = f"{type(e).__name__}: {str(e).strip()[-300:]}"

    with concurrent.futures.ThreadPoolExecutor(workers or min(len(todo), os.cpu_count() or 1) or 1) as ex:
        list(ex.map(one, todo))
    return failed


def gemm_builds(weight_format: str, n: int, k: int, label: str, settings: str = "default"):
    return [Build(f"{weight_format}_gemm", f"{label} [{n}, {k}] {config}", (n, k, config), settings)
            for config in GEMM_CONFIGS]


def builds(cfg: dict, world_size: int = 1, settings: str = "default"):
    """Every kernel at a model config's shapes (a dict of config.json keys) on one of `world_size` ranks, in
    the order the compile CLI runs them. Row counts (tokens, batch, list lengths) are symbolic; the GEMMs
    come in both tile configurations (decode: up to 64 rows, prefill: more) for the attention projections,
    the indexer, the shared and a routed expert; index scores at the padded head count (index_heads)."""
    w = world_size
    dim, hd, q_lora = cfg["dim"], cfg["head_dim"], cfg["q_lora_rank"]
    o_in, inter = cfg["o_groups"] * cfg["o_lora_rank"] // w, cfg["moe_inter_dim"]
    ihd, ih, heads = cfg["index_head_dim"], index_heads(cfg["index_n_heads"] // w), cfg["n_heads"] // w
    out = [Build("act_quant", f"x [M, {k}] block {block}", (k, block, BF16))
           for k, block in dict.fromkeys([(dim, 32), (q_lora, 32), (o_in, 32), (inter, 32), (dim, 128)])]
    out += [Build("fp8_qdq_", f"kv [M, {hd}] block 32", (hd, 32, BF16)),
            Build("fp4_qdq_e8m0_", f"index q/k [M, {ihd}] block 32", (ihd, 32, BF16)),
            Build("fp4_qdq_e4m3_", f"latent [M, {hd}] block 16", (hd, 16, BF16))]
    for label, n, k in [("wq_a", q_lora, dim), ("wq_b", heads * hd, q_lora), ("wkv", hd, dim),
                        ("wo_b", dim, o_in), ("indexer.wq_b", ih * ihd, q_lora),
                        ("shared_expert.w1", inter, dim), ("shared_expert.w2", dim, inter)]:
        out += gemm_builds("fp8", n, k, label)
    expert_format = "fp4" if cfg.get("expert_dtype", "fp4") == "fp4" else "fp8"
    out += gemm_builds(expert_format, inter, dim, "expert.w1") + gemm_builds(expert_format, dim, inter,
                                                                             "expert.w2")
    for topk in dict.fromkeys([cfg["n_activated_experts"], cfg.get("dspark_n_activated_experts", 0)]):
        if topk:
            out.append(Build("expert_gemm", f"expert.w1/w3 [E, {inter}, {dim}] {expert_format}, top-{topk}",
                             (inter, dim, expert_format, topk)))
    out.append(Build("expert_gemm", f"expert.w2 [E, {dim}, {inter}] {expert_format}",
                     (dim, inter, expert_format, 1)))
    hc, iters = cfg["hc_mult"], cfg["hc_sinkhorn_iters"]
    out += [Build("sparse_attn", f"q [B, M, {heads}, {hd}], kv [B, N, {hd}], idx [B, M, K]",
                  (heads, hd, float(hd ** -0.5))),
            Build("hc_split_sinkhorn", f"mixes [R, {(2 + hc) * hc}], {iters} iterations",
                  (hc, iters, float(cfg["hc_eps"]))),
            Build("index_scores", f"q [B, S, {ih}, {ihd}], keys [B, T, {ihd}]", (ih, ihd))]
    return [dataclasses.replace(b, settings=_settings(settings)) for b in out]


# ---------------------------------------------------------------------------------------------------------
# Wrappers: the torch references' signatures. Checks run before any compilation or launch.
#
# Launch limits. CUDA caps a grid's y and z at 65,535 blocks, so every kernel puts its unbounded size (rows,
# queries) on x (2^31 - 1) and only head blocks, key blocks and the batch on y and z. TileLang indexes a
# buffer of symbolic size with int32 arithmetic, so no tensor of one launch may reach 2^31 elements: a call
# beyond that is cut into launches over batch items and row ranges (each slice still contiguous), the same
# numbers since every kernel's rows are independent. `launch_grid` reads a kernel's grid for given sizes.

MAX_GRID = (2 ** 31 - 1, 65535, 65535)     # blocks on x, y, z
MAX_ELEMS = 2 ** 31 - 1                    # elements of any one tensor in one launch (int32 indexing)
INDEX_HEAD_MULTIPLE = 8                    # the index-score MMA's head (column) count is a multiple of 8


def index_heads(h: int) -> int:
    """The head count the index-score kernel runs for h heads: h rounded up to a multiple of 8."""
    return -(-h // INDEX_HEAD_MULTIPLE) * INDEX_HEAD_MULTIPLE


def pad_index_heads(q: torch.Tensor, w: torch.Tensor):
    """q [B, S, H, D], w [B, S, H] -> the same with H padded by zero heads to index_heads(H). A zero head
    adds ReLU(bf16(0 . k)) * 0 = +0 to each score's fp32 head sum, which leaves every sum's bits unchanged:
    the scores are those of the unpadded heads (tests/test_kernels_compile.py checks it on the torch
    route). 4 heads per rank at W = 8 on the released config, 2 at W = 16."""
    h = q.shape[2]
    extra = index_heads(h) - h
    if not extra:
        return q, w
    return torch.nn.functional.pad(q, (0, 0, 0, extra)), torch.nn.functional.pad(w, (0, extra))


def launch_grid(prim_func, *tensors) -> tuple:
    """The (x, y, z) blocks a kernel launches for these arguments (its parameters in order), read from the
    prim_func's thread bindings with its symbolic sizes bound to the tensors' shapes; no GPU needed."""
    from tvm import arith, tirx
    values = {}
    for param, t in zip(prim_func.params, tensors):
        for dim, size in zip(prim_func.buffer_map[param].shape, t.shape):
            if isinstance(dim, tirx.Var):
                values[dim] = tirx.IntImm(dim.dtype, int(size))
    extents = {}

    def visit(node):
        if isinstance(node, tirx.For) and node.thread_binding is not None:
            extents[node.thread_binding.thread_tag] = node.extent

    tirx.stmt_functor.post_order_visit(prim_func.body, visit)
    ana = arith.Analyzer()
    return tuple(int(ana.simplify(tirx.stmt_functor.substitute(extents[f"blockIdx.{a}"], values)))
                 if f"blockIdx.{a}" in extents else 1 for a in "xyz")


def _spans(total: int, per_unit: int, fn: str, what: str):
    """Consecutive slices of range(total), each of at most MAX_ELEMS // per_unit units."""
    step = MAX_ELEMS // max(1, per_unit)
    if step < 1:
        raise ValueError(f"{fn}: one {what} has {per_unit} elements, over the kernels' limit {MAX_ELEMS}")
    return [slice(i, min(total, i + step)) for i in range(0, total, step)]


def _launch_rows(call, *row_major):
    """call(*row_major) once, or over row ranges when a launch's tensors would pass MAX_ELEMS elements.
    row_major: contiguous tensors sharing dim 0 (their slices along it stay contiguous)."""
    per_row = max(t[0].numel() if t.shape[0] else 0 for t in row_major)
    for r in _spans(row_major[0].shape[0], per_row, "kernel", "row"):
        call(*(t[r] for t in row_major))


def _launch_batched(fn: str, call, rows, fixed, out):
    """call(rows, fixed, out) for a kernel over [B, M, ...]: rows (tensors [B, M, ...]) and out are cut along
    B and M, fixed (tensors [B, N, ...]) only along B. One launch when every tensor fits; else one batch item
    at a time (unsqueezed, so that each slice has a contiguous tensor's strides), its rows in ranges."""
    if max(t.numel() for t in (*rows, *fixed, out)) <= MAX_ELEMS:
        call(rows, fixed, out)
        return
    per_item = max(t[0].numel() for t in fixed)
    if per_item > MAX_ELEMS:                         # keys are not cut: one batch item's must fit
        raise ValueError(f"{fn}: one batch item's keys has {per_item} elements, over the kernels' limit "
                         f"{MAX_ELEMS}")
    per_row = max(t[0, 0].numel() for t in (*rows, out))
    for i in range(out.shape[0]):
        for r in _spans(out.shape[1], per_row, fn, "row"):
            call([t[i, r].unsqueeze(0) for t in rows], [t[i].unsqueeze(0) for t in fixed],
                 out[i, r].unsqueeze(0))


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} on {t.device}"


def _expect(ok: bool, fn: str, arg: str, want: str, t):
    if not ok:
        raise ValueError(f"{fn}: {arg} must be {want}, got {_describe(t)}")


def _is(t, *dtypes) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in dtypes


def _placed(fn: str, **tensors):
    """Contiguity, then device: the kernels take dense CUDA buffers."""
    for arg, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {arg} must be contiguous, got strides {list(t.stride())} "
                             f"for shape {list(t.shape)}")
    for arg, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{fn}: {arg} must be a CUDA tensor, got one on {t.device}")


def _rows_input(fn: str, x, block: int):
    _expect(_is(x, torch.bfloat16, torch.float32) and x.dim() >= 1 and x.shape[-1] % block == 0, fn, "x",
            f"bfloat16 or float32 [..., K] with K a multiple of {block}", x)
    _placed(fn, x=x)
    return x.view(-1, x.shape[-1]), _TORCH_TO_TL[x.dtype]


def act_quant(x: torch.Tensor, block: int = 32, settings: str = "default"):
    """(q float8_e4m3fn [..., K], s fp32 [..., K/block]) with power-of-two scales."""
    _settings(settings)
    x2, dt = _rows_input("act_quant", x, block)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(*x.shape[:-1], x.shape[-1] // block, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _launch_rows(_compiled(settings, "act_quant", x2.shape[1], block, dt),
                     x2, q.view(x2.shape), s.view(x2.shape[0], -1))
    return q, s


def _in_place(name: str, x: torch.Tensor, block: int, settings: str) -> torch.Tensor:
    _settings(settings)
    x2, dt = _rows_input(name, x, block)
    if x2.shape[0]:
        _launch_rows(_compiled(settings, name, x2.shape[1], block, dt), x2)
    return x


def fp8_qdq_(x: torch.Tensor, block: int = 32, settings: str = "default") -> torch.Tensor:
    """In place: x <- e4m3(x / s) * s per block (window KV)."""
    return _in_place("fp8_qdq_", x, block, settings)


def fp4_qdq_e8m0_(x: torch.Tensor, block: int = 32, settings: str = "default") -> torch.Tensor:
    """In place: FP4 fake-quant with power-of-two scales per block (indexer queries and keys)."""
    return _in_place("fp4_qdq_e8m0_", x, block, settings)


def fp4_qdq_e4m3_(x: torch.Tensor, block: int = 16, settings: str = "default") -> torch.Tensor:
    """In place: FP4 fake-quant with E4M3 scales per block (compressed KV latents)."""
    return _in_place("fp4_qdq_e4m3_", x, block, settings)


def _gemm(fn: str, x, weight, scale, fp4: bool, settings: str, quantized=None) -> torch.Tensor:
    """`quantized`: act_quant(x)'s (q, s) when already made (several weights reading one x)."""
    _settings(settings)
    _expect(_is(x, torch.bfloat16, torch.float32) and x.dim() >= 1 and x.shape[-1] % GEMM_BLOCK == 0, fn, "x",
            "bfloat16 or float32 [..., K] with K a multiple of 32", x)
    k = x.shape[-1]
    if fp4:
        _expect(_is(weight, torch.float4_e2m1fn_x2) and weight.dim() == 2 and weight.shape[1] * 2 == k, fn,
                "weight", f"float4_e2m1fn_x2 [N, K/2] with K = {k} (x's last dim)", weight)
        n = weight.shape[0]
        want_scale = (n, k // GEMM_BLOCK)
    else:
        _expect(_is(weight, torch.float8_e4m3fn) and weight.dim() == 2 and weight.shape[1] == k, fn, "weight",
                f"float8_e4m3fn [N, K] with K = {k} (x's last dim)", weight)
        n = weight.shape[0]
        want_scale = (-(-n // GEMM_BLOCK), k // GEMM_BLOCK)
    _expect(_is(scale, torch.float8_e8m0fnu) and tuple(scale.shape) == want_scale, fn, "scale",
            f"float8_e8m0fnu {list(want_scale)}", scale)
    _expect(n % 16 == 0, fn, "weight", "[N, ...] with N a multiple of 16", weight)
    _placed(fn, x=x, weight=weight, scale=scale)
    q, s = act_quant(x, GEMM_BLOCK, settings) if quantized is None else quantized
    m = q.numel() // k
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16, device=x.device)
    if m:
        w, ws = weight.view(torch.uint8) if fp4 else weight, scale.view(torch.uint8)
        kernel = _compiled(settings, fn, n, k, gemm_config(m))
        _launch_rows(lambda a, sa, c: kernel(a, sa, w, ws, c), q.view(m, k), s.view(m, -1), out.view(m, n))
    return out


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, settings: str = "default",
             quantized=None) -> torch.Tensor:
    """act_quant(x) times an E4M3 weight [N, K] with UE8M0 32x32 block scales -> bf16 [..., N]. `quantized`:
    act_quant(x, 32) when already made."""
    return _gemm("fp8_gemm", x, weight, scale, False, settings, quantized)


def fp4_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, settings: str = "default",
             quantized=None) -> torch.Tensor:
    """act_quant(x) times an MXFP4 weight [N, K/2] with UE8M0 per-row scales [N, K/32] -> bf16 [..., N].
    `quantized`: act_quant(x, 32) when already made."""
    return _gemm("fp4_gemm", x, weight, scale, True, settings, quantized)


def expert_gemm(q: torch.Tensor, s: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor,
                scale: torch.Tensor, rows_per_token: int = 1, settings: str = "default") -> torch.Tensor:
    """Each selection's row through its expert, from the stored bytes: q E4M3 [M, K] and s fp32 [M, K/32]
    (act_quant of the tokens' rows), experts int32 [P] (selection p's expert, row p // rows_per_token of
    q), weight [E, N, K] float8_e4m3fn with UE8M0 [E, ceil(N/32), K/32], or [E, N, K/2] float4_e2m1fn_x2
    with UE8M0 [E, N, K/32] -> bf16 [P, N]."""
    _settings(settings)
    fn = "expert_gemm"
    _expect(_is(q, torch.float8_e4m3fn) and q.dim() == 2 and q.shape[1] % GEMM_BLOCK == 0, fn, "q",
            "float8_e4m3fn [M, K] with K a multiple of 32", q)
    m, k = q.shape
    _expect(_is(s, torch.float32) and tuple(s.shape) == (m, k // GEMM_BLOCK), fn, "s",
            f"float32 [{m}, {k // GEMM_BLOCK}]", s)
    _expect(_is(experts, torch.int32) and experts.dim() == 1 and experts.shape[0] <= m * rows_per_token, fn,
            "experts", f"int32 [P] with P <= {m * rows_per_token}", experts)
    fp4 = _is(weight, torch.float4_e2m1fn_x2)
    if fp4:
        _expect(weight.dim() == 3 and weight.shape[2] * 2 == k, fn, "weight",
                f"float4_e2m1fn_x2 [E, N, K/2] with K = {k}", weight)
        want_scale = (weight.shape[0], weight.shape[1], k // GEMM_BLOCK)
    else:
        _expect(_is(weight, torch.float8_e4m3fn) and weight.dim() == 3 and weight.shape[2] == k, fn, "weight",
                f"float8_e4m3fn [E, N, K] or float4_e2m1fn_x2 [E, N, K/2] with K = {k}", weight)
        want_scale = (weight.shape[0], -(-weight.shape[1] // GEMM_BLOCK), k // GEMM_BLOCK)
    n = weight.shape[1]
    _expect(_is(scale, torch.float8_e8m0fnu) and tuple(scale.shape) == want_scale, fn, "scale",
            f"float8_e8m0fnu {list(want_scale)}", scale)
    _expect(n % 16 == 0, fn, "weight", "[E, N, ...] with N a multiple of 16", weight)
    _placed(fn, q=q, s=s, experts=experts, weight=weight, scale=scale)
    out = torch.empty(experts.shape[0], n, dtype=torch.bfloat16, device=q.device)
    if out.numel():
        kernel = _compiled(settings, fn, n, k, "fp4" if fp4 else "fp8", rows_per_token)
        kernel(q, s, experts, weight.view(torch.uint8) if fp4 else weight, scale.view(torch.uint8), out)
    return out


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                q_block: int = 64, settings: str = "default") -> torch.Tensor:
    """q [B, M, H, D] bf16, kv [B, N, D] bf16, sink [H] fp32, idx [B, M, K] int32 (-1 = none) -> bf16
    [B, M, H, D]. An index outside [0, N) counts as -1 (the kernel never reads past kv; the torch routes
    raise on it). `q_block` (the reference's memory bound) is accepted and unused."""
    _settings(settings)
    fn = "sparse_attn"
    _expect(_is(q, torch.bfloat16) and q.dim() == 4 and q.shape[-1] % 64 == 0, fn, "q",
            "bfloat16 [B, M, H, D] with D a multiple of 64", q)
    b, m, h, d = q.shape
    _expect(_is(kv, torch.bfloat16) and kv.dim() == 3 and kv.shape[0] == b and kv.shape[2] == d, fn, "kv",
            f"bfloat16 [{b}, N, {d}]", kv)
    _expect(_is(sink, torch.float32) and tuple(sink.shape) == (h,), fn, "sink", f"float32 [{h}]", sink)
    _expect(_is(idx, torch.int32) and idx.dim() == 3 and tuple(idx.shape[:2]) == (b, m), fn, "idx",
            f"int32 [{b}, {m}, K]", idx)
    _placed(fn, q=q, kv=kv, sink=sink, idx=idx)
    out = torch.empty_like(q)
    if b and m:
        kernel = _compiled(settings, fn, h, d, float(scale))
        _launch_batched(fn, lambda r, f, o: kernel(r[0], f[0], sink, r[1], o), (q, idx), (kv,), out)
    return out


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float, settings: str = "default"):
    """mixes [..., (2 + hc) * hc] fp32 -> pre [..., hc], post [..., hc], comb [..., hc, hc] (fp32)."""
    _settings(settings)
    fn, nm = "hc_split_sinkhorn", (2 + hc) * hc
    if not (isinstance(iters, int) and iters >= 1):
        raise ValueError(f"{fn}: iters must be an int >= 1, got {iters!r}")
    _expect(_is(mixes, torch.float32) and mixes.dim() >= 1 and mixes.shape[-1] == nm, fn, "mixes",
            f"float32 [..., {nm}]", mixes)
    _expect(_is(scale, torch.float32) and tuple(scale.shape) == (3,), fn, "scale", "float32 [3]", scale)
    _expect(_is(base, torch.float32) and tuple(base.shape) == (nm,), fn, "base", f"float32 [{nm}]", base)
    _placed(fn, mixes=mixes, scale=scale, base=base)
    lead = mixes.shape[:-1]
    pre = torch.empty(*lead, hc, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(*lead, hc, hc, dtype=torch.float32, device=mixes.device)
    r = mixes.numel() // nm
    if r:
        kernel = _compiled(settings, fn, hc, iters, float(eps))
        _launch_rows(lambda m, p, o, c: kernel(m, scale, base, p, o, c),
                     mixes.view(r, nm), pre.view(r, hc), post.view(r, hc), comb.view(r, hc, hc))
    return pre, post, comb


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, max_elems: int = 1 << 26,
                 settings: str = "default") -> torch.Tensor:
    """sum_h ReLU(q_h . k) * w_h in bf16 (the indexer's head-weighted scores): q [B, S, H, D], keys
    [B, T, D], w [B, S, H], all bf16 -> [B, S, T] bf16. H of at most 256 heads is padded with zero heads to
    a multiple of 8 (pad_index_heads: the same bits). `max_elems` (the reference's chunking) is unused."""
    _settings(settings)
    fn = "index_scores"
    _expect(_is(q, torch.bfloat16) and q.dim() == 4 and 0 < q.shape[2] <= 256, fn, "q",
            "bfloat16 [B, S, H, D] with 1 <= H <= 256", q)
    b, s, h, d = q.shape
    _expect(_is(keys, torch.bfloat16) and keys.dim() == 3 and keys.shape[0] == b and keys.shape[2] == d, fn,
            "keys", f"bfloat16 [{b}, T, {d}]", keys)
    _expect(_is(w, torch.bfloat16) and tuple(w.shape) == (b, s, h), fn, "w", f"bfloat16 [{b}, {s}, {h}]", w)
    _placed(fn, q=q, keys=keys, w=w)
    out = torch.empty(b, s, keys.shape[1], dtype=torch.bfloat16, device=q.device)
    if out.numel():
        q, w = pad_index_heads(q, w)
        kernel = _compiled(settings, fn, q.shape[2], d)
        _launch_batched(fn, lambda r, f, o: kernel(r[0], f[0], r[1], o), (q, w), (keys,), out)
    return out


# ---------------------------------------------------------------------------------------------------------
# The TileLang route behind the numerics interface

def _in_place_any(kernel, x: torch.Tensor, block: int, settings: str) -> torch.Tensor:
    """Run an in-place kernel (contiguous operands only) on any x, writing the result into x."""
    y = x if x.is_contiguous() else x.contiguous()
    kernel(y, block, settings)
    return x if y is x else x.copy_(y)


class TileLang(Fast):
    """The fused kernels above for the quantisers, the FP8/FP4 GEMMs, sparse attention, Sinkhorn and the index
    scores; everything else as the fast order computes it (a prefill's experts loop over the active ones, each
    GEMM a kernel; a decode step indexes the stacked experts with fixed shapes, no host sync). Reference
    rounding points only (golden numerics run the torch kernels). `settings`: how the kernels are built (a
    key of SETTINGS)."""

    name = "tilelang"

    def __init__(self, golden: bool = False, device="cpu", settings: str = "default"):
        super().__init__(golden, device)
        self.settings = _settings(settings)

    def __repr__(self) -> str:
        return f"TileLang(golden={self.golden}, device={self.device}, settings={self.settings!r})"

    def quant_linear(self, held, x, quantized=None):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()                # [M, K]
        gemm = fp8_gemm if held.kind == "fp8" else fp4_gemm
        y = gemm(x2, held.weight, held.scale, settings=self.settings, quantized=quantized)
        return y.view(*x.shape[:-1], y.shape[-1])

    def expert_activations(self, x):
        """None: the kernels quantise their own inputs (one act_quant kernel per call)."""
        return None

    def linears(self, helds, x, a=None):
        """FP8/FP4 Linears that read the same x: one act_quant kernel for all of them."""
        if any(h.scale is None for h in helds):
            return super().linears(helds, x)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        quantized = act_quant(x2, GEMM_BLOCK, self.settings)
        return tuple(self.quant_linear(h, x2, quantized).view(*x.shape[:-1], -1) for h in helds)

    def selected_experts(self, stacked, kind, start, n_local, n_experts, x, weights, idx, swiglu, a=None):
        """A decode step's routed experts by the expert GEMM kernel on the stored bytes: act_quant of the
        tokens, w1 and w3 per selection, the SwiGLU, act_quant, w2 per selection (fixed shapes, no sync)."""
        if kind not in ("fp8", "fp4"):
            return super().selected_experts(stacked, kind, start, n_local, n_experts, x, weights, idx, swiglu)
        n, k = idx.shape
        local = idx - start if start else idx                                    # [N, k]
        own = None
        if n_local < n_experts:                                   # other ranks hold some experts
            own = (local >= 0) & (local < n_local)
            local = torch.where(own, local, 0)
        experts = local.flatten().to(torch.int32)                                # [N k]
        q, s = act_quant(x.contiguous(), GEMM_BLOCK, self.settings)              # [N, D] each token once
        gate, up = (expert_gemm(q, s, experts, *stacked[p], k, self.settings) for p in ("w1", "w3"))
        h = swiglu(gate, up, weights.reshape(-1, 1)).to(x.dtype)                 # [N k, I]
        hq, hs = act_quant(h, GEMM_BLOCK, self.settings)
        out = expert_gemm(hq, hs, experts, *stacked["w2"], 1, self.settings).view(n, k, -1)   # [N, k, D]
        return out if own is None else torch.where(own.unsqueeze(-1), out, 0)

    def sparse_attn(self, q, kv, sink, idx, scale):
        return sparse_attn(q.contiguous(), kv.contiguous(), sink, idx.contiguous(), scale,
                           settings=self.settings)

    def hc_split_sinkhorn(self, mixes, scale, base, hc, iters, eps):
        return hc_split_sinkhorn(mixes.contiguous(), scale, base, hc, iters, eps, settings=self.settings)

    def local_index_scores(self, q, keys, w, visible=None):
        return index_scores(q.contiguous(), keys.contiguous(), w.contiguous(), settings=self.settings)

    def act_quant(self, x, block=32):
        return act_quant(x.contiguous(), block, self.settings)

    def _fp8_qdq_(self, x, block):
        return _in_place_any(fp8_qdq_, x, block, self.settings)

    def _fp4_qdq_e8m0_(self, x, block):
        return _in_place_any(fp4_qdq_e8m0_, x, block, self.settings)

    def _fp4_qdq_e4m3_(self, x, block):
        return _in_place_any(fp4_qdq_e4m3_, x, block, self.settings)
