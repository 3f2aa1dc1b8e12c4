"""Memory plan: what each rank holds on its GPU, by category, and on which GPUs that fits.

    python -m inference.tools.plan --config config.json --mp 4 --max-seq-len 65536 --max-batch-size 4 \\
        --engram-on host [--gpu-mem 141GB] [--prefill-len N] [--prefill-chunk C] [--json]
    python -m inference.tools.plan --config config.json --long-context --mp 4 8 --max-batch-size 1 4 \\
        --engram-on device host [--prefill-chunk C] [--limit 1048576]
    python -m inference.tools.plan --config config.json --experts-on host --mp 1 2 --max-batch-size 1 \\
        --engram-on host device [--gpu-mem 24GB] [--host-bandwidth 50] [--json]

--long-context answers how long a context each setup holds when prompts are prefilled in chunks
(generate.py --prefill-chunk): per GPU, the longest context (at most --limit positions per row) at which a
decode step and a prefill chunk (of C tokens, or the largest that fits but at least one window) fit beside
the weights and the caches of that context, and the chunk it then needs. Prefill time is not estimated.

--experts-on host plans the placement that keeps every routed expert in host memory at its stored bytes,
computed there (RuntimeOptions.experts_on; inference/engine/memory.py): per GPU (the seven of HOST_GPUS, or
--gpu-mem) and MP, what each GPU holds, the longest context that fits as --long-context finds it (prefill
chunks as generate.py picks them, or C), the host memory the node needs (the routed experts of its MP ranks,
the Engram tables with --engram-on host, the expert kernel's workspace for a chunk); a CPU-only line (MP 1,
everything in host memory, prefill chunks of C or 2,048 tokens, at --max-seq-len or 65,536 positions); and a
batch-1 decode bound: the host's read bandwidth (--host-bandwidth GB/s, else measured with
inference.tools.bench.experts.read_bandwidth) over the routed-expert bytes a token reads (top-k experts of
every MoE layer, at their stored bytes incl. scales); for the CPU-only run, over those and the other weights a
token reads as the CPU path holds them (the main layers and the head; FP8/FP4 Linears as their fp32 copies:
inference/engine/memory.py cpu_decode_read_bytes), 27.7 GB a token at the released size against 4.5 of
experts.

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

from ..config import CPU_LINEARS, ENGRAM_PLACEMENTS, EXPERT_PLACEMENTS, ConfigError, ModelArgs, RuntimeOptions
from ..engine.memory import (GPUS, HOST_GPUS, LABELS, WEIGHT_GROUPS, ContextPlan, MemoryPlan, PlanError,
                              context_plan, fix_hint, gib, parse_bytes, plan_memory, workspace_bytes)

CPU_CHUNK = 2048        # the CPU-only line's prefill chunk without --prefill-chunk (a CPU picks none)


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


def decode_estimate(plan: MemoryPlan, bandwidth: float, source: str) -> dict:
    """Batch-1 decode with the routed experts on the host, bounded by reading them: every MoE layer reads its
    top-k experts' stored bytes (weights and scales) once per token; tokens/s = bandwidth / those bytes. The
    node's ranks share the host's bandwidth and together read the same bytes, so MP does not change it."""
    a = plan.args                       # every block has an MoE layer: n_layers of them
    routed = sum(r.weights["routed_experts"] for r in plan.ranks) * plan.world_size // len(plan.ranks)
    per_expert = routed // (a.n_layers * a.n_routed_experts)
    per_token = a.n_activated_experts * per_expert * a.n_layers
    out = {"bandwidth_gbps": bandwidth, "bandwidth": source, "expert_bytes": per_expert,
           "moe_layers": a.n_layers, "experts_per_token": a.n_activated_experts,
           "bytes_per_token": per_token, "tokens_per_s": bandwidth * 1e9 / per_token}
    # CPU only (MP 1 plans one rank): the rest of the model is read from host memory too, every token, as
    # each --cpu-linears form holds it
    for form in CPU_LINEARS:
        other = sum(r.cpu_decode_bytes[form] for r in plan.ranks) * plan.world_size // len(plan.ranks)
        key = "cpu_only" if form == "fp32" else f"cpu_only_{form}"
        out.update({f"{key}_other_bytes": other,
                    f"{key}_tokens_per_s": bandwidth * 1e9 / (per_token + other)})
    return out


def host_row(cp: ContextPlan, name: str, cap: int, chunk: Optional[int], limit: int) -> dict:
    """One GPU with the experts on the host: the longest context (as --long-context), the GPU bytes there,
    and the host memory of the node (every rank's host weights and the expert workspace of its chunk)."""
    plan, batch = cp.plan, cp.plan.args.max_batch_size
    longest = cp.longest_context(cap, chunk, limit)
    largest = cp.largest_chunk(cap, longest) if longest else 0
    used = min(chunk or largest, largest)
    host_weights = sum(r.host_bytes for r in plan.ranks)
    workspace = plan.world_size * plan.host_workspace(max(used, 1) * batch)     # a decode step if none fits
    return {"gpu": name, "capacity": cap, "mp": plan.world_size, "engram_on": plan.engram_on, "batch": batch,
            "gpu_weights_bytes": plan.worst.gpu_weights_bytes, "fits": longest > 0, "context": longest,
            "chunk": used, "resident_bytes": cp.resident(longest) if longest else None,
            "gpu_bytes": cp.need(longest, used) if longest else None,
            "host_weights_bytes": host_weights, "host_workspace_bytes": workspace,
            "host_bytes": host_weights + workspace}


def cpu_only(plan: MemoryPlan, chunk: int) -> dict:
    """MP 1 with everything in host memory: the weights (routed experts at their stored bytes), the fp32
    copies the CPU path keeps of the other quantized weights, the caches, and the larger workspace of a decode
    step and a prefill chunk at the full context (the CPU path's stages and the expert kernel's)."""
    r, a = plan.worst, plan.args

    def call(tokens: int) -> int:       # the CPU path's largest stage and the expert kernel's, per row tokens
        stages = workspace_bytes(plan.shapes, a.max_batch_size, tokens, on_gpu=False, context=a.max_seq_len)
        return max(stages.values()) + plan.host_workspace(tokens * a.max_batch_size)
    workspace = max(call(1), call(chunk))
    return {"mp": 1, "max_seq_len": a.max_seq_len, "batch": a.max_batch_size, "chunk": chunk,
            "weights_bytes": r.weights_bytes, "routed_bytes": r.routed_bytes,
            "dequant_bytes": r.dequant_bytes, "cache_bytes": r.cache_bytes, "workspace_bytes": workspace,
            "host_bytes": r.weights_bytes + r.dequant_bytes + r.cache_bytes + workspace}


def host_table(config: str, mps: List[int], placements: List[str], batches: List[int], gpus: Dict[str, int],
               chunk: Optional[int], limit: int, cpu_seq_len: Optional[int]) -> dict:
    """Rows per (MP, Engram placement, batch, GPU) with the experts on the host, the CPU-only line (first
    batch) and the plan the decode estimate reads."""
    rows, plans = [], {}
    for mp in mps:
        for engram_on in placements:
            for batch in batches:
                args = ModelArgs.from_file(config, max_batch_size=batch, max_seq_len=65536)
                args.check_world_size(mp)
                opts = RuntimeOptions.from_profile("reference", engram_on=engram_on, experts_on="host")
                cp = context_plan(args, mp, opts)
                plans[mp, batch] = cp.plan
                rows += [host_row(cp, name, cap, chunk, limit) for name, cap in gpus.items()]
    seq = cpu_seq_len or 65536
    cpu_plan = plans.get((1, batches[0])) if seq == 65536 else None
    if cpu_plan is None:
        args = ModelArgs.from_file(config, max_batch_size=batches[0], max_seq_len=seq)
        cpu_plan = plan_memory(args, 1, RuntimeOptions.from_profile("reference", experts_on="host"),
                               on_gpu=False)
    return {"rows": rows, "cpu_only": cpu_only(cpu_plan, min(chunk or CPU_CHUNK, seq)), "plan": cpu_plan}


def render_host_table(rows: List[dict], cpu: dict, decode: dict, limit: int) -> str:
    lines = [f"routed experts on the host (--experts-on host): per GPU, the longest context (at most "
             f"{limit:,} per row) / its prefill chunk; host memory for the node (all MP ranks)",
             "| GPU | MP | Engram | batch | weights per GPU | + caches, reserve at that context | "
             "host memory | longest context / chunk | fits |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        at = gib(r["resident_bytes"]) if r["fits"] else "-"
        ctx = f"{r['context']:,} / {r['chunk']:,}" if r["fits"] else "-"
        lines.append(f"| {r['gpu']} | {r['mp']} | {r['engram_on']} | {r['batch']} | "
                     f"{gib(r['gpu_weights_bytes'])} | {at} | {gib(r['host_bytes'])} | {ctx} | "
                     f"{'yes' if r['fits'] else 'no'} |")
    lines.append(f"CPU only (MP 1, {cpu['max_seq_len']:,} x {cpu['batch']}, prefill chunks of "
                 f"{cpu['chunk']:,}): {gib(cpu['host_bytes'])} of host memory = {gib(cpu['weights_bytes'])} "
                 f"weights (routed experts {gib(cpu['routed_bytes'])} at their stored bytes) + "
                 f"{gib(cpu['dequant_bytes'])} fp32 copies of the other quantized weights + "
                 f"{gib(cpu['cache_bytes'])} caches + "
                 f"{gib(cpu['workspace_bytes'])} workspace")
    d = decode
    lines.append(f"decode, batch 1: {d['bandwidth_gbps']:.1f} GB/s of host reads ({d['bandwidth']}) / "
                 f"{d['bytes_per_token'] / 1e9:.3f} GB of routed experts per token ({d['experts_per_token']} "
                 f"experts x {d['expert_bytes']:,} B x {d['moe_layers']} MoE layers) = at most "
                 f"{d['tokens_per_s']:.1f} tokens/s (the GPU's share of a step not counted); CPU only, "
                 f"the other weights too: + {d['cpu_only_other_bytes'] / 1e9:.3f} GB a token as the CPU path "
                 f"holds them (FP8/FP4 Linears as fp32 copies) = at most {d['cpu_only_tokens_per_s']:.1f} "
                 f"tokens/s; with --cpu-linears stored (no copies, {gib(cpu['dequant_bytes'])} less memory) "
                 f"+ {d['cpu_only_stored_other_bytes'] / 1e9:.3f} GB = at most "
                 f"{d['cpu_only_stored_tokens_per_s']:.1f} tokens/s")
    return "\n".join(lines)


def host_bandwidth(given: Optional[float]) -> tuple:
    """(GB/s, 'given' or 'measured'): --host-bandwidth, else a streaming read of this machine's memory."""
    if given is not None:
        if not 0 < given < float("inf"):
            raise PlanError(f"--host-bandwidth must be a positive figure in GB/s, got {given:g}")
        return given, "given"
    from .bench.experts import read_bandwidth
    return read_bandwidth(), "measured"


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
    ap.add_argument("--experts-on", choices=EXPERT_PLACEMENTS, default="device",
                    help="host: the table for the routed experts in host memory (GPUs of 24 to 180 GB, each "
                    "--mp, a CPU-only line, a decode estimate)")
    ap.add_argument("--host-bandwidth", type=float, default=None, help="--experts-on host: the host's memory "
                    "read bandwidth in GB/s for the decode estimate (default: measured here)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    o = ap.parse_args(argv)
    try:
        gpus = {f"{o.gpu_mem} (--gpu-mem)": parse_bytes(o.gpu_mem)} if o.gpu_mem else dict(GPUS)
        if o.experts_on == "host":
            if o.long_context:
                raise PlanError("--long-context and --experts-on host are separate tables (the host table "
                                "gives the longest context)")
            if o.prefill_chunk is not None and o.prefill_chunk < 1:
                raise PlanError(f"--prefill-chunk must be at least 1, got {o.prefill_chunk}")
            bandwidth = host_bandwidth(o.host_bandwidth)
            batches = o.max_batch_size or [ModelArgs.from_file(o.config).max_batch_size]
            out = host_table(o.config, o.mp, o.engram_on, batches, gpus if o.gpu_mem else dict(HOST_GPUS),
                             o.prefill_chunk, o.limit, o.max_seq_len)
            decode = decode_estimate(out.pop("plan"), *bandwidth)
            print(json.dumps({**out, "decode": decode, "limit": o.limit}, indent=1) if o.json
                  else render_host_table(out["rows"], out["cpu_only"], decode, o.limit))
            return 0
        if o.host_bandwidth is not None:
            raise PlanError("--host-bandwidth goes with --experts-on host")
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
