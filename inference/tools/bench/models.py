"""Benchmark: prefill tokens/s, decode ms/step, achieved weight bandwidth and peak memory.

    python -m inference.tools.bench                       # tiny (fixture-shaped) and large random models
    python -m inference.tools.bench --models large --contexts 1024,8192 --decode-steps 8
    python -m inference.tools.bench models --models released --experts-on host --cpu-linears stored \\
        --numerics fast                                   # the released widths against the memory roofline
    python -m inference.tools.bench -h                    # the other subcommands (experts, convert, ...)

Each model is a synthetic random checkpoint in the real formats (tools/synthetic.py + convert.py, cached
under --workdir), with the real DeepSeek tokenizer. `released` (released.py): the released widths on a mix of
the released layer kinds, decode at --contexts x --batches, prefill at --prefills, the bytes a step reads and
the read bandwidth measured in the same run, the released 40-layer model extrapolated. Figures are printed,
never asserted.
"""
import argparse
import os
import resource
import tempfile
import time
from typing import Tuple

import torch

from ...config import ConfigError, ModelArgs, RuntimeOptions
from ...engine.errors import InputError
from ...engine.session import add_model_flags, runtime_options
from .common import WARM_UP, KindTimer, build, make_args, warm_up


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: everything but the routed experts and Engram tables, plus the
    activated share of the experts (gpt-fast's 'achieved bandwidth' convention)."""
    a = model.args
    total = experts = 0
    for n, p in model.named_parameters():
        b = p.numel() * p.element_size()
        if ".engram.embed." in n:
            continue
        if ".experts." in n:
            experts += b
        else:
            total += b
    return total + experts * a.n_activated_experts // a.n_routed_experts


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def engram_bytes_moved(model) -> int:
    """Engram table bytes copied to the model's device so far (0 when the tables live there)."""
    return sum(layer.engram.embed.bytes_moved for layer in model.layers if layer.engram is not None)


def bench_context(model, context: int, steps: int, gen: torch.Generator):
    """-> (prefill tokens/s, decode ms/step, Engram bytes moved per decode step)."""
    model.reset()
    ids = torch.randint(3, model.args.vocab_size, (1, context + steps), generator=gen)
    ids = ids.to(model.ctx.device)
    _, t_prefill = timed(lambda: model.prefill(ids[:, :context]))
    moved = engram_bytes_moved(model)
    times = []
    for i in range(steps):
        _, t = timed(lambda: model.decode(ids[:, context + i:context + i + 1], context + i))
        times.append(t)
    moved = (engram_bytes_moved(model) - moved) / steps
    times = sorted(times)[:max(1, len(times) - len(times) // 4)]      # drop the slowest quarter (noise)
    return context / t_prefill, 1e3 * sum(times) / len(times), moved


def breakdown(model, context: int, steps: int, gen: torch.Generator) -> Tuple[str, str]:
    """Where a prefill of `context` tokens and `steps` decode steps after it spend their time, by module
    kind: (prefill shares, decode shares)."""
    from .launches import attribute
    model.reset()
    ids = torch.randint(3, model.args.vocab_size, (1, context + steps), generator=gen).to(model.ctx.device)
    timers = KindTimer(), KindTimer()
    with attribute(model, timers[0]):
        timers[0].restart()
        model.prefill(ids[:, :context])
        timers[0].switch()
    with attribute(model, timers[1]):
        timers[1].restart()
        for i in range(steps):
            model.decode(ids[:, context + i:context + i + 1], context + i)
        timers[1].switch()
    return timers[0].shares(), timers[1].shares()


def profile_decode(model, context: int, steps: int, gen: torch.Generator, top: int = 6) -> str:
    """torch.profiler over `steps` decode steps after a prefill of `context`: self CPU ms per step, in all and
    for the ops that took most (aten::cat: copies a step makes of weights or caches)."""
    from torch.profiler import profile
    model.reset()
    ids = torch.randint(3, model.args.vocab_size, (1, context + steps + 2), generator=gen)
    ids = ids.to(model.ctx.device)
    model.prefill(ids[:, :context])
    model.decode(ids[:, context:context + 1], context)               # warm: what a step derives once
    with profile() as prof:
        for i in range(1, steps + 1):
            model.decode(ids[:, context + i:context + i + 1], context + i)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    names = [e for e in events[:top]] + [e for e in events[top:] if e.key == "aten::cat"]
    rows = [f"{e.key} {e.self_cpu_time_total / steps / 1e3:.1f} ms ({e.count // steps} calls)" for e in names]
    return f"self CPU per decode step {total:.1f} ms: " + ", ".join(rows)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m inference.tools.bench models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,large", help="comma-separated: tiny, large, released")
    ap.add_argument("--contexts", default=None, help="prompt lengths to decode after (default 1024,8192; "
                    "released: the positions its decode steps run at, 1024,16384)")
    ap.add_argument("--decode-steps", type=int, default=None, help="decode steps measured per context "
                    "(default 8; released: 6 per (context, batch), and as many again with timing hooks)")
    r = ap.add_argument_group("released (--models released)")
    r.add_argument("--layers", type=int, default=7, help="layers in the released mix (at least 7: one of "
                   "each kind; more add ratio-2 and ratio-1 sharers)")
    r.add_argument("--experts", type=int, default=64, help="routed experts held a layer (18.8 MB each)")
    r.add_argument("--batches", default="1,4,16", help="rows of a decode step")
    r.add_argument("--prefills", default="512,4096", help="prompt lengths of the prefill figures (empty: "
                   "none)")
    r.add_argument("--bandwidth-gbs", type=float, default=186.0, help="a bandwidth to extrapolate the "
                   "released model to (186: the EPYC of llama.cpp's published 9.7 tokens/s)")
    r.add_argument("--json", action="store_true", help="one JSON object a line per (context, batch)")
    r.add_argument("--widths", default=None, help="a flat config.json whose widths the mix takes instead of "
                   "the released ones (a quick run of the whole command on small widths)")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="time the first prefill as a fresh process's first prompt (by default a short "
                         "first call builds what the numerics derive from the weights, timed apart)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "dsv41-bench"),
                    help="where the synthetic checkpoints are cached")
    ap.add_argument("--profile", action="store_true", help="also profile decode steps (torch.profiler): "
                    "self CPU ms per step and the ops that took most")
    ap.add_argument("--breakdown", action="store_true", help="also the share of prefill and decode time by "
                    "module kind (attention, indexer, hyper-connections, gate, routed experts, ...)")
    add_model_flags(ap)                    # generate.py's numerics and placement flags, refused alike
    return ap


def positive_ints(text: str, flag: str) -> list:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"bench models: {flag} takes comma-separated integers, got {text!r}")
    if any(v < 1 for v in values):
        raise SystemExit(f"bench models: {flag} takes positive integers, got {text!r}")
    return values


def main(argv=None):
    opts = build_parser().parse_args(argv)
    try:
        runtime = runtime_options(opts)
    except (InputError, ConfigError) as e:
        raise SystemExit(f"bench models: {e}")
    names = [n for n in opts.models.split(",") if n]
    unknown = [n for n in names if n not in ("tiny", "large", "released")]
    if unknown:
        raise SystemExit(f"bench models: unknown model {unknown[0]!r} (tiny, large, released)")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    gen = torch.Generator().manual_seed(0)
    os.makedirs(opts.workdir, exist_ok=True)
    if not opts.json:
        print(f"device {opts.device}, {torch.get_num_threads()} threads, torch {torch.__version__}, numerics "
              f"{opts.numerics}, kernel backend {opts.kernel_backend}, experts on {opts.experts_on}, "
              f"cpu linears {opts.cpu_linears}")
    if "released" in names:
        from .released import run
        from .common import MIN_RELEASED_LAYERS
        if opts.layers < MIN_RELEASED_LAYERS:
            raise SystemExit(f"bench models: --layers {opts.layers}: the released mix needs at least "
                             f"{MIN_RELEASED_LAYERS} (one layer of each kind)")
        if opts.experts < 6:
            raise SystemExit(f"bench models: --experts {opts.experts}: a layer selects 6 (6 or more, then)")
        if opts.widths is not None and not os.path.isfile(opts.widths):
            raise SystemExit(f"bench models: --widths {opts.widths}: no such file")
        run(opts, runtime, opts.layers, opts.experts,
            positive_ints(opts.contexts or "1024,16384", "--contexts"),
            positive_ints(opts.batches, "--batches"), positive_ints(opts.prefills, "--prefills"),
            opts.decode_steps or 6, opts.bandwidth_gbs, opts.breakdown, opts.json, opts.widths)
    contexts = positive_ints(opts.contexts or "1024,8192", "--contexts")
    steps = opts.decode_steps or 8
    for name in (n for n in names if n != "released"):
        args = make_args(name, max(contexts) + steps + 8)
        model = build(name, args, opts.workdir, opts.device, runtime)
        per_token = weight_bytes_per_token(model)
        print(f"[{name}] dim {args.dim}, {args.n_layers} layers, {args.n_routed_experts} experts, "
              f"{per_token / 1e6:.1f} MB of weights read per decode step")
        results = {}
        if opts.no_warm_up:
            print(f"[{name}] no first call: the first prefill and decode step below build the layouts the "
                  f"numerics derive from the weights (a fresh process's first prompt)")
        else:
            warm = warm_up(model, gen)
            print(f"[{name}] first call (a prefill of {WARM_UP} tokens and a decode step): {warm:.2f} s, the "
                  f"layouts the numerics derive from the weights built once (not in the figures below)")
        for ctx in contexts:
            tps, ms, moved = bench_context(model, ctx, steps, gen)
            results[ctx] = ms
            print(f"[{name}] context {ctx:6d}: prefill {tps:9.1f} tok/s | decode {ms:8.1f} ms/step "
                  f"({1e3 / ms:6.2f} tok/s, {per_token / ms / 1e6:6.2f} GB/s of weights) | Engram on "
                  f"{opts.engram_on}: {moved / 1e3:.1f} KB moved per step")
            if opts.profile:
                print(f"[{name}] context {ctx:6d}: {profile_decode(model, ctx, steps, gen)}")
            if opts.breakdown:
                pre, dec = breakdown(model, ctx, steps, gen)
                print(f"[{name}] context {ctx:6d}: prefill by module kind: {pre}")
                print(f"[{name}] context {ctx:6d}: decode by module kind: {dec}")
        if len(contexts) > 1:
            lo, hi = min(contexts), max(contexts)
            print(f"[{name}] decode cost at {hi} vs {lo} context: {results[hi] / results[lo]:.2f}x")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        if opts.device.startswith("cuda"):
            peak = torch.cuda.max_memory_allocated() / 2 ** 30
        print(f"[{name}] peak memory so far: {peak:.2f} GiB")
        del model
