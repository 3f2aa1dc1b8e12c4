"""The numerics (inference/kernels): the order a model gets, the exact order being the reference kernels,
the fast route's distance from it within bounds derived from the arithmetic, the fast route end to
end on the fixture, and a fast decode step free of Python loops over head_dim, K blocks, experts or tokens.

Bounds. u = 2^-24 is fp32's unit roundoff; a bf16 value's spacing is at most 2^-7 of its magnitude, so
rounding to bf16 moves a value by at most 2^-8 of it. Summing n terms in fp32 in any order lands within
(n - 1) u sum|terms| of the true sum; two orders are therefore within 2 (n - 1) u sum|terms| of each other.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import FIXTURE, ROOT, fixture_file, fixture_model, fixture_tensors
from inference import kernels
from inference.config import ConfigError, ModelArgs, RuntimeOptions
from inference.kernels import fast, reference
from inference.layers import Linear
from inference.moe import stacked_experts
from inference.parallel import ParallelContext
from inference.quant import dequant_fp4_weight, dequant_fp8_weight
from inference.kernels.fast import _gate_up_halves, fixed_shape_experts
from inference.kernels.experts import looped_experts
from inference.state import ForwardCall

U = 2.0 ** -24
CPU_LINE = ("--kernel-backend tilelang needs CUDA tensors on a GPU with compute capability >= 9.0; "
            "these are on cpu")
EXACT, FAST = RuntimeOptions(), RuntimeOptions.from_profile("fast")
NX_EXACT, NX_FAST = kernels.numerics_for(EXACT, "cpu"), kernels.numerics_for(FAST, "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_linear(kind: str, n: int, k: int, gen: torch.Generator, opts=EXACT) -> Linear:
    """A Linear of `kind` with random stored weights and scales around 2^-4, in a model of numerics `opts`."""
    from inference.state import ModelContext
    ctx = ModelContext.build(ModelArgs.from_file(os.path.join(FIXTURE, "config.json"), max_seq_len=8),
                             opts=opts)
    lin = Linear(k, n, kind, ctx)
    with torch.no_grad():
        if kind == "fp8":
            lin.weight.copy_((torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn))
        else:
            lin.weight.view(torch.uint8).copy_(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8,
                                                             generator=gen))
        lin.scale.view(torch.uint8).copy_(torch.randint(119, 125, lin.scale.shape, dtype=torch.uint8,
                                                        generator=gen))
    return lin


# ---- routing ----

def test_auto_picks_torch_on_cpu():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    assert kernels.route(RuntimeOptions(), "cpu") == "exact"
    assert type(NX_EXACT).__name__ == "Exact" and type(NX_FAST).__name__ == "Fast"
    assert type(kernels.numerics_for(RuntimeOptions.from_profile("invariant"), "cpu")).__name__ == "Invariant"
    assert kernels.route(RuntimeOptions(kernel_backend="torch"), x) == "exact"
    assert kernels.route(FAST, x) == "fast" and FAST.order == "fast"
    assert kernels.route(RuntimeOptions(order="fast"), x) == "fast"
    assert RuntimeOptions.from_profile("reference").order == "auto"
    with pytest.raises(ConfigError, match="unknown summation order 'quick'"):
        RuntimeOptions.from_profile("reference", order="quick")
    with pytest.raises(ConfigError, match="unknown kernel backend 'cuda'"):
        RuntimeOptions.from_profile("reference", kernel_backend="cuda")
    # The torch routes never import the tilelang module (nor tilelang): a fresh interpreter runs all of them.
    code = ("import sys, torch; from inference import kernels; from inference.config import RuntimeOptions\n"
            "q = torch.randn(1, 1, 2, 64).bfloat16(); kv = torch.randn(1, 8, 64).bfloat16()\n"
            "idx = torch.arange(8, dtype=torch.int32).view(1, 1, 8)\n"
            "for o in (RuntimeOptions(), RuntimeOptions(order='fast')):\n"
            "    nx = kernels.numerics_for(o, 'cpu')\n"
            "    nx.sparse_attn(q, kv, torch.zeros(2), idx, 0.125); nx.fp8_qdq_(kv.clone())\n"
            "print(sorted(m for m in sys.modules if 'tilelang' in m))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_tilelang_on_cpu_is_one_clear_line(tmp_path):
    opts = RuntimeOptions(kernel_backend="tilelang")
    with pytest.raises(kernels.BackendError) as e:
        kernels.numerics_for(opts, "cpu")
    assert str(e.value) == CPU_LINE and isinstance(e.value, ConfigError)
    with pytest.raises(kernels.BackendError, match="these are on cpu"):
        fixture_model(opts)                                          # refused when the model is built
    with pytest.raises(ConfigError, match="golden"):                 # refused whatever the device
        RuntimeOptions(kernel_backend="tilelang", golden=True)
    proc = subprocess.run(
        [sys.executable, "generate.py", "--threads", "1", "--ckpt-path", fixture_file(FIXTURE),
         "--config", os.path.join(FIXTURE, "config.json"), "--device", "cpu",
         "--score", os.path.join(FIXTURE, "score.json"), "--dump-logits", str(tmp_path / "x.safetensors"),
         "--kernel-backend", "tilelang"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {CPU_LINE}"], proc.stderr


# ---- the exact route is the reference ----

def test_exact_route_is_the_reference_kernels():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 256, generator=gen).bfloat16()
    for kind, deq in (("fp8", dequant_fp8_weight), ("fp4", dequant_fp4_weight)):
        lin = random_linear(kind, 96, 256, gen)
        assert torch.equal(lin(x), reference.block_scaled_gemm(x, deq(lin.weight, lin.scale)))
    q = torch.randn(2, 3, 4, 64, generator=gen).bfloat16()
    kv = torch.randn(2, 150, 64, generator=gen).bfloat16()
    sink, idx = torch.randn(4, generator=gen), torch.randint(-1, 150, (2, 3, 130), generator=gen).int()
    assert torch.equal(NX_EXACT.sparse_attn(q, kv, sink, idx, 0.125),
                       reference.sparse_attn(q, kv, sink, idx, 0.125))
    keys, w = torch.randn(2, 40, 64, generator=gen).bfloat16(), torch.randn(2, 3, 4, generator=gen).bfloat16()
    assert torch.equal(NX_EXACT.index_scores(q, keys, w, ParallelContext.single()),
                       reference.index_scores(q, keys, w))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_scores_are_the_same_sums_three_ways(dtype, monkeypatch):
    """The exact attention's q.k: all products at once added by index_add_ (small, decode-step score sets),
    the native kernel (larger ones: kernels/ordered_dot.c) and the column loop (its specification, the
    fallback) give the same bits, on values spread over 2^+-20 so that any other summation order (here a
    GEMM's) rounds differently."""
    from inference.kernels import native
    assert native.ordered_library() is not None, "the native ordered-dot kernel did not build"
    gen = torch.Generator().manual_seed(3)
    spread = lambda *shape: (torch.randn(*shape, generator=gen) * 2.0 ** torch.randint(-20, 21, shape,
                                                                                     generator=gen)).to(dtype)
    for b, m, h, c, d in ((1, 1, 4, 64, 128), (2, 1, 8, 64, 512), (1, 3, 2, 37, 32)):
        q, rows = spread(b, m, h, d), spread(b, m, c, d).float()
        q_cols = reference._columns(q, -1)
        at_once = reference._dot_in_order(q_cols, rows, dtype == torch.bfloat16, max_sums=1 << 30)
        natively = reference._dot_in_order(q_cols, rows, dtype == torch.bfloat16, max_sums=0)
        monkeypatch.setenv(native.ORDERED_ENV, "torch")
        by_column = reference._dot_in_order(q_cols, rows, dtype == torch.bfloat16, max_sums=0)
        monkeypatch.delenv(native.ORDERED_ENV)
        for other in (natively, by_column):
            assert torch.equal(at_once.view(torch.int32), other.view(torch.int32)), (b, m, h, c, d)
        assert not torch.equal(at_once, torch.einsum("bmhd,bmcd->bmhc", q.float(), rows))

def test_both_torch_routes_quantize_alike():
    """The fast order's quantizers (fewer operations: a max-norm, scales from the maxima's bits, no clamp)
    give the exact order's values: spreads over 2^+-40, zero and signed-zero blocks, maxima at 448 x 2^k and
    6 x 2^k and one bf16 ulp above (where the scale's choice is decided)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, 128, generator=gen) * 3
    x[1] *= 2.0 ** torch.randint(-40, 41, (7, 128), generator=gen).float()
    x[2, 0], x[2, 1, :32], x[2, 2, 5] = 0.0, -0.0, 1e-30
    tops = torch.stack([top * 2.0 ** torch.arange(-8, 24.0) for top in (448.0, 6.0)])      # [2, 32]
    x[3, :2] = tops.repeat(1, 4)
    x = x.bfloat16()
    x[3, 2:4] = torch.nextafter(x[3, :2], torch.tensor(float("inf"), dtype=torch.bfloat16))
    for name in ("fp8_qdq_", "fp4_qdq_e8m0_", "fp4_qdq_e4m3_"):
        a, b = getattr(NX_EXACT, name)(x.clone()), getattr(NX_FAST, name)(x.clone())
        assert torch.equal(a, b) and torch.equal(a, getattr(reference, name)(x.clone())), name
    q, s = NX_FAST.act_quant(x)
    dequantized = (q.float().view(4, 7, 4, 32) * s[..., None]).flatten(-2)
    assert torch.equal(fast.quant_act(x, torch.float32), dequantized)


def test_fast_quant_act_is_act_quant_bit_for_bit():
    """fast.quant_act (a max-norm for the block maxima, no clamp before the saturating cast) gives
    reference.act_quant's values exactly: bf16 and fp32 inputs over 2^+-40, all-zero and tiny groups, signed
    zeros, values at 448 * 2^k and just above, where the scale's choice is decided by one ulp."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=gen) * 2.0 ** torch.randint(-40, 40, (64, 1), generator=gen).float()
    x[0], x[1, :32], x[2, 7] = 0.0, -0.0, 1e-30
    x[3, :32] = 448.0 * 2.0 ** torch.arange(-8, 24, dtype=torch.float32)
    x[4, :32] = torch.nextafter(x[3, :32], torch.tensor(float("inf")))
    for dtype in (torch.bfloat16, torch.float32):
        xs = x.to(dtype)
        q, s = reference.act_quant(xs)
        want = (q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)
        for out in (torch.float32, torch.float64):
            assert torch.equal(fast.quant_act(xs, out), want.to(out)), (dtype, out)


def test_fast_sinkhorn_is_the_same_normalisations_in_another_order():
    """The fast order's Sinkhorn (a frame holding eps, two operations per normalisation) forms the
    reference's sums in another order: pre and post within 4 fp32 ulps of the exact order, comb within 32,
    and as close to an fp64 evaluation as the exact order is; columns end normalised."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(3000, 24, generator=gen) * 0.5
    scale, base = torch.rand(3, generator=gen) + 0.5, torch.randn(24, generator=gen) * 0.45
    got = NX_FAST.hc_split_sinkhorn(m, scale, base, 4, 20, 1e-6)
    want = reference.hc_split_sinkhorn(m, scale, base, 4, 20, 1e-6)
    exact = reference.hc_split_sinkhorn(m.double(), scale.double(), base.double(), 4, 20, 1e-6)

    def ulps(a, b):
        return (a.contiguous().view(torch.int32).long() - b.contiguous().view(torch.int32).long()).abs().max()

    assert ulps(got[0], want[0]) <= 4 and ulps(got[1], want[1]) <= 4 and ulps(got[2], want[2]) <= 32
    rel = lambda a: ((a.double() - exact[2]).abs() / exact[2].abs()).max().item()   # noqa: E731
    assert rel(got[2]) <= max(2 * rel(want[2]), 1e-6)
    assert torch.allclose(got[2].sum(-2), torch.ones(3000, 4), atol=1e-5)


# ---- fast vs exact, kernel by kernel ----

@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_fast_gemm_same_products_other_order(kind):
    """Both routes multiply the same exact products (q s and the dequantized weight are exact in bf16, their
    product exact in fp32) and sum K of them in fp32 in different orders: the fp32 results are within
    2 (K - 1) u S (S = sum |products|), and rounding each to bf16 adds at most 2^-8 of its magnitude."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 3, 512, generator=gen).bfloat16() * 2
    lin = random_linear(kind, 200, 512, gen, FAST)
    w = (dequant_fp8_weight if kind == "fp8" else dequant_fp4_weight)(lin.weight, lin.scale)
    assert torch.equal(fast.dequant_weight(lin.weight, lin.scale, kind, torch.bfloat16).float(), w)
    exact = reference.block_scaled_gemm(x, w)
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    a = fast.quant_act(x, torch.float64)
    sums = a.abs() @ w.double().abs().T                             # S per output element
    truth = a @ w.double().T
    bound = 2 * 511 * U * sums * 1.01 + 2.0 ** -7 * exact.double().abs() * 1.01
    assert ((got.double() - exact.double()).abs() <= bound).all()
    assert ((got.double() - truth).abs() <= 511 * U * sums + 2.0 ** -8 * truth.abs() * 1.01).all()
    assert (got == exact).float().mean() > 0.9                      # most outputs round to the same bf16


@pytest.mark.parametrize("m", [1, 3, 70])
def test_fast_sparse_attention_within_bound(m):
    """Scores: D exact products summed in another order, so s moves by at most d = 2 D u sum|q k| scale and
    each p = exp(s - m) by a factor within exp(2 d). Rounding p to bf16 (the kernel's P cast) then differs by
    at most one bf16 step, 2^-7 p. So the output moves by at most (2^-7 + 4 d) (A + |o|), with
    A = sum_j p_j |v_j| / den, plus the two bf16 roundings of o (in the 2^-7 |o|); P.V's fp32 sums in
    another order (the CPU's blocks of queries sum over their union of rows) add ~T u A, far inside.
    m = 1: a decode step's path; 3 and 70 (over a 64-query block): a prefill's, index lists with repeats."""
    gen = torch.Generator().manual_seed(3)
    b, h, d, n = 2, 4, 128, 300
    q = (torch.randn(b, m, h, d, generator=gen) * 2).bfloat16()
    kv = torch.randn(b, n, d, generator=gen).bfloat16()
    sink = torch.randn(h, generator=gen)
    idx = torch.randint(0, n, (b, m, 200), generator=gen).int()
    idx[0, m // 2, 150:] = -1
    idx[1, m - 1] = -1                                              # nothing to attend: zeros on both
    scale = d ** -0.5
    exact = reference.sparse_attn(q, kv, sink, idx, scale)
    got = NX_FAST.sparse_attn(q, kv, sink, idx, scale)
    assert got.dtype == torch.bfloat16 and got[1, m - 1].abs().sum() == 0
    rows = kv[torch.arange(b).view(b, 1, 1), idx.long().clamp_min(0)].double()      # [B, M, T, D]
    s = torch.einsum("bmhd,bmtd->bmht", q.double(), rows) * scale
    s = s.masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    top = torch.maximum(s.amax(-1), sink.double().view(1, 1, h)).clamp_min(-1e30)
    p = torch.exp(s - top.unsqueeze(-1))
    den = p.sum(-1) + torch.exp(sink.double().view(1, 1, h) - top)
    spread = torch.einsum("bmht,bmtd->bmhd", p, rows.abs()) / den.unsqueeze(-1)
    dev = 2 * d * U * (torch.einsum("bmhd,bmtd->bmht", q.double().abs(), rows.abs()) * scale).amax(-1)
    bound = (2.0 ** -7 + 4 * dev.unsqueeze(-1)) * (spread + exact.double().abs()) * 1.01 + 1e-6
    assert ((got.double() - exact.double()).abs() <= bound).all()


@pytest.mark.parametrize("s, causal", [(3, False), (300, True)])
def test_fast_index_scores_within_bound(s, causal):
    """Per head: q.k over D exact products in another order, rounded to bf16 (one bf16 step, 2^-7 |s_h|,
    plus 2 (D - 1) u S_h); times w_h rounded to bf16 (one more step); the head sum (fp32, H terms, another
    order) rounded to bf16: |d| <= (2^-6 + 2 (D + H) u) sum_h |w_h| S_h + 2^-7 |out|. Causal: a prefill of
    300 queries, each seeing the first (position + 1) // 4 keys, as the indexer passes them: on the CPU the
    query blocks score only what they see, and every score a query sees keeps the bound."""
    gen = torch.Generator().manual_seed(4)
    t = 80 if causal else 50
    q = torch.randn(2, s, 16, 64, generator=gen).bfloat16()
    keys = torch.randn(2, t, 64, generator=gen).bfloat16()
    w = (torch.randn(2, s, 16, generator=gen) / 64).bfloat16()
    visible = (torch.arange(s) + 1) // 4 if causal else None
    exact = reference.index_scores(q, keys, w)
    got = NX_FAST.index_scores(q, keys, w, ParallelContext.single(), visible)
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    heads = torch.einsum("bshd,btd->bsht", q.double().abs(), keys.double().abs())   # S_h
    weighted = (heads * w.double().abs().unsqueeze(-1)).sum(2)
    bound = (2.0 ** -6 + 2 * (64 + 16) * U) * weighted * 1.02 + 2.0 ** -7 * exact.double().abs()
    seen = torch.ones(s, t, dtype=torch.bool) if visible is None else torch.arange(t) < visible.unsqueeze(1)
    assert ((got.double() - exact.double()).abs() <= bound)[:, seen].all()
    if causal:      # the unseen scores of the first blocks were never made: less work, not other numbers
        assert (got[:, :64, 16:] == 0).all() and not (got[:, -1] == 0).all()


def test_dequant_of_stacked_experts_matches_one_by_one():
    gen = torch.Generator().manual_seed(5)
    for kind, deq in (("fp8", dequant_fp8_weight), ("fp4", dequant_fp4_weight)):
        lins = [random_linear(kind, 64, 96 if kind == "fp8" else 128, gen) for _ in range(3)]
        stack = lambda ts: torch.stack([t.view(torch.uint8) for t in ts]).view(ts[0].dtype)   # [3, ...]
        got = fast.dequant_weight(stack([lin.weight for lin in lins]), stack([lin.scale for lin in lins]),
                                  kind, torch.bfloat16)
        assert torch.equal(got.float(), torch.stack([deq(lin.weight, lin.scale) for lin in lins]))


# ---- the MoE's gathered / grouped paths against the per-expert loop ----

class SecondOfTwo(ParallelContext):
    """Rank 1 of 2 without a process group: its all-reduce returns its own partial sum."""

    def all_reduce(self, x):
        return x


def exact_arithmetic_moe(par: ParallelContext, opts: RuntimeOptions):
    """An MoE whose GEMMs are exact in any summation order: integer activations and FP4/FP8 weights with
    small integer values and scale 1 (every partial sum an exact fp32 value), and w2 with one non-zero per
    output row. Any difference between the routes is then in the routing, gathering or combination."""
    from inference.moe import MoE
    from inference.state import ModelContext
    args = ModelArgs.from_file(os.path.join(FIXTURE, "config.json"))
    moe = MoE(ModelContext.build(args, par, opts), args.n_routed_experts, args.n_activated_experts,
              with_bias_vl=False)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=gen).bfloat16())
        moe.gate.bias.zero_()
        for lin in (m for m in moe.modules() if isinstance(m, Linear)):
            n, k = lin.out_features, lin.in_features
            if n == args.dim:                                         # w2: one non-zero per row
                vals = torch.zeros(n, k)
                vals[torch.arange(n), torch.arange(n) % k] = torch.randint(-3, 4, (n,), generator=gen).float()
            else:
                vals = torch.randint(-3, 4, (n, k), generator=gen).float()
            lin.scale.view(torch.uint8).fill_(127)                   # UE8M0 1.0
            if lin.kind == "fp8":
                lin.weight.copy_(vals.to(torch.float8_e4m3fn))
            else:                                                     # E2M1 codes of -3..3, low nibble first
                codes = torch.tensor([8 + 5, 8 + 4, 8 + 2, 0, 2, 4, 5])[vals.long() + 3]
                lin.weight.view(torch.uint8).copy_(codes[:, 0::2] | codes[:, 1::2] << 4)
    return moe


@pytest.mark.parametrize("par", [ParallelContext.single(), SecondOfTwo(world_size=2, rank=1)],
                         ids=["W1", "rank1of2"])
def test_fixed_shape_experts_equal_the_expert_loop(par):
    """The GPU decode path (the stacked experts indexed with shapes fixed by the batch and top-k, no host
    sync), run here on CPU tensors: both of its forms (gathered selections while N k <= local experts, else
    every local expert on every token) give the exact loop's numbers on the exact-arithmetic MoE."""
    exact_moe, fast_moe = exact_arithmetic_moe(par, EXACT), exact_arithmetic_moe(par, FAST)
    assert _gate_up_halves(fast_moe.stacked) is not None            # w1 and w3 gathered together
    gen = torch.Generator().manual_seed(8)
    for n in (1, 2, 3, 5):                                           # N k = 3, 6 | 9, 15 for 8 (4) experts
        x = torch.randint(-8, 9, (n, exact_moe.ctx.args.dim), generator=gen).bfloat16()
        with torch.inference_mode():
            weights, idx = fast_moe.gate(x)
            want = exact_moe.nx.combine_experts(looped_experts(exact_moe, x, weights, idx), idx, par)
            first = fast_moe.experts[fast_moe.start]
            out = fixed_shape_experts(fast_moe.stacked, first.w1.kind, fast_moe.start, fast_moe.n_local,
                                      fast_moe.n_experts, x, weights, idx, first.swiglu)   # [N, k, D]
            got = NX_FAST.combine_experts(out, idx, par)
        assert want.abs().sum() > 0 and torch.equal(got, want), n


@pytest.mark.parametrize("kind", ["fp4", "fp8"])
def test_fixed_shape_experts_gather_w1_and_w3_together_bit_for_bit(kind):
    """w1 and w3 laid out side by side (moe.stacked_experts) are gathered, dequantised and multiplied as one
    batch (or dequantised as one when every expert runs): the same bits as each alone (the same layout's
    tensors copied apart), and with the MoE layer's activations given. Random codes at scale 1 and integer
    activations: the w1 / w3 products and sums are exact, so the batched GEMMs' shapes cannot move a bit on
    any CPU; what is left to differ is a wrong row or half."""
    gen = torch.Generator().manual_seed(3)
    stacked = stacked_experts(128, 96, kind, 8)
    for w, s in stacked.values():
        fp4 = torch.randint(0, 256, w.shape, generator=gen, dtype=torch.uint8)
        fp8 = torch.randint(-3, 4, w.shape, generator=gen).float().to(torch.float8_e4m3fn).view(torch.uint8)
        w.view(torch.uint8).copy_(fp4 if kind == "fp4" else fp8)
        s.view(torch.uint8).fill_(127)                                  # UE8M0 1.0
    apart = {p: tuple(t.clone() for t in ws) for p, ws in stacked.items()}
    assert _gate_up_halves(stacked) is not None and _gate_up_halves(apart) is None
    swiglu = lambda g, u, w: F.silu(g.float()) * u.float() * w                    # noqa: E731
    for n, k in ((1, 6), (2, 3), (3, 2), (3, 6)):           # N k = 18 > 8: every expert, every token
        x = torch.randint(-8, 9, (n, 128), generator=gen).bfloat16()
        idx, weights = torch.randint(0, 8, (n, k), generator=gen), torch.rand(n, k, generator=gen)
        together, alone = (fixed_shape_experts(st, kind, 0, 8, 8, x, weights, idx, swiglu)
                           for st in (stacked, apart))
        assert together.abs().sum() > 0 and torch.equal(together, alone), (n, k)
        # the activations made once by the MoE layer (expert_activations) give the same numbers
        given = fixed_shape_experts(stacked, kind, 0, 8, 8, x, weights, idx, swiglu,
                                    a=NX_FAST.expert_activations(x))
        assert torch.equal(given, together), (n, k)


@pytest.mark.parametrize("par", [ParallelContext.single(), SecondOfTwo(world_size=2, rank=1)],
                         ids=["W1", "rank1of2"])
def test_the_kernel_routes_decode_experts_equal_the_expert_loop(par, monkeypatch):
    """The TileLang route's decode experts (act_quant once per token, the expert GEMM kernel per selection
    reading row p // top-k, SwiGLU, act_quant, the kernel for w2), its kernels replaced by torch stand-ins
    that compute their definition (tools/gpu_check.TorchKernels, which also runs the wrappers' argument
    checks): the exact loop's numbers on the exact-arithmetic MoE, at every batch size, on either rank."""
    pytest.importorskip("tilelang")
    from types import SimpleNamespace
    from inference.kernels import tilelang_ops as ops
    from inference.tools.gpu_check import TorchKernels
    wrappers = SimpleNamespace(expert_gemm=ops.expert_gemm, act_quant=ops.act_quant)
    stand_in = TorchKernels(wrappers)
    monkeypatch.setattr(ops, "expert_gemm", stand_in.expert_gemm)
    monkeypatch.setattr(ops, "act_quant", stand_in.act_quant)
    nx = ops.TileLang(device="cpu")
    exact_moe, fast_moe = exact_arithmetic_moe(par, EXACT), exact_arithmetic_moe(par, FAST)
    gen = torch.Generator().manual_seed(8)
    for n in (1, 2, 3, 5):
        x = torch.randint(-8, 9, (n, exact_moe.ctx.args.dim), generator=gen).bfloat16()
        with torch.inference_mode():
            weights, idx = fast_moe.gate(x)
            want = exact_moe.nx.combine_experts(looped_experts(exact_moe, x, weights, idx), idx, par)
            first = fast_moe.experts[fast_moe.start]
            out = nx.selected_experts(fast_moe.stacked, first.w1.kind, fast_moe.start, fast_moe.n_local,
                                      fast_moe.n_experts, x, weights, idx, first.swiglu)      # [N, k, D]
            got = NX_FAST.combine_experts(out, idx, par)
        assert want.abs().sum() > 0 and torch.equal(got, want), n


@pytest.mark.parametrize("par", [ParallelContext.single(), SecondOfTwo(world_size=2, rank=1)],
                         ids=["W1", "rank1of2"])
def test_fast_moe_equals_the_expert_loop(par):
    exact_moe, fast_moe = exact_arithmetic_moe(par, EXACT), exact_arithmetic_moe(par, FAST)   # same weights
    gen = torch.Generator().manual_seed(7)
    for shape in ((3, 1), (1, 5), (1, 40)):                          # decode batch, draft block, prefill
        x = torch.randint(-8, 9, (*shape, exact_moe.ctx.args.dim), generator=gen).bfloat16()
        call = ForwardCall.prefill(0, shape[1], exact_moe.ctx.args, "cpu")       # (not a VERIFY)
        with torch.inference_mode():
            exact, got = exact_moe(x, call), fast_moe(x, call)
            loop = plain_expert_loop(exact_moe, x.view(-1, x.shape[-1]), par).to(x.dtype).view(x.shape)
        assert exact.abs().sum() > 0
        assert torch.equal(got, exact) and torch.equal(exact, loop), shape


def plain_expert_loop(moe, x, par):
    """The reference's MoE written out: per local expert in increasing index, its tokens through it, added
    into an fp32 sum; all-reduced; the shared expert added."""
    weights, idx = moe.gate(x)
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in range(moe.start, moe.start + moe.n_local):
        tok, slot = torch.where(idx == e)
        if len(tok):
            y[tok] += moe.experts[e](x[tok], weights[tok, slot, None])
    return par.all_reduce(y) + moe.shared_experts(x)


# ---- end to end on the fixture ----

def test_fast_end_to_end_teacher_forced():
    """`--numerics fast` on the conformance fixture: inside the parity bounds of the reference."""
    from test_model_fixture import run_teacher_forced
    model = fixture_model(RuntimeOptions.from_profile("fast"))
    ref = fixture_tensors("reference_logits")
    logits, drafts = run_teacher_forced(model, ref)
    want = ref["step_logits"]
    d = (logits - want).abs()
    print(f"fast vs reference logits: max |d| {d.max():.4f} mean {d.mean():.5f}")
    assert d.max() <= 0.25 and d.mean() <= 0.03
    top2 = want.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 0.5
    assert clear.any() and torch.equal(logits.argmax(-1)[clear], want.argmax(-1)[clear])
    dl = (torch.stack([x[1] for x in drafts]) - ref["dspark_logits"]).abs()
    assert dl.max() <= 0.25


# ---- no loop over head_dim, K blocks, experts or tokens in a fast decode step ----

class OpCount(TorchDispatchMode):
    """Counts the torch ops that compute (views and slices, which torch elides for some shapes, excluded)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


def random_model(opts, **sizes):
    """The fixture's layer layout (every layer role) without Engram and DSpark, at other widths, random."""
    from inference.model import Transformer
    args = ModelArgs.from_file(os.path.join(FIXTURE, "config.json"), max_seq_len=96, max_batch_size=3,
                               engram_layer_ids=[], engram_num_embeddings=[], **sizes)
    model = Transformer(args, opts=opts, build_dspark=False)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype in (torch.float8_e8m0fnu, torch.float4_e2m1fn_x2):
                lo, hi = (118, 126) if p.dtype == torch.float8_e8m0fnu else (0, 256)
                p.view(torch.uint8).copy_(torch.randint(lo, hi, p.shape, dtype=torch.uint8, generator=gen))
            else:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype))
    return model


def decode_op_count(model, batch: int) -> int:
    ids = torch.randint(3, model.args.vocab_size, (batch, 41), generator=torch.Generator().manual_seed(9))
    model.reset()
    model.prefill(ids[:, :40])
    model.decode(ids[:, 40:41], 40)                                  # warm: CPU dequantization caches
    model.prefill(ids[:, :40])
    with OpCount() as count:
        model.decode(ids[:, 40:41], 40)
    return count.n


def test_fast_decode_step_has_no_loop_over_sizes():
    """The same number of computing torch ops for one decode step at head_dim 128 / 256 with twice the K
    blocks in every GEMM and twice the experts; the exact route's count grows (the check can fail). (On the
    CPU the routed experts loop over the experts a step selects, so the count grows with the batch there;
    on a GPU it does not: tests/test_fake_cuda.py counts a decode step at batch 1, 2 and 3.)"""
    small = dict(n_routed_experts=8)
    large = dict(dim=512, head_dim=256, q_lora_rank=256, moe_inter_dim=256, index_head_dim=128,
                 o_lora_rank=128, n_routed_experts=16)
    sizes = [decode_op_count(random_model(FAST, **cfg), 1) for cfg in (small, large)]
    print("fast decode step ops: small / large", sizes)
    assert sizes[0] == sizes[1]
    exact = [decode_op_count(random_model(EXACT, **sizes), 1) for sizes in (small, large)]
    assert exact[1] > exact[0] + 128, exact


# ---- CUDA ----

@needs_cuda
def test_cuda_routes_and_fast_kernels_within_bounds():
    """On a GPU: auto takes tilelang on compute capability >= 9.0 with tilelang installed, else the fast
    torch route; the fast kernels in bf16 with fp32 accumulation stay within the CPU bounds above."""
    x = torch.zeros(2, 32, device="cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    auto = "tilelang" if hopper and kernels._tilelang_imports() else "fast"
    assert kernels.route(RuntimeOptions(), x) == auto
    assert kernels.route(RuntimeOptions(kernel_backend="torch"), x) == "fast"
    torch_opts = RuntimeOptions(kernel_backend="torch")
    nx = kernels.numerics_for(torch_opts, "cuda")
    gen = torch.Generator().manual_seed(2)
    xs = torch.randn(7, 3, 512, generator=gen).bfloat16() * 2
    lin = random_linear("fp8", 200, 512, gen)
    w = dequant_fp8_weight(lin.weight, lin.scale)
    exact = reference.block_scaled_gemm(xs, w)
    lin = lin.cuda()
    got = nx.linear(lin.held(), xs.cuda()).cpu()
    sums = fast.quant_act(xs, torch.float64).abs() @ w.double().abs().T
    bound = 2 * 511 * U * sums * 1.01 + 2.0 ** -7 * exact.double().abs() * 1.01
    assert ((got.double() - exact.double()).abs() <= bound).all()
    q = (torch.randn(1, 1, 8, 128, generator=gen) * 2).bfloat16()
    kv = torch.randn(1, 300, 128, generator=gen).bfloat16()
    idx = torch.randint(0, 300, (1, 1, 200), generator=gen).int()
    sink = torch.randn(8, generator=gen)
    exact = reference.sparse_attn(q, kv, sink, idx, 128 ** -0.5)
    got = nx.sparse_attn(q.cuda(), kv.cuda(), sink.cuda(), idx.cuda(), 128 ** -0.5).cpu()
    assert (got.float() - exact.float()).abs().max() <= 2.0 ** -5 * exact.float().abs().max()
