"""The prepared device check, for a machine with a CUDA GPU of compute capability >= 9.0 (an H200 in mind).

    python -m inference.tools.gpu_check [--fixture DIR] [--budget SECONDS] [--phases kernels,speed,cudagraph]
    python -m inference.tools.gpu_check --rehearse [--phases ...]     # every phase's setup on CPU, no GPU
    bash run.sh gpu-check [--wheels DIR | DIR.tar.xz | DIR.tar.xz.part0] [ARGS]  # from the project's runner

Phases (the table PHASES at the end of the file), each with a time budget; a phase that runs out of time skips
the rest of its work with a note:
  kernels  every TileLang kernel against its torch reference (inference/kernels/reference.py) on random
           inputs at the released shapes (config.json): quantisers must give identical bytes and scales;
           GEMMs, attention and index scores must agree within the tolerances in CASE_TOLERANCES (printed);
           the indexer's top-512 selection must overlap >= 99 % (ties at the boundary count as agreement).
  fixture  the conformance fixture (tests/fixtures/reference-tiny, or --fixture) scored on CUDA by
           generate.py with --kernel-backend torch and tilelang, each compared with the fixture's reference
           logits by the parity tool (`python -m inference.tools.parity compare`, run in this process, with
           its default tolerances).
  speed    what a decode step costs (inference/tools/gpu_speed.py): the released widths with 2 and 4 layers
           and synthetic weights made on the GPU, per route decode ms/step at batch 1, 4 and 32, eager and
           replayed from CUDA graphs, beside its launch count and its weights' share of the HBM bandwidth;
           prefill tokens/s at 1K and 8K; --experts-on host's decode and the host link's GB/s; the
           host-expert kernel at 1 to 16 threads. Printed, not asserted.
  tp       W = 2 with nccl when two GPUs are visible: a synthetic fixture-shaped model at W = 2 against W = 1
           (tilelang backend), compared by the parity tool.
  cudagraph  --cuda-graph: greedy decode steps of the fixture's model replayed from CUDA graphs against the
           same steps run eagerly, at batch 1 and 4 across a length bucket and both parities: logits bit for
           bit; ms/step both ways. Not yet run on a GPU.
  hostexperts  --experts-on host: the fixture scored on CUDA with its routed experts in host memory, computed
           by the host-expert kernel (one round trip per MoE layer), against the reference logits and against
           the all-GPU torch route (the fast order's floor: the parity tool's default tolerances); decode ms
           per token both ways. Not yet run on a GPU.
Without CUDA it prints one line and exits 2. Exit status 1 when any check that ran failed, else 0.

Time budget on one H200 (seconds). The whole check, compilation included, stays within 9 minutes (540 s); a
session with 15 minutes of device time runs a subset first (`--phases kernels,speed,cudagraph`: 350 s):

  phase       budget  where the time goes
  kernels       110   compiling the 29 kernels at the released shapes (17.8 s on the H200's host, 70 s on 2
                      CPU cores), then 21 cases of well under a second each (35 s in all on one H200); a
                      failing GEMM rebuilt plain (every kernel plain: 41 s)
  fixture       110   compiling the fixture's kernels, then generate.py twice (a 301-token prefill and 20
                      steps each, a process start with torch and tilelang imports) and three comparisons
  speed         190   per layer count and route: the model built and randomised on the GPU (38 GB at 4
                      layers), the expert GEMMs compiled, prefills of 1K and 8K, then per batch a prefill
                      of 1K rows and 12 steps eager and 12 replayed; the experts on the host; 5 thread
                      counts of the host kernel
  tp             50   two GPUs only (skipped on one): a fixture-shaped checkpoint converted for W = 1 and 2,
                      each scored, one comparison
  cudagraph      40   the fixture's model built and loaded, then per batch (1, 4) a prefill and 60 decode
                      steps eager, and again replayed from CUDA graphs (a capture per bucket and parity)
  hostexperts    30   generate.py twice on the fixture (torch kernels, experts on the device, then on the
                      host; the host kernel built once, under a second), two comparisons
  start-up       10   Python, torch and CUDA initialisation, the summary
  total         540
--budget defaults to the sum of the phases' budgets (530 s); it caps the whole run, and
each phase also stops at its own budget. tests/test_gpu_check.py holds this table to PHASES.

Rehearsal (--rehearse): every phase's setup walked on CPU at reduced shapes, so that a typo cannot cost a
device run: the kernel list at the released shapes and the kernel cases at the fixture's shapes, each input
passed through the TileLang wrapper's own argument checks and the kernel replaced by its torch counterpart;
the fixture scored on CPU for the first 72 tokens of its prompt (its 64-token window and 8 more) and 3 steps
(torch kernels; the fast order stands in for tilelang), against the reference logits at those positions; the
speed phase at the fixture's widths (2 layers, batches 1 and 2, 2 steps, the captured step run eagerly); W = 2
with gloo for a 16-token prompt and one step, compared with W = 1 within bounds for a setup check
(REHEARSAL_TP_TOLERANCES). Each phase prints what
the real check does and a PASS / FAIL line; exit status 1 when any phase's setup raised or a comparison
failed. About 25 s on 2 cores.

Wheels for a GPU host without network (docs/cli.md §4.3), what `bash run.sh wheels DIR` and
`bash run.sh gpu-check --wheels DIR` call:
    python -m inference.tools.gpu_check wheels DIR [--python-version 3.12] [--pack [--part-size 30M]]
    python -m inference.tools.gpu_check install-wheels DIR|DIR.tar.xz|DIR.tar.xz.part0 [--target .device/site]
                                                       [--all]
`wheels` downloads (pip download --only-binary=:all: --no-deps, manylinux x86_64, for the given Python) the
project's requirements other than torch, numpy and the test tools, tilelang first, and their runtime
dependencies read from each wheel's metadata, never torch, triton or nvidia-* packages, with a manifest
(wheels.json); --pack also writes DIR.tar.xz (xz preset 9, the wheels stored uncompressed inside) and, when
that is larger than --part-size, its parts DIR.tar.xz.part0, .part1, ... (a host that takes a limited size
per transfer, like the device machine, gets one part a call), and prints which call carries which part.
`install-wheels` joins the parts of an archive (given as one of them, or as the folder holding them; a missing
part is named), installs, with pip --no-index --no-deps, the wheels the host lacks (or has at a version the
requirement excludes) into a private folder, never the host's site-packages, then checks that tilelang
imports with that folder on PYTHONPATH. Neither imports torch.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import email.parser
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import zipfile
import zlib
from typing import Callable

# torch is imported where it is used: `wheels` and `install-wheels` run without it (the machine with network
# may lack torch) and start in a fraction of a second.

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "reference-tiny")
TOTAL_SECONDS = 540             # the whole check on one H200, compilation included
START_UP_SECONDS = 10           # Python, torch and CUDA initialisation, the summary
RESERVED = {}                   # budgets of phases still to come; a new phase moves its line into PHASES
# (relative to |reference|, floor as a fraction of max |reference|): one bf16 ulp is 2^-8..2^-7 relative;
# the floor covers outputs that cancel to near zero, where one ulp of a partial sum is large.
CASE_TOLERANCES = {"gemm": (2 ** -7, 2 ** -10), "attention": (2 ** -7, 2 ** -9), "scores": (2 ** -7, 2 ** -8)}
SINKHORN_ULPS = {"pre": 4, "post": 4, "comb": 16}
TOPK_OVERLAP = 0.99
LONG_ROWS = 70_000              # query rows of the kernels phase's one-call cases (CUDA's grid y cap: 65,535)
REHEARSAL_STEPS = 3             # decode steps the rehearsal's fixture phase scores after its prompt
REHEARSAL_PAST_WINDOW = 8       # ... a prompt of the fixture's window (64 tokens) and this many more
REHEARSAL_TP = (16, 1)          # prompt and steps of the rehearsal's tp phase: a prefill and a decode step
# ... compared as a setup check: at single early positions of the random synthetic model W = 1 and 2 part by
# up to max |d| 0.25, mean |d| 0.045, KL 1.5e-3, cosine 0.9985 (the real check's means over 321 positions stay
# within its bounds, 0.35, 0.05, 1e-3, 0.999). Rank 1's attention output lost in one of the 8 layers gives
# 0.87, 0.21, 0.034, 0.963.
REHEARSAL_TP_TOLERANCES = ("--atol-max", "0.7", "--atol-mean", "0.1", "--max-kl", "0.01", "--min-cos", "0.99")
REHEARSAL_PHASE_SECONDS = 600   # a rehearsal phase's clock: the GPU budgets say nothing about a CPU


class Clock:
    """A deadline: the whole run's, and each phase's inside it."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def phase(self, seconds: float) -> "Clock":
        return Clock(min(seconds, self.left()))


def note(msg: str):
    print(msg, flush=True)


@dataclasses.dataclass
class Ctx:
    """What a phase works with. `rehearse`: the CPU rehearsal (reduced shapes, torch kernels, gloo)."""
    released: dict          # config.json: the released shapes
    fixture: str            # the conformance fixture's directory
    tmp: str                # this run's scratch directory
    clock: Clock            # this phase's deadline
    rehearse: bool = False
    kernel_build: str = "default"   # how the TileLang kernels are built (--kernel-build)

    @property
    def device(self) -> str:
        return "cpu" if self.rehearse else "cuda"

    def backend_flags(self, backend: str) -> list:
        """generate.py's flags for a kernel backend. The rehearsal runs the torch kernels: the exact order for
        `torch`, the fast order standing in for `tilelang`."""
        if not self.rehearse:
            return ["--kernel-backend", backend, "--kernel-build", self.kernel_build]
        return ["--kernel-backend", "torch"] + (["--numerics", "fast"] if backend == "tilelang" else [])

    def runtime(self, backend: str):
        """RuntimeOptions for a model built in this process, as backend_flags for generate.py."""
        from ..config import RuntimeOptions
        if not self.rehearse:
            return RuntimeOptions.from_profile("reference", kernel_backend=backend,
                                               kernel_build=self.kernel_build)
        return RuntimeOptions.from_profile("reference,fast" if backend == "tilelang" else "reference",
                                           kernel_backend="torch")

    def fixture_config(self) -> dict:
        with open(os.path.join(self.fixture, "config.json"), encoding="utf-8") as f:
            return json.load(f)

    def score_file(self, prompt: int = 0, steps: int = REHEARSAL_STEPS) -> str:
        """The fixture's score.json; in the rehearsal a copy cut to the first `prompt` tokens as the prompt
        (default: the fixture's window and REHEARSAL_PAST_WINDOW more, so that the window's ring wraps) and
        `steps` decode steps. Positions keep their numbers, so the cut scores compare with the reference's."""
        path = os.path.join(self.fixture, "score.json")
        if not self.rehearse:
            return path
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        if spec.get("prefill_len"):
            window = self.fixture_config().get("window_size", 0)
            prompt = min(prompt or window + REHEARSAL_PAST_WINDOW, spec["prefill_len"])
            spec["prefill_len"] = prompt
            spec["sequences"] = [s[:prompt + steps] if isinstance(s, list) else s for s in spec["sequences"]]
        short = os.path.join(self.tmp, f"score-{prompt}-{steps}.json")
        with open(short, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        return short


# ---------------------------------------------------------------------------------------------------------
# Comparisons

def _close(out: torch.Tensor, ref: torch.Tensor, kind: str):
    import torch
    rel, floor = CASE_TOLERANCES[kind]
    o, r = out.float(), ref.float()
    d = (o - r).abs()
    tol = rel * r.abs() + floor * r.abs().max()
    ok = bool(torch.isfinite(o).all()) and bool((d <= tol).all())
    differ = (out != ref).float().mean().item() * 100
    return ok, f"max|d| {d.max().item():.3g}, {differ:.3f}% differ", f"|d| <= {rel:.4g}|ref| + {floor:.4g}max"


def _same_bits(out: torch.Tensor, ref: torch.Tensor):
    import torch
    a, b = out.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)
    n = (a != b).sum().item()
    return n == 0, f"{n} bytes differ of {a.numel()}", "identical bytes"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    import torch
    ai, bi = a.contiguous().view(torch.int32).long(), b.contiguous().view(torch.int32).long()
    return (ai - bi).abs().max().item()


def _bf16_ulps_apart(a, b) -> int:
    """Largest distance between two bf16 tensors in units in the last place (adjacent values: 1)."""
    import torch
    bits = [t.contiguous().view(torch.int16).int() for t in (a, b)]
    key = [torch.where(k < 0, -(k & 0x7FFF), k) for k in bits]     # sign-magnitude -> ordered integers
    return int((key[0] - key[1]).abs().max().item()) if a.numel() else 0


def _topk_overlap(scores: torch.Tensor, ref: torch.Tensor, k: int) -> float:
    """Mean fraction of the kernel's top-k that the reference also selects; an index whose reference
    score ties the reference's k-th score counts as selected (which tied index wins is arbitrary)."""
    import torch
    mine = scores.float().topk(k, dim=-1).indices
    top = ref.float().topk(k, dim=-1)
    kth = top.values[..., -1:]
    chosen = torch.zeros_like(ref, dtype=torch.bool).scatter_(-1, top.indices, True)
    agree = chosen.gather(-1, mine) | (ref.float().gather(-1, mine) == kth)
    return agree.float().mean().item()


# ---------------------------------------------------------------------------------------------------------
# Phase: kernels against the torch references

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
    from ..kernels import reference as ref
    if ops is None:
        from ..kernels import tilelang_ops as ops
    from ..quant import dequant_fp4_weight, dequant_fp8_weight
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
        from ..kernels import reference as ref
        self._accepted("act_quant", x, block, settings)
        return ref.act_quant(x, block)

    def _qdq(self, name, x, block, settings):
        from ..kernels import reference as ref
        self._accepted(name, x, block, settings)
        return getattr(ref, name)(x, block)

    def fp8_qdq_(self, x, block=32, settings="default"):
        return self._qdq("fp8_qdq_", x, block, settings)

    def fp4_qdq_e8m0_(self, x, block=32, settings="default"):
        return self._qdq("fp4_qdq_e8m0_", x, block, settings)

    def fp4_qdq_e4m3_(self, x, block=16, settings="default"):
        return self._qdq("fp4_qdq_e4m3_", x, block, settings)

    def fp8_gemm(self, x, weight, scale, settings="default"):
        from ..kernels import fast
        from ..quant import dequant_fp8_weight
        self._accepted("fp8_gemm", x, weight, scale, settings)
        return fast.gemm(x, dequant_fp8_weight(weight, scale))

    def fp4_gemm(self, x, weight, scale, settings="default"):
        from ..kernels import fast
        from ..quant import dequant_fp4_weight
        self._accepted("fp4_gemm", x, weight, scale, settings)
        return fast.gemm(x, dequant_fp4_weight(weight, scale))

    def expert_gemm(self, q, s, experts, weight, scale, rows_per_token=1, settings="default"):
        import torch
        from ..kernels import fast
        self._accepted("expert_gemm", q, s, experts, weight, scale, rows_per_token, settings)
        kind = "fp4" if weight.dtype == torch.float4_e2m1fn_x2 else "fp8"
        a = (q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)      # act_quant's values
        rows = a[torch.arange(experts.shape[0], device=a.device) // rows_per_token]   # [P, K]
        w = fast.dequant_weight(weight, scale, kind, a.dtype)[experts.long()]        # [P, N, K]
        return fast.matmul_fp32(rows.unsqueeze(1), w.transpose(-1, -2)).squeeze(1).bfloat16()

    def sparse_attn(self, q, kv, sink, idx, scale, settings="default"):
        from ..kernels import fast
        self._accepted("sparse_attn", q, kv, sink, idx, scale, 64, settings)
        return fast.sparse_attn(q, kv, sink, idx, scale)

    def hc_split_sinkhorn(self, *args, settings="default"):
        from ..kernels import reference as ref
        self._accepted("hc_split_sinkhorn", *args, settings)
        return ref.hc_split_sinkhorn(*args)

    def index_scores(self, q, keys, w, settings="default"):
        from ..kernels import fast
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
    from ..kernels import tilelang_ops as ops
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
    from ..kernels import tilelang_ops as ops    # the kernel list and the wrappers' argument checks
    todo = ops.builds(ctx.released)
    note(f"kernels: would compile {len(todo)} kernels at the released shapes "
         f"({', '.join(dict.fromkeys(b.name for b in todo))})")
    small, stand_in = ctx.fixture_config(), TorchKernels(ops)
    missing = sorted(set(ops.FACTORIES) - {name for name, _, _ in kernel_cases(small, stand_in)})
    if missing:
        note(f"kernels: no case tests {', '.join(missing)}")
    note("kernels: the cases at the fixture's shapes, the torch kernels standing in for TileLang")
    return _kernel_table(small, ctx.clock, stand_in, "cpu")


# ---------------------------------------------------------------------------------------------------------
# Checkpoint-derived kernel lists (to compile ahead in parallel)

def checkpoint_builds(ckpt_dir: str, cfg: dict, world_size: int = 1, settings: str = "default"):
    """The kernels a converted checkpoint's model calls: builds(cfg) plus every FP8/FP4 GEMM shape found in
    the shard headers (both tile configurations) and the act_quant feeding it."""
    from ..kernels import tilelang_ops as ops
    from ..safetensors_io import read_header
    out = list(ops.builds(cfg, world_size, settings))
    for f in sorted(os.listdir(ckpt_dir)):
        if not f.endswith(".safetensors") or not f.startswith("model0-"):
            continue
        tensors, _ = read_header(os.path.join(ckpt_dir, f))
        for name, info in tensors.items():
            paired = name.endswith(".weight") and name[:-len(".weight")] + ".scale" in tensors
            if not paired or ".engram.embed." in name:
                continue
            fmt = {"F8_E4M3": "fp8", "F4": "fp4"}.get(info.dtype)
            if fmt:
                n, k = info.shape
                out += ops.gemm_builds(fmt, n, k, name, settings)
                out.append(ops.Build("act_quant", f"x [M, {k}] block 32", (k, 32, ops.BF16), settings))
    return list(dict.fromkeys(out))


def _warm(ckpt_dir: str, cfg: dict, what: str, world_size: int = 1, compile_them: bool = True,
          settings: str = "default"):
    """Compile the kernels a checkpoint's model calls; the rehearsal only lists them."""
    from ..kernels import tilelang_ops as ops
    t0 = time.perf_counter()
    todo = checkpoint_builds(ckpt_dir, cfg, world_size, settings)
    if not compile_them:
        note(f"{what}: would compile {len(todo)} kernels (listed from the shard headers)")
        return
    failed = ops.precompile(todo)
    note(f"{what}: compiled {len(todo)} kernels in {time.perf_counter() - t0:.1f} s"
         + (f" ({len(failed)} FAILED: {sorted(b.shapes for b in failed)})" if failed else ""))


def _run(cmd, clock: Clock, what: str):
    """Run a command in the repository root within the clock; returns (ok, output)."""
    if clock.left() < 10:
        return False, f"{what}: skipped, out of time"
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=clock.left())
    except subprocess.TimeoutExpired:
        return False, f"{what}: timed out"
    return p.returncode == 0, (p.stdout + p.stderr).strip()


def _in_process(main, argv: list, clock: Clock, what: str):
    """A tool's main(ARGV) run in this process, as `python -m` would run it but without a second start-up of
    torch, within the clock: (ok, its output)."""
    if clock.left() < 10:
        return False, f"{what}: skipped, out of time"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            ok = main(argv) == 0
        except SystemExit as e:     # its argument parser
            ok = e.code == 0
    return ok, out.getvalue().strip()


def _synthetic(argv: list, clock: Clock, what: str):
    """`python -m inference.tools.synthetic ARGV` in this process (its shard writers, when it starts any, are
    spawned): (ok, output)."""
    from . import synthetic
    return _in_process(synthetic.main, argv, clock, what)


def _tail(text: str, n: int = 12) -> str:
    return "\n".join("    " + line for line in text.splitlines()[-n:])


def _score(ckpt: str, config: str, score: str, dump: str, flags: list, clock: Clock, world: int = 1,
           device: str = "cuda"):
    cmd = [sys.executable, os.path.join(ROOT, "generate.py")]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               os.path.join(ROOT, "generate.py")]
    cmd += ["--ckpt-path", ckpt, "--config", config, "--score", score, "--dump-logits", dump,
            "--device", device, *flags]
    return _run(cmd, clock, f"generate.py {' '.join(flags)} (W = {world})")


def _compare(a: str, b: str, clock: Clock, what: str, tolerances=()) -> bool:
    """`python -m inference.tools.parity compare A B [tolerances]`, run in this process (no second start-up
    of torch): True when it passes."""
    from . import parity
    if clock.left() < 10:
        note(f"{what}: skipped, out of time")
        return False
    ok, out = _in_process(parity.main, ["compare", a, b, *tolerances], clock, what)
    note(f"{what}: {'ok' if ok else 'FAIL'}\n{_tail(out)}")
    return ok


# ---------------------------------------------------------------------------------------------------------
# Phase: the conformance fixture with both kernel backends

def phase_fixture(ctx: Ctx) -> bool:
    fix, clock, tmp = ctx.fixture, ctx.clock, ctx.tmp
    if not os.path.isfile(os.path.join(fix, "reference_logits.safetensors")):
        note(f"fixture: skipped, no reference_logits.safetensors in {fix} (give --fixture DIR)")
        return True
    cfg = ctx.fixture_config()
    # the subprocess finds them in TileLang's cache
    _warm(fix, cfg, "fixture", compile_them=not ctx.rehearse, settings=ctx.kernel_build)
    ok_all = True
    dumps = {}
    for backend in ("torch", "tilelang"):
        flags = ctx.backend_flags(backend)
        dumps[backend] = os.path.join(tmp, f"fixture-{backend}.safetensors")
        t0 = time.perf_counter()
        ok, out = _score(fix, os.path.join(fix, "config.json"), ctx.score_file(), dumps[backend], flags,
                         clock, device=ctx.device)
        note(f"fixture scored with {' '.join(flags)}: {'ok' if ok else 'FAIL'} "
             f"({time.perf_counter() - t0:.1f} s)" + ("" if ok else "\n" + _tail(out)))
        ok_all &= ok and _compare(dumps[backend], os.path.join(fix, "reference_logits.safetensors"), clock,
                                  f"fixture, {backend} vs reference logits")
    if all(os.path.isfile(p) for p in dumps.values()):
        _compare(dumps["tilelang"], dumps["torch"], clock, "fixture, tilelang vs torch (information)")
    return ok_all


# ---------------------------------------------------------------------------------------------------------
# Phase: two ranks with nccl (gloo in the rehearsal)

def phase_tp(ctx: Ctx) -> bool:
    import torch
    fix, clock, tmp = ctx.fixture, ctx.clock, ctx.tmp
    if not ctx.rehearse and torch.cuda.device_count() < 2:
        note(f"tp: skipped, {torch.cuda.device_count()} GPU visible (W = 2 needs two)")
        return True
    cfg_path = os.path.join(fix, "config.json")
    hf = os.path.join(tmp, "tp-hf")
    ok, out = _synthetic(["--config", cfg_path, "--out", hf, "--tokenizer", fix], clock,
                         "synthetic fixture-shaped checkpoint")
    dumps = {}
    for world in (1, 2):
        ckpt = os.path.join(tmp, f"tp-mp{world}")
        if ok:
            ok, out = _run([sys.executable, os.path.join(ROOT, "convert.py"), "--hf-ckpt-path", hf,
                            "--save-path", ckpt, "--model-parallel", str(world)], clock,
                           f"convert.py --model-parallel {world}")
        if ok:
            dumps[world] = os.path.join(tmp, f"tp-w{world}.safetensors")
            ok, out = _score(ckpt, cfg_path, ctx.score_file(*REHEARSAL_TP), dumps[world],
                             ctx.backend_flags("tilelang"), clock, world, device=ctx.device)
    if not ok:
        note(f"tp: FAIL\n{_tail(out)}")
        return False
    # W changes two reductions' rounding (bf16 index scores, fp32 wo_b partials): the project's own W = 2
    # test on the fixture allows 0.35 / 0.05
    what = "tp, W = 2 vs W = 1 " + ("(torch kernels, gloo)" if ctx.rehearse else "(tilelang, nccl)")
    bounds = REHEARSAL_TP_TOLERANCES if ctx.rehearse else ("--atol-max", "0.35", "--atol-mean", "0.05")
    return _compare(dumps[2], dumps[1], clock, what, bounds)


# ---------------------------------------------------------------------------------------------------------
# Phase: decode steps replayed from CUDA graphs against eager ones

CUDAGRAPH_RUN = (200, 60)        # prompt past the window, then steps across the 256 bucket and both parities
REHEARSAL_CUDAGRAPH = (60, 6)    # the rehearsal's, on CPU (bucket minimum 32: the 64 bucket is crossed)


def phase_cudagraph(ctx: Ctx) -> bool:
    """The fixture's model on the GPU (fast order, deterministic top-k, as --cuda-graph sets it), batch 1 and
    4: greedy decode steps eager and replayed from CUDA graphs (engine/cuda_graph.py), logits compared bit for
    bit, ms/step both ways (captures excluded). Rehearsal: no graph on a CPU, so the step a graph captures
    (a tensor position over a length bucket) runs eagerly against the plain eager step."""
    import torch
    from encoding.tokenizer import load_tokenizer
    from ..config import ModelArgs, RuntimeOptions
    from ..engine.checkpoint import load_checkpoint
    from ..engine.cuda_graph import GraphedDecode, bucket
    from ..model import Transformer
    from ..state import DecodeStep
    prompt, steps = REHEARSAL_CUDAGRAPH if ctx.rehearse else CUDAGRAPH_RUN
    args = ModelArgs.from_file(os.path.join(ctx.fixture, "config.json"), max_batch_size=4,
                               max_seq_len=prompt + steps + 8, temperature=0.0)
    opts = RuntimeOptions.from_profile("reference", kernel_backend="torch", deterministic_topk=True)
    model = Transformer(args, opts=opts, device=ctx.device, tokenizer=load_tokenizer(ctx.fixture))
    load_checkpoint(model, ctx.fixture)
    with open(os.path.join(ctx.fixture, "score.json"), encoding="utf-8") as f:
        seq = json.load(f)["sequences"][0]
    ok = True
    for batch in (1, 4):
        if ctx.clock.left() < 10:
            note(f"cudagraph: out of time, skipped batch {batch}")
            break
        ids = torch.tensor([seq[b:b + prompt + steps] for b in range(batch)], device=ctx.device)
        runs, times = [], []
        for graphed in (False, True):
            model.reset()
            model.prefill(ids[:, :prompt])
            graphs = GraphedDecode(model) if graphed and not ctx.rehearse else None
            logits, ms = [], []
            for p in range(prompt, prompt + steps):
                t = time.perf_counter()
                if graphs is not None:
                    out = graphs(ids[:, p:p + 1], p)[1]
                elif graphed:                                 # the rehearsal: the captured step, eagerly
                    length = bucket(p, args.max_seq_len, minimum=32)
                    pos = torch.tensor(p, device=ctx.device)
                    out = model.decode(ids[:, p:p + 1], DecodeStep(pos, p % 2, length)).logits
                else:
                    out = model.decode(ids[:, p:p + 1], p).logits
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                ms.append(1e3 * (time.perf_counter() - t))
                logits.append(out.float().cpu())
            runs.append(torch.stack(logits))
            times.append(sorted(ms)[len(ms) // 4: len(ms) - len(ms) // 4] or ms)   # middle half: no capture
        same = torch.equal(runs[0], runs[1])
        eager, replayed = (sum(t) / len(t) for t in times)
        what = "the captured step run eagerly" if ctx.rehearse else "replayed"
        note(f"cudagraph batch {batch}: {steps} steps from position {prompt}, {what} vs eager: "
             f"{'identical logits' if same else 'logits DIFFER'} (max |d| "
             f"{(runs[0] - runs[1]).abs().max().item():.3g}); {eager:.2f} ms/step eager, {replayed:.2f} "
             f"ms/step {what} (middle half of the steps)")
        ok &= same
    del model
    return ok


# ---------------------------------------------------------------------------------------------------------
# Phase: the routed experts in host memory beside the GPU

def phase_host_experts(ctx: Ctx) -> bool:
    fix, clock, tmp = ctx.fixture, ctx.clock, ctx.tmp
    ref = os.path.join(fix, "reference_logits.safetensors")
    if not os.path.isfile(ref):
        note(f"hostexperts: skipped, no reference_logits.safetensors in {fix} (give --fixture DIR)")
        return True
    dumps, ok_all = {}, True
    for where in ("device", "host"):
        dumps[where] = os.path.join(tmp, f"experts-on-{where}.safetensors")
        flags = ctx.backend_flags("torch") + ["--experts-on", where]
        t0 = time.perf_counter()
        ok, out = _score(fix, os.path.join(fix, "config.json"), ctx.score_file(), dumps[where], flags, clock,
                         device=ctx.device)
        took = f"{time.perf_counter() - t0:.1f} s, process start included"
        step = re.search(r"decode: (\d+) tokens in ([\d.]+) s", out)
        per_token = f"decode {1e3 * float(step[2]) / int(step[1]):.1f} ms per token, " if step else ""
        note(f"fixture scored with {' '.join(flags)}: {'ok' if ok else 'FAIL'} ({per_token}{took})"
             + ("" if ok else "\n" + _tail(out)))
        ok_all &= ok
    if ok_all:
        ok_all &= _compare(dumps["host"], ref, clock, "experts on the host vs reference logits")
        ok_all &= _compare(dumps["host"], dumps["device"], clock, "experts on the host vs on the device")
    return ok_all


# ---------------------------------------------------------------------------------------------------------
# The phases

from .gpu_speed import phase_speed  # noqa: E402  (a module of its own: the speed phase, gpu_speed.py)

@dataclasses.dataclass(frozen=True)
class Phase:
    """One row of the check. run(ctx) on CUDA and rehearse(ctx) on CPU (ctx.rehearse set) return whether
    every check passed (the same function where the phase reads ctx.rehearse); `budget`: seconds on one
    H200, compilation included; `checks`: what the real run checks, one line."""
    name: str
    budget: int
    run: Callable[[Ctx], bool]
    rehearse: Callable[[Ctx], bool]
    checks: str


PHASES = (
    Phase("kernels", 110, phase_kernels, rehearse_kernels,
          "every TileLang kernel against its torch reference at the released shapes (bytes, tolerances, "
          "top-k overlap)"),
    Phase("fixture", 110, phase_fixture, phase_fixture,
          "the reference-tiny fixture scored on CUDA with --kernel-backend torch and tilelang, each against "
          "the reference logits"),
    Phase("speed", 190, phase_speed, phase_speed,
          "decode ms/step eager and from CUDA graphs with launches a step and HBM share, prefill tok/s, at "
          "the released widths (2 and 4 layers); the experts in host memory; the host link; the host kernel"),
    Phase("tp", 50, phase_tp, phase_tp,
          "W = 2 with nccl against W = 1 on a fixture-shaped model (two GPUs; skipped on one)"),
    Phase("cudagraph", 40, phase_cudagraph, phase_cudagraph,
          "decode logits replayed from CUDA graphs equal the eager ones bit for bit (fixture, batch 1 and "
          "4); ms/step both ways"),
    Phase("hostexperts", 30, phase_host_experts, phase_host_experts,
          "the fixture scored with --experts-on host against the reference logits and the all-GPU route; "
          "decode ms per token both ways"),
)


def rehearse(phases, released: dict, fixture: str, workdir=None) -> int:
    """Walk each phase's setup on CPU; 1 when any raised or failed."""
    import torch
    note(f"gpu-check rehearsal on CPU (torch {torch.__version__}): every phase's setup at reduced shapes, "
         f"the TileLang kernels replaced by torch; nothing here measures a GPU")
    tmp = workdir or tempfile.mkdtemp(prefix="gpu-check-rehearsal-")
    os.makedirs(tmp, exist_ok=True)
    results, t_all = {}, time.perf_counter()
    try:
        for p in phases:
            note(f"== {p.name} (rehearsal). The real check: {p.checks}; budget {p.budget} s on one H200")
            t0 = time.perf_counter()
            try:
                ctx = Ctx(released, fixture, tmp, Clock(REHEARSAL_PHASE_SECONDS), rehearse=True)
                ok = bool(p.rehearse(ctx))
            except Exception as e:  # a typo in a phase's setup: name it, with where it happened
                tb = traceback.format_exc().strip().splitlines()[-8:]
                note(f"{p.name}: setup raised {type(e).__name__}: {e}\n" + "\n".join("    " + s for s in tb))
                ok = False
            results[p.name] = ok
            note(f"== {p.name}: {'PASS' if ok else 'FAIL'} ({time.perf_counter() - t0:.1f} s)")
    finally:
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    failed = [n for n, ok in results.items() if not ok]
    note(f"rehearsal: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}, {len(results)} phase(s) in "
         f"{time.perf_counter() - t_all:.1f} s")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------
# Wheels for a GPU host without network: `bash run.sh wheels DIR` downloads them, `bash run.sh gpu-check
# --wheels DIR` installs them into a private folder and runs the check with it on PYTHONPATH.

# A GPU host has Python, torch (with the packages torch itself requires) and numpy: never downloaded.
HOST_HAS = {"torch", "numpy", "triton", "typing-extensions", "filelock", "sympy", "mpmath", "networkx",
            "jinja2", "markupsafe", "fsspec", "setuptools", "pip"}
NEVER = ("torch", "triton", "nvidia-")    # never installed from a wheel folder, whatever it holds
# In a package's metadata but never imported by the check: tokenizers imports huggingface-hub only in
# Tokenizer.from_pretrained; the project reads tokenizer.json files.
NOT_IMPORTED = {"huggingface-hub"}
TEST_ONLY = {"pytest", "hypothesis", "pytest-xdist"}       # requirements.txt's test tools
# Imported but missing from a package's metadata (found by tests/test_gpu_check.py, which imports the check's
# modules with only torch, numpy and the wheels visible): torch_c_dlpack_ext/core.py imports packaging.
UNDECLARED = {"torch-c-dlpack-ext": ["packaging"]}
# The manylinux levels of a host that runs torch's CUDA wheels (glibc >= 2.28), newest first.
PLATFORMS = ([f"manylinux_2_{n}_x86_64" for n in range(28, 4, -1)]
             + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])
MANIFEST = "wheels.json"
PART_BYTES = 30 * 2 ** 20       # --pack also writes the archive in parts of at most this size (--part-size)
SITE = os.path.join(ROOT, ".device", "site")               # the default private folder (git-ignored)
NO_NETWORK = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name "
              "resolution", "Name or service not known", "Network is unreachable", "ConnectTimeoutError",
              "ProxyError", "Max retries exceeded", "ReadTimeoutError", "Connection refused")


class WheelError(Exception):
    """A problem with the wheels, reported as one line."""


def _packaging():
    """(Requirement, SpecifierSet, default_environment): packaging's, or the copy pip carries."""
    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
    except ImportError:
        from pip._vendor.packaging.markers import default_environment
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.specifiers import SpecifierSet
    return Requirement, SpecifierSet, default_environment


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _never(name: str) -> bool:
    return any(name == n or (n.endswith("-") and name.startswith(n)) for n in NEVER)


def _satisfies(version: str, spec: str) -> bool:
    _, SpecifierSet, _ = _packaging()
    try:
        return SpecifierSet(spec).contains(version, prereleases=True)
    except ValueError:      # a version string packaging cannot read
        return False


def target_environment(python_version: str) -> dict:
    """Marker values of CPython `python_version` on Linux x86_64 (no extras)."""
    _, _, default_environment = _packaging()
    env = dict(default_environment())
    env.update(python_version=python_version, python_full_version=python_version + ".0", sys_platform="linux",
               platform_system="Linux", os_name="posix", platform_machine="x86_64",
               implementation_name="cpython", platform_python_implementation="CPython", extra="")
    return env


def wheel_metadata(path: str):
    """(name, version, [Requires-Dist lines]) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(meta) != 1:
            raise WheelError(f"{os.path.basename(path)}: not a wheel (no single .dist-info/METADATA)")
        msg = email.parser.HeaderParser().parsestr(z.read(meta[0]).decode("utf-8"))
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def _needed(requirements, env, by: str):
    """(name, specifier, by) for requirement lines that apply to `env` and that a GPU host may lack."""
    Requirement, _, _ = _packaging()
    out = []
    for line in requirements:
        req = Requirement(line)
        name = canonical(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if name in HOST_HAS or name in NOT_IMPORTED or name in TEST_ONLY or _never(name):
            continue
        out.append((name, str(req.specifier), by))
    return out


def project_requirements(path: str = os.path.join(ROOT, "requirements.txt")) -> list:
    with open(path, encoding="utf-8") as f:
        lines = [ln.split("#", 1)[0].strip() for ln in f]
    reqs = [ln for ln in lines if ln and not ln.startswith("-")]
    return sorted(reqs, key=lambda r: not canonical(r).startswith("tilelang"))      # tilelang first


def _pip_download(requirements, dest: str, python_version: str) -> list:
    """pip download, one wheel per requirement, no dependencies; returns the paths pip reports."""
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "--python-version",
           python_version, "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)],
           "--dest", dest, "--retries", "1", "--timeout", "30", "--progress-bar", "off",
           "--disable-pip-version-check", *requirements]
    p = subprocess.run(cmd, capture_output=True, text=True)
    text = p.stdout + p.stderr
    if p.returncode != 0:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if any(s in text for s in NO_NETWORK):
            why = re.search(r"Failed to establish a new connection: [^'\"]*|Temporary failure in name "
                            r"resolution|Name or service not known|Network is unreachable|Connection refused|"
                            r"Read timed out|ProxyError|Max retries exceeded", text)
            where = re.search(r"Looking in indexes: (.*)", text)
            raise WheelError("no network: pip could not reach the package index"
                             + (" " + where.group(1).strip() if where else "")
                             + f" ({why.group(0).rstrip(')') if why else 'connection failed'})")
        missing = re.search(r"No matching distribution found for (\S+)", text)
        if missing:
            versions = re.search(r"\(from versions: ([^)]*)\)", text)
            found = versions.group(1) if versions else "none"
            raise WheelError(f"no wheel of {missing.group(1)} for Python {python_version} on manylinux "
                             f"x86_64 (versions with such a wheel: {found})")
        raise WheelError(f"pip download failed: {lines[-1] if lines else p.returncode}")
    found = re.findall(r"^\s*(?:Saved|File was already downloaded)\s+(.+\.whl)\s*$", text, re.M)
    return [os.path.abspath(f) for f in found]


def download_wheels(dest: str, python_version: str, requirements=None) -> list:
    """Download the wheels a GPU host with Python `python_version`, torch and numpy needs for the check:
    the project's requirements other than HOST_HAS and the test tools, and their dependencies from each
    wheel's metadata, recursively. Writes DEST/wheels.json; returns its records."""
    if not re.fullmatch(r"3\.\d{1,2}", python_version):
        raise WheelError(f"unknown --python-version {python_version!r} (expected 3.N, e.g. 3.12)")
    env = target_environment(python_version)
    os.makedirs(dest, exist_ok=True)
    specs, by_of, got = {}, {}, {}
    roots = requirements if requirements is not None else project_requirements()
    todo = _needed(roots, env, "requirements.txt")
    while todo:
        batch = []
        for name, spec, by in todo:
            specs.setdefault(name, [])
            if spec and spec not in specs[name]:
                specs[name].append(spec)
            by_of.setdefault(name, by)
            if name in got:
                if not _satisfies(got[name]["version"], ",".join(specs[name])):
                    raise WheelError(f"{by} needs {name}{spec}, but {got[name]['file']} was chosen for "
                                     f"{got[name]['requirement']}")
            elif name not in batch:
                batch.append(name)
        todo = []
        if not batch:
            break
        paths = _pip_download([name + ",".join(specs[name]) for name in batch], dest, python_version)
        for path in paths:
            dist, version, requires = wheel_metadata(path)
            name = canonical(dist)
            if name not in batch or name in got:
                continue
            got[name] = {"file": os.path.basename(path), "name": name, "version": version,
                         "requirement": name + ",".join(specs[name]), "needed_by": by_of[name],
                         "bytes": os.path.getsize(path)}
            todo += _needed(requires + UNDECLARED.get(name, []), env, name)
        lost = [n for n in batch if n not in got]
        if lost:
            raise WheelError(f"pip download reported no wheel for {', '.join(lost)}")
    records = list(got.values())
    with open(os.path.join(dest, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"python_version": python_version, "platforms": PLATFORMS[0] + " and older",
                   "wheels": records}, f, indent=1)
        f.write("\n")
    return records


def _stored(wheel: str, out: str):
    """Copy a wheel with every member stored uncompressed: the same files (so the same RECORD hashes), a
    valid wheel, and raw libraries for xz to compress (deflated ones it cannot shrink)."""
    with zipfile.ZipFile(wheel) as zi, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            zo.writestr(info, zi.read(info), compress_type=zipfile.ZIP_STORED)


def pack_wheels(dest: str, records) -> str:
    """DEST.tar.xz (xz preset 9, `xz -T0` when the xz program is there) holding the manifest and the wheels
    it lists, flat, each wheel stored uncompressed (_stored): half the size of the wheels as downloaded."""
    out = os.path.normpath(dest) + ".tar.xz"
    xz = shutil.which("xz")
    with tempfile.TemporaryDirectory() as scratch, open(out + ".tmp", "wb") as f:
        proc = subprocess.Popen([xz, "-9", "-T0", "-c"], stdin=subprocess.PIPE, stdout=f) if xz else None
        try:
            with (tarfile.open(fileobj=proc.stdin, mode="w|") if proc else
                  tarfile.open(fileobj=f, mode="w:xz", preset=9)) as tar:
                tar.add(os.path.join(dest, MANIFEST), arcname=MANIFEST)
                for r in records:
                    copy = os.path.join(scratch, r["file"])
                    _stored(os.path.join(dest, r["file"]), copy)
                    tar.add(copy, arcname=r["file"])
                    os.remove(copy)
        finally:
            if proc:
                proc.stdin.close()
                proc.wait()
        if proc and proc.returncode:
            raise WheelError(f"xz failed (exit status {proc.returncode}) writing {out}")
    os.replace(out + ".tmp", out)
    return out


def split_archive(archive: str, part_bytes: int = PART_BYTES) -> list:
    """When `archive` is larger than `part_bytes`: ARCHIVE.part0, .part1, ... (as few as fit, of equal size
    but the last), for hosts that take a limited size per transfer, the device machine for one (64 MiB a
    call, the repository's files included); [] otherwise. Parts of an earlier pack of that name are removed
    first. `cat ARCHIVE.part0 ARCHIVE.part1 > ARCHIVE` joins them; gpu-check --wheels joins them itself."""
    for old in _part_files(os.path.dirname(archive) or ".", os.path.basename(archive)).values():
        os.remove(old)
    size = os.path.getsize(archive)
    if size <= part_bytes:
        return []
    n = -(-size // part_bytes)
    each = -(-size // n)
    parts = []
    with open(archive, "rb") as f:
        for i in range(n):
            part = f"{archive}.part{i}"
            with open(part + ".tmp", "wb") as out:
                out.write(f.read(each))
            os.replace(part + ".tmp", part)
            parts.append(part)
    return parts


def _part_files(folder: str, name: str) -> dict:
    """{i: path} of the files NAME.part<i> in `folder`."""
    prefix = name + ".part"
    return {int(f[len(prefix):]): os.path.join(folder, f) for f in os.listdir(folder)
            if f.startswith(prefix) and f[len(prefix):].isdigit()}


def _xz_ends(path: str) -> bool:
    """Whether the file ends with an xz stream's footer: CRC32 of the next 6 bytes, backward size, flags,
    b"YZ" (a part cut from the middle of a stream does so by chance once in 2^48)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < 12:
            return False
        f.seek(-12, os.SEEK_END)
        footer = f.read(12)
    return footer[10:] == b"YZ" and zlib.crc32(footer[4:10]) == int.from_bytes(footer[:4], "little")


def archive_sources(src: str):
    """(name, [files]) of a packed wheel folder given as its archive, as one part of the archive split by
    `--pack` (NAME.part<i>), or as the folder holding those parts; None for a folder of wheels. A part
    missing (a gap, or a last part that does not end the xz stream) is a WheelError naming it."""
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, MANIFEST)) or any(f.endswith(".whl") for f in os.listdir(src)):
            return None
        names = set()
        for f in os.listdir(src):
            m = re.fullmatch(r"(.+)\.part\d+", f)
            if m and os.path.isfile(os.path.join(src, f)):
                names.add(m.group(1))
        names = sorted(names)
        if len(names) > 1:
            raise WheelError(f"{src} holds the parts of {len(names)} archives ({', '.join(names)}): give the "
                             f"first part of one, e.g. {os.path.join(src, names[0])}.part0")
        if not names:
            return None
        folder, name = src, names[0]
    else:
        m = re.fullmatch(r"(.+)\.part\d+", os.path.basename(src))
        if not m:
            return os.path.basename(src), [src]
        folder, name = os.path.dirname(src), m.group(1)
    have = _part_files(folder, name)
    base = os.path.join(folder, name)
    parts = []
    for i in range(max(have) + 1):
        if i not in have:
            found = ", ".join(f"part{j}" for j in sorted(have))
            raise WheelError(f"{base}.part{i} is missing (found {found}; "
                             f"the parts of one `bash run.sh wheels DIR --pack` join in order)")
        parts.append(have[i])
    if name.endswith((".xz", ".txz")) and not _xz_ends(parts[-1]):
        raise WheelError(f"{base}.part{len(parts)} is missing (the archive goes on after "
                         f"{os.path.basename(parts[-1])})")
    return name, parts


class _Joined(io.RawIOBase):
    """Files read one after the other as one stream (the parts of a split archive)."""

    def __init__(self, paths):
        self.files = [open(p, "rb") for p in paths]

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self.files:
            n = self.files[0].readinto(buf)
            if n:
                return n
            self.files.pop(0).close()
        return 0

    def close(self):
        for f in self.files:
            f.close()
        self.files = []
        super().close()


@contextlib.contextmanager
def _open_archive(files):
    """The tar stream of a packed wheel folder: one archive, or its parts joined ("r|*": read once, in
    order, any compression)."""
    with io.BufferedReader(_Joined(files), 1 << 20) as stream:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            yield tar


def _unpack(files, src: str, folder: str) -> str:
    """Extract a packed wheel folder (flat: wheels.json and *.whl) from its archive or parts `files` into
    `folder`, unless already there."""
    mark = "\n".join(f"{os.path.abspath(p)} {os.stat(p).st_size} {os.stat(p).st_mtime_ns}" for p in files)
    stamp = os.path.join(folder, ".from")
    if os.path.isfile(stamp) and open(stamp, encoding="utf-8").read() == mark:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    try:
        with _open_archive(files) as tar:
            for m in tar:
                if m.isfile() and "/" not in m.name and (m.name == MANIFEST or m.name.endswith(".whl")):
                    with tar.extractfile(m) as data, open(os.path.join(folder, m.name), "wb") as out:
                        shutil.copyfileobj(data, out)
    except (tarfile.TarError, EOFError, OSError, lzma.LZMAError) as e:
        raise WheelError(f"{src}: not a readable archive ({e})")
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(mark)
    return folder


def _archive_manifest(files, src: str):
    """The manifest of a packed wheel folder (its first member: the first part is enough), or None."""
    try:
        with _open_archive(files) as tar:
            for m in tar:
                if m.name == MANIFEST and m.isfile():
                    return json.load(tar.extractfile(m))
    except (tarfile.TarError, EOFError, OSError, ValueError, lzma.LZMAError) as e:
        raise WheelError(f"{src}: not a readable archive ({e})")
    return None


def _python_of(spec, src: str, here: str):
    if spec is not None and spec.get("python_version") != here:
        raise WheelError(f"the wheels in {src} are for Python {spec.get('python_version')}, this is Python "
                         f"{here} (make them with: bash run.sh wheels DIR --python-version {here})")


def _host_versions(exclude: str) -> dict:
    """{name: version} of the distributions this Python sees, `exclude` (the private folder) left out."""
    import importlib.metadata as md
    exclude = os.path.abspath(exclude)
    path = [p for p in sys.path if os.path.abspath(p or ".") != exclude
            and not os.path.abspath(p or ".").startswith(exclude + os.sep)]
    out = {}
    for d in md.distributions(path=path):
        name = d.metadata["Name"]
        if name:
            out.setdefault(canonical(name), d.version)
    return out


def choose_wheels(records, host: dict, everything: bool = False):
    """(records to install, ["name version" of the host's own that meet the requirement]): torch, triton and
    nvidia-* never; a wheel the host {name: version} has at a version its requirement allows only with
    `everything`."""
    chosen, kept = [], []
    for r in records:
        if _never(r["name"]):
            note(f"wheels: {r['file']} left out (torch, triton and nvidia-* come with the host)")
            continue
        have = host.get(r["name"])
        if not everything and have is not None and _satisfies(have, r["requirement"][len(r["name"]):]):
            kept.append(f"{r['name']} {have}")
        else:
            chosen.append(r)
    return chosen, kept


def install_wheels(src: str, target: str = SITE, everything: bool = False) -> list:
    """Install the wheels of `src` (a folder from download_wheels, its .tar.xz, or that archive's parts, given
    as one of them or as their folder: archive_sources) that the host lacks into `target` with pip --no-index
    --no-deps, then check that tilelang imports with `target` on PYTHONPATH. `everything`: install every
    wheel, even those the host has. Returns the installed records."""
    src, target = os.path.abspath(src), os.path.abspath(target)
    if not os.path.exists(src):
        raise WheelError(f"{src}: no such folder or archive (make one with: bash run.sh wheels DIR [--pack])")
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    folder, packed = src, archive_sources(src)
    if packed:
        name, files = packed
        _python_of(_archive_manifest(files, src), src, here)     # before unpacking: its first member
        stem = re.sub(r"\.tar(\.xz|\.gz|\.bz2)?$|\.t[gx]z$", "", name)
        folder = _unpack(files, src, os.path.join(os.path.dirname(target), "wheels", stem))
    manifest = os.path.join(folder, MANIFEST)
    if os.path.isfile(manifest):
        with open(manifest, encoding="utf-8") as f:
            spec = json.load(f)
        _python_of(spec, src, here)
        records = spec["wheels"]
    else:       # a folder of wheels made by hand: each pinned to its own version
        records = []
        for f in sorted(os.listdir(folder)):
            if f.endswith(".whl"):
                name, version = canonical(f.split("-")[0]), f.split("-")[1]
                records.append({"file": f, "name": name, "version": version,
                                "requirement": f"{name}=={version}"})
    if not records:
        raise WheelError(f"no wheels in {src} (make them with: bash run.sh wheels DIR)")
    absent = [r["file"] for r in records if not os.path.isfile(os.path.join(folder, r["file"]))]
    if absent:
        raise WheelError(f"{src} lacks {', '.join(absent)} (listed in its {MANIFEST})")
    chosen, kept = choose_wheels(records, _host_versions(target), everything)
    stamp = os.path.join(target, ".wheels")
    want = "\n".join(sorted(r["file"] for r in chosen))
    if os.path.isfile(stamp) and open(stamp, encoding="utf-8").read() == want:
        note(f"wheels: {target} already holds {len(chosen)} of them")
    else:
        tmp = target + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if chosen:
            cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--no-index", "--no-deps",
                   "--find-links", folder, "--target", tmp, "--no-cache-dir", "--no-warn-script-location",
                   "--disable-pip-version-check", "-q", *[os.path.join(folder, r["file"]) for r in chosen]]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
                raise WheelError(f"pip install --no-index into {target} failed: {lines[-1] if lines else ''}")
        with open(os.path.join(tmp, ".wheels"), "w", encoding="utf-8") as f:
            f.write(want)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        note(f"wheels: installed into {target}: "
             + (", ".join(f"{r['name']} {r['version']}" for r in chosen) or "nothing"))
    if kept:
        note(f"wheels: the host's own: {', '.join(kept)}")
    code = ("import os, tilelang, tilelang.env as e; n = os.path.join(e.CUDA_HOME or '', 'bin', 'nvcc'); "
            "print(tilelang.__version__, tilelang.__file__, n if os.path.isfile(n) else '-')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [target, os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        raise WheelError(f"tilelang does not import with {target} on PYTHONPATH: "
                         f"{lines[-1] if lines else p.returncode}")
    version, where, nvcc = (p.stdout.strip().splitlines() or [""])[-1].split(" ")
    note(f"wheels: tilelang {version} imports from {os.path.dirname(os.path.dirname(where))}; nvcc: "
         + (nvcc if nvcc != "-" else "none found, so no kernel can compile (TileLang looks at CUDA_HOME, "
                                     "PATH, /usr/local/cuda)"))
    return chosen


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


def _size(text: str) -> int:
    """Bytes of `30M`, `512K` or `1000000` (M and K: MiB and KiB)."""
    m = re.fullmatch(r"(\d+)([KkMm]?)", text.strip())
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 30M or 512K, got {text!r}")
    return int(m.group(1)) * {"": 1, "k": 2 ** 10, "m": 2 ** 20}[m.group(2).lower()]


def _in_repo(path: str) -> str:
    """`path` relative to the repository root when it lies inside it (as `carry` names it), else as given."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return path if rel.startswith("..") else rel


def carry_plan(archive: str, parts) -> list:
    """Lines saying which file each call to a host with a size limit per transfer carries (one part a
    call) and what the last call runs."""
    run = f"bash run.sh gpu-check --wheels {_in_repo(parts[0])}"
    lines = [f"in {len(parts)} parts of {_mib(os.path.getsize(parts[0]))} at most, for a host that takes a "
             f"limited size per transfer (the device machine: docs/cli.md §4.3), one part a call:"]
    for i, part in enumerate(parts):
        lines.append(f"  call {i + 1}: carry {_in_repo(part)} ({_mib(os.path.getsize(part))})"
                     + (f", run: {run}" if i == len(parts) - 1 else ""))
    return lines


def wheels_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="bash run.sh wheels", description="Download the wheels an offline GPU "
                                 "host needs for the device check (docs/cli.md §4.3).")
    ap.add_argument("dir", help="folder to write the wheels and wheels.json into (created)")
    ap.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                    help="the GPU host's Python, 3.N (default: this interpreter's)")
    ap.add_argument("--pack", action="store_true",
                    help="also write DIR.tar.xz (xz preset 9) and, when it is larger than --part-size, "
                         "DIR.tar.xz.part0, .part1, ...")
    ap.add_argument("--part-size", type=_size, default=PART_BYTES,
                    help=f"the largest part of a packed archive (default {PART_BYTES >> 20}M)")
    opts = ap.parse_args(argv)
    try:
        t0 = time.perf_counter()
        records = download_wheels(opts.dir, opts.python_version)
        for r in records:
            note(f"  {r['name']:20s} {r['version']:12s} {_mb(r['bytes']):>9s}  (for {r['needed_by']})")
        total = sum(r["bytes"] for r in records)
        note(f"wrote {len(records)} wheels, {_mb(total)}, for Python {opts.python_version} to {opts.dir} "
             f"in {time.perf_counter() - t0:.0f} s")
        out = opts.dir
        if opts.pack:
            t0 = time.perf_counter()
            out = pack_wheels(opts.dir, records)
            size = os.path.getsize(out)
            note(f"packed into {out}: {_mb(size)} ({_mib(size)}) in {time.perf_counter() - t0:.0f} s")
            parts = split_archive(out, opts.part_size)
            if parts:
                for line in carry_plan(out, parts):
                    note(line)
        note(f"on the GPU host: bash run.sh gpu-check --wheels {out}")
    except (WheelError, OSError) as e:
        print(f"run.sh: error: wheels: {e}", file=sys.stderr)
        return 1
    return 0


def install_wheels_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="bash run.sh gpu-check --wheels", description="Install the wheels of a "
                                 "folder or archive from `bash run.sh wheels` into a private folder.")
    ap.add_argument("src", help="the folder, its .tar.xz, a part of that (.part0) or the folder holding the "
                                "parts")
    ap.add_argument("--target", default=SITE,
                    help=f"the private folder (default {os.path.relpath(SITE, ROOT)})")
    ap.add_argument("--all", action="store_true", help="install every wheel, also those the host has")
    opts = ap.parse_args(argv)
    try:
        install_wheels(opts.src, opts.target, opts.all)
    except (WheelError, OSError, subprocess.SubprocessError) as e:
        print(f"run.sh: error: gpu-check --wheels: {e}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["wheels"]:
        return wheels_main(argv[1:])
    if argv[:1] == ["install-wheels"]:
        return install_wheels_main(argv[1:])
    names = [p.name for p in PHASES]
    ap = argparse.ArgumentParser(prog="python -m inference.tools.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default=FIXTURE, help="conformance fixture directory")
    default_budget = sum(p.budget for p in PHASES)
    ap.add_argument("--budget", type=float, default=default_budget,
                    help=f"seconds for the whole check (default {default_budget}, the phases' budgets "
                         f"summed)")
    ap.add_argument("--phases", default=",".join(names), help=f"comma-separated subset of {', '.join(names)}")
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--kernel-build", choices=["default", "plain"], default="default",
                    help="how the TileLang kernels are built (plain: no warp specialization or TMA "
                         "lowering); the kernels phase retries a failing GEMM plain either way")
    ap.add_argument("--rehearse", action="store_true",
                    help="walk every phase's setup on CPU at reduced shapes (no GPU needed)")
    opts = ap.parse_args(argv)
    import torch
    if not opts.rehearse and not torch.cuda.is_available():
        print("gpu-check needs CUDA: no CUDA device is visible")
        return 2
    phases = [p for p in opts.phases.split(",") if p]
    unknown = [p for p in phases if p not in names]
    if unknown:
        ap.error(f"unknown phase(s) {unknown}; known: {', '.join(names)}")
    phases = [next(q for q in PHASES if q.name == p) for p in phases]
    with open(os.path.join(ROOT, "config.json"), encoding="utf-8") as f:
        released = json.load(f)
    if opts.rehearse:
        return rehearse(phases, released, opts.fixture, opts.workdir)
    clock = Clock(opts.budget)
    note(f"gpu-check on {torch.cuda.get_device_name()} (x{torch.cuda.device_count()}), "
         f"torch {torch.__version__}, budget {opts.budget:.0f} s")
    tmp = opts.workdir or tempfile.mkdtemp(prefix="gpu-check-")
    os.makedirs(tmp, exist_ok=True)
    results = {}
    try:
        for p in phases:
            c = clock.phase(p.budget)
            if c.left() < 10:
                note(f"== {p.name}: skipped, the run's budget is spent")
                continue
            note(f"== {p.name} (budget {c.left():.0f} s)")
            t0 = time.perf_counter()
            try:
                results[p.name] = p.run(Ctx(released, opts.fixture, tmp, c, kernel_build=opts.kernel_build))
            except Exception as e:  # report the phase as failed, run the next one
                note(f"{p.name}: FAIL ({type(e).__name__}: {e})")
                results[p.name] = False
            note(f"== {p.name}: {'ok' if results[p.name] else 'FAIL'} in {time.perf_counter() - t0:.1f} s")
    finally:
        if opts.workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    note("gpu-check: " + ", ".join(f"{p} {'ok' if r else 'FAIL'}" for p, r in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
