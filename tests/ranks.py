"""Multi-process runs for the tests, forked from a warm server instead of started afresh.

A new interpreter spends about 2 s of CPU importing torch before it runs a line; torchrun costs one more
interpreter on top of its ranks. The tests start dozens of ranks, so they fork them from Python's forkserver,
which imports torch and generate.py once per pytest worker and never runs a kernel itself (forking a process
whose OpenMP pool is running can hang the child). What a rank runs is what it runs under torchrun: torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), generate.main(ARGS), its exit status. The torchrun launcher
itself stays covered where it matters: test_generate's interactive and missing-shard tests run under it.
"""
import faulthandler
import functools
import io
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import wait

from conftest import ROOT, free_port

# A rank still running after this long writes every thread's stack to its stderr file (again each period):
# a run that stands still and then goes on is reported as a warning with those stacks, a run that times out
# fails with them. The slowest run in the suite takes under a tenth of this on a 2-core machine.
STACKS_AFTER_S = 120


@functools.lru_cache(maxsize=None)
def context():
    """The forkserver context, its server preloading torch and generate.py (set before it first starts)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "generate"])
    return ctx


def call_main(args) -> int:
    """generate.main(ARGS) as `python generate.py ARGS` ends: its exit status; for an exception it lets out,
    a traceback printed and status 1."""
    import generate
    try:
        return generate.main(list(args))
    except SystemExit as e:                      # argparse's own exits
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        traceback.print_exc()
        return 1


def _rank(rank: int, world: int, port: int, args: list, stdin: str, out: str, err: str):
    """One rank of `torchrun --nproc-per-node WORLD generate.py ARGS`, its output in files `out` and `err`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)                    # what torchrun's OMP_NUM_THREADS=1 gives a fresh process
    os.chdir(ROOT)
    with open(out, "w", encoding="utf-8") as fo, open(err, "w", encoding="utf-8") as fe:
        os.dup2(fo.fileno(), 1)                 # native writes (gloo, torch warnings) land there too
        os.dup2(fe.fileno(), 2)
        sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin or ""), fo, fe
        faulthandler.dump_traceback_later(STACKS_AFTER_S, repeat=True, file=fe)
        code = call_main(args)
        fo.flush()
        fe.flush()
    os._exit(code)


def run_generate(args, nproc: int, stdin=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node NPROC generate.py ARGS` for a test: the ranks' outputs
    concatenated in rank order, exit status 1 if a rank failed. Like torchrun, the first rank to fail stops
    the others; past `timeout` every rank is killed and subprocess.TimeoutExpired raised."""
    ctx, port = context(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        files = [(os.path.join(tmp, f"out{r}"), os.path.join(tmp, f"err{r}")) for r in range(nproc)]
        procs = [ctx.Process(target=_rank, args=(r, nproc, port, list(args), stdin, *files[r]))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.exitcode is None for p in procs):
                left = deadline - time.monotonic()
                if left <= 0:
                    print(f"the ranks' stderr at the timeout:\n{_errs(files)}")     # shown with the failure
                    raise subprocess.TimeoutExpired(["generate.py", *args], timeout)
                wait([p.sentinel for p in procs if p.exitcode is None], timeout=left)
                if any(p.exitcode for p in procs):
                    break
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join()
        out, err = "".join(open(f[0], encoding="utf-8").read() for f in files), _errs(files)
    code = 1 if any(p.exitcode for p in procs) else 0
    if "Timeout (" in err:          # faulthandler's header: a rank ran past STACKS_AFTER_S
        warnings.warn(f"generate.py {' '.join(args)}: a rank ran past {STACKS_AFTER_S} s; its stacks:\n{err}")
    return subprocess.CompletedProcess(["generate.py", *args], code, out, err)


def _errs(files) -> str:
    """The ranks' stderr files, concatenated in rank order."""
    return "".join(open(f[1], encoding="utf-8").read() for f in files)


def _with_stacks(rank: int, fn, *args):
    faulthandler.dump_traceback_later(STACKS_AFTER_S, repeat=True)     # to the worker's stderr
    fn(rank, *args)


def spawn(fn, args: tuple, nprocs: int = 2):
    """torch.multiprocessing.spawn(fn, args, nprocs) with the ranks forked from the warm server (a rank still
    running after STACKS_AFTER_S writes its stacks to stderr)."""
    import torch.multiprocessing as mp
    context()
    mp.start_processes(_with_stacks, args=(fn, *args), nprocs=nprocs, start_method="forkserver")


def descendants(pid: int) -> list:
    """The children of pid, theirs and so on, from /proc (torchrun's ranks run in sessions of their own: a
    signal to the launcher's process group misses them)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found
