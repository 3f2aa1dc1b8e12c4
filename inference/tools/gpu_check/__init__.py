"""The prepared device check, for a machine with a CUDA GPU of compute capability >= 9.0 (an H200 in mind).

    python -m inference.tools.gpu_check [--fixture DIR] [--budget SECONDS] [--phases kernels,speed,cudagraph]
    python -m inference.tools.gpu_check --rehearse [--phases ...]     # every phase's setup on CPU, no GPU
    bash run.sh gpu-check [--wheels DIR | DIR.tar.xz | DIR.tar.xz.part0] [ARGS]  # from the project's runner

Phases (the table PHASES in phases.py), each with a time budget; a phase that runs out of time skips the
rest of its work with a note:
  kernels  every TileLang kernel against its torch reference (inference/kernels/reference.py) on random
           inputs at the released shapes (config.json): quantisers must give identical bytes and scales;
           GEMMs, attention and index scores must agree within the tolerances in CASE_TOLERANCES (printed);
           the indexer's top-512 selection must overlap >= 99 % (ties at the boundary count as agreement).
  fixture  the conformance fixture (tests/fixtures/reference-tiny, or --fixture) scored on CUDA by
           generate.py with --kernel-backend torch and tilelang, each compared with the fixture's reference
           logits by the parity tool (`python -m inference.tools.parity compare`, run in this process, with
           its default tolerances).
  speed    what a decode step costs (speed.py): the released widths with 2 and 4 layers
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

The package (inference/tools/gpu_check/):
  __init__.py     this text, main(): the arguments, the run loop on CUDA (and `wheels`, `install-wheels`)
  __main__.py     `python -m inference.tools.gpu_check`
  common.py       Clock, Ctx, note; the comparisons with a reference; the runs a phase makes (a command,
                  a tool's main in this process, generate.py scoring, the parity tool comparing); the
                  kernels a checkpoint calls (checkpoint_builds)
  kernels.py, fixture.py, speed.py, tp.py, cudagraph.py, hostexperts.py   one phase each, its constants
                  and its rehearsal
  phases.py       Phase, PHASES (the order, budgets and checks), the whole check's budget, rehearse()
  wheels.py       the wheels for a GPU host without network
A constant is read in the file that defines it: to change one (a test's monkeypatch), set it there.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

# torch is imported where it is used: `wheels` and `install-wheels` run without it (the machine with network
# may lack torch) and start in a fraction of a second. No module of the package imports it at the top.
from .common import CASE_TOLERANCES, FIXTURE, ROOT, Clock, Ctx, checkpoint_builds, note
from .cudagraph import CUDAGRAPH_RUN, REHEARSAL_CUDAGRAPH, phase_cudagraph
from .fixture import phase_fixture
from .hostexperts import phase_host_experts
from .kernels import LONG_ROWS, TorchKernels, kernel_cases, phase_kernels, rehearse_kernels
from .phases import PHASES, RESERVED, START_UP_SECONDS, TOTAL_SECONDS, Phase, rehearse
from .speed import phase_speed
from .tp import REHEARSAL_TP, REHEARSAL_TP_TOLERANCES, phase_tp
from .wheels import (HOST_HAS, MANIFEST, PART_BYTES, SITE, UNDECLARED, WheelError, archive_sources,
                     canonical, choose_wheels, download_wheels, install_wheels, install_wheels_main,
                     pack_wheels, project_requirements, split_archive, target_environment, wheel_metadata,
                     wheels_main)

__all__ = ["CASE_TOLERANCES", "FIXTURE", "ROOT", "Clock", "Ctx", "checkpoint_builds", "note",
           "CUDAGRAPH_RUN", "REHEARSAL_CUDAGRAPH", "phase_cudagraph", "phase_fixture", "phase_host_experts",
           "LONG_ROWS", "TorchKernels", "kernel_cases", "phase_kernels", "rehearse_kernels",
           "PHASES", "RESERVED", "START_UP_SECONDS", "TOTAL_SECONDS", "Phase", "rehearse", "phase_speed",
           "REHEARSAL_TP", "REHEARSAL_TP_TOLERANCES", "phase_tp",
           "HOST_HAS", "MANIFEST", "PART_BYTES", "SITE", "UNDECLARED", "WheelError", "archive_sources",
           "canonical", "choose_wheels", "download_wheels", "install_wheels", "install_wheels_main",
           "pack_wheels", "project_requirements", "split_archive", "target_environment", "wheel_metadata",
           "wheels_main", "main"]


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

