"""The device check's phases in the order they run (PHASES: each one's name, budget on one H200, the
function that runs it on CUDA and the one that rehearses it on CPU, what it checks), the whole check's time
budget, and the CPU rehearsal's loop (rehearse). The package docstring's budget table follows PHASES
(tests/test_gpu_check.py holds them together).
"""
import dataclasses
import os
import shutil
import tempfile
import time
import traceback
from typing import Callable

from .common import Clock, Ctx, note
from .cudagraph import phase_cudagraph
from .fixture import phase_fixture
from .hostexperts import phase_host_experts
from .kernels import phase_kernels, rehearse_kernels
from .speed import phase_speed
from .tp import phase_tp

TOTAL_SECONDS = 540             # the whole check on one H200, compilation included
START_UP_SECONDS = 10           # Python, torch and CUDA initialisation, the summary
RESERVED = {}                   # budgets of phases still to come; a new phase moves its line into PHASES
REHEARSAL_PHASE_SECONDS = 600   # a rehearsal phase's clock: the GPU budgets say nothing about a CPU


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
