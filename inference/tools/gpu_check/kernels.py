"""The device check's `kernels` phase: every TileLang kernel against its torch reference
(inference/kernels/reference.py) on random inputs at the released shapes (kernel_cases, _kernel_table,
phase_kernels), and its rehearsal on CPU (rehearse_kernels), where TorchKernels stands in for
inference.kernels.tilelang_ops: each call goes through the wrapper's own argument checks, then returns the
torch result.
"""

import time

from .common import (CASE_TOLERANCES, Clock, Ctx, _bf16_ulps_apart, _close, _same_bits, _topk_overlap, _ulps,
                     note)

SINKHORN_ULPS = {"pre": 4, "post": 4, "comb": 16}
TOPK_OVERLAP = 0.99
LONG_ROWS = 70_000              # query rows of the kernels phase's one-call cases (CUDA's grid y cap: 65,535)


def _e4m3_weight(n, k, gen):
    import torch
    w = (torch.randn(n, k, generator=gen, device=gen.device) * 96).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(117, 128, (-(-n // 32), k // 32), generator=gen, device=gen.device, dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def _fp4_weight(n, k, gen):
    import torch
    w = torch.randint(0, 256, (n, k // 2), generator=gen, device=gen.device, dtype=torch.uint8)
    s = torch.randint(117, 128, (n, k // 32), generator=gen, device=gen.device, dtype=torch.uint8)
    return w.view(torch.float4_e2m1fn_x2), s.view(torch.float8_e8m0fnu)


def _activations(m, k, gen):
    """bf16 rows of magnitudes 1e-3..1e2; with 3 rows or more, also an all-zero row and a row starting with
    the edge cases of the scales (tiny values, a negative zero, exact powers of two)."""
    import torch
    x = torch.randn(m, k, generator=gen, device=gen.device)
    if m >= 3:
        x = x * torch.logspace(-3, 2, m, device=gen.device).unsqueeze(1)
        x[-1] = 0
        x[1, :7] = torch.tensor([1e-30, -1e-30, -0.0, 448.0 * 2 ** -7, 3.0, -1.75, 2.5], device=gen.device)
    return x.to(torch.bfloat16)


def kernel_cases(cfg: dict, ops=None, long_rows: int = 0):
    """(name, shapes, run) for every kernel; run(gen) -> (ok, measured, tolerance), on gen's device. `ops`:
    the kernels under test, inference.kernels.tilelang_ops unless given (the rehearsal's TorchKernels).
    `long_rows`: also one call of sparse attention and of index scores with this many query rows (past
    CUDA's 65,535 blocks on a grid's y axis), its last 64 rows compared with the reference."""
    import torch
    from ...kernels import reference as ref
    if ops is None:
        from ...kernels import tilelang_ops as ops
    from ...quant import dequant_fp4_weight, dequant_fp8_weight
    dim, hd, inter = cfg["dim"], cfg["head_dim"], cfg["moe_inter_dim"]
    heads, ihd, ih = cfg["n_heads"], cfg["index_head_dim"], cfg["index_n_heads"]
    cases = []

    def quant_case(k, block):
        def run(gen, settings="default"):
            x = _activations(300, k, gen)
            q, s = ops.act_quant(x, block, settings=settings)
            rq, rs = ref.act_quant(x, block)
            ok_q, m_q, _ = _same_bits(q, rq)
            ok_s, m_s, _ = _same_bits(s, rs)
            return ok_q and ok_s, f"q: {m_q}; s: {m_s}", "identical bytes"
        cases.append(("act_quant", f"x [300, {k}] block {block}", run))

    def qdq_case(name, k, block):
        def run(gen, settings="default"):
            x = _activations(300, k, gen)
            got = getattr(ops, name)(x.clone(), block, settings=settings)
            return _same_bits(got, getattr(ref, name)(x.clone(), block))
        cases.append((name, f"x [300, {k}] block {block}", run))

    def gemm_case(fmt, label, n, k, m):
        def run(gen, settings="default"):
            w, s = (_e4m3_weight if fmt == "fp8" else _fp4_weight)(n, k, gen)
            x = _activations(m, k, gen)
            out = (ops.fp8_gemm if fmt == "fp8" else ops.fp4_gemm)(x, w, s, settings=settings)
            deq = dequant_fp8_weight(w, s) if fmt == "fp8" else dequant_fp4_weight(w, s)
            want = ref.block_scaled_gemm(x, deq)
            ok, measured, tol = _close(out, want, "gemm")
            # the tensor cores' FP8 accumulation (about 14 bits kept) against the torch route's fp32 block
            # sums, seen through the bf16 output: the share of outputs that differ, and by how many ulps where
            # the output does not cancel to near zero (|ref| above the tolerance's floor)
            big = want.float().abs() >= CASE_TOLERANCES["gemm"][1] * want.float().abs().max()
            return ok, f"{measured}, <= {_bf16_ulps_apart(out[big], want[big])} ulp off-floor", tol
        cases.append((f"{fmt}_gemm", f"{label} [{n}, {k}], M = {m}", run))

    def expert_case(fmt, label, n, k, tokens, topk, experts=8):
        def run(gen, settings="default"):
            made = [(_e4m3_weight if fmt == "fp8" else _fp4_weight)(n, k, gen) for _ in range(experts)]
            stack = lambda ts: torch.stack([t.view(torch.uint8) for t in ts]).view(ts[0].dtype)   # noqa: E731
            w, s = stack([a for a, _ in made]), stack([b for _, b in made])           # [E, N, ...]
            x = _activations(tokens, k, gen)
            sel = torch.randint(0, experts, (tokens * topk,), generator=gen, device=gen.device,
                                dtype=torch.int32)
            q, sa = ops.act_quant(x, 32, settings=settings)
            out = ops.expert_gemm(q, sa, sel, w, s, topk, settings=settings)        # [P, N]
            deq = dequant_fp8_weight if fmt == "fp8" else dequant_fp4_weight
            want = torch.cat([ref.block_scaled_gemm(x[p // topk:p // topk + 1], deq(*made[e]))
                              for p, e in enumerate(sel.tolist())])
            ok, measured, tol = _close(out, want, "gemm")
            big = want.float().abs() >= CASE_TOLERANCES["gemm"][1] * want.float().abs().max()
            return ok, f"{measured}, <= {_bf16_ulps_apart(out[big], want[big])} ulp off-floor", tol
        cases.append(("expert_gemm", f"{label} [{experts}, {n}, {k}], {tokens} x top-{topk}", run))

    def attn_case(b, m, n_win, n_comp, k_comp):
        def run(gen, settings="default"):
            n = n_win + n_comp
            q = torch.randn(b, m, heads, hd, generator=gen, device=gen.device).to(torch.bfloat16)
            kv = torch.randn(b, n, hd, generator=gen, device=gen.device).to(torch.bfloat16)
            sink = torch.randn(heads, generator=gen, device=gen.device) * 0.45
            win = torch.stack([torch.randperm(n_win, generator=gen, device=gen.device) for _ in range(b * m)])
            comp = torch.full((b * m, k_comp), -1, dtype=torch.long, device=gen.device)
            for r in range(b * m):    # a prefix of valid compressed rows in order, then -1 (the layout)
                valid = int(torch.randint(0, min(n_comp, k_comp) + 1, (1,), generator=gen, device=gen.device))
                rows = torch.randperm(n_comp, generator=gen, device=gen.device)[:valid]
                comp[r, :valid] = rows.sort().values + n_win
            idx = torch.cat([win, comp], -1).view(b, m, -1).to(torch.int32)
            scale = hd ** -0.5
            return _close(ops.sparse_attn(q, kv, sink, idx, scale, settings=settings),
                          ref.sparse_attn(q, kv, sink, idx, scale), "attention")
        cases.append(("sparse_attn", f"q [{b}, {m}, {heads}, {hd}], {n_win}+{k_comp} indices", run))

    def sinkhorn_case():
        def run(gen, settings="default"):
            hc = cfg["hc_mult"]
            mixes = torch.randn(2, 257, (2 + hc) * hc, generator=gen, device=gen.device) * 0.5
            scale = torch.rand(3, generator=gen, device=gen.device) + 0.5
            base = torch.randn((2 + hc) * hc, generator=gen, device=gen.device) * 0.45
            args = (mixes, scale, base, hc, cfg["hc_sinkhorn_iters"], cfg["hc_eps"])
            got, want = ops.hc_split_sinkhorn(*args, settings=settings), ref.hc_split_sinkhorn(*args)
            ulps = {k: _ulps(a, b) for k, a, b in zip(SINKHORN_ULPS, got, want)}
            ok = all(ulps[k] <= SINKHORN_ULPS[k] for k in ulps)
            return ok, ", ".join(f"{k} {v} ulp" for k, v in ulps.items()), \
                ", ".join(f"{k} <= {v} ulp" for k, v in SINKHORN_ULPS.items())
        cases.append(("hc_split_sinkhorn", "mixes [2, 257, 24]", run))

    def scores_case(b, s, t, k, heads=ih):
        def run(gen, settings="default"):
            q = torch.randn(b, s, heads, ihd, generator=gen, device=gen.device).to(torch.bfloat16)
            keys = torch.randn(b, t, ihd, generator=gen, device=gen.device).to(torch.bfloat16)
            ref.fp4_qdq_e8m0_(q)              # the indexer's inputs are FP4 round trips
            ref.fp4_qdq_e8m0_(keys)
            w = (torch.randn(b, s, heads, generator=gen, device=gen.device) / 64).to(torch.bfloat16)
            out, want = ops.index_scores(q, keys, w, settings=settings), ref.index_scores(q, keys, w)
            ok, measured, tol = _close(out, want, "scores")
            overlap = _topk_overlap(out, want, k)
            return ok and overlap >= TOPK_OVERLAP, f"{measured}; top-{k} overlap {overlap:.4f}", \
                f"{tol}; overlap >= {TOPK_OVERLAP}"
        cases.append(("index_scores", f"q [{b}, {s}, {heads}, {ihd}], keys [{b}, {t}, {ihd}]", run))

    for k, block in ((dim, 32), (dim, 128), (inter, 32)):
        quant_case(k, block)
    qdq_case("fp8_qdq_", hd, 32)
    qdq_case("fp4_qdq_e8m0_", ihd, 32)
    qdq_case("fp4_qdq_e4m3_", hd, 16)
    for m in (1, 200):
        gemm_case("fp8", "wq_a", cfg["q_lora_rank"], dim, m)
        gemm_case("fp8", "wo_b", dim, cfg["o_groups"] * cfg["o_lora_rank"], m)
        gemm_case("fp4", "expert.w1", inter, dim, m)
        gemm_case("fp4", "expert.w2", dim, inter, m)
    expert_fmt = "fp4" if cfg.get("expert_dtype", "fp4") == "fp4" else "fp8"
    expert_case(expert_fmt, "expert.w1", inter, dim, 2, cfg["n_activated_experts"])   # a decode step's
    expert_case(expert_fmt, "expert.w2", dim, inter, 12, 1)                            # selections
    attn_case(2, 1, cfg["window_size"], 384, cfg["index_topk"])      # decode, with -1 padding
    attn_case(1, 64, 64, 32, 64)                                       # a prefill chunk
    sinkhorn_case()
    scores_case(2, 3, 2048, cfg["index_topk"])
    scores_case(2, 3, 2048, cfg["index_topk"], heads=ih // 8)        # one of 8 ranks: heads padded to 8

    def long_case(name, rows):
        def run(gen, settings="default"):
            dev, tail = gen.device, slice(rows - 64, rows)
            if name == "sparse_attn":
                q = torch.randn(1, rows, heads, hd, generator=gen, device=dev).to(torch.bfloat16)
                kv = torch.randn(1, 256, hd, generator=gen, device=dev).to(torch.bfloat16)
                sink = torch.randn(heads, generator=gen, device=dev) * 0.45
                idx = torch.randint(-1, 256, (1, rows, 64), generator=gen, device=dev, dtype=torch.int32)
                out = ops.sparse_attn(q, kv, sink, idx, hd ** -0.5, settings=settings)
                return _close(out[:, tail], ref.sparse_attn(q[:, tail], kv, sink, idx[:, tail], hd ** -0.5),
                              "attention")
            q = torch.randn(1, rows, ih, ihd, generator=gen, device=dev).to(torch.bfloat16)
            keys = torch.randn(1, 512, ihd, generator=gen, device=dev).to(torch.bfloat16)
            w = (torch.randn(1, rows, ih, generator=gen, device=dev) / 64).to(torch.bfloat16)
            out = ops.index_scores(q, keys, w, settings=settings)
            return _close(out[:, tail], ref.index_scores(q[:, tail], keys, w[:, tail]), "scores")
        cases.append((name, f"{rows} query rows in one call, the last 64 compared", run))

    if long_rows:
        long_case("sparse_attn", long_rows)
        long_case("index_scores", long_rows)
    return cases


class TorchKernels:
    """The rehearsal's stand-in for tilelang_ops: each call first goes through the TileLang wrapper's own
    argument checks, which on CPU tensors must stop at "must be a CUDA tensor" (dtypes and shapes accepted),
    then returns the torch result: the quantisers and Sinkhorn from the exact reference, the GEMMs, attention
    and index scores from the fast (loop-free) order, another summation order at the same rounding points."""

    def __init__(self, ops):
        self.ops = ops          # inference.kernels.tilelang_ops

    def _accepted(self, name: str, *args):
        try:
            getattr(self.ops, name)(*args)
        except ValueError as e:
            if "must be a CUDA tensor" in str(e):
                return
            raise
        raise RuntimeError(f"{name}: the TileLang wrapper accepted CPU tensors")

    def act_quant(self, x, block=32, settings="default"):
        from ...kernels import reference as ref
        self._accepted("act_quant", x, block, settings)
        return ref.act_quant(x, block)

    def _qdq(self, name, x, block, settings):
        from ...kernels import reference as ref
        self._accepted(name, x, block, settings)
        return getattr(ref, name)(x, block)

    def fp8_qdq_(self, x, block=32, settings="default"):
        return self._qdq("fp8_qdq_", x, block, settings)

    def fp4_qdq_e8m0_(self, x, block=32, settings="default"):
        return self._qdq("fp4_qdq_e8m0_", x, block, settings)

    def fp4_qdq_e4m3_(self, x, block=16, settings="default"):
        return self._qdq("fp4_qdq_e4m3_", x, block, settings)

    def fp8_gemm(self, x, weight, scale, settings="default"):
        from ...kernels import fast
        from ...quant import dequant_fp8_weight
        self._accepted("fp8_gemm", x, weight, scale, settings)
        return fast.gemm(x, dequant_fp8_weight(weight, scale))

    def fp4_gemm(self, x, weight, scale, settings="default"):
        from ...kernels import fast
        from ...quant import dequant_fp4_weight
        self._accepted("fp4_gemm", x, weight, scale, settings)
        return fast.gemm(x, dequant_fp4_weight(weight, scale))

    def expert_gemm(self, q, s, experts, weight, scale, rows_per_token=1, settings="default"):
        import torch
        from ...kernels import fast
        self._accepted("expert_gemm", q, s, experts, weight, scale, rows_per_token, settings)
        kind = "fp4" if weight.dtype == torch.float4_e2m1fn_x2 else "fp8"
        a = (q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)      # act_quant's values
        rows = a[torch.arange(experts.shape[0], device=a.device) // rows_per_token]   # [P, K]
        w = fast.dequant_weight(weight, scale, kind, a.dtype)[experts.long()]        # [P, N, K]
        return fast.matmul_fp32(rows.unsqueeze(1), w.transpose(-1, -2)).squeeze(1).bfloat16()

    def sparse_attn(self, q, kv, sink, idx, scale, settings="default"):
        from ...kernels import fast
        self._accepted("sparse_attn", q, kv, sink, idx, scale, 64, settings)
        return fast.sparse_attn(q, kv, sink, idx, scale)

    def hc_split_sinkhorn(self, *args, settings="default"):
        from ...kernels import reference as ref
        self._accepted("hc_split_sinkhorn", *args, settings)
        return ref.hc_split_sinkhorn(*args)

    def index_scores(self, q, keys, w, settings="default"):
        from ...kernels import fast
        self._accepted("index_scores", q, keys, w, 1 << 26, settings)
        return fast.index_scores(q, keys, w)


def _case(run, gen, **kw):
    """One case: (ok, measured, tolerance); an exception is a failure with its message."""
    try:
        return run(gen, **kw)
    except Exception as e:  # one failing kernel must not hide the others
        return False, f"{type(e).__name__}: {str(e)[:120]}", ""


def _kernel_table(cfg: dict, clock: Clock, ops, device: str, settings: str = "default",
                  long_rows: int = 0) -> bool:
    """Run every case of kernel_cases(cfg, ops) on `device`, one line each. A GEMM that fails or mismatches
    as built by default is rebuilt with the "plain" settings (tilelang_ops.SETTINGS: no warp specialization,
    no TMA lowering) and run again; the line says which build passed. Returns whether every case passed in
    some build."""
    import torch
    gen = torch.Generator(device=device).manual_seed(0)
    ok_all, plain = True, []
    note(f"{'kernel':18s} {'shapes':44s} {'result':6s} {'measured':46s} tolerance")
    for name, shapes, run in kernel_cases(cfg, ops, long_rows):
        if clock.left() < 5:
            note(f"kernels: out of time, skipped {name} {shapes} and the rest")
            return False
        ok, measured, tol = _case(run, gen, settings=settings)
        if not ok and name.endswith("_gemm") and settings != "plain" and clock.left() > 20:
            note(f"{name:18s} {shapes:44s} {'FAIL':6s} {measured:46s} {tol} (default build)")
            ok, measured, tol = _case(run, gen, settings="plain")
            shapes += " [plain]"
            plain.append(f"{name} {shapes}" if ok else None)
        ok_all &= ok
        note(f"{name:18s} {shapes:44s} {'ok' if ok else 'FAIL':6s} {measured:46s} {tol}")
    if any(plain):
        note("kernels: the default build failed where the plain one passed: run with --kernel-build plain "
             f"({'; '.join(p for p in plain if p)})")
    return ok_all


def phase_kernels(ctx: Ctx) -> bool:
    from ...kernels import tilelang_ops as ops
    cfg = ctx.released
    t0 = time.perf_counter()
    todo = ops.builds(cfg, settings=ctx.kernel_build)
    failed = ops.precompile(todo)
    note(f"compiled {len(todo)} kernels at the released shapes ({ctx.kernel_build} build) in "
         f"{time.perf_counter() - t0:.1f} s" + (f"; FAILED: {failed}" if failed else ""))
    # a GEMM that does not build is rebuilt "plain" by the table; any other kernel fails the phase here
    return _kernel_table(cfg, ctx.clock, ops, "cuda", ctx.kernel_build, LONG_ROWS) and not any(
        not b.name.endswith("_gemm") for b in failed)


def rehearse_kernels(ctx: Ctx) -> bool:
    from ...kernels import tilelang_ops as ops    # the kernel list and the wrappers' argument checks
    todo = ops.builds(ctx.released)
    note(f"kernels: would compile {len(todo)} kernels at the released shapes "
         f"({', '.join(dict.fromkeys(b.name for b in todo))})")
    small, stand_in = ctx.fixture_config(), TorchKernels(ops)
    missing = sorted(set(ops.FACTORIES) - {name for name, _, _ in kernel_cases(small, stand_in)})
    if missing:
        note(f"kernels: no case tests {', '.join(missing)}")
    note("kernels: the cases at the fixture's shapes, the torch kernels standing in for TileLang")
    return _kernel_table(small, ctx.clock, stand_in, "cpu")

