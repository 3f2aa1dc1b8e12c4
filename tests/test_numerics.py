"""Number formats and kernels against the worked examples of docs/numerics.md and independent computations."""
import math

import pytest
import torch

from inference.state import window_decode_idx, window_prefill_idx
from inference.config import RuntimeOptions
from inference.kernels import numerics_for
from inference.indexer import select_candidate_blocks, topk_indices
from inference.kernels.reference import (act_quant, block_scaled_gemm, fp4_qdq_e4m3_, fp4_qdq_e8m0_,
                                        fp8_qdq_)
from inference.quant import (C6, C448, FP4_MAX, FP8_MAX, ceil_pow2, dequant_fp4_weight, e2m1_round,
                             float_to_ue8m0, pow2_scale, ue8m0_to_float, unpack_fp4)
from inference.rope import apply_rotary_, precompute_freqs_cis
from inference.kernels.reference import hc_split_sinkhorn, sparse_attn

NX = numerics_for(RuntimeOptions(), "cpu")      # the exact order


def bf16(values):
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)


def test_act_quant_worked_example():
    # docs/numerics.md §2: one group with amax 3.0 -> scale 2^-7
    x = torch.zeros(32)
    x[:5] = torch.tensor([3.0, 1.234375, 0.30078125, -0.010009765625, 1.00136e-5])
    q, s = act_quant(x.to(torch.bfloat16))
    assert s.item() == 2.0 ** -7
    deq = q.float()[:5] * s
    expect = [3.0, 1.25, 0.3125, -0.009765625, 1.52587890625e-5]
    assert deq.tolist() == pytest.approx(expect, rel=0, abs=0)


def test_act_quant_edges():
    _, s = act_quant(torch.zeros(1, 32, dtype=torch.bfloat16))
    assert s.item() == 2.0 ** -22                          # amax floor 1e-4
    x = torch.zeros(32, dtype=torch.bfloat16)
    x[0] = 448 * 2.0 ** 3                                 # a = 448 * 2^k -> s = 2^k exactly, value 448
    q, s = act_quant(x)
    assert s.item() == 8.0 and q.float()[0].item() == 448.0


def test_ceil_pow2_and_ue8m0():
    y = torch.tensor([1.0, 1.5, 1.45, 0.75, 2.0 ** -20 * 1.01])
    assert ceil_pow2(y).tolist() == [1.0, 2.0, 2.0, 1.0, 2.0 ** -19]
    # against frexp (y = m 2^e, m in [0.5, 1): 2^(e-1) when m = 1/2, else 2^e) over every normal exponent,
    # both signs; a subnormal gives the smallest normal, 2^-126
    y = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-37, 38, 4096)
    pow2 = torch.ldexp(torch.ones(254), torch.arange(-126, 128))
    ulp_off = [torch.nextafter(pow2, pow2 * 2), torch.nextafter(pow2, pow2 / 2)]
    y = torch.cat([y, -y, pow2, *ulp_off])
    normal = y.abs() >= 2.0 ** -126
    m, e = torch.frexp(y[normal].abs())
    assert torch.equal(ceil_pow2(y[normal]), torch.ldexp(torch.ones_like(m), e - (m == 0.5).int()))
    assert (~normal).sum() > 0 and (ceil_pow2(y[~normal]) == 2.0 ** -126).all()
    # a plain cast rounds to nearest (1.45 -> 1): the pitfall the bit rule avoids
    assert torch.tensor([1.45]).to(torch.float8_e8m0fnu).float().item() == 1.0
    assert ue8m0_to_float(torch.tensor([0, 127, 130], dtype=torch.uint8)).tolist() == [2.0 ** -127, 1.0, 8.0]
    assert ue8m0_to_float(float_to_ue8m0(torch.tensor([0.25, 4.0]))).tolist() == [0.25, 4.0]


def test_pow2_scale_is_the_clamp_the_quotient_and_ceil_pow2():
    """pow2_scale (three operations on amax's bits) against the clamp, amax / top (multiplied by fl(1 / top),
    as the reference does, and divided, as the cache does) and ceil_pow2, for both tops: every fp32 mantissa
    in the floor's binade, in [1, 2) and in the largest binade, the floor's neighbours and zero."""
    m = torch.arange(1 << 23, dtype=torch.int32)
    for top, floor, recip in ((FP8_MAX, 1e-4, C448), (FP4_MAX, 6 * 2.0 ** -126, C6)):
        e_floor = int(torch.tensor(floor).view(torch.int32)) >> 23
        near = torch.tensor([0.0, floor]).nextafter(torch.tensor([1.0, 0.0]))
        for e in (e_floor, 127, 254):
            a = torch.cat([(m | (e << 23)).view(torch.float32), near, torch.tensor([0.0, floor])])
            got = pow2_scale(a, floor, top)
            assert torch.equal(got, ceil_pow2(a.clamp_min(floor) * recip)), (top, e)
            assert torch.equal(got, ceil_pow2(a.clamp_min(floor) / top)), (top, e)


def test_e2m1_ties_to_even():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 5.1, -1.75, -0.25])
    assert e2m1_round(v).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, -2.0, -0.0]


def test_e2m1_round_is_the_nearest_grid_value_by_midpoints():
    """e2m1_round (divide by the binade's step, round half to even) against the grid's midpoints written
    out, where a tie goes to the even code: every fp32 in [-6, 6] whose low 12 mantissa bits are one of six
    patterns (the ties have them all zero), signed zeros included, bit for bit."""
    def by_midpoints(v):
        a = v.abs()
        r = torch.where(a <= 0.25, 0.0, torch.where(a < 0.75, 0.5, torch.where(a <= 1.25, 1.0, torch.where(
            a < 1.75, 1.5, torch.where(a <= 2.5, 2.0, torch.where(a < 3.5, 3.0, torch.where(a <= 5.0, 4.0,
                                                                                           6.0)))))))
        return torch.copysign(r, v)
    high = torch.arange(0, 0x40C00000 >> 12, dtype=torch.int64) << 12          # 6.0 is 0x40C00000
    v = torch.cat([(high | low).to(torch.int32) for low in (0, 1, 0x7FF, 0x800, 0x801, 0xFFF)])
    v = v.view(torch.float32)
    v = torch.cat([v[v <= 6.0], -v[v <= 6.0]])
    assert torch.equal(e2m1_round(v).view(torch.int32), by_midpoints(v).view(torch.int32))


@pytest.mark.parametrize("amax,expect", [
    (5.0, {5.0: 4.0, 4.90625: 4.0, 3.296875: 3.0, 2.5: 2.0, 1.25: 1.0, 0.75: 1.0, -1.75: -2.0, 0.25: 0.0,
           3.5: 4.0}),
    (10.0, {10.0: 8.0, 4.90625: 4.0, 3.296875: 3.0, 2.5: 2.0, 1.25: 1.0, 0.75: 1.0, -1.75: -2.0, 0.25: 0.0,
            3.5: 4.0}),
])
def test_fp4_e8m0_worked_example(amax, expect):
    # docs/numerics.md §4.5: each row is one group holding amax and the probe value
    for value, out in expect.items():
        x = torch.zeros(32)
        x[0], x[1] = amax, value
        x = fp4_qdq_e8m0_(x.to(torch.bfloat16))
        assert x[1].item() == out, (amax, value)


def test_fp4_e4m3_worked_example():
    x = torch.zeros(16)
    x[:6] = torch.tensor([5.0, 2.5, 3.296875, 0.75, -1.0, 0.1])
    x = fp4_qdq_e4m3_(x.to(torch.bfloat16))
    assert x[:6].float().tolist() == [4.875, 2.4375, 3.25, 0.8125, -0.8125, 0.0]
    z = fp4_qdq_e4m3_(torch.zeros(16, dtype=torch.bfloat16))
    assert z.abs().sum() == 0


def test_fp8_qdq_is_dequantized_act_quant():
    torch.manual_seed(0)
    x = torch.randn(3, 64).to(torch.bfloat16)
    q, s = act_quant(x)
    expect = (q.float().view(3, 2, 32) * s.unsqueeze(-1)).view(3, 64)
    assert torch.equal(fp8_qdq_(x.clone()).float(), expect)


def test_fp4_unpack_low_nibble_first():
    b = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)    # codes 1,2 then 8 (-0), 15 (-6)
    vals = unpack_fp4(b.view(torch.float4_e2m1fn_x2))
    assert vals.tolist() == [[0.5, 1.0, -0.0, -6.0]]
    s = torch.full((1, 1), 128, dtype=torch.uint8).view(torch.float8_e8m0fnu)   # 2.0
    w = torch.tensor([[0x21] * 16], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    assert dequant_fp4_weight(w, s)[0, :2].tolist() == [1.0, 2.0]


def test_block_gemm_matches_exact_blockwise_sum():
    torch.manual_seed(1)
    x = torch.randn(5, 96).to(torch.bfloat16)
    w = (torch.randn(40, 96) * 0.1).to(torch.float8_e4m3fn).float()
    q, s = act_quant(x)
    a = (q.float().view(5, 3, 32) * s.unsqueeze(-1)).double()
    ref = sum(a[:, kb] @ w.double().view(40, 3, 32)[:, kb].T for kb in range(3))
    out = block_scaled_gemm(x, w)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), ref, rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("rows", [3, 70])      # below and above reference.BLOCKWISE_OUTPUTS: both ways
def test_block_gemm_sums_each_block_in_k_order_then_the_blocks_in_k_order(rows):
    """The exact order, computed element by element: within a 32-block the exact products added one by one
    from zero in increasing k, in fp32; the blocks' sums added in increasing K order; then bf16."""
    from inference.kernels import reference
    n = 2048
    assert 3 * n < reference.BLOCKWISE_OUTPUTS <= 70 * n
    torch.manual_seed(2)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    w = (torch.randn(n, 96) * 0.1).to(torch.float8_e4m3fn).float()
    q, s = act_quant(x)
    a = (q.float().view(rows, 3, 32) * s.unsqueeze(-1)).view(rows, 96)
    acc = None
    for kb in range(3):
        part = torch.zeros(rows, n)
        for k in range(32 * kb, 32 * kb + 32):
            part = part + a[:, k:k + 1] * w[:, k]                       # exact products, fp32 adds
        acc = part if acc is None else acc + part
    assert torch.equal(block_scaled_gemm(x, w).view(torch.int16), acc.to(torch.bfloat16).view(torch.int16))


def naive_attention(q, kv, sink, idx, scale):
    """Plain float64 softmax over the listed rows with the sink in the denominator."""
    b, m, h, d = q.shape
    out = torch.zeros(b, m, h, d, dtype=torch.float64)
    for bi in range(b):
        for mi in range(m):
            ids = [i for i in idx[bi, mi].tolist() if i >= 0]
            if not ids:
                continue
            rows = kv[bi, ids].double()
            s = q[bi, mi].double() @ rows.T * scale                  # [h, n]
            mx = s.amax(-1, keepdim=True)
            p = torch.exp(s - mx)
            den = p.sum(-1, keepdim=True) + torch.exp(sink.double().view(h, 1) - mx)
            out[bi, mi] = (p / den) @ rows
    return out


def test_sparse_attention_against_naive_softmax():
    torch.manual_seed(2)
    b, m, h, d, n = 2, 3, 4, 64, 150
    q = torch.randn(b, m, h, d).to(torch.bfloat16)
    kv = torch.randn(b, n, d).to(torch.bfloat16)
    sink = torch.randn(h)
    idx = torch.randint(0, n, (b, m, 130), dtype=torch.int32)
    idx[0, 1, 100:] = -1
    idx[1, 2, :] = -1                                          # a row with nothing to attend
    out = sparse_attn(q, kv, sink, idx, d ** -0.5)
    ref = naive_attention(q, kv, sink, idx, d ** -0.5)
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert out[1, 2].abs().sum() == 0
    # appending -1 entries never changes the result, bit for bit
    padded = torch.cat([idx, torch.full((b, m, 70), -1, dtype=torch.int32)], dim=-1)
    assert torch.equal(sparse_attn(q, kv, sink, padded, d ** -0.5), out)


def test_sinkhorn_split():
    torch.manual_seed(3)
    m = torch.randn(7, 24) * 0.5
    pre, post, comb = hc_split_sinkhorn(m, torch.ones(3), torch.zeros(24), 4, 20, 1e-6)
    assert (pre > 0).all() and (pre < 1 + 1e-6 + 1e-7).all() and (post > 0).all() and (post < 2).all()
    assert torch.allclose(comb.sum(-1), torch.ones(7, 4), atol=1e-5)
    assert torch.allclose(comb.sum(-2), torch.ones(7, 4), atol=1e-5)
    # independent float64 evaluation of the same recurrence (docs/numerics.md §8)
    c = m[:, 8:].double().view(7, 4, 4)
    c = torch.softmax(c, -1) + 1e-6
    c = c / (c.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        c = c / (c.sum(-1, keepdim=True) + 1e-6)
        c = c / (c.sum(-2, keepdim=True) + 1e-6)
    assert torch.allclose(comb.double(), c, atol=1e-6)


def test_yarn_frequencies_released():
    f = precompute_freqs_cis(64, 2, 160000, 65536, 16, 32, 1, nx=NX)[1].angle()   # angle at 1 = frequency
    assert f[0].item() == pytest.approx(1.0, rel=1e-7)
    assert f[16].item() == pytest.approx(0.0022656249, rel=1e-6)
    assert f[25].item() == pytest.approx(5.3723124e-06, rel=1e-6)
    assert f[31].item() == pytest.approx(5.6805294e-07, rel=1e-6)
    plain = precompute_freqs_cis(64, 2, 10000, nx=NX)[1].angle()
    assert plain[1].item() == pytest.approx(10000 ** (-2 / 64), rel=1e-6)


def test_rotary_interleaved_pairs_and_inverse():
    x = torch.zeros(1, 1, 1, 4, dtype=torch.float32)
    x[..., 0] = 1.0                                           # pair 0 = 1 + 0j
    f = precompute_freqs_cis(4, 3, 10000, nx=NX)[2:3]                # position 2, angle 2 rad on pair 0
    y = apply_rotary_(x.clone(), f, NX)
    assert y[0, 0, 0, :2].tolist() == pytest.approx([math.cos(2), math.sin(2)], abs=1e-6)
    z = apply_rotary_(y.clone(), f, NX, inverse=True)
    assert torch.allclose(z, x, atol=1e-6)


def test_window_index_lists():
    assert window_prefill_idx(3, 128).tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2]]
    assert window_prefill_idx(6, 4).tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3],
                                                 [1, 2, 3, 4], [2, 3, 4, 5]]
    assert window_decode_idx(5, 4).tolist() == [2, 3, 0, 1]
    assert window_decode_idx(2, 4).tolist() == [-1, 0, 1, 2]


def test_deterministic_topk_is_the_head_of_a_stable_descending_sort():
    """topk_indices(deterministic=True) against its definition, on rows full of exact ties (±inf, ±0, values
    rounded to bf16 and to integers) and on plain random rows, in fp32 and bf16, for every k."""
    gen = torch.Generator().manual_seed(0)
    levels = torch.tensor([-math.inf, -2.0, -0.0, 0.0, 0.5, 1.0, math.inf])
    for trial in range(300):
        rows, cols = (int(torch.randint(1, n, (1,), generator=gen)) for n in (4, 70))
        shape = (rows, cols)
        x = [levels[torch.randint(0, len(levels), shape, generator=gen)],
             torch.randn(shape, generator=gen).bfloat16().float().round(),
             torch.randn(shape, generator=gen)][trial % 3]
        for k in (1, int(torch.randint(1, shape[1] + 1, (1,), generator=gen)), shape[1]):
            for y in (x, x.bfloat16()):
                want = torch.sort(y, dim=-1, descending=True, stable=True).indices[..., :k]
                assert torch.equal(topk_indices(y, k, deterministic=True), want), (y, k)


def test_candidate_blocks_example():
    inf = float("inf")
    score = torch.tensor([[[0.5, 0.1, -1, 2.0, 0.3, 0.2, 0.9, 0.0, 1.5, -inf, -inf, -inf]]])
    mask = select_candidate_blocks(score, torch.tensor([9]), n_blocks=2, block=4)
    assert mask.int().tolist() == [[[1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]]]
