"""What every phase of the device check works with: the deadlines (Clock), the context a phase gets (Ctx) and
its output (note); the comparisons of a kernel's output with its reference (_close within CASE_TOLERANCES,
_same_bits, _ulps, _bf16_ulps_apart, _topk_overlap); the runs a phase makes: a command in the repository root
(_run), a tool's main in this process (_in_process, _synthetic), generate.py scoring a checkpoint (_score),
the parity tool's comparison (_compare), and the kernels a converted checkpoint calls, compiled ahead
(checkpoint_builds, _warm).

torch is imported where it is used: the package's `wheels` and `install-wheels` import this module and run
without torch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:                   # annotations only: torch is imported where it is used
    import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "reference-tiny")
# (relative to |reference|, floor as a fraction of max |reference|): one bf16 ulp is 2^-8..2^-7 relative;
# the floor covers outputs that cancel to near zero, where one ulp of a partial sum is large.
CASE_TOLERANCES = {"gemm": (2 ** -7, 2 ** -10), "attention": (2 ** -7, 2 ** -9), "scores": (2 ** -7, 2 ** -8)}
REHEARSAL_STEPS = 3             # decode steps the rehearsal's fixture phase scores after its prompt
REHEARSAL_PAST_WINDOW = 8       # ... a prompt of the fixture's window (64 tokens) and this many more


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
        from ...config import RuntimeOptions
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
# Checkpoint-derived kernel lists (to compile ahead in parallel)

def checkpoint_builds(ckpt_dir: str, cfg: dict, world_size: int = 1, settings: str = "default"):
    """The kernels a converted checkpoint's model calls: builds(cfg) plus every FP8/FP4 GEMM shape found in
    the shard headers (both tile configurations) and the act_quant feeding it."""
    from ...kernels import tilelang_ops as ops
    from ...safetensors_io import read_header
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
    from ...kernels import tilelang_ops as ops
    t0 = time.perf_counter()
    todo = checkpoint_builds(ckpt_dir, cfg, world_size, settings)
    if not compile_them:
        note(f"{what}: would compile {len(todo)} kernels (listed from the shard headers)")
        return
    failed = ops.precompile(todo)
    note(f"{what}: compiled {len(todo)} kernels in {time.perf_counter() - t0:.1f} s"
         + (f" ({len(failed)} FAILED: {sorted(b.shapes for b in failed)})" if failed else ""))


# ---------------------------------------------------------------------------------------------------------
# The runs a phase makes: a command, a tool in this process, generate.py scoring, the parity tool comparing

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
    from .. import synthetic
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
    from .. import parity
    if clock.left() < 10:
        note(f"{what}: skipped, out of time")
        return False
    ok, out = _in_process(parity.main, ["compare", a, b, *tolerances], clock, what)
    note(f"{what}: {'ok' if ok else 'FAIL'}\n{_tail(out)}")
    return ok


