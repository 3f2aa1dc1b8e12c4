"""Loop-free torch kernels: every rounding point of the reference, another summation order.

The fast order (class Fast at the end; inference/kernels/numerics.py has the interface): the torch path on
CUDA when the tilelang kernels are absent or off, and on CPU with `--numerics fast`. It keeps every rounding
point of the reference (act_quant before each FP8/FP4 GEMM, bf16 GEMM outputs, FP8/FP4 cache round trips,
probabilities rounded to bf16 before P.V relative to the running max of their 64-entry chunk, bf16 indexer
scores) and differs only in the order in which fp32 sums are formed. Why the products are the same numbers: an
E4M3 value times a power-of-two scale, and an E2M1 value times a UE8M0 scale, are exact in bf16 (<= 4
significant bits), and the product of two such values is exact in fp32 (<= 8 of its 24 bits); so a GEMM of the
dequantised activation and weight accumulated in fp32 forms exactly the reference's products.

No Python loop here grows with head_dim, the number of K blocks, the number of experts or the number of
tokens of a decode step: a GEMM is one matmul; attention scores are one batched matmul, the chunked online
softmax is rebuilt from a cumulative max over the chunk maxima, P.V is one batched matmul over the chunks (on
the CPU a prefill's block of queries scores and sums over the union of the rows they attend to, one GEMM
each); the only loops left run over query blocks of a prefill (bounding memory) and Sinkhorn's fixed
iteration count (sequential by nature; the fused kernel is the fast path there).

Memory: a non-expert FP8/FP4 weight is dequantised once and kept in the compute dtype (in its Derived):
bf16 on CUDA, 2 bytes per weight next to its 1 (FP8) or 0.5 (FP4) stored bytes (released config: 6.0 G
such weights, an 11.1 GiB cache at W = 1); fp32 on CPU, 4 bytes per weight, as the exact path has always
cached. Routed experts are not cached off CPU: a decode step stacks and dequantises only the experts it
selects (fixed_shape_experts; released config, batch 1: 6 experts x 3 matrices of 5120 x 2304, 0.4 GiB of
bf16 for the duration of one layer), a prefill each active expert once per call.

Measured on the reference-tiny fixture, teacher-forced (the prompt, then 20 single-token steps), on CPU, one
thread (docs/numerics.md §16.3):
    fast vs exact:                 logits max |d| 0.105, mean |d| 0.015; same argmax at 20 of 21 steps (the
                                   miss where exact's top-1/top-2 margin is 0.015)
    fast vs the reference logits:  max |d| 0.147, mean |d| 0.016 (exact: 0.156 / 0.016 on this CPU)
    argmax vs the reference:       21 of 21 steps
    one thread, ms per decode step: fixture 35 (exact ~80); inference.tools.bench tiny (129k vocabulary,
    fp32 head) 76-87 at context 256 (exact 134-148), 95-105 at 1024 (exact 170-196); prefill 1.4-2x faster.
tests/test_kernels_dispatch.py asserts max |d| <= 0.25, mean |d| <= 0.03 against the reference logits and
the same argmax wherever the reference's top-1/top-2 margin exceeds 0.5, and bounds per kernel derived
from the arithmetic.
"""
import torch
import torch.nn.functional as F

from ..quant import FP4_MAX, CodeTables, block_amax, e2m1_round, fp8_block_codes, pow2_scale
from .reference import CHUNK, Exact

BLOCK = 32


def compute_dtype(device: torch.device) -> torch.dtype:
    """Dtype of dequantised operands: bf16 on GPUs (fp32 accumulation is asked of the GEMM), fp32 on CPU
    (CPU bf16 GEMMs are slow and their accumulation is not specified)."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] accumulated in fp32, fp32 out. bf16 CUDA operands go to the GEMM with
    an fp32 output (no reduced-precision split-K reduction); everything else is widened to fp32 first."""
    if a.is_cuda and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        lead = a.shape[:-2]
        if not lead:
            return torch.mm(a, b, out_dtype=torch.float32)
        a3, b3 = a.reshape(-1, *a.shape[-2:]), b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
        return torch.bmm(a3, b3, out_dtype=torch.float32).view(*lead, a.shape[-2], b.shape[-1])
    return torch.matmul(a.float(), b.float())


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor, kind: str, dtype: torch.dtype,
                   tables: CodeTables = None) -> torch.Tensor:
    """Stored weight -> its exact value in `dtype`, over any leading (expert) dims.
    fp8: E4M3 [..., N, K] with UE8M0 [..., ceil(N/32), ceil(K/32)]; fp4: packed [..., N, K/2] with UE8M0
    [..., N, K/32]; bf16 / fp32 kinds (scale None) are only cast. `tables`: the device's CodeTables."""
    if scale is None:
        return weight.to(dtype)
    s = scale.view(torch.float8_e8m0fnu).to(dtype)                 # exact powers of two
    if kind == "fp8":
        n, k = weight.shape[-2:]
        if n % BLOCK == 0 and k % BLOCK == 0:                      # each 32 x 32 block times its scale
            w = weight.to(dtype).unflatten(-1, (k // BLOCK, BLOCK)).unflatten(-3, (n // BLOCK, BLOCK))
            return (w * s.unsqueeze(-1).unsqueeze(-3)).flatten(-2).flatten(-3, -2)
        s = s.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]   # [..., N, K]
        return weight.to(dtype) * s
    values = (tables or CodeTables(weight.device)).fp4(weight, dtype)       # [..., N, K]
    return (values.unflatten(-1, (-1, BLOCK)) * s.unsqueeze(-1)).flatten(-2)


def quant_act(x: torch.Tensor, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """act_quant(x) dequantised: e4m3(x / s) * s per `block`, exact in bf16 and fp32. [..., K] -> [..., K].
    The same values as reference.act_quant's in fewer operations (7 on a GPU: quant.fp8_block_codes, then
    the codes times their scales)."""
    g = x.unflatten(-1, (-1, block))                                                 # [..., K/b, b]
    q, s = fp8_block_codes(g, block_amax(g))                                         # [..., K/b, b], [.., 1]
    return q.to(dtype).mul_(s).flatten(-2)           # e4m3 x 2^k is exact in bf16: no rounding to move


def gemm(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor = None) -> torch.Tensor:
    """FP8 x FP8 / FP8 x FP4 GEMM semantics with one matmul: x [..., K] bf16, w [N, K] dequantised in the
    compute dtype -> [..., N] bf16 (`a`: quant_act(x, w.dtype) when already made). Same products as
    reference.block_scaled_gemm, summed in the GEMM's order instead of per 32-block partials in K order."""
    a = quant_act(x, w.dtype) if a is None else a                   # [..., K]
    y = matmul_fp32(a.reshape(-1, a.shape[-1]), w.t())             # [M, N] fp32
    return y.to(torch.bfloat16).view(*x.shape[:-1], w.shape[0])


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, quantize: bool) -> torch.Tensor:
    """One matmul for a group of weights: x [G, M, K] bf16, w [G, N, K] -> [G, M, N] bf16, with act_quant
    (FP8/FP4 weights) or without (bf16 weights, plain bf16 GEMM semantics)."""
    a = quant_act(x, w.dtype) if quantize else x.to(w.dtype)
    return matmul_fp32(a, w.transpose(-1, -2)).to(torch.bfloat16)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                q_block: int = 64) -> torch.Tensor:
    """reference.sparse_attn's semantics without its loops: q [B, M, H, D], kv [B, N, D], sink [H],
    idx [B, M, T] (-1 = none) -> [B, M, H, D]. The probabilities of chunk c are exp(s - m_c), m_c the running
    max after chunk c (a cumulative max over chunk maxima), rounded to kv's dtype as the kernel does; each
    chunk's P.V and denominator are then rescaled to the final max with exp(m_c - m_last) rather than by the
    product of the per-step factors (same value, fp32-level rounding apart). A decode step and the GPU take
    _attend (each query's rows gathered); a CPU prefill's query blocks take _attend_shared (their union of
    rows)."""
    m = q.shape[1]
    attend = _attend if q.is_cuda or m == 1 else _attend_shared
    if m <= q_block:
        return attend(q, kv, sink, idx, scale)
    out = torch.empty_like(q)
    for m0 in range(0, m, q_block):  # prefill only: bounds the gathered KV memory
        out[:, m0:m0 + q_block] = attend(q[:, m0:m0 + q_block], kv, sink, idx[:, m0:m0 + q_block], scale)
    return out


def _chunk_probabilities(s: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, dtype: torch.dtype):
    """Scores s [B, M, H, T'] (T' = nc * 64) in each query's index order -> (p [B, M, H, nc, 64] rounded to
    `dtype` as the kernel rounds P, rescale [B, M, H, nc] = exp(m_c - m_last), den [B, M, H])."""
    h = s.shape[2]
    s = torch.where(valid.unsqueeze(2), s, float("-inf")).unflatten(-1, (-1, CHUNK))   # [B, M, H, nc, 64]
    run = torch.cummax(s.amax(-1), dim=-1).values.clamp_min(-1e30)  # [B, M, H, nc] running max, as the kernel
    p = torch.exp(s - run.unsqueeze(-1))                            # [B, M, H, nc, 64]
    last = run[..., -1]                                             # [B, M, H]
    rescale = torch.exp(run - last.unsqueeze(-1))                   # [B, M, H, nc]
    den = (p.sum(-1) * rescale).sum(-1) + torch.exp(sink.float().view(1, 1, h) - last)
    return p.to(dtype), rescale, den


def _attend_shared(q, kv, sink, idx, scale):
    """_attend for a block of queries on the CPU (a prefill): neighbouring queries attend to mostly the same
    KV rows (the window slides by one, the index picks from one pool), so the block's union of rows is
    widened once and scored by one GEMM, instead of each query's 640 rows copied out. The rounding points of
    _attend (P rounded chunk by chunk against the running max); fp32 sums in another order: a score's D
    products in this GEMM's order, and P.V summed over the union with each P already times its chunk's
    rescale."""
    b, m, h, d = q.shape
    t = idx.shape[-1]
    nc = max(1, -(-t // CHUNK))
    idx = F.pad(idx, (0, nc * CHUNK - t), value=-1).long()           # [B, M, T'], T' = nc * 64
    out = torch.empty_like(q)
    for i in range(b):
        rows, where = torch.unique(idx[i].clamp_min(0), return_inverse=True)   # [U], [M, T'] into rows
        kv_u = kv[i, rows].float()                                  # [U, D] the block's rows, widened once
        s_u = torch.mm(q[i].reshape(m * h, d).float(), kv_u.t()).view(m, h, -1)          # [M, H, U]
        s = s_u.gather(-1, where.unsqueeze(1).expand(m, h, -1)) * scale                   # [M, H, T']
        p, rescale, den = _chunk_probabilities(s.unsqueeze(0), idx[i:i + 1] >= 0, sink, kv.dtype)
        w = (p.float() * rescale.unsqueeze(-1)).flatten(-2)[0]       # [M, H, T'] fp32 (invalid: 0)
        p_u = torch.zeros_like(s_u).scatter_add_(-1, where.unsqueeze(1).expand(m, h, -1), w)  # [M, H, U]
        acc = torch.mm(p_u.view(m * h, -1), kv_u).view(m, h, d)     # [M, H, D]
        out[i] = (acc / den[0].unsqueeze(-1)).to(q.dtype)
    return out


def _attend(q, kv, sink, idx, scale):
    b, m, h, d = q.shape
    t = idx.shape[-1]
    nc = max(1, -(-t // CHUNK))
    if nc * CHUNK > t:
        idx = F.pad(idx, (0, nc * CHUNK - t), value=-1)             # [B, M, T'], T' = nc * 64
    idx = idx.long()
    valid = idx >= 0
    if q.is_cuda:        # one launch, the index broadcast along D
        at = idx.clamp_min(0).flatten(1).unsqueeze(-1).expand(-1, -1, d)         # [B, M T', D]
        rows = kv.gather(1, at).view(b, m, -1, d)                   # [B, M, T', D]
    else:                # whole rows copied (a gather reads an index per value: 2-5x slower on the CPU) and
        # widened once here (matmul_fp32 would widen them twice, once transposed: a copy)
        rows = kv[torch.arange(b).view(b, 1, 1), idx.clamp_min(0)].float()      # [B, M, T', D]
    s = matmul_fp32(q, rows.transpose(-1, -2)) * scale              # [B, M, H, T'] fp32, exact products
    p, rescale, den = _chunk_probabilities(s, valid, sink, kv.dtype)
    pc = p.permute(0, 1, 3, 2, 4)                                   # [B, M, nc, H, 64], the kernel's P cast
    pv = matmul_fp32(pc, rows.unflatten(2, (nc, CHUNK)))            # [B, M, nc, H, D] fp32
    acc = (pv * rescale.transpose(-1, -2).unsqueeze(-1)).sum(2)     # [B, M, H, D]
    return torch.div(acc, den.unsqueeze(-1), out=q.new_empty(acc.shape))   # fp32 quotient, rounded as stored


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, max_elems: int = 1 << 26,
                 visible: torch.Tensor = None) -> torch.Tensor:
    """reference.index_scores with explicit rounding points: per-head q.k accumulated in fp32 and rounded to
    bf16, ReLU, times w rounded to bf16, summed over heads in fp32 and rounded to bf16.
    q [B, S, H, D], keys [B, T, D], w [B, S, H] -> [B, S, T] bf16. Query chunks in long prefills only; with
    `visible` [S] (a CPU tensor: the keys each query may see), in eighths of the queries, each scoring only
    the keys its queries see (the rest left 0, for the caller's mask): half the work of a causal prefill."""
    b, s, h, _ = q.shape
    t = keys.shape[1]
    rows = max(1, max_elems // max(1, b * h * t))
    if visible is not None:
        rows = min(rows, max(64, -(-s // 8)))
    out = torch.zeros(b, s, t, dtype=w.dtype, device=q.device) if visible is not None and rows < s else None
    parts = []
    for s0 in range(0, s, rows):
        qc = q[:, s0:s0 + rows]                                     # [B, s', H, D]
        tc = t if out is None else min(t, int(visible[s0:s0 + rows].max()))
        score = matmul_fp32(qc.flatten(1, 2), keys[:, :tc].transpose(-1, -2)).to(q.dtype)   # [B, s'*H, T']
        score = score.unflatten(1, (qc.shape[1], h)).relu_() * w[:, s0:s0 + rows].unsqueeze(-1)
        score = score.float().sum(dim=2).to(w.dtype)               # [B, s', T']
        if out is None:
            parts.append(score)
        else:
            out[:, s0:s0 + rows, :tc] = score
    if out is not None:
        return out
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _bmm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [G, M, K] (already quantised) @ w [G, N, K]^T accumulated in fp32 -> [G, M, N] bf16."""
    return matmul_fp32(a, w.transpose(-1, -2)).to(torch.bfloat16)


def moe_decode(a: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
               w2: torch.Tensor, quantize: bool, swiglu, out_dtype: torch.dtype) -> torch.Tensor:
    """Routed experts of one decode step: one batched GEMM per projection over the A experts the step uses.

    a [N, D]: the tokens' activations as the GEMMs take them (act_quant'ed for FP8/FP4 experts); slot [N, k]:
    each selection's index into the stacked experts (-1 = another rank's expert); weights [N, k] fp32;
    w1 / w3 [A, I, D] and w2 [A, D, I]: the dequantized weights of those experts; quantize: FP8/FP4 experts
    (act_quant before w2 too). `swiglu(gate, up, weights)` is the expert activation (clamps, SiLU, routing
    weight) -> fp32. Returns [N, k, D] bf16, zero for other ranks' selections. Each of the A experts runs on
    all N tokens (N is the decode batch): each weight is read once, and since act_quant works per row, the
    rows kept are the numbers a per-expert loop over its own tokens forms."""
    n, k = slot.shape
    g = w1.shape[0]                                                 # A
    tok = torch.arange(n, device=a.device).unsqueeze(1).expand(n, k)
    take = torch.where(slot >= 0, slot, g)                          # [N, k]; row A is a zero dummy
    xs = a.unsqueeze(0).expand(g, n, a.shape[-1])                   # [A, N, D]
    gate = _bmm(xs, w1)[slot.clamp_min(0), tok]                     # [N, k, I]
    up = _bmm(xs, w3)[slot.clamp_min(0), tok]
    h = swiglu(gate, up, weights.unsqueeze(-1)).to(out_dtype)       # [N, k, I]
    hs = h.new_zeros(g + 1, n, h.shape[-1])                         # [A + 1, N, I]; a token selects an
    hs[take, tok] = h                                               # expert at most once
    hs = quant_act(hs[:g], w2.dtype) if quantize else hs[:g].to(w2.dtype)
    out = _bmm(hs, w2)                                              # [A, N, D]
    return F.pad(out, (0, 0, 0, 0, 0, 1))[take, tok]                # [N, k, D]


def fixed_shape_experts(stacked, kind: str, start: int, n_local: int, n_experts: int, x: torch.Tensor,
                        weights: torch.Tensor, idx: torch.Tensor, swiglu, tables: CodeTables = None,
                        a: torch.Tensor = None) -> torch.Tensor:
    """The routed experts of a decode step (or a small call) with every shape fixed by N, k and the number of
    local experts E (no host sync): stacked {projection: (weights [E, ...], scales [E, ...] or None)}, this
    rank's experts start..start + E (of n_experts) of `kind`; x [N, D], weights and idx [N, k];
    `swiglu(gate, up, weights)` the expert activation -> [N, k, D] bf16, zero for other ranks' experts. The
    tokens' activations are quantised once for every selection (or given: `a`, quant_act(x) in the compute
    dtype, used for FP8/FP4 experts). With N k <= E, each selection's expert
    weights are gathered (bytes) and dequantised, one batched GEMM per projection over the N k selections
    (w1 and w3 as one, when laid out side by side); otherwise every local expert runs on every token
    (moe_decode), which reads no weight twice."""
    n, k = idx.shape
    own = None
    local = idx - start if start else idx                                            # [N, k]
    if n_local < n_experts:                                       # other ranks hold some experts
        own = (local >= 0) & (local < n_local)
        local = torch.where(own, local, 0)
    quantize, dtype = stacked["w1"][1] is not None, compute_dtype(x.device)
    if not quantize:
        a = x.to(dtype)                                                              # [N, D]
    elif a is None:
        a = quant_act(x, dtype)

    def dequantized(w, s, rows=None):    # stacked (w, s) [..., E, out, in] -> rows `rows` (all), dequantised
        if rows is not None:
            w = w.view(torch.uint8)[..., rows, :, :].view(w.dtype)
            s = None if s is None else s.view(torch.uint8)[..., rows, :, :].view(s.dtype)
        return dequant_weight(w, s, kind, dtype, tables)

    halves = _gate_up_halves(stacked)     # w1 and w3 side by side: gathered and dequantised together
    if n * k <= n_local:
        sel = local.flatten()                                                        # [N k]
        if halves is None:
            xs = a.repeat_interleave(k, dim=0).unsqueeze(1)                          # [N k, 1, D]
            gate, up = (_bmm(xs, dequantized(*stacked[p], sel)) for p in ("w1", "w3"))   # [N k, 1, I]
        else:            # one gather, one dequantisation, one batched GEMM for both
            w13 = dequantized(*halves, sel).flatten(0, 1)                            # [2 N k, I, D]
            xs = a[None, :, None].expand(2, n, k, a.shape[-1]).reshape(2 * n * k, 1, -1)   # [2 N k, 1, D]
            gate, up = _bmm(xs, w13).chunk(2)                                        # [N k, 1, I] each
        h = swiglu(gate, up, weights.reshape(-1, 1, 1)).to(x.dtype)
        h = quant_act(h, dtype) if quantize else h.to(dtype)
        out = _bmm(h, dequantized(*stacked["w2"], sel)).view(n, k, -1)              # [N, k, D]
    else:
        w1, w3 = ((dequantized(*stacked[p]) for p in ("w1", "w3")) if halves is None
                  else dequantized(*halves).unbind(0))                               # [E, I, D] each
        out = moe_decode(a, local if own is None else torch.where(own, local, -1), weights, w1, w3,
                         dequantized(*stacked["w2"]), quantize, swiglu, x.dtype)
    return out if own is None else torch.where(own.unsqueeze(-1), out, 0)


def _gate_up_halves(stacked):
    """(weights [2, E, ...], scales [2, E, ...] or None) of which w1 and w3 are the halves [0] and [1]
    (moe.stacked_experts lays them out so), or None for layouts made otherwise."""
    pair = []
    for t1, t3 in zip(stacked["w1"], stacked["w3"]):
        if t1 is None or t3 is None:
            pair.append(None if t1 is None and t3 is None else False)
            continue
        base = t1._base
        side_by_side = (base is not None and t3._base is base and base.dim() == t1.dim() + 1
                        and base.shape[0] == 2 and base.is_contiguous() and t1.shape == base.shape[1:]
                        and t1.storage_offset() == base.storage_offset()
                        and t3.storage_offset() == base.storage_offset() + base.stride(0))
        pair.append(base if side_by_side else False)
    return None if pair[0] is False or pair[1] is False else tuple(pair)


def sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float):
    """reference.hc_split_sinkhorn's computation: the gates and the row softmax (sinkhorn_gates), then the
    passes (sinkhorn_passes). -> pre [..., hc], post [..., hc], comb [..., hc, hc]."""
    pre, post, comb = sinkhorn_gates(mixes, scale, base, hc, eps)
    return pre, post, sinkhorn_passes(comb, iters, eps)


def sinkhorn_gates(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, eps: float):
    """-> pre [..., hc] (sigmoid + eps), post [..., hc] (2 sigmoid), and comb's logits softmaxed by row
    [..., hc, hc], before the Sinkhorn passes."""
    pair = mixes[..., :2 * hc].unflatten(-1, (2, hc))                 # [..., 2, hc]: pre's and post's logits
    gates = torch.sigmoid(torch.addcmul(base[:2 * hc].view(2, hc), pair, scale[:2].view(2, 1))).flatten(-2)
    pre, post = gates[..., :hc] + eps, 2 * gates[..., hc:]
    comb = torch.addcmul(base[2 * hc:], mixes[..., 2 * hc:], scale[2]).unflatten(-1, (hc, hc)).softmax(-1)
    return pre, post, comb


def sinkhorn_passes(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row-softmaxed comb [..., hc, hc] -> doubly stochastic, in two operations per normalisation: comb lives
    in an [hc + 1, hc + 1] frame whose last column and row hold eps, so that a row (column) sum over the frame
    is the sum plus eps, and the [hc, hc] block is divided in place (a view of the frame)."""
    hc = comb.shape[-1]
    frame = F.pad(comb, (0, 1, 0, 1), value=eps)                    # [..., hc + 1, hc + 1]
    block = frame[..., :hc, :hc]
    block.add_(eps)                                                 # row softmax + eps
    block.div_(frame[..., :, :hc].sum(-2, keepdim=True))            # column pass
    for _ in range(iters - 1):
        block.div_(frame[..., :hc, :].sum(-1, keepdim=True))
        block.div_(frame[..., :, :hc].sum(-2, keepdim=True))
    return block


# ---- the fast order behind the numerics interface ----

class Fast(Exact):
    """Loop-free torch at the reference's rounding points: GEMMs on weights dequantised once into the compute
    dtype, batched attention and index scores, the normalisations and the hyper-connections' stream sums as
    one kernel each, Sinkhorn in two operations per normalisation; on a GPU, a decode step's routed experts
    from batched GEMMs on the experts it selects (fixed_shape_experts, applied by experts.StackedExperts)."""

    name = "fast"

    @property
    def gathers_experts(self) -> bool:
        """Batched GEMMs on dequantised stacked experts give this order's numbers (not in golden numerics)."""
        return not self.golden

    def dequantized(self, held, dtype=torch.float32):
        """fp32 as the exact order keeps it; bf16 (the GPU's compute dtype) kept in the layer's Derived
        unless it keeps nothing (routed experts off the CPU: a step dequantises only those it selects)."""
        if dtype == torch.float32:
            return super().dequantized(held, dtype)
        return held.derived.get(held.weight, f"dequantized:{dtype}",
                                 lambda: dequant_weight(held.weight, held.scale, held.kind, dtype,
                                                        self.tables))

    def quant_linear(self, held, x):
        return gemm(x, self.dequantized(held, compute_dtype(x.device)))

    def _fp8_qdq_(self, x, block):
        """quant_act's values written back (reference.fp8_qdq_'s numbers: e4m3 x 2^k is exact in bf16)."""
        return x.copy_(quant_act(x, x.dtype, block))

    def _fp4_qdq_e8m0_(self, x, block):
        """reference.fp4_qdq_e8m0_'s values in fewer operations: the block maxima by one reduction, s from
        their bits (pow2_scale), no clamp (|x / s| <= 6 but for the rounding of amax / 6, which e2m1_round
        takes to 6 as the clamp would)."""
        g = x.unflatten(-1, (-1, block))                                             # [..., K/b, b]
        s = pow2_scale(block_amax(g), 6 * 2.0 ** -126, FP4_MAX)                      # [..., K/b, 1]
        return x.copy_((e2m1_round(g / s) * s).flatten(-2))

    def linears(self, helds, x, a=None):
        """FP8/FP4 Linears that read the same x: its act_quant once (the same numbers: it works per row), or
        `a` (expert_activations) when given."""
        if self.golden or any(h.scale is None for h in helds):
            return super().linears(helds, x)
        dtype = compute_dtype(x.device)
        a = quant_act(x, dtype) if a is None else a
        return tuple(gemm(x, self.dequantized(h, dtype), a) for h in helds)

    def rms_norm(self, x, weight, eps, derived):
        """torch's fused RMSNorm on the fp32 values with the fp32 weight (kept), one cast out."""
        w = derived.get(weight, "float32", weight.float) if weight.dtype != torch.float32 else weight
        return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)

    def hc_mix_logits(self, u, fn, eps, derived):
        """The scalar applied first (torch's fused RMSNorm without a weight), then the GEMM."""
        u = u.float()
        return self.dense(F.rms_norm(u, (u.shape[-1],), None, eps), fn, derived)

    def hc_pre(self, x, pre):
        """One batched product per token: pre [.., 1, hc] @ x [.., hc, D]."""
        return matmul_fp32(pre.unsqueeze(-2), x.float()).squeeze(-2).to(x.dtype)

    def hc_post(self, y, residual, post, comb):
        """post (x) y + comb^T @ R as one batched multiply-add per token."""
        b, s, hc, d = residual.shape
        outer = post.unsqueeze(-1) * y.unsqueeze(-2)       # [B, S, hc, D] fp32 (post is): y widened exactly
        out = torch.baddbmm(outer.view(-1, hc, d), comb.reshape(-1, hc, hc).transpose(-1, -2),
                            residual.float().view(-1, hc, d))
        return out.view(b, s, hc, d).to(y.dtype)

    def hc_split_sinkhorn(self, mixes, scale, base, hc, iters, eps):
        return sinkhorn(mixes, scale, base, hc, iters, eps)

    def sparse_attn(self, q, kv, sink, idx, scale):
        return sparse_attn(q, kv, sink, idx, scale)

    def local_index_scores(self, q, keys, w, visible=None):
        """On the CPU a prefill's query blocks score only the keys they may see (a causal prefill's early
        blocks see few); on a GPU every key (reading `visible` there would wait for the device)."""
        return index_scores(q, keys, w, visible=None if q.is_cuda else visible)

    def expert_activations(self, x):
        """quant_act(x) in the compute dtype: what fixed_shape_experts and linears quantise x to."""
        return None if self.golden else quant_act(x, compute_dtype(x.device))

    def selected_experts(self, stacked, kind, start, n_local, n_experts, x, weights, idx, swiglu, a=None):
        return fixed_shape_experts(stacked, kind, start, n_local, n_experts, x, weights, idx, swiglu,
                                   self.tables, a)

    def combine_experts(self, out, idx, par):
        """The k selections' outputs summed in fp32 in one reduction (not one add per expert in increasing
        index), then the ranks' sums all-reduced."""
        return par.all_reduce(out.sum(1, dtype=torch.float32))
