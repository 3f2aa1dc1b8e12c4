"""Benchmark: prefill tokens/s, decode ms/step, achieved weight bandwidth and peak memory.

    python -m inference.tools.bench                       # tiny (fixture-shaped) and large random models
    python -m inference.tools.bench --models large --contexts 1024,8192 --decode-steps 8
    python -m inference.tools.bench -h                    # the other subcommands (experts, convert, ...)

Each model is a synthetic random checkpoint in the real formats (tools/synthetic.py + convert.py, cached
under --workdir), with the real DeepSeek tokenizer. Figures are printed, never asserted.
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
from .common import make_args, synthetic_checkpoint


def build(name: str, args: ModelArgs, workdir: str, device: str, opts: RuntimeOptions = None):
    """Synthetic HF checkpoint -> convert.py at MP 1 -> Transformer (all cached in workdir)."""
    from encoding.tokenizer import load_tokenizer
    from ...engine.checkpoint import load_checkpoint
    from ...model import Transformer
    ckpt = synthetic_checkpoint(name, args, workdir, shards=2)
    model = Transformer(args, opts=opts, device=device, tokenizer=load_tokenizer(ckpt))
    load_checkpoint(model, ckpt)
    return model


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


WARM_UP = 64


def warm_up(model, gen: torch.Generator) -> float:
    """A short prefill and a decode step before anything is timed -> their seconds: the first call builds
    what the numerics derive from the weights once (dequantized copies, packed layouts), a cost of the
    model's first prompt, not of a prefill's length."""
    model.reset()
    ids = torch.randint(3, model.args.vocab_size, (1, WARM_UP + 1), generator=gen).to(model.ctx.device)
    t = time.perf_counter()
    model.prefill(ids[:, :WARM_UP])
    model.decode(ids[:, WARM_UP:], WARM_UP)
    return time.perf_counter() - t


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


class KindTimer:
    """Wall seconds per module kind (launches.module_kind: attention, indexer, gate, routed experts, ...),
    each second charged to the innermost module of a kind that runs then ("other": outside all, the call's
    set-up and the head's sampling). `kinds` is the stack launches.attribute keeps."""

    def __init__(self):
        timer = self

        class Kinds(list):
            def append(self, kind):
                timer.switch()
                super().append(kind)

            def pop(self):
                timer.switch()
                return super().pop()
        self.kinds, self.seconds, self.mark = Kinds(), {}, time.perf_counter()

    def restart(self) -> None:
        """Time from now (what ran before is nobody's)."""
        self.seconds, self.mark = {}, time.perf_counter()

    def switch(self) -> None:
        now = time.perf_counter()
        kind = self.kinds[-1] if self.kinds else "other"
        self.seconds[kind] = self.seconds.get(kind, 0.0) + now - self.mark
        self.mark = now

    def shares(self) -> str:
        total = sum(self.seconds.values()) or 1.0
        rows = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in rows if v / total >= 0.005)


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
    ap.add_argument("--models", default="tiny,large", help="comma-separated: tiny, large")
    ap.add_argument("--contexts", default="1024,8192", help="prompt lengths to decode after")
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps measured per context")
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


def main(argv=None):
    opts = build_parser().parse_args(argv)
    try:
        runtime = runtime_options(opts)
    except (InputError, ConfigError) as e:
        raise SystemExit(f"bench models: {e}")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    contexts = [int(c) for c in opts.contexts.split(",")]
    gen = torch.Generator().manual_seed(0)
    os.makedirs(opts.workdir, exist_ok=True)
    print(f"device {opts.device}, {torch.get_num_threads()} threads, torch {torch.__version__}, numerics "
          f"{opts.numerics}, kernel backend {opts.kernel_backend}")
    for name in opts.models.split(","):
        args = make_args(name, max(contexts) + opts.decode_steps + 8)
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
            tps, ms, moved = bench_context(model, ctx, opts.decode_steps, gen)
            results[ctx] = ms
            print(f"[{name}] context {ctx:6d}: prefill {tps:9.1f} tok/s | decode {ms:8.1f} ms/step "
                  f"({1e3 / ms:6.2f} tok/s, {per_token / ms / 1e6:6.2f} GB/s of weights) | Engram on "
                  f"{opts.engram_on}: {moved / 1e3:.1f} KB moved per step")
            if opts.profile:
                print(f"[{name}] context {ctx:6d}: {profile_decode(model, ctx, opts.decode_steps, gen)}")
            if opts.breakdown:
                pre, dec = breakdown(model, ctx, opts.decode_steps, gen)
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

