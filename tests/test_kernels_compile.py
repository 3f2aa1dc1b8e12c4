"""The TileLang kernels without a GPU: every kernel lowers and compiles for sm_90a (nvcc only), the lowered
code has the structure the numerics rely on, the kernels' scalar helpers and two whole kernels run on the CPU
through TileLang's C target against the torch reference, the wrappers reject bad arguments before any
launch, tilelang is imported only on use, and the device check's no-CUDA path."""
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from conftest import ROOT

ARCH = "sm_90a"
# One build per kernel; the GEMMs in both tile configurations (they are different code).
KERNELS = ["act_quant", "fp8_qdq_", "fp4_qdq_e8m0_", "fp4_qdq_e4m3_", "fp8_gemm/decode", "fp8_gemm/prefill",
           "fp4_gemm/decode", "fp4_gemm/prefill", "expert_gemm", "sparse_attn", "hc_split_sinkhorn",
           "index_scores"]
# What the lowered CUDA must contain: one FP8 tensor-core MMA per 32-wide K block (the block partial sums),
# separately rounded multiply/add where FMA contraction would change bits, the saturating E4M3 casts.
SOURCE_MARKS = {
    "fp8_gemm": r"wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, "
                r"\d+, \d+, 32,",
    "fp4_gemm": r"wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, "
                r"\d+, \d+, 32,",
    "expert_gemm": r"Exp\[(.|\n)*wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, "
                   r"tl::DataType::kFloat32, \d+, \d+, 32,",
    "sparse_attn": r"__fmul_rn\(.*\n(.|\n)*expf\(",
    "hc_split_sinkhorn": r"__fadd_rn\(__fmul_rn\(",
    "act_quant": r"\(fp8_e4_t\)",
    "fp8_qdq_": r"\(fp8_e4_t\)",
    "fp4_qdq_e4m3_": r"\(fp8_e4_t\)",
    "fp4_qdq_e8m0_": r"copysignf\(",
    "index_scores": r"wgmma_ss<tl::DataType::kBFloat16",
}


@pytest.fixture(scope="module")
def ops():
    try:
        import tilelang
        from inference.kernels import tilelang_ops
    except ImportError as e:
        pytest.fail(f"tilelang is not importable ({e}): pip install -r requirements.txt (tilelang==0.1.15)")
    tilelang.disable_cache()          # compile for real, write nothing to ~/.tilelang
    yield tilelang_ops
    tilelang.enable_cache()


@pytest.fixture(scope="module")
def nvcc(ops):
    if ops.nvcc_path() is None:
        pytest.fail(f"no nvcc: {ops.NVCC_HINT}")


@pytest.fixture(scope="module")
def released():
    with open(os.path.join(ROOT, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def test_every_kernel_has_a_compile_test(ops):
    assert {k.split("/")[0] for k in KERNELS} == set(ops.FACTORIES)


@pytest.fixture(scope="module")
def lowered(ops, nvcc, released):
    """{kernel: its CUDA source for sm_90a}: every build of KERNELS through TileLang's passes and code
    generation, as tilelang.compile runs them, without nvcc (test_every_kernel_compiles_for_sm90a runs it
    once for all)."""
    import tilelang
    from tvm.target import Target
    target = Target({"kind": "cuda", "arch": ARCH})
    out = {}
    for kernel in KERNELS:
        name, _, config = kernel.partition("/")
        build = next(b for b in ops.builds(released)
                     if b.name == name and (not config or b.args[-1] == config))
        with target:
            out[kernel] = tilelang.lower(build.prim_func(), target=target).kernel_source
    return target, out


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_lowers_to_the_numerics_structure(lowered, kernel):
    src = lowered[1][kernel]
    assert "__global__" in src
    name = kernel.split("/")[0]
    assert re.search(SOURCE_MARKS[name], src), f"{name}: the lowered CUDA lacks {SOURCE_MARKS[name]!r}"


def test_every_kernel_compiles_for_sm90a(lowered):
    """All the lowered sources in one translation unit, compiled by TileLang's own nvcc step (its flags and
    include paths, a cubin for sm_90a): the headers, which take most of nvcc's time, are parsed once instead
    of once per kernel (the 11 builds, lowering included: 28 s -> 15 s on 2 cores). Each kernel sits in a
    namespace named after it, its extern "C" entry renamed likewise, so an error names the kernel.
    test_compile_cli compiles one kernel the whole way through tilelang.compile."""
    from tilelang.cuda.backend import tilelang_callback_cuda_compile
    target, sources = lowered
    preludes, bodies, entries = [], [], []
    for kernel, src in sources.items():
        tag = re.sub(r"\W", "_", kernel)
        lines = src.splitlines()
        top = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
        preludes.append("\n".join(lines[:top]))       # the #include block (headers are include-guarded)
        body = "\n".join(lines[top:])
        for entry in set(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(',
                                    body)):
            body = re.sub(rf"\b{entry}\b", f"{entry}__{tag}", body)
            entries.append(f"{entry}__{tag}")
        bodies.append(f"namespace {tag} {{\n{body}\n}}  // namespace {tag}")
    head = "\n".join(dict.fromkeys(preludes)) + "\n"
    starts, line = [], head.count("\n") + 1                  # the first line of each kernel's block
    for kernel, body in zip(sources, bodies):
        starts.append((line, kernel))
        line += body.count("\n") + 1
    try:
        cubin = tilelang_callback_cuda_compile(head + "\n".join(bodies), target)
    except RuntimeError as e:
        bad = {next((k for first, k in reversed(starts) if first <= int(n)), "the #include block")
               for n in re.findall(r"\.cu\((\d+)\): error", str(e))}
        pytest.fail(f"nvcc failed for {ARCH} in {sorted(bad) or 'the headers'}:\n{str(e)[-3000:]}")
    assert len(entries) >= len(sources)
    missing = [e for e in entries if e.encode() not in bytes(cubin)]
    assert not missing, f"the {ARCH} cubin lacks the entries {missing}"


def test_compile_cli(nvcc, capsys):
    """The CLI (`python -m inference.kernels`, its main() run here: tilelang is imported already) compiles
    a named kernel (one line per build, exit 0) and rejects an unknown name."""
    from inference.kernels.__main__ import main
    assert main(["--compile", "--arch", ARCH, "--only", "fp8_qdq_"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("fp8_qdq_")]
    assert len(lines) == 1 and lines[0].endswith(" ok"), out
    assert "1/1 kernel builds ok for sm_90a" in out
    with pytest.raises(SystemExit) as e:
        main(["--list", "--only", "nope"])
    assert e.value.code == 2 and "unknown kernel(s) ['nope']" in capsys.readouterr().err


# ---- the kernels' arithmetic, run on the CPU through TileLang's C target ----

def test_scalar_helpers_on_cpu(ops):
    import tilelang
    import tilelang.language as T
    from inference.quant import E2M1_TABLE, ceil_pow2, e2m1_round, ue8m0_to_float
    n, i32, f32 = 256, "int32", "float32"

    @T.prim_func
    def helpers(Code: T.Tensor((n,), i32), Bits: T.Tensor((n,), i32), Y: T.Tensor((n,), f32),
                P: T.Tensor((n,), f32), U: T.Tensor((n,), f32), V: T.Tensor((n,), f32),
                E: T.Tensor((n,), f32)):
        with T.Kernel(1, threads=n):
            for i in T.Parallel(n):
                Bits[i] = ops._e2m1_code_to_e4m3_bits(Code[i] & 15)
                P[i] = ops._ceil_pow2(Y[i])
                U[i] = ops._ue8m0(T.Cast("uint8", Code[i]))
                E[i] = ops._e2m1_round(V[i])

    kernel = tilelang.compile(helpers, target="c")
    code = torch.arange(n, dtype=torch.int32)
    y = torch.rand(n, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, n)
    y[:7] = torch.tensor([1.0, 2.0, 0.5, 3.0, 448.0, 2.0 ** -126, 1.5])
    v = torch.linspace(-6, 6, n)      # with every tie of the E2M1 grid, both signs of zero, the ends
    v[:16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.0, 0.0, -2.5, 5.0001, 4.9999,
                           0.2500001, -6.0, 6.0])
    bits, p, u, e = (torch.empty(n, dtype=torch.int32), torch.empty(n), torch.empty(n), torch.empty(n))
    kernel(code, bits, y, p, u, v, e)
    e4m3_of_e2m1 = torch.tensor(E2M1_TABLE).to(torch.float8_e4m3fn).view(torch.uint8).int()
    assert torch.equal(bits, e4m3_of_e2m1[code % 16])
    assert torch.equal(p, ceil_pow2(y))
    # byte 255 is no scale (OCP MX: NaN; torch's float8_e8m0fnu gives NaN, the kernel's bit shift inf)
    assert torch.equal(u[:255], ue8m0_to_float(code.to(torch.uint8))[:255]) and u[255] == float("inf")
    assert torch.equal(e.view(torch.int32), e2m1_round(v).view(torch.int32))   # signed zeros included


def test_fp4_qdq_e8m0_kernel_on_cpu(ops):
    """The whole in-place FP4 kernel (fp32 storage: the C target has no bf16) against the reference, bit for
    bit, on rows from 1e-30 to 1e3 with an all-zero group, a negative zero and tiny negatives."""
    import tilelang
    from inference.kernels import reference as ref
    kernel = tilelang.compile(ops.fp4_qdq_e8m0_kernel(128, 32, "float32"), target="c")
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(257, 128, generator=gen) * torch.logspace(-30, 3, 257).unsqueeze(1)).bfloat16().float()
    x[3, :32], x[4, 5], x[5] = 0.0, -0.0, -1e-30
    y = x.clone()
    kernel(y)
    assert torch.equal(y.view(torch.int32), ref.fp4_qdq_e8m0_(x.clone(), 32).view(torch.int32))


def test_sinkhorn_kernel_on_cpu(ops):
    """The Sinkhorn kernel's operation order on the CPU (plain + and *, libm exp) against the fp32 reference
    and an fp64 evaluation: as close to fp64 as the reference is, and a few fp32 ulps from it."""
    import tilelang
    from inference.kernels import reference as ref
    kernel = tilelang.compile(ops.hc_sinkhorn_kernel(4, 20, 1e-6, ieee=False), target="c")
    gen = torch.Generator().manual_seed(0)
    mixes = torch.randn(300, 24, generator=gen) * 0.5
    scale, base = torch.rand(3, generator=gen) + 0.5, torch.randn(24, generator=gen) * 0.45
    pre, post, comb = torch.empty(300, 4), torch.empty(300, 4), torch.empty(300, 4, 4)
    kernel(mixes, scale, base, pre, post, comb)
    want = ref.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    exact = ref.hc_split_sinkhorn(mixes.double(), scale.double(), base.double(), 4, 20, 1e-6)

    def ulps(a, b):
        return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max().item()

    assert ulps(pre, want[0]) <= 2 and ulps(post, want[1]) <= 2 and ulps(comb, want[2]) <= 16
    rel = lambda a: ((a.double() - exact[2]).abs() / exact[2].abs()).max().item()   # noqa: E731
    assert rel(comb) <= max(2 * rel(want[2]), 1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(300, 4), atol=1e-5)       # columns end normalised


# ---- argument checks (CPU tensors: they run before any compilation or launch) ----

def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("call, message", [
    (lambda o: o.act_quant(torch.zeros(2, 64, dtype=torch.float16)),
     "act_quant: x must be bfloat16 or float32 [..., K] with K a multiple of 32, got float16 [2, 64] on cpu"),
    (lambda o: o.fp8_qdq_(_bf16(2, 48)), "fp8_qdq_: x must be bfloat16 or float32 [..., K] with K a"),
    (lambda o: o.fp4_qdq_e4m3_(torch.zeros(2, 64, dtype=torch.int32)), "fp4_qdq_e4m3_: x must be bfloat16"),
    (lambda o: o.fp8_gemm(_bf16(2, 64), _bf16(32, 64), torch.zeros(1, 2)),
     "fp8_gemm: weight must be float8_e4m3fn [N, K] with K = 64 (x's last dim), got bfloat16 [32, 64]"),
    (lambda o: o.fp8_gemm(_bf16(2, 64), torch.zeros(32, 64).to(torch.float8_e4m3fn), torch.zeros(1, 2)),
     "fp8_gemm: scale must be float8_e8m0fnu [1, 2], got float32 [1, 2] on cpu"),
    (lambda o: o.fp4_gemm(_bf16(2, 64), torch.zeros(32, 64).to(torch.float8_e4m3fn), torch.zeros(32, 2)),
     "fp4_gemm: weight must be float4_e2m1fn_x2 [N, K/2] with K = 64"),
    (lambda o: o.sparse_attn(torch.zeros(1, 1, 4, 64), _bf16(1, 8, 64), torch.zeros(4),
                             torch.zeros(1, 1, 8, dtype=torch.int32), 0.125),
     "sparse_attn: q must be bfloat16 [B, M, H, D] with D a multiple of 64, got float32 [1, 1, 4, 64]"),
    (lambda o: o.sparse_attn(_bf16(1, 1, 4, 64), _bf16(1, 8, 64), torch.zeros(4),
                             torch.zeros(1, 1, 8, dtype=torch.int64), 0.125),
     "sparse_attn: idx must be int32 [1, 1, K], got int64 [1, 1, 8] on cpu"),
    (lambda o: o.hc_split_sinkhorn(torch.zeros(3, 24, dtype=torch.float64), torch.zeros(3), torch.zeros(24),
                                   4, 20, 1e-6),
     "hc_split_sinkhorn: mixes must be float32 [..., 24], got float64"),
    (lambda o: o.index_scores(_bf16(1, 2, 16, 64), _bf16(1, 5, 64), torch.zeros(1, 2, 16)),
     "index_scores: w must be bfloat16 [1, 2, 16], got float32 [1, 2, 16] on cpu"),
    (lambda o: o.act_quant(_bf16(4, 64).t()), "act_quant: x must be bfloat16 or float32 [..., K]"),
    (lambda o: o.act_quant(_bf16(64, 64).t()), "act_quant: x must be contiguous, got strides [1, 64]"),
    (lambda o: o.act_quant(_bf16(2, 64)), "act_quant: x must be a CUDA tensor, got one on cpu"),
    (lambda o: o.fp4_gemm(_bf16(2, 64), torch.zeros(32, 32, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
                          torch.zeros(32, 2, dtype=torch.uint8).view(torch.float8_e8m0fnu)),
     "fp4_gemm: x must be a CUDA tensor, got one on cpu"),
])
def test_wrappers_name_the_bad_argument(ops, call, message):
    with pytest.raises(ValueError) as e:
        call(ops)
    assert str(e.value).startswith(message), str(e.value)


# ---- imports and the device check ----

def test_tilelang_is_imported_only_on_use():
    code = ("import sys, inference.kernels, inference.model, inference.tools.gpu_check, "
            "inference.tools.bench.models; print('tilelang' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stdout + p.stderr


def test_gpu_check_cases_accept_the_torch_path_and_catch_a_wrong_kernel(ops, released, monkeypatch):
    """The device check's kernel cases, run on the CPU with the torch paths standing in for the kernels: the
    loop-free path (another summation order) passes every tolerance; a quantiser with one flipped byte and a
    GEMM 3 % high fail. (The slow cases, prefill-sized GEMMs and attention, are left to the GPU.)"""
    from inference.kernels import fast, reference as ref
    from inference.quant import dequant_fp4_weight, dequant_fp8_weight
    from inference.tools import gpu_check

    def stand_in(f):                       # the torch function, taking the wrappers' build setting
        return lambda *args, settings="default": f(*args)

    for name in ("act_quant", "fp8_qdq_", "fp4_qdq_e8m0_", "fp4_qdq_e4m3_", "hc_split_sinkhorn"):
        monkeypatch.setattr(ops, name, stand_in(getattr(ref, name)))
    monkeypatch.setattr(ops, "fp8_gemm", stand_in(lambda x, w, s: fast.gemm(x, dequant_fp8_weight(w, s))))
    monkeypatch.setattr(ops, "fp4_gemm", stand_in(lambda x, w, s: fast.gemm(x, dequant_fp4_weight(w, s))))
    wrapper = types.SimpleNamespace(expert_gemm=ops.expert_gemm)    # its checks run first (CPU tensors)
    monkeypatch.setattr(ops, "expert_gemm", gpu_check.TorchKernels(wrapper).expert_gemm)
    monkeypatch.setattr(ops, "sparse_attn", stand_in(fast.sparse_attn))
    monkeypatch.setattr(ops, "index_scores", stand_in(fast.index_scores))
    slow = ("M = 200", "[1, 64, 64")
    cases = [c for c in gpu_check.kernel_cases(released) if not any(t in c[1] for t in slow)]
    assert {c[0] for c in cases} == set(ops.FACTORIES)
    gen = torch.Generator().manual_seed(0)
    for name, shapes, run in cases:
        ok, measured, tolerance = run(gen)
        assert ok, f"{name} {shapes}: {measured} (tolerance {tolerance})"

    def one_byte_off(x, block=32):
        q, s = ref.act_quant(x, block)
        q.view(torch.uint8)[5, 7] ^= 1
        return q, s

    def three_percent_high(x, w, s):
        return (fast.gemm(x, dequant_fp8_weight(w, s)).float() * 1.03).bfloat16()

    monkeypatch.setattr(ops, "act_quant", stand_in(one_byte_off))
    monkeypatch.setattr(ops, "fp8_gemm", stand_in(three_percent_high))
    picked = [next(c for c in cases if c[0] == n) for n in ("act_quant", "fp8_gemm")]
    assert [run(gen)[0] for _, _, run in picked] == [False, False]


def test_gpu_check_without_cuda_prints_one_line_and_exits_2():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "inference.tools.gpu_check"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stdout == "gpu-check needs CUDA: no CUDA device is visible\n" and p.stderr == ""


# ---- sizes the kernels meet: world sizes, head padding, launch limits --------------------------------------

# A call far past CUDA's grid caps: 1M query rows (the released context) in one call, a batch of 8.
BIG = {"M": 1 << 20, "S": 1 << 20, "R": 8 << 20, "B": 8, "N": (1 << 20) + 128, "T": 1 << 19, "K": 2688,
       "P": 1 << 20, "E": 384}


def _fixture_config():
    path = os.path.join(ROOT, "tests", "fixtures", "reference-tiny", "config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("which,world", [("released", 1), ("released", 2), ("released", 4), ("released", 8),
                                         ("released", 16), ("fixture", 1), ("fixture", 2)])
def test_every_build_at_every_world_size_stays_within_the_grid(ops, released, which, world):
    """Every kernel a rank of `world` builds (the released config up to W = 16 index heads: 2 per rank,
    padded to 8; the fixture's o_groups = 2 admits W = 1, 2) is made by its factory, and its grid at a call of
    a million query rows keeps y and z within CUDA's 65,535 blocks (rows ride on x)."""
    cfg = released if which == "released" else _fixture_config()
    for b in ops.builds(cfg, world):
        f = b.prim_func()
        shapes = [[int(d) if not hasattr(d, "name") else BIG[d.name] for d in f.buffer_map[p].shape]
                  for p in f.params]
        grid = ops.launch_grid(f, *(torch.empty(s, device="meta") for s in shapes))
        assert all(g <= limit for g, limit in zip(grid, ops.MAX_GRID)), (b.name, b.shapes, grid)


def test_index_scores_padded_heads_are_the_same_bits(ops):
    """Zero heads (zero queries, zero weights) add +0 to every score's head sum: the torch routes give the
    padded head counts the tilelang wrapper launches (1..7 -> 8, 12 -> 16) the same bits as the heads
    alone."""
    from inference.kernels import fast, reference as ref
    gen = torch.Generator().manual_seed(0)
    for h in (1, 2, 3, 4, 5, 7, 12):
        q = torch.randn(2, 19, h, 128, generator=gen).bfloat16()
        keys = torch.randn(2, 300, 128, generator=gen).bfloat16()
        w = (torch.randn(2, 19, h, generator=gen) / 8).bfloat16()
        qp, wp = ops.pad_index_heads(q, w)
        assert qp.shape[2] == ops.index_heads(h) and qp.shape[2] % 8 == 0
        for route in (ref, fast):
            a, b = route.index_scores(q, keys, w), route.index_scores(qp, keys, wp)
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (route.__name__, h)


def test_launches_cut_under_the_element_limit_give_the_same_numbers(ops, monkeypatch):
    """With the element limit lowered, a call is cut over batch items and row ranges: each launch gets
    contiguous slices under the limit, and the rows together are the whole call's numbers bit for bit."""
    from inference.kernels import reference as ref
    monkeypatch.setattr(ops, "MAX_ELEMS", 4000)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 50, 4, 64, generator=gen).bfloat16()
    kv = torch.randn(3, 40, 64, generator=gen).bfloat16()
    idx = torch.randint(-1, 40, (3, 50, 16), generator=gen, dtype=torch.int32)
    sink = torch.randn(4, generator=gen)
    launches = []

    def attend(r, f, o):
        launches.append([t.shape for t in (*r, *f, o)])
        assert all(t.is_contiguous() and t.numel() <= 4000 for t in (*r, *f, o))
        assert o.stride() == torch.empty(o.shape).stride()              # a dense tensor's strides
        o.copy_(ref.sparse_attn(r[0], f[0], sink, r[1], 0.125))

    out = torch.empty_like(q)
    ops._launch_batched("sparse_attn", attend, (q, idx), (kv,), out)
    assert len(launches) == 3 * 4 and torch.equal(out, ref.sparse_attn(q, kv, sink, idx, 0.125))

    x = torch.randn(300, 64, generator=gen).bfloat16()
    qx, sx = torch.empty(300, 64, dtype=torch.float8_e4m3fn), torch.empty(300, 2)
    pieces = []

    def quantise(xr, qr, sr):
        pieces.append(xr.shape[0])
        qr.copy_(ref.act_quant(xr)[0]), sr.copy_(ref.act_quant(xr)[1])

    ops._launch_rows(quantise, x, qx, sx)
    want_q, want_s = ref.act_quant(x)
    assert pieces == [62] * 4 + [52] and torch.equal(qx.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(sx, want_s)
    with pytest.raises(ValueError, match="one batch item's keys has 4096 elements"):
        ops._launch_batched("sparse_attn", attend, (q, idx), (torch.empty(3, 64, 64).bfloat16(),), out)


def test_kernel_build_settings_are_the_options_choices(ops):
    """--kernel-build's choices are the kernels' SETTINGS; plain turns off warp specialization and TMA
    lowering; an unknown one is one line."""
    from inference.config import KERNEL_BUILDS, ConfigError, RuntimeOptions
    assert set(KERNEL_BUILDS) == set(ops.SETTINGS)
    assert ops.SETTINGS["plain"] == {ops.tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
                                     ops.tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True}
    assert {b.settings for b in ops.builds(_fixture_config(), settings="plain")} == {"plain"}
    with pytest.raises(ConfigError, match="unknown kernel build 'tma'"):
        RuntimeOptions.from_profile("reference", kernel_build="tma")
    with pytest.raises(ValueError, match="unknown kernel build 'tma'"):
        ops.act_quant(torch.zeros(2, 32, dtype=torch.bfloat16, device="meta"), settings="tma")
