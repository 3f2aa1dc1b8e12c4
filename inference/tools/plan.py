"""Memory plan: what each rank holds on its GPU, by category, and on which GPUs that fits.

    python -m inference.tools.plan --config config.json --mp 4 --max-seq-len 65536 --max-batch-size 4 \\
        --engram-on host [--gpu-mem 141GB] [--prefill-len N] [--prefill-chunk C] [--json]
    python -m inference.tools.plan --config config.json --long-context --mp 4 8 --max-batch-size 1 4 \\
        --engram-on device host [--prefill-chunk C] [--limit 1048576]

--long-context answers how long a context each setup holds when prompts are prefilled in chunks
(generate.py --prefill-chunk): per GPU, the longest context (at most --limit positions per row) at which a
decode step and a prefill chunk (of C tokens, or the largest that fits but at least one window) fit beside
the weights and the caches of that context, and the chunk it then needs. Prefill time is not estimated.

Weights and caches are exact (the model is built on the meta device for every rank); the activation
workspace is a stated estimate of the torch code path (inference/engine/memory.py lists its terms). The
verdict follows generate.py, which prefills in chunks when one call does not fit: "fits" when weights +
caches + reserve + the workspace of a decode step fit, and so does a prefill chunk of at least one window
(window_size tokens; --prefill-chunk C: of C tokens) at the full context, with the chunk generate.py then
uses (one call when a prompt of --max-seq-len fits in one); "decode only" when the model decodes but no such
chunk fits; otherwise "does not fit", with the fix. The longest one-call prefill (and the workspace of one
of --prefill-len tokens per row, default --max-seq-len) is given as information.

Released config at MP 1: 513,149,074,264 weight bytes, 2,863,051,264 (+0.56 %) above the checkpoint's
510,286,023,000 tensor bytes: wo_a held in bf16 without its scales (+1,441,431,552), head.weight in fp32
(+1,323,827,200), the Markov head in fp32 (+66,191,360), the ratio-2 compressor wkv/wgate in fp32
(+31,457,280), the ViT norms in fp32 (+133,120), the confidence projection in fp32 (+10,752).
"""
import argparse
import json
import sys
from dataclasses import replace
from typing import Dict, List, Optional

from ..config import ENGRAM_PLACEMENTS, ConfigError, ModelArgs, RuntimeOptions
from ..engine.memory import (GPUS, LABELS, WEIGHT_GROUPS, MemoryPlan, PlanError, context_plan, fix_hint, gib,
                              parse_bytes, plan_memory)


def verdicts(plan: MemoryPlan, gpus: Dict[str, int], chunk: Optional[int] = None) -> Dict[str, dict]:
    """Per GPU: fits (a decode step and a prefill chunk of `chunk` tokens, by default at least one window),
    the chunk generate.py uses (None: one call), and the one-call figures."""
    out = {}
    for name, cap in gpus.items():
        decode = plan.fits_decode(cap)
        largest = plan.largest_chunk(cap) if decode else 0
        default = None if largest >= plan.args.max_seq_len else largest
        out[name] = {"capacity": cap, "fits": decode and largest >= (chunk or plan.min_chunk),
                     "fits_decode": decode, "largest_chunk": largest, "prefill_chunk": chunk or default,
                     "fits_one_call": plan.worst.total_bytes <= cap,
                     "longest_prefill": plan.longest_prefill(cap)}
    return out


def cache_density(plan: MemoryPlan, other: MemoryPlan) -> Dict[str, Dict[str, float]]:
    """Per token of context (compressed KV + indexer keys) and per sequence (window and DSpark rings), for
    this plan's cache format and the other one."""
    out = {}
    for p in (plan, other):
        c, a = p.ranks[0].caches, p.args
        key = "packed" if p.packed_kv else "bf16"
        out[key] = {"per_token": (c["compressed_kv"] + c["index_keys"]) / (a.max_batch_size * a.max_seq_len),
                    "rings_per_sequence": (c["window_kv"] + c["dspark_rings"]) / a.max_batch_size}
    return out


Density = Dict[str, Dict[str, float]]


def render(plan: MemoryPlan, ver: Dict[str, dict], config: str, density: Density,
           chunk: Optional[int] = None) -> str:
    a = plan.args
    lines = [f"{config}: MP {plan.world_size}, max_seq_len {a.max_seq_len:,}, batch {a.max_batch_size}, "
             f"Engram on {plan.engram_on}, prefill {plan.prefill_len:,} tokens per row in one call"]
    groups = []   # ranks with identical plans share a column
    for r in plan.ranks:
        key = (r.weights, r.caches, r.workspace)
        if groups and groups[-1][0] == key:
            groups[-1][1].append(r)
        else:
            groups.append((key, [r]))
    heads = [f"rank {g[0].rank}" if len(g) == 1 else f"ranks {g[0].rank}-{g[-1].rank} (each)"
             for _, g in groups]
    reps = [g[0] for _, g in groups]
    width = 46

    def row(label: str, values: List[int]) -> str:
        return f"{label:<{width}}" + "".join(f"{gib(v):>22}" for v in values)

    lines.append(f"{'':<{width}}" + "".join(f"{h:>22}" for h in heads))
    lines.append("weights")
    for key, label, _ in WEIGHT_GROUPS:
        where = "" if key != "engram_tables" or plan.engram_on == "device" else f" (on {plan.engram_on})"
        lines.append(row(f"  {label}{where}", [r.weights[key] for r in reps]))
    lines.append(row("  = weights on the GPU", [r.gpu_weights_bytes for r in reps]))
    lines.append(f"caches ({a.max_batch_size} x {a.max_seq_len:,} tokens, allocated up front)")
    for key in reps[0].caches:
        lines.append(row(f"  {LABELS[key]}", [r.caches[key] for r in reps]))
    lines.append(row("  = caches", [r.cache_bytes for r in reps]))
    this, other = ("packed", "bf16") if plan.packed_kv else ("bf16", "packed")
    d, b = density[this], density[other]
    lines.append(f"  per token of context (compressed KV + indexer keys): {d['per_token']:,.0f} B "
                 f"({other}: {b['per_token']:,.0f} B)")
    lines.append(f"  per sequence (window and DSpark rings): {d['rings_per_sequence'] / 2 ** 20:.2f} MiB "
                 f"({other}: {b['rings_per_sequence'] / 2 ** 20:.2f} MiB)")
    lines.append("activation workspace (stated estimate: the largest stage of a call)")
    for phase in ("decode", "prefill"):
        stage = max((k for k in reps[0].workspace if k.startswith(phase)), key=reps[0].workspace.get)
        what = "decode step" if phase == "decode" else f"prefill {plan.prefill_len:,} x {a.max_batch_size}"
        lines.append(row(f"  {what}: {stage.split(': ', 1)[1]}", [r.workspace[stage] for r in reps]))
    lines.append(row("runtime reserve (CUDA context, NCCL, slack)", [r.reserve for r in reps]))
    lines.append(row("= total on the GPU", [r.total_bytes for r in reps]))
    if any(r.host_bytes for r in reps):
        lines.append(row("host memory (Engram tables, pinned)", [r.host_bytes for r in reps]))
    lines.append(row("converted shard file (tensor bytes)", [r.file_bytes for r in reps]))
    r0 = reps[0]
    lines.append(f"exact bytes (rank {r0.rank}): weights {r0.weights_bytes:,}, on the GPU "
                 f"{r0.gpu_weights_bytes:,}, caches {r0.cache_bytes:,}, total {r0.total_bytes:,}")
    for name, v in ver.items():
        if v["fits"] and v["prefill_chunk"] is None:
            say = f"fits: prompts of {a.max_seq_len:,} tokens x {a.max_batch_size} rows prefill in one call"
        elif v["fits"]:
            how = (f"--prefill-chunk; the largest that fits: {v['largest_chunk']:,}" if chunk
                   else "generate.py's default, the largest that fits")
            say = (f"fits: prefill in chunks of {v['prefill_chunk']:,} tokens ({how}); one call fits up to "
                   f"{v['longest_prefill']:,} tokens per row (batch {a.max_batch_size})")
        elif v["fits_decode"]:
            floor = f"{chunk:,} (--prefill-chunk)" if chunk else f"one window ({plan.min_chunk:,})"
            fix = "lower --prefill-chunk" if chunk else fix_hint(plan)
            say = f"decode only: a prefill chunk fits up to {v['largest_chunk']:,} tokens (< {floor}); {fix}"
        else:
            r = plan.worst
            short = r.resident_bytes + r.phase_bytes("decode") - v["capacity"]
            say = f"does not fit: {gib(max(short, 0))} short even for decoding; {fix_hint(plan)}"
        lines.append(f"{name:<14} ({gib(v['capacity'])}): {say}")
    return "\n".join(lines)


def to_json(plan: MemoryPlan, ver: Dict[str, dict], config: str, density: Density) -> dict:
    r0 = plan.worst
    a = plan.args
    return {
        "config": config, "mp": plan.world_size, "max_seq_len": a.max_seq_len,
        "max_batch_size": a.max_batch_size, "engram_on": plan.engram_on, "prefill_len": plan.prefill_len,
        "weights_bytes": r0.weights_bytes, "gpu_weights_bytes": r0.gpu_weights_bytes,
        "cache_bytes": r0.cache_bytes, "workspace_bytes": r0.workspace_bytes, "reserve_bytes": r0.reserve,
        "total_bytes": r0.total_bytes, "host_bytes": r0.host_bytes, "file_bytes": r0.file_bytes,
        **{key: {k: v[key] for k, v in ver.items()}
           for key in ("fits", "fits_decode", "prefill_chunk", "largest_chunk", "fits_one_call",
                       "longest_prefill")},
        "kv_format": "packed" if plan.packed_kv else "bf16", "cache_density": density,
        "ranks": [{"rank": r.rank, "weights": r.weights, "caches": r.caches, "workspace": r.workspace,
                   "weights_bytes": r.weights_bytes, "file_bytes": r.file_bytes, "total_bytes": r.total_bytes}
                  for r in plan.ranks],
    }


def long_context(config: str, mps: List[int], batches: List[int], placements: List[str],
                 gpus: Dict[str, int], chunk: Optional[int], limit: int) -> List[dict]:
    """One row per (MP, Engram placement, batch): per GPU the longest context that fits and its chunk."""
    rows = []
    for mp in mps:
        for engram_on in placements:
            for batch in batches:
                args = ModelArgs.from_file(config, max_batch_size=batch, max_seq_len=65536)
                args.check_world_size(mp)
                cp = context_plan(args, mp, RuntimeOptions.from_profile("reference", engram_on=engram_on))
                fits = {}
                for name, cap in gpus.items():
                    longest = cp.longest_context(cap, chunk, limit)
                    largest = cp.largest_chunk(cap, longest) if longest else 0
                    fits[name] = {"context": longest, "chunk": min(chunk or largest, largest)}
                rows.append({"mp": mp, "engram_on": engram_on, "batch": batch, "gpus": fits,
                             "cache_bytes_per_position": cp.per_position})
    return rows


def render_long_context(rows: List[dict], limit: int) -> str:
    names = list(rows[0]["gpus"]) if rows else []
    lines = [f"longest context per row (at most {limit:,}) / prefill chunk it needs (tokens per call)",
             "| MP | Engram | batch | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{g['context']:,} / {g['chunk']:,}" if g["context"] else "does not fit"
                 for g in r["gpus"].values()]
        lines.append(f"| {r['mp']} | {r['engram_on']} | {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="inference config.json")
    ap.add_argument("--mp", type=int, nargs="+", default=[1], help="model-parallel world size (GPUs); "
                    "--long-context takes several")
    ap.add_argument("--max-seq-len", type=int, default=None, help="context per row (default: the config's)")
    ap.add_argument("--max-batch-size", type=int, nargs="+", default=None,
                    help="rows (default: the config's); --long-context takes several")
    ap.add_argument("--engram-on", choices=ENGRAM_PLACEMENTS, nargs="+", default=["device"],
                    help="where the Engram tables live (host and disk keep them off the GPU); --long-context "
                    "takes several")
    ap.add_argument("--long-context", action="store_true", help="the longest context each setup holds with "
                    "chunked prefill, and the chunk it needs")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="judge this chunk (default: the largest "
                    "that fits, at least one window)")
    ap.add_argument("--limit", type=int, default=1 << 20, help="--long-context: the longest context asked "
                    "about (default 1,048,576, the released model's)")
    ap.add_argument("--prefill-len", type=int, default=None,
                    help="tokens per row prefilled in one call (default: --max-seq-len)")
    ap.add_argument("--gpu-mem", default=None, help="judge this GPU size only, e.g. 141GB or 139GiB")
    ap.add_argument("--language-model-only", action="store_true", help="without the ViT")
    ap.add_argument("--kv-format", choices=["packed", "bf16"], default="packed",
                    help="KV caches as FP8/FP4 codes + scales (the default) or bf16 buffers")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    o = ap.parse_args(argv)
    try:
        gpus = {f"{o.gpu_mem} (--gpu-mem)": parse_bytes(o.gpu_mem)} if o.gpu_mem else dict(GPUS)
        if o.long_context:
            batches = o.max_batch_size or [ModelArgs.from_file(o.config).max_batch_size]
            rows = long_context(o.config, o.mp, batches, o.engram_on, gpus, o.prefill_chunk, o.limit)
            print(json.dumps(rows, indent=1) if o.json else render_long_context(rows, o.limit))
            return 0
        if len(o.mp) > 1 or len(o.engram_on) > 1 or o.max_batch_size and len(o.max_batch_size) > 1:
            raise PlanError("several --mp, --max-batch-size or --engram-on values go with --long-context")
        mp, engram_on = o.mp[0], o.engram_on[0]
        over = {k: v for k, v in (("max_seq_len", o.max_seq_len),
                                  ("max_batch_size", o.max_batch_size and o.max_batch_size[0])) if v}
        args = ModelArgs.from_file(o.config, **over)
        args.check_world_size(mp)
        if o.prefill_chunk is not None and not 1 <= o.prefill_chunk <= args.max_seq_len:
            raise PlanError(f"--prefill-chunk must be in 1..{args.max_seq_len:,} (--max-seq-len), got "
                            f"{o.prefill_chunk}")
        opts = RuntimeOptions.from_profile("reference", engram_on=engram_on,
                                           packed_kv=o.kv_format == "packed")
        plan = plan_memory(args, mp, opts, prefill_len=o.prefill_len,
                           language_model_only=o.language_model_only)
        other = plan_memory(args, mp, replace(opts, packed_kv=not opts.packed_kv), ranks=[0],
                            language_model_only=o.language_model_only)
    except (ConfigError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    ver = verdicts(plan, gpus, o.prefill_chunk)
    density = cache_density(plan, other)
    print(json.dumps(to_json(plan, ver, o.config, density), indent=1) if o.json
          else render(plan, ver, o.config, density, o.prefill_chunk))
    return 0


if __name__ == "__main__":
    sys.exit(main())
