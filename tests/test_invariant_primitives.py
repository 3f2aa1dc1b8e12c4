"""The invariant-numerics primitives (inference/kernels/invariant.py) against independent computations."""
import math

import numpy as np
import pytest
import torch

from inference.kernels import invariant as inv


def canonical_sum_reference(values, chunks=8):
    """The canonical tree written out with numpy float32 scalars (independent of the code): gcd(n, 8) chunks,
    each a pairwise tree of neighbours (zero-padded to a power of two), then a pairwise tree of the chunks."""
    f = np.float32

    def pairwise(v):
        p = 1
        while p < len(v):
            p *= 2
        v = list(v) + [f(0)] * (p - len(v))
        while len(v) > 1:
            v = [f(v[i] + v[i + 1]) for i in range(0, len(v), 2)]
        return v[0]

    n = len(values)
    k = math.gcd(n, chunks)
    c = n // k
    return pairwise([pairwise(values[i * c:(i + 1) * c]) for i in range(k)])


@pytest.mark.parametrize("n", [1, 3, 8, 13, 64, 100, 511])
def test_tree_sum_is_the_canonical_tree(n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(5, n, generator=g) * torch.logspace(-4, 4, n)).float()
    got = inv.tree_sum(x)
    for row in range(5):
        want = canonical_sum_reference([np.float32(v) for v in x[row].tolist()])
        assert got[row].item() == float(want)


def padded_pairwise(x):
    """The pairwise tree over the last dimension as first written: zero-padded to 2^k, neighbours added."""
    n = x.shape[-1]
    x = torch.nn.functional.pad(x, (0, (1 << max(0, (n - 1).bit_length())) - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def bits(t):
    return t.contiguous().view(torch.int64 if t.dtype == torch.float64 else torch.int32)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 12, 33])
def test_pairwise_along_any_dim_and_list_dot_are_the_padded_tree(n):
    """The tree without padding (an odd one out + 0) gives the padded tree's bits, signed zeros included,
    along any dimension; list_dot gives list_sum's bits of the products it never forms whole."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, 6, generator=g, dtype=torch.float64) * 1e3
    x[x.abs() < 300] = -0.0
    x[0] = -0.0                                   # a row of -0 only: the padding makes it +0
    want = padded_pairwise(x.movedim(1, -1))      # [4, 6]
    assert torch.equal(bits(inv._pairwise(x, 1)), bits(want))
    assert torch.equal(bits(inv.tree_sum(x.float(), 1)), bits(inv.tree_sum(x.float().movedim(1, -1))))
    a = torch.randn(4, n, 1, generator=g).bfloat16().double()
    b = torch.randn(1, n, 6, generator=g).bfloat16().double()
    b[:, ::3] = -0.0
    assert torch.equal(bits(inv.list_dot(a, b, 1)), bits(padded_pairwise((a * b).movedim(1, -1)) + 0.0))
    assert torch.equal(bits(inv.list_dot(a, b, 1)), bits(inv.list_sum(a * b, 1)))


class FakePar:
    """Stands in for W ranks: all_gather_cat returns what each rank's local subtree gives."""

    def __init__(self, world_size, locals_):
        self.world_size, self.locals = world_size, locals_

    def all_gather_cat(self, t, dim):
        chunks = math.gcd(sum(x.shape[-1] for x in self.locals), 8) // self.world_size
        parts = [inv._pairwise(inv.chunk_sums(x, chunks)).unsqueeze(-1) for x in self.locals]
        assert torch.equal(parts[0], t)            # the caller is rank 0
        return torch.cat(parts, dim=dim)


@pytest.mark.parametrize("w, n", [(2, 256), (4, 256), (8, 256), (2, 4), (2, 6), (4, 12)])
def test_split_reduction_reproduces_w1(w, n):
    g = torch.Generator().manual_seed(w)
    x = torch.randn(3, 7, n, generator=g) * 10
    parts = list(x.chunk(w, dim=-1))
    got = inv.tree_sum_split(parts[0], FakePar(w, parts))
    assert torch.equal(got, inv.tree_sum(x))


def test_tree_sum_does_not_depend_on_threads_batch_or_neighbours():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 1000, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = inv.tree_sum(x)
        torch.set_num_threads(2)
        two = inv.tree_sum(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(torch.stack([inv.tree_sum(x[i]) for i in range(16)]), one)


def test_linear_rows_alone_equal_rows_in_a_batch():
    """torch's fp32 GEMM may round a row differently inside a batch (seen on some CPUs); this one cannot."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 300, generator=g)
    w = torch.randn(70, 300, generator=g)
    batch = inv.linear(x, w)
    alone = torch.cat([inv.linear(x[i:i + 1], w) for i in range(9)])
    assert torch.equal(batch, alone)
    exact = (x.double() @ w.double().T)                             # fp64: within rounding of the true sum
    assert torch.allclose(batch.double(), exact, rtol=1e-5, atol=1e-4)


def test_block_partials_are_exact():
    """FP8 x FP8 block partials: an fp64 GEMM in any order and an exact integer computation agree."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 64, generator=g).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    w = torch.randn(6, 64, generator=g).mul(30).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    got = inv.block_partials(q, inv.PreparedWeight.of(w).wt)       # [4, 6, 2]
    # E4M3 values are multiples of 2^-9: scaled to integers the block sums are exact in int64.
    qi, wi = (q * 512).long(), (w * 512).long()
    want = torch.stack([(qi[:, None, b * 32:(b + 1) * 32] * wi[None, :, b * 32:(b + 1) * 32]).sum(-1)
                        for b in range(2)], -1).double() / 512 ** 2
    assert torch.equal(got, want.float())


def test_exp_log_sigmoid_silu_softplus_against_double_math():
    x = torch.linspace(-30, 30, 20001, dtype=torch.float32)
    for name, fn in (("exp", math.exp), ("sigmoid", lambda v: 1 / (1 + math.exp(-v))),
                     ("silu", lambda v: v / (1 + math.exp(-v))),
                     ("softplus", lambda v: v if v > 20 else math.log1p(math.exp(v)))):
        got = getattr(inv, name)(x)
        want = torch.tensor([fn(v) for v in x.double().tolist()], dtype=torch.float64).float()
        ulp = (want.double().abs() * 2.0 ** -23).clamp_min(2.0 ** -149)
        err = ((got.double() - want.double()).abs() / ulp).max().item()
        assert err <= 1.0, (name, err)                              # at most one fp32 ulp from the true value
        assert (got == want).float().mean().item() > 0.999, name    # and almost always correctly rounded
    assert inv.exp(torch.tensor([float("-inf"), float("nan"), 100.0])).tolist()[0] == 0.0
    assert math.isnan(inv.exp(torch.tensor([float("nan")])).item())
    assert math.isinf(inv.exp(torch.tensor([100.0])).item())


def test_softmax_sums_to_one_and_matches_torch_closely():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 33, generator=g) * 5
    p = inv.softmax(x)
    assert torch.allclose(p, torch.softmax(x, -1), rtol=1e-6, atol=1e-7)
    assert torch.allclose(inv.tree_sum(p), torch.ones(7), atol=1e-6)


def test_linear_fast_and_elementwise_paths_agree():
    """The bmm path is taken only where a block's sum is exact; the elementwise path computes the same
    definition. Rows with a huge dynamic range inside a block take the elementwise path."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 96, generator=g).bfloat16()
    x[3, 5] = 1e30                                                   # row 3: products span > 2^31
    x[3, 6] = 1e-30
    w = torch.randn(40, 96, generator=g).bfloat16()
    got = inv.linear(x, w, torch.float32)
    prod = x.double()[:, None, :] * w.double()[None]                 # the definition, written out
    blocks = inv._pairwise(prod.unflatten(-1, (3, 32))) + 0.0
    want = inv.tree_sum(blocks).float()
    assert torch.equal(got, want)


def test_rope_sin_cos_and_pow_against_double_math():
    """The RoPE table's cos / sin and the frequencies' powers, from basic operations, round to the same fp32
    as the C library's double functions here (which may use FMA or not, machine by machine)."""
    x = torch.cat([torch.linspace(-100, 100, 4001), torch.linspace(0, 65535, 4001)]).float().double()
    s, c = inv._sincos64(x)
    assert (s - torch.tensor([math.sin(v) for v in x.tolist()], dtype=torch.float64)).abs().max() < 1e-15
    assert (c - torch.tensor([math.cos(v) for v in x.tolist()], dtype=torch.float64)).abs().max() < 1e-15
    e = torch.arange(0, 64, 2).double() / 64
    want = torch.tensor([math.pow(160000.0, v) for v in e.tolist()], dtype=torch.float64)
    assert ((inv.pow_(160000.0, e) - want) / want).abs().max() < 1e-14
