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
softmax is rebuilt from a cumulative max over the chunk maxima, P.V is one batched matmul over the chunks;
the only loops left run over query blocks of a prefill (bounding memory) and Sinkhorn's fixed iteration
count (sequential by nature; the fused kernel is the fast path there).

Memory: a non-expert FP8/FP4 weight is dequantised once and kept in the compute dtype (in its Derived):
bf16 on CUDA, 2 bytes per weight next to its 1 (FP8) or 0.5 (FP4) stored bytes (released config: 6.0 G
such weights, an 11.1 GiB cache at W = 1); fp32 on CPU, 4 bytes per weight, as the exact path has always
cached. Routed experts are not cached off CPU: a decode step stacks and dequantises only the experts it
selects (fixed_shape_experts; released config, batch 1: 6 experts x 3 matrices of 5120 x 2304, 0.4 GiB of
bf16 for the duration of one layer), a prefill each active expert once per call.

Measured on the reference-tiny fixture, teacher-forced (the prompt, then 20 single-token steps), on CPU:
    fast vs exact:                 logits max |d| 0.094, mean |d| 0.016; same argmax at 20 of 21 steps
    fast vs the reference logits:  max |d| 0.134, mean |d| 0.018 (exact: 0.156 / 0.016 on this CPU)
    argmax vs the reference:       20 of 21 steps; the one miss has a reference top-1/top-2 margin of 0.015
    one thread, ms per decode step: fixture 35 (exact ~80); inference.tools.bench tiny (129k vocabulary,
    fp32 head) 76-87 at context 256 (exact 134-148), 95-105 at 1024 (exact 170-196); prefill 1.4-2x faster.
tests/test_kernels_dispatch.py asserts max |d| <= 0.25, mean |d| <= 0.03 against the reference logits and
the same argmax wherever the reference's top-1/top-2 margin exceeds 0.5, and bounds per kernel derived
from the arithmetic.
"""
import torch
import torch.nn.functional as F

from ..quant import e2m1_values, ue8m0_to_float
from .reference import CHUNK, Exact, act_quant

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


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Stored weight -> its exact value in `dtype`, over any leading (expert) dims.
    fp8: E4M3 [..., N, K] with UE8M0 [..., ceil(N/32), ceil(K/32)]; fp4: packed [..., N, K/2] with UE8M0
    [..., N, K/32]; bf16 / fp32 kinds (scale None) are only cast."""
    if scale is None:
        return weight.to(dtype)
    s = ue8m0_to_float(scale).to(dtype)
    if kind == "fp8":
        n, k = weight.shape[-2:]
        s = s.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]   # [..., N, K]
        return weight.to(dtype) * s
    b = weight.view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2).long()   # [..., N, K], low nibble first
    values = e2m1_values(weight.device, dtype)[codes]
    return values * s.repeat_interleave(BLOCK, -1)


def quant_act(x: torch.Tensor, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """act_quant(x) dequantised: e4m3(x / s) * s per `block`, exact in bf16 and fp32. [..., K] -> [..., K]."""
    q, s = act_quant(x, block)
    return (q.to(dtype).unflatten(-1, (-1, block)) * s.to(dtype).unsqueeze(-1)).flatten(-2)


def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """FP8 x FP8 / FP8 x FP4 GEMM semantics with one matmul: x [..., K] bf16, w [N, K] dequantised in the
    compute dtype -> [..., N] bf16. Same products as reference.block_scaled_gemm, summed in the GEMM's order
    instead of per 32-block partials in K order."""
    a = quant_act(x, w.dtype)                                       # [..., K]
    lead = a.shape[:-1]
    y = matmul_fp32(a.reshape(-1, a.shape[-1]), w.t())             # [M, N] fp32
    return y.to(torch.bfloat16).view(*lead, w.shape[0])


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
    product of the per-step factors (same value, fp32-level rounding apart)."""
    m = q.shape[1]
    if m <= q_block:
        return _attend(q, kv, sink, idx, scale)
    out = torch.empty_like(q)
    for m0 in range(0, m, q_block):  # prefill only: bounds the gathered KV memory
        out[:, m0:m0 + q_block] = _attend(q[:, m0:m0 + q_block], kv, sink, idx[:, m0:m0 + q_block], scale)
    return out


def _attend(q, kv, sink, idx, scale):
    b, m, h, d = q.shape
    t = idx.shape[-1]
    nc = max(1, -(-t // CHUNK))
    idx = F.pad(idx, (0, nc * CHUNK - t), value=-1).long()          # [B, M, T'], T' = nc * 64
    valid = idx >= 0
    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    rows = kv[batch, idx.clamp_min(0)]                              # [B, M, T', D]
    s = matmul_fp32(q, rows.transpose(-1, -2)) * scale              # [B, M, H, T'] fp32, exact products
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf")).unflatten(-1, (nc, CHUNK))   # [B, M, H, nc, 64]
    run = torch.cummax(s.amax(-1), dim=-1).values.clamp_min(-1e30)  # [B, M, H, nc] running max, as the kernel
    p = torch.exp(s - run.unsqueeze(-1))                            # [B, M, H, nc, 64]
    last = run[..., -1]                                             # [B, M, H]
    rescale = torch.exp(run - last.unsqueeze(-1))                   # [B, M, H, nc]
    den = (p.sum(-1) * rescale).sum(-1) + torch.exp(sink.float().view(1, 1, h) - last)
    pc = p.to(kv.dtype).permute(0, 1, 3, 2, 4)                      # [B, M, nc, H, 64], the kernel's P cast
    pv = matmul_fp32(pc, rows.unflatten(2, (nc, CHUNK)))            # [B, M, nc, H, D] fp32
    acc = (pv * rescale.transpose(-1, -2).unsqueeze(-1)).sum(2)     # [B, M, H, D]
    return (acc / den.unsqueeze(-1)).to(q.dtype)


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor,
                 max_elems: int = 1 << 26) -> torch.Tensor:
    """reference.index_scores with explicit rounding points: per-head q.k accumulated in fp32 and rounded to
    bf16, ReLU, times w rounded to bf16, summed over heads in fp32 and rounded to bf16.
    q [B, S, H, D], keys [B, T, D], w [B, S, H] -> [B, S, T] bf16. Query chunks in long prefills only."""
    b, s, h, _ = q.shape
    rows = max(1, max_elems // max(1, b * h * keys.shape[1]))
    parts = []
    for s0 in range(0, s, rows):
        qc = q[:, s0:s0 + rows]                                     # [B, s', H, D]
        score = matmul_fp32(qc.flatten(1, 2), keys.transpose(-1, -2)).to(q.dtype)   # [B, s'*H, T]
        score = score.unflatten(1, (qc.shape[1], h)).relu_() * w[:, s0:s0 + rows].unsqueeze(-1)
        parts.append(score.float().sum(dim=2).to(w.dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def moe_decode(x: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
               w2: torch.Tensor, quantize: bool, swiglu) -> torch.Tensor:
    """Routed experts of one decode step: one batched GEMM per projection over the A experts the step uses.

    x [N, D] bf16; slot [N, k]: each selection's index into the stacked experts (-1 = another rank's expert);
    weights [N, k] fp32; w1 / w3 [A, I, D] and w2 [A, D, I]: the dequantized weights of those experts;
    quantize: FP8/FP4 experts (act_quant before each GEMM) rather than bf16 ones.
    `swiglu(gate, up, weights)` is the expert activation (clamps, SiLU, routing weight) -> fp32.
    Returns [N, k, D] bf16, zero for other ranks' selections. Each of the A experts runs on all N tokens
    (N is the decode batch): each weight is read once, and since act_quant works per row, the rows kept are
    the numbers a per-expert loop over its own tokens forms."""
    n, k = slot.shape
    g = w1.shape[0]                                                 # A
    tok = torch.arange(n, device=x.device).unsqueeze(1).expand(n, k)
    take = torch.where(slot >= 0, slot, g)                          # [N, k]; row A is a zero dummy
    xs = x.unsqueeze(0).expand(g, n, x.shape[-1])                   # [A, N, D]
    gate = grouped_gemm(xs, w1, quantize)[slot.clamp_min(0), tok]   # [N, k, I]
    up = grouped_gemm(xs, w3, quantize)[slot.clamp_min(0), tok]
    h = swiglu(gate, up, weights.unsqueeze(-1)).to(x.dtype)         # [N, k, I]
    hs = h.new_zeros(g + 1, n, h.shape[-1])                         # [A + 1, N, I]; a token selects an
    hs[take, tok] = h                                               # expert at most once
    out = grouped_gemm(hs[:g], w2, quantize)                        # [A, N, D]
    return F.pad(out, (0, 0, 0, 0, 0, 1))[take, tok]                # [N, k, D]


def fixed_shape_experts(stacked, kind: str, start: int, n_local: int, x: torch.Tensor, weights: torch.Tensor,
                        idx: torch.Tensor, swiglu) -> torch.Tensor:
    """The routed experts of a decode step (or a small call) with every shape fixed by N, k and the number of
    local experts E (no host sync): stacked {projection: (weights [E, ...], scales [E, ...] or None)}, this
    rank's experts start..start + E of `kind`; x [N, D], weights and idx [N, k]; `swiglu(gate, up, weights)`
    the expert activation -> [N, k, D] bf16, zero for other ranks' experts. With N k <= E, each selection's
    expert weights are gathered (bytes) and dequantised, one batched GEMM per projection over the N k
    selections; otherwise every local expert runs on every token (moe_decode), which reads no weight twice."""
    n, k = idx.shape
    own = (idx >= start) & (idx < start + n_local)                                   # [N, k]
    local = torch.where(own, idx - start, 0)                                         # [N, k]
    quantize, dtype = stacked["w1"][1] is not None, compute_dtype(x.device)

    def weights_of(name, rows=None):     # dequantised [A, out, in] of the stacked experts `rows` (all)
        w, s = stacked[name]
        if rows is not None:
            w = w.view(torch.uint8)[rows].view(w.dtype)
            s = None if s is None else s.view(torch.uint8)[rows].view(s.dtype)
        return dequant_weight(w, s, kind, dtype)

    if n * k <= n_local:
        sel = local.flatten()                                                        # [N k]
        xs = x.repeat_interleave(k, dim=0).unsqueeze(1)                              # [N k, 1, D]
        gate = grouped_gemm(xs, weights_of("w1", sel), quantize)                     # [N k, 1, I]
        up = grouped_gemm(xs, weights_of("w3", sel), quantize)
        h = swiglu(gate, up, weights.reshape(-1, 1, 1)).to(x.dtype)
        out = grouped_gemm(h, weights_of("w2", sel), quantize).view(n, k, -1)        # [N, k, D]
    else:
        out = moe_decode(x, torch.where(own, local, -1), weights, weights_of("w1"), weights_of("w3"),
                         weights_of("w2"), quantize, swiglu)
    return torch.where(own.unsqueeze(-1), out, 0)


# ---- the fast order behind the numerics interface ----

class Fast(Exact):
    """Loop-free torch at the reference's rounding points: GEMMs on weights dequantised once into the compute
    dtype, batched attention and index scores; on a GPU, a decode step's routed experts from batched GEMMs on
    the experts it selects (fixed_shape_experts, applied by moe.StackedExperts)."""

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
                                 lambda: dequant_weight(held.weight, held.scale, held.kind, dtype))

    def quant_linear(self, held, x):
        return gemm(x, self.dequantized(held, compute_dtype(x.device)))

    def sparse_attn(self, q, kv, sink, idx, scale):
        return sparse_attn(q, kv, sink, idx, scale)

    def local_index_scores(self, q, keys, w):
        return index_scores(q, keys, w)
