"""The device check's `fixture` phase: the conformance fixture scored on CUDA by generate.py with
--kernel-backend torch and tilelang, each compared with the fixture's reference logits by the parity tool
(in the rehearsal: on CPU, a cut prompt, the fast order standing in for tilelang).
"""
import os
import time

from .common import Ctx, _compare, _score, _tail, _warm, note


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

