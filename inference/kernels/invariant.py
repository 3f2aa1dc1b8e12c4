"""Invariant numerics: every reduction in an order fixed by the shapes alone, every transcendental function
from basic IEEE operations, so that the same inputs give the same bits on any CPU, with any number of
threads, in any batch, in any chunking of the sequence and at any world size W that divides 8.

Why this works:
- IEEE addition, multiplication, division and square root are correctly rounded: the same operands give the
  same result on every machine. What moves between machines is the *order* of a reduction (a BLAS or a
  vectorised sum picks it by instruction set, thread count and shape) and the last bit of vectorised exp,
  log, sin or pow. So here every sum is a tree of elementwise additions whose shape depends only on the
  length (`tree_sum`), and exp / log / sigmoid / SiLU / softplus are evaluated in fp64 by range reduction and
  a polynomial made of basic operations, then rounded once to fp32.
- A product of two FP8 values (E4M3 x E4M3, or E4M3 x E2M1, each times a power-of-two scale) has at most 8
  significant bits, and a sum of 32 of them spans at most 49 bits: an FP8/FP4 block GEMM's per-32-block
  partial sums are exact in fp64 in any order, so the fp64 BLAS may compute them however it likes.
- Other products (bf16 x bf16, fp32 x bf16, fp32 x fp32) are exact in fp64; their sums are not, so those
  GEMMs form the products elementwise and reduce them with `tree_sum`. That is slow, and it is the price.

The canonical tree: a length-n reduction is cut into gcd(n, 8) equal contiguous chunks, each chunk is summed
by a pairwise tree (neighbours added elementwise, repeatedly, after zero-padding to a power of two), then
the chunk sums by the same pairwise tree. A reduction split over W ranks in contiguous parts (the
row-parallel GEMM, the indexer's heads; W divides 8 and n, so it divides gcd(n, 8)) gives each rank whole
chunks and an aligned subtree of the top tree, so W ranks reproduce the W = 1 bits (`tree_sum_split`).
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import reference
from .numerics import Numerics, exact_weight

CHUNKS = 8          # the largest supported world size
_LN2_HI = 0.693147180369123816490        # few significant bits: k * _LN2_HI is exact for |k| < 2^20
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.0 / math.log(2.0)


# ---------------------------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------------------------

def _pairwise(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x [..., n, ...] -> the sum over `dim` (removed): neighbours (2i, 2i+1) added elementwise until one
    value is left. An odd one out at the end of a level is added to +0: the tree of n zero-padded to 2^k,
    whose all-padding subtrees sum to +0, without the padding's copy. Neighbour pairing keeps every aligned
    run of 2^j leaves a subtree (what tree_sum_split needs). Summing along `dim` in place of the last
    dimension keeps the inner dimensions contiguous (the same pairs, the same bits)."""
    dim = dim % x.dim()
    if x.shape[dim] == 0:
        return x.new_zeros(x.shape[:dim] + x.shape[dim + 1:])
    lead = (slice(None),) * dim
    while x.shape[dim] > 1:
        n = x.shape[dim]
        first, second = x[lead + (slice(0, n - 1, 2),)], x[lead + (slice(1, n, 2),)]    # n // 2 pairs
        if n % 2 == 0:
            x = first + second
            continue
        y = x.new_empty(x.shape[:dim] + (n // 2 + 1,) + x.shape[dim + 1:])
        torch.add(first, second, out=y[lead + (slice(0, n // 2),)])
        torch.add(x[lead + (slice(n - 1, n),)], 0.0, out=y[lead + (slice(n // 2, None),)])
        x = y
    return x.squeeze(dim)


def chunk_count(n: int) -> int:
    """How many contiguous chunks a length-n reduction is cut into: gcd(n, 8), a power of two that every
    world size dividing n (and 8) divides too."""
    return math.gcd(n, CHUNKS)


def chunk_sums(x: torch.Tensor, chunks: int, dim: int = -1) -> torch.Tensor:
    """[..., n, ...] -> [..., chunks, ...]: each of `chunks` equal contiguous chunks of `dim` summed by a
    pairwise tree."""
    dim = dim % x.dim()
    return _pairwise(x.unflatten(dim, (chunks, x.shape[dim] // chunks)), dim + 1)


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum along `dim` in the canonical order (see the module docstring); x's dtype."""
    n = x.shape[dim]
    # up to 8 values (a power of two): gcd(n, 8) = n chunks of one, so the tree is the pairwise one
    y = _pairwise(x, dim) if n in (1, 2, 4, 8) else _pairwise(chunk_sums(x, chunk_count(n), dim), dim)
    return y.unsqueeze(dim) if keepdim else y


def tree_sum_split(x_local: torch.Tensor, par, dim: int = -1) -> torch.Tensor:
    """tree_sum of a tensor whose `dim` is split over the ranks of `par` in contiguous equal parts (in rank
    order): the same bits as tree_sum of the whole tensor at W = 1 (each rank holds whole chunks, an aligned
    subtree of the tree over the chunks; the W subtree sums are gathered and finished by the same pairwise
    tree)."""
    w = par.world_size
    if w == 1:
        return tree_sum(x_local, dim)
    x = x_local.movedim(dim, -1)
    chunks = chunk_count(x.shape[-1] * w)
    if chunks % w:
        raise ValueError(f"invariant numerics: a reduction over {x.shape[-1] * w} values cannot be split "
                         f"over {w} ranks in whole chunks (the world size must divide 8 and the length)")
    local = _pairwise(chunk_sums(x, chunks // w))                  # [...]: this rank's aligned subtree
    parts = par.all_gather_cat(local.unsqueeze(-1).contiguous(), dim=-1)   # [..., W] in rank order
    return _pairwise(parts)


def tree_mean(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    return tree_sum(x, dim, keepdim) / x.shape[dim]


# ---------------------------------------------------------------------------------------------------------
# Elementary functions: fp64 range reduction and polynomials of basic operations, rounded once
# ---------------------------------------------------------------------------------------------------------

def _exp64(x: torch.Tensor) -> torch.Tensor:
    """e^x for fp64 x, from basic operations only (about 1e-16 relative error; the same bits everywhere)."""
    x = x.clamp(-800.0, 800.0)                 # beyond fp32's range either way; keeps 2^k finite in fp64
    k = torch.round(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO         # |r| <= 0.35
    p = torch.full_like(r, 1.0 / 6227020800.0)     # Taylor to r^13 / 13!: truncation < 1e-17
    for n in range(12, -1, -1):
        p = p * r + 1.0 / math.factorial(n)
    return torch.ldexp(p, k)


def _log64(y: torch.Tensor) -> torch.Tensor:
    """ln y for fp64 y > 0, from basic operations (atanh series around the mantissa)."""
    m, e = torch.frexp(y)                       # y = m * 2^e, m in [0.5, 1)
    small = m < math.sqrt(0.5)
    m = torch.where(small, m * 2.0, m)          # m in [sqrt(1/2), sqrt(2))
    e = torch.where(small, e - 1, e).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)                   # |s| <= 0.1716
    s2 = s * s
    p = torch.full_like(s, 1.0 / 31.0)
    for n in range(29, 0, -2):                  # 2 * (s + s^3/3 + ... + s^31/31): truncation < 1e-20
        p = p * s2 + 1.0 / n
    return (e * _LN2_HI + 2.0 * s * p) + e * _LN2_LO


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x, x's dtype (fp32 or bf16); -inf -> 0, NaN stays NaN."""
    y = _exp64(x.double())
    y = torch.where(torch.isnan(x), float("nan"), y)
    y = torch.where(x == float("-inf"), 0.0, y)
    return y.to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return (1.0 / (1.0 + _exp64(-xd))).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return (xd / (1.0 + _exp64(-xd))).to(x.dtype)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + e^x), and x itself above `threshold` (torch's default rule)."""
    xd = x.double()
    u = _exp64(xd)
    v = 1.0 + u
    # log1p(u) without cancellation: log(v) * u / (v - 1) corrects for the rounding of 1 + u.
    y = torch.where(v == 1.0, u, _log64(v) * (u / (v - 1.0)))
    return torch.where(xd > threshold, xd, y).to(x.dtype)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x): two correctly rounded operations."""
    return 1.0 / torch.sqrt(x)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(x - max) / tree_sum, in x's dtype (max is exact in any order)."""
    e = exp(x - x.amax(dim, keepdim=True))
    return e / tree_sum(e, dim, keepdim=True)


# ---------------------------------------------------------------------------------------------------------
# GEMMs
# ---------------------------------------------------------------------------------------------------------

def _budget_rows(per_row: int, max_bytes: int = 1 << 26) -> int:
    return max(1, max_bytes // max(1, per_row))


def _significant_bits(t: torch.Tensor) -> int:
    """8 when every value of t is a bf16 value (whatever t's dtype), else 24 (fp32) or 53."""
    if t.dtype == torch.bfloat16 or torch.equal(t.float().bfloat16().double(), t.double()):
        return 8
    return 24 if t.dtype != torch.float64 else 53


LINEAR_BLOCK = 32


def _block_range(a: torch.Tensor):
    """a [..., nb, 32] fp64 -> per block (max |a|, smallest nonzero |a|; 1 if all zero), [..., nb]."""
    a = a.abs()
    small = a.masked_fill(a == 0, float("inf")).amin(-1)
    return a.amax(-1), torch.where(torch.isinf(small), torch.ones_like(small), small)


@dataclass
class PreparedWeight:
    """A weight [N, K] laid out for `linear` once (the owner keeps it between calls): fp64 [K/32, 32, N]
    (K zero-padded), its per-block magnitude range over all columns, and its significant bits."""
    wt: torch.Tensor
    big: torch.Tensor
    small: torch.Tensor
    bits: int

    @staticmethod
    def of(w: torch.Tensor) -> "PreparedWeight":
        n, k = w.shape
        wd = F.pad(w.double(), (0, -k % LINEAR_BLOCK)).view(n, -1, LINEAR_BLOCK)      # [N, nb, 32]
        big, small = _block_range(wd)                                             # [N, nb]
        return PreparedWeight(wd.permute(1, 2, 0).contiguous(), big.amax(0), small.amin(0),
                              _significant_bits(w))


def linear(x: torch.Tensor, w: Optional[torch.Tensor], out_dtype: Optional[torch.dtype] = None,
           prepared: Optional[PreparedWeight] = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T for bf16 / fp32 operands, rounded once to fp32 and then to out_dtype (default
    x's dtype). Its definition: the products in fp64 (exact), each 32-block of K summed by a pairwise fp64
    tree, +0, then tree_sum over the blocks in fp64. `prepared`: w laid out once by PreparedWeight.of.

    How it is computed: a block's pairwise sum is exact, and so equal to what any fp64 GEMM gives, when the
    products' magnitudes span few enough bits that every partial sum fits in 53 (at most 2^(47 - b) between
    the largest and the smallest nonzero product, b their significant bits: 16 for bf16 x bf16). That is
    checked per row from per-block maxima and minima (never across rows, so a row's path does not depend on
    its neighbours): rows that pass take one fp64 bmm per block; the others form the products and the
    trees elementwise. Both give the definition's bits."""
    pw = prepared if prepared is not None else PreparedWeight.of(w)
    nb, _, n = pw.wt.shape
    lead, k = x.shape[:-1], x.shape[-1]
    xd = F.pad(x.reshape(-1, k).double(), (0, nb * LINEAR_BLOCK - k)).view(-1, nb, LINEAR_BLOCK)
    xb, xs = _block_range(xd)                                                     # [M, nb]
    bits = _significant_bits(x) + pw.bits
    fast = ((xb * pw.big) <= (xs * pw.small) * 2.0 ** (47 - bits)).all(-1)       # [M] exact block sums
    out = torch.empty(xd.shape[0], n, dtype=torch.float32, device=x.device)
    rows_fast = fast.nonzero().flatten()
    if rows_fast.numel():
        a = xd[rows_fast].transpose(0, 1)                                         # [nb, m, 32]
        step = _budget_rows(n * nb * 8)
        for r0 in range(0, a.shape[1], step):
            parts = torch.bmm(a[:, r0:r0 + step], pw.wt).permute(1, 2, 0) + 0.0  # [r, N, nb] exact
            out[rows_fast[r0:r0 + step]] = tree_sum(parts).float()
    rows_slow = (~fast).nonzero().flatten()
    if rows_slow.numel():
        cols = _budget_rows(nb * LINEAR_BLOCK * 8)
        for c0 in range(0, n, cols):
            wc = pw.wt[:, :, c0:c0 + cols]                                        # [nb, 32, c]
            step = _budget_rows(wc.shape[-1] * nb * LINEAR_BLOCK * 8)
            for r0 in range(0, rows_slow.numel(), step):
                rows = rows_slow[r0:r0 + step]
                # each block's exact products [r, nb, 32, c] by its pairwise tree, + 0 -> [r, nb, c]
                parts = list_dot(xd[rows].unsqueeze(-1), wc.unsqueeze(0), dim=2)
                out[rows.unsqueeze(1), torch.arange(c0, c0 + wc.shape[-1], device=x.device)] = \
                    tree_sum(parts, dim=1).float()
    return out.to(out_dtype or x.dtype).view(*lead, n)


def block_partials(a: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """Per-block partial sums of an FP8/FP4 GEMM: a [M, K] (dequantised FP8 activations) and the weight laid
    out as PreparedWeight.wt [K/32, 32, N] -> [M, N, K/32] fp32. Each partial is exact in fp64 (see the
    module docstring), so the BLAS order does not matter; it is then rounded once to fp32."""
    nb, block, _ = wt.shape
    ab = a.double().view(a.shape[0], nb, block).transpose(0, 1)    # [nb, M, b]
    return torch.bmm(ab, wt).permute(1, 2, 0).float()              # [M, N, nb]


def dot(a: torch.Tensor, b: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """sum over `dim` of a * b, products exact in fp64 (operands of at most 24 significant bits), reduced by
    tree_sum; fp64 out (the caller rounds once)."""
    return tree_sum(a.double() * b.double(), dim)


def quant_gemm(x: torch.Tensor, prepared: PreparedWeight, act_quant, par=None) -> torch.Tensor:
    """The FP8/FP4 GEMM at the reference's rounding points (act_quant of x per 32, bf16 output) with exact
    per-block partials and a tree over the blocks. x [..., K] -> [..., N] bf16; `prepared`: the dequantised
    weight laid out once (PreparedWeight.of). `par` given: the K dimension is split over its ranks (a
    row-parallel layer) and the tree continues across them."""
    block = LINEAR_BLOCK
    q, s = act_quant(x, block)
    lead, k = x.shape[:-1], x.shape[-1]
    a = (q.float().unflatten(-1, (k // block, block)) * s.unsqueeze(-1)).reshape(-1, k)   # [M, K] exact
    n = prepared.wt.shape[-1]
    out = torch.empty(a.shape[0], n, dtype=torch.float32, device=x.device)
    rows = _budget_rows(n * (k // block) * 12)
    for r0 in range(0, a.shape[0], rows):
        parts = block_partials(a[r0:r0 + rows], prepared.wt)           # [r, N, K/b] fp32
        out[r0:r0 + rows] = tree_sum(parts) if par is None else tree_sum_split(parts, par)
    return out.to(torch.bfloat16).view(*lead, n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) in fp32, x's dtype out (the mean by tree_sum)."""
    u = x.float()
    u = u * rsqrt(tree_mean(u * u, -1, keepdim=True) + eps)
    return (weight.float() * u).to(x.dtype)


def canonical_lists(idx: torch.Tensor) -> torch.Tensor:
    """Index lists in a canonical layout: the valid entries first, in their list order, then -1, trimmed to
    the longest valid run of the batch. Prefill, decode and extend write the same entries in the same order
    but put the empty slots in different places and use lists of different lengths; a pairwise tree over
    the compacted list gives the same sums whatever the padding (adding +0 changes nothing but -0)."""
    order = torch.sort((idx < 0).to(torch.int8), dim=-1, stable=True).indices
    idx = idx.gather(-1, order)
    n = int((idx >= 0).sum(-1).max()) if idx.numel() else 0
    return idx[..., :max(n, 1)]


def list_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over a canonical list: one pairwise tree (no chunking, so trailing padding does not change it),
    and +0 so that a -0 result does not depend on the padding either."""
    return _pairwise(x, dim) + 0.0


def list_dot(a: torch.Tensor, b: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """list_sum(a * b, dim) for operands of the same rank (broadcast) whose products are exact, without the
    tensor of all products: the tree's first level is formed as a[2i] b[2i] + a[2i+1] b[2i+1] (one rounding,
    as the tree's addition of two exact products), an odd last product + 0, as the padding gives."""
    d = dim % a.dim()
    n = a.shape[d]
    half, odd = n // 2, n % 2

    def take(t, k):                             # t's entries 2i + k along d, i < half (as in _pairwise)
        return t[(slice(None),) * d + (slice(k, 2 * half, 2),)]

    shape = torch.broadcast_shapes(a.shape, b.shape)
    y = torch.empty(shape[:d] + (half + odd,) + shape[d + 1:], dtype=torch.promote_types(a.dtype, b.dtype),
                    device=a.device)
    first = y.narrow(d, 0, half)
    torch.mul(take(a, 0), take(b, 0), out=first)
    first.addcmul_(take(a, 1), take(b, 1))
    if odd:
        torch.mul(a.narrow(d, n - 1, 1), b.narrow(d, n - 1, 1), out=y.narrow(d, half, 1)).add_(0.0)
    return list_sum(y, d)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                q_block: int = 64) -> torch.Tensor:
    """Sparse attention with a sink over canonical index lists (see canonical_lists), in one pass: the
    scores q . k by `linear` against every KV row (then gathered), the max over the whole list, p = exp(s -
    max) rounded to bf16 before P.V (relative to the list's max, not to a running max: a running max
    depends on where chunk boundaries fall), the denominator by list_sum and P.V by list_dot.
    q [B, M, H, D], kv [B, N, D], sink [H], idx [B, M, T] -> [B, M, H, D]."""
    b, m, h, d = q.shape
    out = torch.empty_like(q)
    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    for m0 in range(0, m, q_block):
        qb = q[:, m0:m0 + q_block]
        mb = qb.shape[1]
        ic = canonical_lists(idx[:, m0:m0 + q_block]).long()              # [B, Mb, T]
        valid = (ic >= 0).unsqueeze(2)                                    # [B, Mb, 1, T]
        every = torch.stack([linear(qb[i].reshape(-1, d), kv[i], torch.float32) for i in range(b)])
        every = every.view(b, mb, h, -1)                                  # [B, Mb, H, N]
        s = every.gather(-1, ic.clamp_min(0).unsqueeze(2).expand(-1, -1, h, -1)) * scale   # [B, Mb, H, T]
        s = s.masked_fill(~valid, float("-inf"))
        mx = s.amax(-1).clamp_min(-1e30)                                  # [B, Mb, H] (exact)
        p = exp(s - mx.unsqueeze(-1))                                     # 0 where masked
        den = list_sum(p) + exp(sink.float().view(1, 1, h) - mx)
        rows = kv[batch, ic.clamp_min(0)]                                 # [B, Mb, T, D]
        # P.V: the products [B, Mb, H, T, D] are exact in fp64, never formed all at once
        pv = list_dot(p.to(kv.dtype).double().unsqueeze(-1), rows.double().unsqueeze(2), dim=-2)
        # pv: [B, Mb, H, D] fp64
        out[:, m0:m0 + q_block] = (pv.float() / den.unsqueeze(-1)).to(q.dtype)
    return out


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                      iters: int, eps: float):
    """The reference's Sinkhorn split with invariant sigmoid, softmax and sums."""
    pre = sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mixes[..., 2 * hc:].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = softmax(comb, -1) + eps
    comb = comb / (tree_sum(comb, -2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (tree_sum(comb, -1, keepdim=True) + eps)
        comb = comb / (tree_sum(comb, -2, keepdim=True) + eps)
    return pre, post, comb


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, par=None) -> torch.Tensor:
    """sum_h ReLU(q_h . k) * w_h: per-head scores rounded to bf16, products rounded to bf16 (the reference's
    rounding points), the head sum by tree_sum in fp32 and rounded once. q [B, S, H, D], keys [B, T, D],
    w [B, S, H] -> [B, S, T] bf16. `par` given: the heads are split over its ranks (no further all-reduce)."""
    b, s, h, d = q.shape
    t = keys.shape[1]
    out = torch.empty(b, s, t, dtype=torch.bfloat16, device=q.device)
    rows = _budget_rows(h * t * 16)
    for i in range(b):
        for s0 in range(0, s, rows):
            qs = q[i, s0:s0 + rows]                                        # [r, H, D]
            score = linear(qs.reshape(-1, d), keys[i], q.dtype).view(qs.shape[0], h, t).relu()
            prod = (score * w[i, s0:s0 + rows].unsqueeze(-1)).float()      # bf16 products, widened
            summed = tree_sum(prod, dim=1) if par is None else tree_sum_split(prod, par, dim=1)
            out[i, s0:s0 + rows] = summed.to(q.dtype)
    return out


# pi / 2 in three parts, the first two with few enough bits that k * part is exact for |k| < 2^20
_PIO2_1 = 1.57079632673412561417e+00
_PIO2_2 = 6.07710050650619224932e-11
_PIO2_3 = 2.02226624879595063154e-21


def _sincos64(x: torch.Tensor):
    """(sin x, cos x) for fp64 |x| < 2^20, from basic operations (range reduction by pi/2, Taylor series)."""
    k = torch.round(x * (2.0 / math.pi))
    r = ((x - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3           # |r| <= pi/4 (a hair more)
    r2 = r * r
    sin_p = torch.full_like(r, 1.0 / math.factorial(19))
    for n in range(17, 0, -2):
        sin_p = sin_p * r2 * (-1.0) + 1.0 / math.factorial(n)         # alternating series in r^2
    sin_r = r * sin_p
    cos_p = torch.full_like(r, 1.0 / math.factorial(20))
    for n in range(18, -1, -2):
        cos_p = cos_p * r2 * (-1.0) + 1.0 / math.factorial(n)
    cos_r = cos_p
    q = torch.remainder(k, 4.0)
    sin_x = torch.where(q == 0, sin_r, torch.where(q == 1, cos_r, torch.where(q == 2, -sin_r, -cos_r)))
    cos_x = torch.where(q == 0, cos_r, torch.where(q == 1, -sin_r, torch.where(q == 2, -cos_r, sin_r)))
    return sin_x, cos_x


def pow_(base: float, e: torch.Tensor) -> torch.Tensor:
    """base ** e in fp64 from basic operations (exp of e * ln base), e any fp64 tensor, base > 0."""
    return _exp64(e * _log64(torch.tensor(float(base), dtype=torch.float64)))


def rope_table(freqs_fp32: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """cos / sin table [max_seq_len, n, 2] fp32 of the angles t * f (fp32 products, as the reference forms
    them), evaluated in fp64 from basic operations and rounded once."""
    t = torch.arange(max_seq_len, dtype=torch.float32)
    angles = torch.outer(t, freqs_fp32.float().cpu()).double()        # exact fp32 products, widened
    sin, cos = _sincos64(angles)
    return torch.stack([cos, sin], dim=-1).float()


def rotate(x: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """(x0 + i x1) * (c +- i s) with separate fp32 products and sums (a complex multiply may be fused
    differently by each vector unit). x [..., n, 2] fp32, cos_sin broadcastable [..., n, 2]."""
    c, s = cos_sin[..., 0], cos_sin[..., 1]
    if inverse:
        s = -s
    x0, x1 = x[..., 0], x[..., 1]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)


# ---------------------------------------------------------------------------------------------------------
# The invariant order behind the numerics interface
# ---------------------------------------------------------------------------------------------------------

class Invariant(Numerics):
    """Every reduction in the canonical tree, every transcendental function from basic operations, GEMMs with
    exact products (see the module docstring). Weights are laid out once (PreparedWeight) and kept in their
    module's Derived instead of an fp32 copy. The quantizers are the exact order's (they reduce only by max,
    which any order computes alike)."""

    name = "invariant"
    rows_independent = True

    def _prepared(self, held) -> PreparedWeight:
        return held.derived.get(held.weight, "invariant", lambda: PreparedWeight.of(exact_weight(held)))

    def linear(self, held, x):
        if self.golden or held.scale is None:
            return linear(x.float() if self.golden else x, None, prepared=self._prepared(held))
        return quant_gemm(x, self._prepared(held), reference.act_quant)

    def row_parallel_linear(self, held, x, par):
        """FP8/FP4 weights: the sum over K continues across the ranks, in its tree (no all-reduce after)."""
        if self.golden or held.scale is None:
            return super().row_parallel_linear(held, x, par)
        return quant_gemm(x, self._prepared(held), reference.act_quant, par=par)

    def dense(self, x, w, derived, key=None):
        prepared = derived.get(w if key is None else key, "invariant", lambda: PreparedWeight.of(w))
        return linear(x, None, prepared=prepared)

    def grouped_linear(self, x, weight, groups, derived):
        per_group = derived.get(weight, "invariant-groups",
                                lambda: [PreparedWeight.of(w) for w in weight.view(groups, -1, x.shape[-1])])
        return torch.stack([linear(x[:, :, g], None, prepared=p) for g, p in enumerate(per_group)], 2)

    def sum(self, x, dim, keepdim=False):
        return tree_sum(x, dim, keepdim)

    def mean(self, x, dim, keepdim=False):
        return tree_mean(x.float(), dim, keepdim).to(x.dtype)

    def rsqrt(self, x):
        return rsqrt(x)

    def sigmoid(self, x):
        return sigmoid(x)

    def silu(self, x):
        return silu(x)

    def softplus(self, x):
        return softplus(x)

    def softmax(self, x, dim):
        return softmax(x, dim)

    def pow(self, base, e):
        return pow_(base, e.double()).float()

    def rope_table(self, freqs, max_seq_len):
        """A real table [max_seq_len, n, 2] of cos, sin (see rope_table)."""
        if freqs.is_meta:
            return torch.empty(max_seq_len, freqs.shape[0], 2, device="meta")
        return rope_table(freqs, max_seq_len).to(freqs.device)

    def rotate(self, pairs, table, inverse=False):
        return rotate(pairs, table, inverse)

    def exponential_like(self, p, generator=None):
        """-log(U) of the generator's uniform bits (exponential_ evaluates its log with the vector unit's
        rounding)."""
        u = torch.rand(p.shape, generator=generator, dtype=torch.float64, device=p.device)
        return (-_log64(1.0 - u)).float()

    def sparse_attn(self, q, kv, sink, idx, scale):
        return sparse_attn(q, kv, sink, idx, scale)

    def hc_split_sinkhorn(self, mixes, scale, base, hc, iters, eps):
        return hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)

    def index_scores(self, q, keys, w, par, visible=None):
        """The head sum continues across the ranks in its tree (no all-reduce after); every score made."""
        return index_scores(q, keys, w, par)

    def act_quant(self, x, block=32):
        return reference.act_quant(x, block)

    def _fp8_qdq_(self, x, block):
        return reference.fp8_qdq_(x, block)

    def _fp4_qdq_e8m0_(self, x, block):
        return reference.fp4_qdq_e8m0_(x, block)

    def _fp4_qdq_e4m3_(self, x, block):
        return reference.fp4_qdq_e4m3_(x, block)

    def combine_experts(self, out, idx, par):
        """Each selection's output in its own slot [N, k, D]: summed over the ranks (exact: one rank holds
        each slot, the others add zeros), then tree_sum over the slots in increasing expert index. No sum
        depends on the world size or on which tokens share an expert."""
        out = par.all_reduce(out.float())
        out = out.gather(1, idx.argsort(dim=1).unsqueeze(-1).expand(-1, -1, out.shape[-1]))
        return tree_sum(out, dim=1)
