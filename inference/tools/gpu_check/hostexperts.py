"""The device check's `hostexperts` phase: the fixture scored with its routed experts in host memory
(--experts-on host) against the reference logits and against the all-GPU torch route.
"""
import os
import re
import time

from .common import Ctx, _compare, _score, _tail, note


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

