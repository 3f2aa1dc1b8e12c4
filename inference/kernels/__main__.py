"""Compile the TileLang kernels without a GPU (nvcc is enough) at a model config's shapes.

    python -m inference.kernels --compile --arch sm_90a          # released config.json, every kernel
    python -m inference.kernels --compile --arch sm_100a --only fp8_gemm,sparse_attn
    python -m inference.kernels --list

Prints one line per kernel build (name, shapes, seconds, ok/FAILED) and exits 1 if any build failed.
TileLang's kernel cache is switched off for the run, so the times are real compiles and nothing is stored.
"""
import argparse
import concurrent.futures
import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCHS = ("sm_90a", "sm_100a")


def compile_one(build, arch: str) -> str:
    """Lower and compile one tilelang_ops.Build for `arch`: "ok" or "FAILED (the error's last line)"."""
    from . import tilelang_ops as ops
    try:
        ops.compile_kernel(build.prim_func(), target={"kind": "cuda", "arch": arch})
        return "ok"
    except Exception as e:  # reported, and the other kernels still compile
        lines = str(e).strip().splitlines() or [""]
        return f"FAILED ({type(e).__name__}: {lines[-1][:200]})"


def compile_all(builds, arch: str, jobs: int = 1, out=sys.stdout) -> int:
    """Compile the builds for `arch` (`jobs` at a time), one printed line each as they finish; returns the
    number of failures."""
    def timed(b):
        t0 = time.perf_counter()
        return b, compile_one(b, arch), time.perf_counter() - t0

    failures = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as ex:
        for b, status, seconds in ex.map(timed, builds):
            failures += status != "ok"
            print(f"{b.name:18s} {b.shapes:58s} {seconds:6.1f} s  {status}", file=out, flush=True)
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m inference.kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true", help="lower and compile the kernels")
    ap.add_argument("--list", action="store_true", help="print the kernels and their build shapes")
    ap.add_argument("--arch", default="sm_90a", choices=ARCHS, help="CUDA architecture to compile for")
    ap.add_argument("--config", default=os.path.join(ROOT, "config.json"), help="model config.json")
    ap.add_argument("--world-size", type=int, default=1, help="tensor-parallel shapes for this many ranks")
    ap.add_argument("--only", default="", help="comma-separated kernel names (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="kernels compiled at a time (default 2)")
    opts = ap.parse_args(argv)
    if not (opts.compile or opts.list):
        ap.error("give --compile or --list")
    with open(opts.config, encoding="utf-8") as f:
        cfg = json.load(f)
    from . import tilelang_ops as ops
    builds = ops.builds(cfg, opts.world_size)
    if opts.only:
        wanted = set(opts.only.split(","))
        unknown = wanted - set(ops.FACTORIES)
        if unknown:
            ap.error(f"unknown kernel(s) {sorted(unknown)}; known: {', '.join(ops.FACTORIES)}")
        builds = [b for b in builds if b.name in wanted]
    if opts.list:
        for b in builds:
            print(f"{b.name:18s} {b.shapes}")
        return 0
    if ops.nvcc_path() is None:
        print(f"no nvcc found: {ops.NVCC_HINT}", file=sys.stderr)
        return 2
    import tilelang
    tilelang.disable_cache()
    logging.getLogger("tilelang").setLevel(logging.WARNING)   # no begin/end line per compile
    t0 = time.perf_counter()
    failures = compile_all(builds, opts.arch, opts.jobs)
    print(f"{len(builds) - failures}/{len(builds)} kernel builds ok for {opts.arch} in "
          f"{time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
