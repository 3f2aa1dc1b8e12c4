"""The CPU-exact torch kernels: the reference's rounding points *and* its summation order.

These functions define the numbers the project reproduces bit for bit on CPU: activation quantization, the
quantize-dequantize round trips of the caches, the block-scaled FP8/FP4 GEMM (per-32 partial sums added one
block at a time in increasing K order), sparse attention with a sink (online softmax over 64-entry chunks,
each q.k summed in head-dim order), the hyper-connection Sinkhorn split and the indexer's head-weighted
scores. They are written for clarity and exactness, not speed: `fast.py` has loop-free versions with the same
rounding points, and `tilelang_ops.py` the fused GPU kernels. Model code reaches them through the numerics
interface (`numerics.py`): class Exact at the end of this file is the exact order's.
"""
import torch

from ..quant import C6, C448, FP4_MAX, FP8_MAX, ceil_pow2, e2m1_round
from . import native
from .numerics import Numerics

CHUNK = 64  # sparse attention walks each index list in blocks of 64 entries


def _group(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.unflatten(-1, (x.shape[-1] // block, block))


# ---- quantizers (bit-exact on every route) ----

def act_quant(x: torch.Tensor, block: int = 32):
    """Per-`block` FP8 quantization along the last dim with power-of-two scales.

    Returns (q float8_e4m3fn [..., K], s fp32 [..., K/block]).
    """
    g = _group(x.float(), block)                                   # [..., K/b, b]
    amax = g.abs().amax(-1).clamp_min(1e-4)
    s = ceil_pow2(amax * C448)                                     # [..., K/b]
    q = (g / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


def fp8_qdq_(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """In-place FP8 fake-quant (window KV): x <- bf16(e4m3(x/s) * s)."""
    q, s = act_quant(x, block)
    x.copy_((_group(q.float(), block) * s.unsqueeze(-1)).flatten(-2))
    return x


def fp4_qdq_e8m0_(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """In-place FP4 fake-quant with power-of-two scales per 32 (indexer queries and keys)."""
    g = _group(x.float(), block)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    s = ceil_pow2(amax * C6)
    v = (g / s).clamp(-FP4_MAX, FP4_MAX)
    x.copy_((e2m1_round(v) * s).flatten(-2))
    return x


def fp4_qdq_e4m3_(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """In-place FP4 fake-quant with E4M3 scales per 16 (compressed KV latents); s is not a power of two."""
    g = _group(x.float(), block)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -9)
    s = (amax / 6.0).clamp_max(FP8_MAX).to(torch.float8_e4m3fn).float()
    v = (g / s).clamp(-FP4_MAX, FP4_MAX)
    x.copy_((e2m1_round(v) * s).flatten(-2))
    return x


# ---- block-scaled GEMM ----

def block_scaled_gemm(x: torch.Tensor, w_deq: torch.Tensor, block: int = 32, max_bytes: int = 1 << 27):
    """FP8 x FP8 / FP8 x FP4 GEMM semantics: act_quant(x), exact per-32 block products summed in fp32,
    block partials added in increasing K order, output rounded to bf16.

    `w_deq` is the dequantized fp32 weight [N, K]; with power-of-two activation scales the scaled block
    products are the same numbers the kernel forms. Rows go in chunks whose [K/b, rows, N] partials would
    fit max_bytes (BLAS sums a block's 32 products alike for the same rows: the chunks fix the bits). A small
    chunk takes its partials from one batched GEMM; a larger one block by block into one [rows, N] buffer,
    each added to the sum at once (the same numbers, a fraction of the memory traffic: 2.5-4x faster from a
    thousand rows).
    """
    q, s = act_quant(x, block)
    a = (_group(q.float(), block) * s.unsqueeze(-1))                # [..., K/b, b]
    lead = a.shape[:-2]
    a = a.reshape(-1, a.shape[-2], block).transpose(0, 1)           # [K/b, M, b]
    n = w_deq.shape[0]
    wb = w_deq.view(n, -1, block).permute(1, 2, 0)                  # [K/b, b, N]
    kb, m = a.shape[0], a.shape[1]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    rows = max(1, max_bytes // max(1, kb * n * 4))
    for r0 in range(0, m, rows):
        chunk = a[:, r0:r0 + rows]                                  # [K/b, r, b]
        if chunk.shape[1] * n < BLOCKWISE_OUTPUTS:
            parts = torch.bmm(chunk, wb)                            # [K/b, r, N]
            acc = parts[0].clone()
            for part in parts[1:]:
                acc += part
        else:
            acc, part = torch.mm(chunk[0], wb[0]), torch.empty(chunk.shape[1], n, device=x.device)
            for j in range(1, kb):
                acc += torch.mm(chunk[j], wb[j], out=part)          # [r, N], block j's partials
        out[r0:r0 + rows] = acc
    return out.to(torch.bfloat16).view(*lead, n)


# From this many outputs (rows x N) a chunk's block partials are made block by block (block_scaled_gemm);
# below, one batched GEMM makes them all, faster for a decode step's few rows (measured on 2 cores).
BLOCKWISE_OUTPUTS = 1 << 17


# ---- sparse attention with a sink ----

def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                q_block: int = 64) -> torch.Tensor:
    """q [B, M, H, D] bf16, kv [B, N, D] bf16 (K = V), sink [H] fp32, idx [B, M, T] int32 (-1 = none).

    Online softmax over 64-entry chunks in list order; probabilities are rounded to V's dtype, bf16 (relative
    to the running max), before P.V; the sink logit enters only the denominator. Returns [B, M, H, D] bf16.
    With fp32 q and kv (golden numerics) nothing is rounded and the output is fp32.
    """
    b, m, h, d = q.shape
    out = torch.empty_like(q)
    for m0 in range(0, m, q_block):  # bound the gathered KV memory
        out[:, m0:m0 + q_block] = _attend(q[:, m0:m0 + q_block], kv, sink, idx[:, m0:m0 + q_block], scale)
    return out


def _columns(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x's fp32 columns along its last dim, stacked first and each contiguous: [D, *x.shape[:-1]] with a 1
    inserted at `dim`."""
    return x.movedim(-1, 0).to(torch.float32, memory_format=torch.contiguous_format).unsqueeze(dim)


def _dot_in_order(q_cols: torch.Tensor, rows: torch.Tensor, exact_products: bool,
                  max_sums: int = 1024) -> torch.Tensor:
    """Scores q.k [B, M, H, C] from q's fp32 columns [D, B, M, H, 1] and fp32 rows [B, M, C, D]: the products
    summed in fp32 one at a time, in d order. That order reproduces the reference's near-tie bf16 roundings of
    p; a blocked GEMM (einsum) flips some of them (layer-isolated block_pre_mix max diff 4.3e-4 instead of
    1.2e-4 at layer 4, 1.4e-4 vs 2.3e-5 at 0).

    Three ways to the same sums on CPU: up to `max_sums` scores (a decode step's), all products formed at once
    and added by index_add_, which adds its source slices one at a time in index order there (D - 1 ops
    fewer: 2 to 10x faster); beyond, the native kernel (native.ordered_scores: the same loop in C, vectors
    across the sums); without it, one column at a time (index_add_ is slower on larger slices): the loop
    below, the specification."""
    n_sums = q_cols[0].numel() * rows.shape[-2]
    lib = native.ordered_library() if rows.device.type == "cpu" and n_sums > max_sums else None
    if lib is not None:
        q = q_cols.squeeze(-1).movedim(0, -1)                       # [B, M, H, D]
        s = native.ordered_scores(lib, q.reshape(-1, *q.shape[-2:]).contiguous(),
                                  rows.reshape(-1, *rows.shape[-2:]).contiguous())   # [B*M, H, C]
        return s.view(*q.shape[:-1], rows.shape[-2])
    k_cols = _columns(rows, -2)                                     # [D, B, M, 1, C]
    s = torch.zeros(*q_cols.shape[1:-1], rows.shape[-2], dtype=torch.float32, device=rows.device)
    if s.numel() <= max_sums and rows.device.type == "cpu":      # CUDA's index_add_: no fixed order
        products = q_cols * k_cols                                  # [D, B, M, H, C]
        first = torch.zeros(len(products), dtype=torch.long, device=rows.device)
        return s.unsqueeze(0).index_add_(0, first, products)[0]
    if exact_products:
        # bf16 x bf16 is exact in fp32 (above 2^-133), so a fused multiply-add rounds where s += q k does
        for qk, kk in zip(q_cols, k_cols):
            s.addcmul_(qk, kk)
    else:
        for qk, kk in zip(q_cols, k_cols):
            s += qk * kk
    return s


def _attend(q, kv, sink, idx, scale):
    b, m, h, d = q.shape
    t = idx.shape[-1]
    mx = torch.full((b, m, h), -1e30, dtype=torch.float32, device=q.device)
    den = torch.zeros(b, m, h, dtype=torch.float32, device=q.device)
    acc = torch.zeros(b, m, h, d, dtype=torch.float32, device=q.device)
    q_cols = _columns(q, -1)                                        # [D, B, M, H, 1]
    exact = q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16
    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    for c0 in range(0, t, CHUNK):
        ic = idx[:, :, c0:c0 + CHUNK].long()                        # [B, M, C]
        valid = ic >= 0
        rows = kv[batch, ic.clamp_min(0)].float()                   # [B, M, C, D]
        s = _dot_in_order(q_cols, rows, exact) * scale              # [B, M, H, C] fp32
        s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
        new_mx = torch.maximum(mx, s.amax(-1))
        alpha = torch.exp(mx - new_mx)
        p = torch.exp(s - new_mx.unsqueeze(-1))
        den = den * alpha + p.sum(-1)
        pv = torch.einsum("bmhc,bmcd->bmhd", p.to(kv.dtype).float(), rows)      # the kernel's P cast
        acc = acc * alpha.unsqueeze(-1) + pv
        mx = new_mx
    den = den + torch.exp(sink.float().view(1, 1, h) - mx)
    return (acc / den.unsqueeze(-1)).to(q.dtype)


# ---- hyper-connection Sinkhorn split ----

def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                      iters: int, eps: float):
    """mixes [..., (2 + hc) * hc] fp32 -> pre [..., hc], post [..., hc], comb [..., hc, hc]: sigmoid gates
    for pre (+eps) and post (x2), and comb made doubly stochastic by a row softmax then `iters` alternating
    column / row normalizations (the first row pass is the softmax itself)."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mixes[..., 2 * hc:].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = comb.softmax(-1) + eps                                   # row softmax + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)                # column pass
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


# ---- indexer scores ----

def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor,
                 max_elems: int = 1 << 26) -> torch.Tensor:
    """sum_h ReLU(q_h . k) * w_h in bf16: per-head scores rounded to bf16, products rounded to bf16, one
    reduction over heads. q [B, S, H, D], keys [B, T, D], w [B, S, H] -> [B, S, T] bf16. Long prefills are
    processed in query chunks to bound the [S, H, T] intermediate."""
    b, s, h, _ = q.shape
    rows = max(1, max_elems // max(1, b * h * keys.shape[1]))
    parts = []
    for s0 in range(0, s, rows):
        score = torch.einsum("bshd,btd->bsht", q[:, s0:s0 + rows], keys)        # bf16 out, fp32 accumulation
        parts.append((score.relu_() * w[:, s0:s0 + rows].unsqueeze(-1)).sum(dim=2))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


# ---- the exact order behind the numerics interface ----

class Exact(Numerics):
    """The reference's summation order (bit for bit on CPU), at the reference's or the golden rounding
    points."""

    name = "exact"

    def quant_linear(self, held, x):
        return block_scaled_gemm(x, self.dequantized(held))

    def sparse_attn(self, q, kv, sink, idx, scale):
        return sparse_attn(q, kv, sink, idx, scale)

    def hc_split_sinkhorn(self, mixes, scale, base, hc, iters, eps):
        return hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)

    def local_index_scores(self, q, keys, w, visible=None):
        return index_scores(q, keys, w)

    def act_quant(self, x, block=32):
        return act_quant(x, block)

    def _fp8_qdq_(self, x, block):
        return fp8_qdq_(x, block)

    def _fp4_qdq_e8m0_(self, x, block):
        return fp4_qdq_e8m0_(x, block)

    def _fp4_qdq_e4m3_(self, x, block):
        return fp4_qdq_e4m3_(x, block)
