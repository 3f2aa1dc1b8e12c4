"""The CPU routed-expert kernel (inference/kernels/host_experts.c) against its torch specification.

Both form the same exact products (an E4M3 activation times an E2M1 or E4M3 weight times powers of two) and
sum them in fp32 in different orders. Any order of summing n numbers in fp32 is within gamma(n - 1) * sum|p|
of the exact sum (Higham, Accuracy and Stability, 4.2: gamma(n) = n u / (1 - n u), u = 2^-24; an FMA of an
exact product is one rounded addition), so two orders differ by at most 2 gamma(K - 1) sum|p|. After the
rounding to bf16, which is monotone, they differ by at most that plus one bf16 ulp of the larger.
"""
import functools
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from inference.kernels import host_experts as he
from inference.kernels import native
from inference.kernels.fast import dequant_weight, quant_act
from inference.moe import Expert

NATIVE = ["avx512", "avx2", "scalar"] if he.auto_variant() == "avx512" else \
    ["avx2", "scalar"] if he.auto_variant() == "avx2" else ["scalar"]
U = 2.0 ** -24


def stored(kind, e, n, k, gen, small=False):
    """Random stored weights [e, n, ...] and scales: every E2M1 code, or every non-NaN E4M3 code; scale
    bytes around 2^0 (small: small integers at scale 1, so every sum is exact)."""
    if kind == "fp4":
        w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
        if small:
            w &= 0x77                                               # E2M1 0 .. 6, positive
        s_shape = (e, n, k // 32)
    else:
        w = torch.randint(0, 256, (e, n, k), dtype=torch.uint8, generator=gen)
        w[(w & 0x7F) == 0x7F] = 0x38                                # no NaN codes; 0x38 is 1.0
        if small:
            w = torch.randint(0, 7, (e, n, k), generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
        s_shape = (e, -(-n // 32), k // 32)
    s = torch.full(s_shape, 127, dtype=torch.uint8) if small else \
        torch.randint(117, 134, s_shape, dtype=torch.uint8, generator=gen)
    return w, s


def abs_products(x, counts, experts, w, s, kind):
    """sum_k |a_k w_k| per output, float64 [M, N]: the scale of the summation-order error."""
    a = quant_act(x, torch.float32).double().abs()
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for e, c in zip(experts, counts):
        wv = w[e].view(torch.float8_e4m3fn) if kind == "fp8" else w[e]
        out[start:start + c] = a[start:start + c] @ dequant_weight(wv, s[e], kind, torch.float64).abs().t()
        start += c
    return out


def bf16_ulp(v):
    """One bf16 ulp at |v| (8 significant bits), float64."""
    e = torch.frexp(v.double().abs().clamp_min(2.0 ** -126))[1]
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), e - 8)


@pytest.mark.parametrize("variant", NATIVE)
@pytest.mark.parametrize("kind", ["fp4", "fp8"])
@pytest.mark.parametrize("m,n,k", [(1, 37, 64), (3, 70, 160), (16, 45, 96), (5, 33, 384), (2, 600, 64)])
def test_kernel_matches_spec_within_the_summation_bound(variant, kind, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, s = stored(kind, 4, n, k, gen)
    counts, experts = [m, 0, 2, 1], [2, 0, 3, 2]                   # an expert twice, one with no rows
    x = (torch.randn(sum(counts), k, generator=gen) * 3).bfloat16()
    spec = he.linear_torch(x, counts, experts, w, s, kind)
    got = he.expert_linears_fp32(x, counts, experts, [(w, s)], kind, variant)[0]
    bound = 2 * (k - 1) * U / (1 - (k - 1) * U) * abs_products(x, counts, experts, w, s, kind)
    assert ((got.double() - spec.double()).abs() <= bound).all()
    got16 = he.expert_linear(x, counts, experts, w, s, kind, variant)
    spec16 = spec.to(torch.bfloat16)
    ulp = bf16_ulp(torch.maximum(got16.double().abs(), spec16.double().abs()))
    assert ((got16.double() - spec16.double()).abs() <= bound + ulp).all()


@pytest.mark.parametrize("variant", NATIVE)
@pytest.mark.parametrize("kind", ["fp4", "fp8"])
@pytest.mark.parametrize("n,k", [(37, 32), (70, 64), (45, 96), (33, 160), (9, 2304)])
def test_a_decode_step_matches_spec_within_the_summation_bound(variant, kind, n, k):
    """One row per expert, as in a decode step: AVX2 reads MXFP4 blocks in pairs then, its activations in
    order 4 (an odd block count ends on one block alone: K 32, 96, 160)."""
    gen = torch.Generator().manual_seed(n + k)
    w, s = stored(kind, 4, n, k, gen)
    counts, experts = [1, 1, 1, 1], [2, 0, 3, 1]
    x = (torch.randn(4, k, generator=gen) * 3).bfloat16()
    spec = he.linear_torch(x, counts, experts, w, s, kind)
    got = he.expert_linears_fp32(x, counts, experts, [(w, s)], kind, variant)[0]
    bound = 2 * (k - 1) * U / (1 - (k - 1) * U) * abs_products(x, counts, experts, w, s, kind)
    assert ((got.double() - spec.double()).abs() <= bound).all()


@pytest.mark.parametrize("variant", NATIVE + ["torch"])
@pytest.mark.parametrize("kind", ["fp4", "fp8"])
@pytest.mark.parametrize("lead", [(1,), (2, 3)])
def test_a_linear_from_its_stored_bytes(variant, kind, lead):
    """--cpu-linears stored: a Linear's FP8/FP4 GEMM from its stored bytes (stored_linear, [..., K] ->
    [..., N] bf16, leading dims kept) against the fast order's GEMM on the exact fp32 copy (fast.gemm):
    within the summation bound and one bf16 ulp; the StoredLinears order makes no copy."""
    from inference.config import RuntimeOptions
    from inference.kernels import numerics_for
    from inference.kernels.fast import gemm
    from inference.kernels.numerics import Derived, Held
    gen = torch.Generator().manual_seed(len(lead) + 7 * (kind == "fp8"))
    n, k = 70, 160
    w, s = stored(kind, 1, n, k, gen)
    x = (torch.randn(*lead, k, generator=gen) * 3).bfloat16()
    weight = w[0].view(torch.float8_e4m3fn) if kind == "fp8" else w[0].view(torch.float4_e2m1fn_x2)
    scale = s[0].view(torch.float8_e8m0fnu)
    want = gemm(x, dequant_weight(weight, scale, kind, torch.float32))          # [..., N] bf16
    got = he.stored_linear(x, weight, scale, kind, variant)
    rows = x.reshape(-1, k)
    bound = 2 * (k - 1) * U / (1 - (k - 1) * U) * abs_products(rows, [rows.shape[0]], [0], w, s, kind)
    ulp = bf16_ulp(torch.maximum(got.double().abs(), want.double().abs())).view(-1, n)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert ((got.double() - want.double()).abs().view(-1, n) <= bound + ulp).all()
    nx = numerics_for(RuntimeOptions.from_profile("fast", experts_on="host", cpu_linears="stored"), "cpu")
    held = Held(weight, scale, kind, Derived())
    assert torch.equal(nx.linear(held, x), he.stored_linear(x, weight, scale, kind))
    assert len(held.derived) == 0


def test_the_kernel_refuses_activations_in_another_order():
    """he_run checks the order its caller quantised the activations in (_order): MXFP4 in the build's own,
    FP8 in 0, and on AVX2 order 4 (blocks in pairs) for jobs of one row only; else -1, nothing written."""
    lib = he._library(NATIVE[0], native.compiler(), native.cache_dir())
    w, s = stored("fp4", 1, 8, 64, torch.Generator().manual_seed(3))
    x = he._activations(lib, torch.ones(2, 64, dtype=torch.bfloat16), he._order("fp4", NATIVE[0]))
    y = torch.full((2, 8), float("nan"))                            # untouched rows stay NaN
    scratch = torch.empty(2, dtype=torch.int64)

    def run(m, fmt, order):
        jobs = torch.tensor([w.data_ptr(), s.data_ptr(), x.data_ptr(), y.data_ptr(), 8, m, 8])
        return lib.he_run(jobs.data_ptr(), 1, scratch.data_ptr(), 64, fmt, order, 1)

    for m, fmt, order in [(2, 4, 4), (2, 4, 0), (1, 8, he._order("fp4", NATIVE[0]))]:
        assert run(m, fmt, order) == -1 and y.isnan().all(), (m, fmt, order)
    assert run(2, 4, he._order("fp4", NATIVE[0])) == 0 and y.isfinite().all()
    if NATIVE[0] == "avx2":                                         # order 4: the same values for ones
        y.fill_(float("nan"))
        assert run(1, 4, 4) == 0 and y[0].isfinite().all() and y[1].isnan().all()


@pytest.mark.parametrize("variant", NATIVE)
@pytest.mark.parametrize("kind,e", [("fp4", e) for e in (0, 1, 2, 64, 127, 200, 250)] +
                         [("fp8", e) for e in (0, 1, 64, 127, 200)])
def test_scale_bytes_far_from_one_keep_the_products_exact(variant, kind, e):
    """Every row at scale byte e, from 2^-127 (byte 0) up to where the weights still fit fp32 (the AVX2
    kernel looks the scaled weight E2M1 x 2^(e - 127) up in a table per byte: each is a bf16, subnormal at
    the bottom); activations scaled by 2^(127 - e) within [2^-8, 2^100] (act_quant floors amax at 1e-4), so
    that every product is a normal number, exact in both."""
    gen = torch.Generator().manual_seed(e)
    w, s = stored(kind, 2, 37, 96, gen)
    s.fill_(e)
    x = (torch.randn(3, 96, generator=gen) * 2.0 ** max(-8, min(100, 127 - e))).bfloat16()
    counts, experts = [2, 1], [1, 0]
    spec = he.linear_torch(x, counts, experts, w, s, kind)
    got = he.expert_linears_fp32(x, counts, experts, [(w, s)], kind, variant)[0]
    assert torch.isfinite(spec).all() and (spec != 0).any()
    bound = 2 * 95 * U / (1 - 95 * U) * abs_products(x, counts, experts, w, s, kind)
    assert ((got.double() - spec.double()).abs() <= bound).all()


@pytest.mark.parametrize("variant", NATIVE)
@pytest.mark.parametrize("kind", ["fp4", "fp8"])
@pytest.mark.parametrize("k", [32, 256, 288])
@pytest.mark.parametrize("counts", [[1, 4, 2], [1, 1, 1]])          # [1, 1, 1]: a decode step's pairs
def test_exact_sums_are_bit_identical(variant, kind, k, counts):
    """Small integers (x quantised to multiples of 1/64 at most 7, weights 0 .. 6 at scale 1): every partial
    sum is exact in fp32, so no order can change a bit."""
    gen = torch.Generator().manual_seed(k)
    w, s = stored(kind, 3, 41, k, gen, small=True)
    x = torch.randint(-7, 8, (sum(counts), k), generator=gen).bfloat16()
    x[:, 0] = 7                                                     # amax 7: the scale 2^-6, codes 64 x
    experts = [1, 0, 2]
    spec = he.linear_torch(x, counts, experts, w, s, kind).to(torch.bfloat16)
    got = he.expert_linear(x, counts, experts, w, s, kind, variant)
    assert torch.equal(got.view(torch.int16), spec.view(torch.int16))


@pytest.mark.parametrize("variant", NATIVE)
def test_two_projections_in_one_call_and_threads(variant):
    """w1 and w3 in one call equal two calls; 1 and 2 threads give the same bits (each output is one
    thread's sum)."""
    gen = torch.Generator().manual_seed(5)
    (w1, s1), (w3, s3) = stored("fp4", 3, 40, 128, gen), stored("fp4", 3, 72, 128, gen)
    x = torch.randn(5, 128, generator=gen).bfloat16()
    counts, experts = [2, 3], [2, 0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = he.expert_linears(x, counts, experts, [(w1, s1), (w3, s3)], "fp4", variant)
        torch.set_num_threads(2)
        two = he.expert_linears(x, counts, experts, [(w1, s1), (w3, s3)], "fp4", variant)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], he.expert_linear(x, counts, experts, w1, s1, "fp4", variant))
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("variant", NATIVE)
@pytest.mark.parametrize("big", [False, True])
def test_fp8_one_token_scales_activations_or_weights_alike(variant, big):
    """AVX2's one-token FP8 tile multiplies a block's activations by the weights' scale, where that stays
    below 2^127, instead of every weight (host_experts.c tile_fp8_one): the same exact products. Integer
    activations times 2^100 (`big`: every block takes the weights' multiply) or not, weights 0 .. 6 at scale
    1: exact sums, the spec's bits either way."""
    gen = torch.Generator().manual_seed(11)
    w, s = stored("fp8", 2, 40, 96, gen, small=True)
    x = torch.randint(-7, 8, (2, 96), generator=gen).float() * (2.0 ** 100 if big else 1.0)
    x = x.bfloat16()
    spec = he.linear_torch(x, [1, 1], [1, 0], w, s, "fp8").to(torch.bfloat16)
    got = he.expert_linear(x, [1, 1], [1, 0], w, s, "fp8", variant)
    assert torch.equal(got.view(torch.int16), spec.view(torch.int16))


@pytest.mark.parametrize("variant", NATIVE)
@pytest.mark.parametrize("order", [0, 1, 2, 3, 4, 5])
def test_c_act_quant_is_torchs_bit_for_bit(variant, order):
    """he_act_quant against act_quant (dequantised, reordered): magnitudes over 2^-40 .. 2^40 within blocks
    (E4M3 subnormals, ties: bf16 inputs have 8 significant bits), a zero row (the 1e-4 floor), -0."""
    gen = torch.Generator().manual_seed(order)
    x = torch.randn(9, 160, generator=gen) * torch.pow(2.0, torch.randint(-40, 41, (9, 160), generator=gen))
    x[2] = 0
    x[3, :32] = -0.0
    x[4] = torch.randn(160, generator=gen) * 1e-6
    x = x.bfloat16()
    lib = he._library(variant, native.compiler(), native.cache_dir())
    got = he._activations(lib, x, order)
    want = he.activations_torch(x, order)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_swiglu_is_the_experts():
    """host_experts.swiglu is moe.Expert.swiglu's arithmetic (the clamps, the routing weight)."""
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(2, 6, 40, generator=gen) * 8).bfloat16()
    weights = torch.rand(6, 1, generator=gen)
    expert = SimpleNamespace(limit=7.0, nx=SimpleNamespace(silu=torch.nn.functional.silu))
    assert torch.equal(he.swiglu(gate, up, weights, 7.0), Expert.swiglu(expert, gate, up, weights))


@pytest.mark.parametrize("kind", ["fp4", "fp8"])
def test_expert_swiglu_native_vs_torch(kind):
    """A whole expert set: the same as the torch path up to the summation order (gate and up rounded to
    bf16 can differ by an ulp where a sum lies near a rounding boundary, so compared loosely here; each GEMM
    is held to its bound above)."""
    gen = torch.Generator().manual_seed(2)
    d, i = 96, 64
    w1, w3 = stored(kind, 4, i, d, gen), stored(kind, 4, i, d, gen)
    w2 = stored(kind, 4, d, i, gen)
    x = torch.randn(6, d, generator=gen).bfloat16()
    rw = torch.rand(6, generator=gen)
    counts, experts = [1, 1, 4], [3, 0, 1]
    act = functools.partial(he.swiglu, limit=10.0)
    got = he.expert_swiglu(x, counts, experts, rw, w1, w3, w2, kind, act, NATIVE[0])
    spec = he.expert_swiglu(x, counts, experts, rw, w1, w3, w2, kind, act, "torch")
    assert got.shape == (6, d) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), spec.float(), rtol=0.02, atol=0.02 * spec.float().abs().max())


@pytest.mark.parametrize("variant", ["torch"] + NATIVE)
@pytest.mark.parametrize("counts,experts,tokens", [
    ([1, 1, 1], [3, 0, 1], [2, 2, 2]),                      # a decode step: one token, a row per expert
    ([1, 1, 1, 1], [2, 1, 3, 0], [0, 4, 4, 1]),             # one row each, pointing into x
    ([2, 1, 3], [1, 0, 3], [0, 3, 1, 3, 0, 2])])            # rows gathered: several per expert
def test_tokens_quantised_once_give_the_rows_numbers(variant, counts, experts, tokens):
    """x [N, K] with each row's token: the same numbers, bit for bit, as those rows gathered into [M, K]."""
    gen = torch.Generator().manual_seed(len(tokens))
    w1, w3, w2 = stored("fp4", 4, 64, 96, gen), stored("fp4", 4, 64, 96, gen), stored("fp4", 4, 96, 64, gen)
    x = (torch.randn(5, 96, generator=gen) * 3).bfloat16()
    tokens = torch.tensor(tokens)
    rows = he.expert_linears_fp32(x[tokens], counts, experts, [w1, w3], "fp4", variant)
    got = he.expert_linears_fp32(x, counts, experts, [w1, w3], "fp4", variant, tokens=tokens)
    assert all(torch.equal(a, b) for a, b in zip(got, rows))
    rw, act = torch.rand(len(tokens), generator=gen), functools.partial(he.swiglu, limit=10.0)
    assert torch.equal(he.expert_swiglu(x, counts, experts, rw, w1, w3, w2, "fp4", act, variant, tokens),
                       he.expert_swiglu(x[tokens], counts, experts, rw, w1, w3, w2, "fp4", act, variant))


def test_bad_input_is_one_line():
    w, s = stored("fp4", 2, 8, 64, torch.Generator().manual_seed(0))
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not cover"):
        he.expert_linear(x, [1, 1], [0, 1], w, s, "fp4", "torch")
    with pytest.raises(ValueError, match="outside the 2 stored experts"):
        he.expert_linear(x, [3], [2], w, s, "fp4", "torch")
    with pytest.raises(ValueError, match="multiple of 32"):
        he.expert_linear(torch.zeros(3, 48, dtype=torch.bfloat16), [3], [0], w, s, "fp4", "torch")
    with pytest.raises(ValueError, match="unknown variant"):
        he.expert_linear(x, [3], [0], w, s, "fp4", "avx9")
    for bad in (torch.tensor([0, 3]), torch.tensor([0.0, 1.0]), torch.tensor([[0, 1]])):
        with pytest.raises(ValueError, match="tokens must be"):
            he.expert_linears(x, [2], [0], [(w, s)], "fp4", "torch", tokens=bad)


def test_without_a_compiler_the_torch_path_runs_and_says_so_once(tmp_path):
    """CC names no program, an empty cache: one line on stderr, then the torch path, the same numbers."""
    code = (
        "import torch\n"
        "from inference.kernels import host_experts as he\n"
        "w = torch.randint(0, 256, (2, 8, 32), dtype=torch.uint8)\n"
        "s = torch.full((2, 8, 2), 127, dtype=torch.uint8)\n"
        "x = torch.randn(3, 64).bfloat16()\n"
        "a = [he.expert_linear(x, [1, 2], [1, 0], w, s, 'fp4') for _ in range(3)]\n"
        "b = he.linear_torch(x, [1, 2], [1, 0], w, s, 'fp4').to(torch.bfloat16)\n"
        "assert all(torch.equal(t, b) for t in a)\n"
        "print(he.kernel_variant())\n")
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.pop(he.ENV, None)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "torch"
    notices = [line for line in p.stderr.splitlines() if line.startswith("host experts:")]
    assert len(notices) == 1 and "torch path" in notices[0], p.stderr


def test_a_variant_beyond_the_cpu_is_refused_in_one_line(monkeypatch):
    """Forcing avx512 on an AVX2 CPU (or avx2 on one without) would die of SIGILL in the kernel: resolve
    refuses it first, naming the variant and what the CPU has (torch's view) and what runs instead."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setenv(he.ENV, "avx512")
    with pytest.raises(ValueError, match=r"variant 'avx512' needs a CPU with AVX512; this one has AVX2 "
                                         r"\(use avx2, scalar or torch\)"):
        he.kernel_variant()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(ValueError, match=r"variant 'avx2' needs a CPU with AVX2; this one has DEFAULT "
                                         r"\(use scalar or torch\)"):
        he.resolve("avx2")
    monkeypatch.setenv(he.ENV, "torch")
    assert he.kernel_variant() == "torch" and he.auto_variant() == "scalar"


def test_forced_torch_path_needs_no_compiler(monkeypatch):
    monkeypatch.setenv(he.ENV, "torch")
    assert he.kernel_variant() == "torch"


def test_bench_experts_runs_small(capsys):
    """`python -m inference.tools.bench experts` at a small size: the figures the issue names, the bandwidth
    read in turns with the decode (one share per round), the bad combination refused in one line. Figures
    are printed, never asserted."""
    from inference.tools.bench import experts as bench_experts
    r = bench_experts.main(["--experts", "6", "--steps", "5", "--rounds", "3", "--tokens", "8", "--subset",
                            "2", "--bandwidth-gib", "0.05", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out == r and {"read_bandwidth_gbs", "routed_decode_gbs", "prefill_tokens_per_s",
                         "peak_rss_bytes"} <= set(out)
    assert len(out["routed_decode_fraction_rounds"]) == 3
    assert all(out[k] > 0 for k in ("read_bandwidth_gbs", "routed_decode_gbs", "prefill_tokens_per_s",
                                    "peak_rss_bytes"))
    times = bench_experts.fp8_linear([1, 3], torch.Generator().manual_seed(0), n=64, k=256, copies=2)
    assert set(times) == {1, 3} and all(ms > 0 for pair in times.values() for ms in pair)
    with pytest.raises(SystemExit, match="--linear takes token counts >= 1 joined by commas, got 1,0"):
        bench_experts.main(["--linear", "1,0"])
    with pytest.raises(SystemExit, match=r"need 1 <= --rounds \(4\) <= --steps \(3\)"):
        bench_experts.main(["--steps", "3", "--rounds", "4"])
    with pytest.raises(SystemExit, match="--bandwidth-gib must be a positive size, got 0"):
        bench_experts.main(["--bandwidth-gib", "0"])


# ---- bf16 weights, the team of threads, the fused Linears, the Sinkhorn passes: --cpu-linears stored ----

@pytest.mark.parametrize("variant", NATIVE)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_bf16_weights_match_spec_within_the_summation_bound(variant, m, x_dtype):
    """bf16_linear (the head, wo_a, the router from their stored 2 bytes a weight) against the GEMM on the
    widened weight: the same products, fp32 sums in another order; one FMA rounds each addition (with its
    product exact inside, or rounded once more by a GEMM without FMA): within (2 (K - 1) + 1) u sum|p|.
    Grouped (wo_a): each group its own weight; 1 .. 9 tokens (tiles of 4 and the rest)."""
    gen = torch.Generator().manual_seed(m + 10 * (x_dtype == torch.float32))
    k, n = 160, 37
    x = (torch.randn(m, k, generator=gen) * 3).to(x_dtype)
    w = torch.randn(n, k, generator=gen).bfloat16()
    got, spec = he.bf16_linear(x, [w], variant), he.bf16_linear_torch(x, [w])
    assert got.shape == (m, n) and got.dtype == torch.float32
    abs_p = x.double().abs() @ w.double().abs().t()
    assert ((got.double() - spec.double()).abs() <= (2 * (k - 1) + 1) * U * 1.01 * abs_p).all()
    xg = (torch.randn(m, 3, k, generator=gen) * 3).to(x_dtype)                 # [M, G, K]
    ws = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(3)]
    got, spec = he.bf16_linear(xg, ws, variant), he.bf16_linear_torch(xg, ws)
    abs_p = torch.stack([xg[:, g].double().abs() @ w.double().abs().t() for g, w in enumerate(ws)], 1)
    assert got.shape == (m, 3, n)
    assert ((got.double() - spec.double()).abs() <= (2 * k - 1) * U * 1.01 * abs_p).all()
    with pytest.raises(ValueError, match="bf16_linear takes x"):
        he.bf16_linear(x, [w.float()], variant)


@pytest.mark.parametrize("variant", NATIVE)
def test_the_team_of_threads_gives_each_call_its_numbers(variant):
    """The kernel's threads are started once and woken per call (host_experts.c team_*): calls with 1 to 4
    threads and sizes of 1 to 40 chunks, from two Python threads at once (one runs alone while the other
    holds the team), and from a forked child after the parent used them, each give the numbers of a call with
    one thread (the same sums: every row is one thread's)."""
    import concurrent.futures
    import multiprocessing as mp
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(40 * 256, 64, generator=gen).bfloat16()
    x = torch.randn(1, 64, generator=gen).bfloat16()
    alone = he.bf16_linear(x, [w], variant)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3, 4, 2, 1):
            torch.set_num_threads(t)
            for rows in (1, 256, 257, 40 * 256):
                assert torch.equal(he.bf16_linear(x, [w[:rows]], variant), alone[:, :rows])
        torch.set_num_threads(2)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda _: he.bf16_linear(x, [w], variant), range(16)))
        assert all(torch.equal(o, alone) for o in outs)
        ctx = mp.get_context("fork")
        with ctx.Pool(1) as child:
            got = child.apply_async(_child_call, (x, w, variant)).get(timeout=60)
        assert got == alone.tolist()
    finally:
        torch.set_num_threads(threads)


def _child_call(x, w, variant):
    """(In a forked child: no torch operation that starts OpenMP threads, which hang after a fork.)"""
    torch.set_num_threads(2)
    return he.bf16_linear(x, [w], variant).tolist()


@pytest.mark.parametrize("kind", ["fp4", "fp8"])
def test_linears_that_read_one_x_share_a_kernel_call(kind):
    """StoredLinears.linears (wq_a with wkv, an expert's w1 with w3): one kernel call, the numbers of each
    Linear alone bit for bit (each output row's sum is the same whatever else the call computes)."""
    from inference.config import RuntimeOptions
    from inference.kernels import numerics_for
    from inference.kernels.numerics import Derived, Held
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 2, 160, generator=gen) * 3).bfloat16()
    helds = []
    for n in (70, 37):
        w, s = stored(kind, 1, n, 160, gen)
        wt = w[0].view(torch.float8_e4m3fn) if kind == "fp8" else w[0].view(torch.float4_e2m1fn_x2)
        helds.append(Held(wt, s[0].view(torch.float8_e8m0fnu), kind, Derived()))
    for order in ("fast", "reference"):
        nx = numerics_for(RuntimeOptions.from_profile(order, experts_on="host", cpu_linears="stored"), "cpu")
        together = nx.linears(helds, x)
        assert len(together) == 2 and all(torch.equal(t, nx.linear(h, x)) for t, h in zip(together, helds))


def test_sinkhorn_passes_in_c_are_the_torch_loops_within_rounding():
    """native.sinkhorn_passes against fast.sinkhorn_passes (its specification): the same divisions, each sum
    in index order instead of torch's: within 4 fp32 ulps of 1, the rows' and columns' sum (measured: at most
    2 over 48,000 random matrices; a small entry's relative difference reaches some 50 ulps of itself, its
    row's rounding carried into it), over tokens of every scale of logits; every column sums to 1 after the
    last pass."""
    from inference.kernels import fast
    lib = native.sinkhorn_library()
    assert lib is not None
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        mixes = torch.randn(n, 24, generator=gen) * float(2 ** torch.randint(-4, 5, (1,), generator=gen))
        scale, base = torch.randn(3, generator=gen), torch.randn(24, generator=gen)
        _, _, comb = fast.sinkhorn_gates(mixes, scale, base, 4, 1e-6)
        want = fast.sinkhorn_passes(comb.clone(), 20, 1e-6)
        got = native.sinkhorn_passes(lib, comb, 20, 1e-6)
        assert (got - want).abs().max() <= 4 * 2.0 ** -23
        assert (got.sum(-2) - 1).abs().max() < 1e-5                # the last pass normalises the columns


def test_fast_stored_linears_use_the_bf16_and_sinkhorn_kernels_within_their_bounds():
    """The fast order with --cpu-linears stored: its head (held in bf16) / router / wo_a GEMMs on bf16
    weights and its Sinkhorn against the fast order's own (within the bounds above); the exact order with the
    same option keeps the head in fp32 and gives the exact order's bits (a bf16 weight widened is the fp32
    copy's value)."""
    from inference.config import RuntimeOptions
    from inference.kernels import numerics_for
    from inference.kernels.numerics import Derived
    gen = torch.Generator().manual_seed(1)
    fast_nx = numerics_for(RuntimeOptions.from_profile("fast"), "cpu")
    stored = RuntimeOptions.from_profile("fast", experts_on="host", cpu_linears="stored")
    stored_nx = numerics_for(stored, "cpu")
    exact = numerics_for(RuntimeOptions.from_profile("reference"), "cpu")
    exact_stored = numerics_for(RuntimeOptions.from_profile("reference", experts_on="host",
                                                            cpu_linears="stored"), "cpu")
    assert stored_nx.head_dtype == torch.bfloat16 and exact_stored.head_dtype == torch.float32
    x = torch.randn(2, 3, 256, generator=gen).bfloat16()
    w = torch.randn(50, 256, generator=gen).bfloat16()
    want = fast_nx.dense(x.float(), w.float(), Derived())
    got = stored_nx.dense(x.float(), w, Derived())
    abs_p = x.float().double().abs() @ w.double().abs().t()
    assert ((got.double() - want.double()).abs() <= 511 * U * 1.01 * abs_p).all()
    assert torch.equal(exact_stored.dense(x.float(), w, Derived()),
                       exact.dense(x.float(), w.float(), Derived()))
    got = stored_nx.router_logits(x[0], w, Derived())
    assert ((got.double() - want[0].double()).abs() <= 511 * U * 1.01 * abs_p[0]).all()
    assert torch.equal(exact_stored.router_logits(x[0], w, Derived()),
                       exact.router_logits(x[0], w, Derived()))
    xg = torch.randn(1, 2, 4, 64, generator=gen).bfloat16()
    wg = torch.randn(4 * 16, 64, generator=gen).bfloat16()
    want = fast_nx.grouped_linear(xg, wg, 4, Derived())
    got = stored_nx.grouped_linear(xg, wg, 4, Derived())
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    ulp = bf16_ulp(torch.maximum(got.double().abs(), want.double().abs()))
    assert ((got.double() - want.double()).abs() <= ulp + 1e-6).all()
    mixes = torch.randn(3, 24, generator=gen)
    scale, base = torch.randn(3, generator=gen), torch.randn(24, generator=gen)
    a, b = stored_nx.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6), \
        fast_nx.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[2] - b[2]).abs().max() <= 4 * 2.0 ** -23
