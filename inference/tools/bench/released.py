"""`bench models --models released`: the released widths on this machine, against its memory roofline.

A random-weight checkpoint with the released config.json's widths (dim 5120, 64 heads of 512, the q / o LoRA
ranks, 8 output groups, experts of 2304 with top-6, the indexer's 32 heads of 128, Engram's 8 heads of 256)
on a mix of the released layer kinds (common.LAYER_KINDS: a window layer, each compression ratio as a writer
of the compressed KV and index keys and as a sharer, the candidate source, an index source, Engram in a
window layer), --experts routed experts a layer (18.8 MB each: far beyond any cache), written once and
converted by convert.py, then timed:

    decode      a step of --batches rows at each of --contexts positions: ms, tokens/s, the bytes the step
                must read (every weight it touches as held, the routed experts its rows select, the cache rows
                it reads) and the read bandwidth measured in turns with the steps (a torch sum over 2 GiB):
                the step's share of that roofline
    prefill     tokens/s of one prompt of each --prefills length
    by layer    each layer kind's time in a step (forward hooks; --breakdown: by module kind too)
    released    the released model extrapolated: seconds a token = the layer kinds' times times the released
                40-layer mix (the routed experts scaled to the experts 384 would give the batch), plus
                Engram's two layers, the embedding, the head and the call; beside its roofline here and at
                --bandwidth-gbs; the DSpark head's draft call beside (a speculative step's extra)

A decode step at context C runs at positions C, C + 1, ... after a short prefill: its cost depends on the
positions (the window, the top-k rows, the index keys scored), not on what the caches hold, so no C-token
prefill is needed to time it. Figures are printed, never asserted; --json prints one object a line per
(context, batch).
"""
import json
import os
import resource
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Dict, List, Optional

import torch

from ...config import ModelArgs, RuntimeOptions
from ...kv_cache import entry_bytes
from ..synthetic import engram_table_sizes
from .common import (LAYER_KINDS, RELEASED_ENGRAM, KindTimer, build, released_args, released_config,
                     released_kinds, warm_up)

WARM_UP = 16                       # prefill positions before the positioned decode steps
BANDWIDTH_GIB = 2.0                # the read-bandwidth buffer
LLAMA_CPP = {"tokens_per_s": 9.7, "bandwidth_gbs": 186.0, "bytes_per_token": 7.3e9}   # issue 61's anchor


# ---- what a decode step must read ----

@dataclass
class StepBytes:
    """Bytes one decode step reads, by part."""
    weights: int                    # every weight it touches as held (routed experts aside)
    experts: int                    # the distinct routed experts its rows select, at their stored bytes
    caches: int                     # window rows, gathered compressed rows, index keys scored
    rows: int                       # embedding rows and Engram table rows of its tokens

    @property
    def total(self) -> int:
        return self.weights + self.experts + self.caches + self.rows


def expert_bytes(model) -> int:
    """Stored bytes (weights and scales) of one routed expert of the backbone."""
    moe = model.layers[0].ffn
    return sum(t[0].nbytes for pair in moe.stacked.values() for t in pair if t is not None)


def weight_read_bytes(model) -> int:
    """Weights a decode step touches, as the model holds them: the main layers' and the head's parameters
    (not the routed experts, the embedding, the Engram tables or the DSpark head: memory.py's rules), each
    FP8/FP4 Linear as the fp32 copy it computes from with --cpu-linears fp32
    (memory.cpu_decode_read_bytes)."""
    from ...engine.memory import HOST_EXPERTS, NOT_READ_PER_TOKEN, cpu_decode_read_bytes
    if model.ctx.opts.cpu_linears == "fp32":
        return cpu_decode_read_bytes(model)["fp32"]
    return sum(p.nbytes for n, p in model.named_parameters()
               if not (HOST_EXPERTS.match(n) or NOT_READ_PER_TOKEN.search(n)))


def cache_read_bytes(args: ModelArgs, packed: bool, pos: int) -> int:
    """Cache bytes one row's decode step at position `pos` reads: every layer's window ring, the top-k
    compressed rows each index source gathers (the layers after it share them), the index keys each index
    source scores (docs/architecture.md §6)."""
    hd, ihd = args.head_dim, args.index_head_dim

    def row(fmt: str, dim: int) -> int:
        return entry_bytes(fmt, dim) if packed else 2 * dim
    total = args.n_layers * min(args.window_size, pos + 1) * row("fp8", hd)
    for i in args.index_source_layers:
        keys = (pos + 1) // args.compress_ratios[i]
        total += min(args.index_topk, keys) * row("fp4_e4m3", hd) + keys * row("fp4_ue8m0", ihd)
    return total


def token_row_bytes(args: ModelArgs) -> int:
    """One token's embedding row and its Engram rows (each n-gram order and head: head_dim E4M3 bytes and
    their scales) in every Engram layer."""
    per_layer = (args.engram_max_ngram_size - 1) * args.engram_n_heads * (args.engram_head_dim +
                                                                           args.engram_head_dim // 32)
    return args.dim * 2 + per_layer * len(args.engram_layer_ids)


def step_bytes(model, batch: int, pos: int, distinct: float) -> StepBytes:
    """What a step of `batch` rows at position `pos` reads, its layers selecting `distinct` routed experts
    each on average."""
    a = model.args
    opts = model.ctx.opts
    return StepBytes(weights=weight_read_bytes(model),
                     experts=int(distinct * a.n_layers * expert_bytes(model)),
                     caches=batch * cache_read_bytes(a, opts.packed_kv and not opts.golden, pos),
                     rows=batch * token_row_bytes(a))


def expected_distinct(n_experts: int, topk: int, batch: int) -> float:
    """Distinct experts `batch` tokens select, each its top-k of n_experts, were the choices uniform."""
    return n_experts * (1 - (1 - topk / n_experts) ** batch)


# ---- timing ----

def read_bandwidth_sample(buf: torch.Tensor) -> float:
    """GB/s of one streaming read of buf (a torch sum, the threads the model uses)."""
    t = time.perf_counter()
    buf.sum()
    return buf.nbytes / (time.perf_counter() - t) / 1e9


class LayerTimer:
    """Wall seconds in each block's forward and, inside it, its MoE layer's router, shared expert and whole
    (the routed experts are the rest of the MoE layer); each Engram module; the head and the embedding;
    each DSpark stage (forward hooks). And the distinct routed experts each router call selects."""

    def __init__(self, model):
        self.seconds: Dict[str, float] = {}
        self.distinct: List[int] = []
        self.started: Dict[str, float] = {}
        self.handles = []
        parts = [("head", model.head), ("embedding", model.embed)]
        for i, b in enumerate(model.layers):
            parts += [(f"layer {i}", b), (f"moe {i}", b.ffn), (f"gate {i}", b.ffn.gate),
                      (f"shared {i}", b.ffn.shared_experts)]
            if b.engram is not None:
                parts.append((f"engram {i}", b.engram))
            self.handles.append(b.ffn.gate.register_forward_hook(
                lambda mod, inp, out: self.distinct.append(int(out[1].unique().numel()))))
        if model.mtp is not None:
            parts += [(f"stage {k}", stage) for k, stage in enumerate(model.mtp)]
        for name, m in parts:
            self.handles.append(m.register_forward_pre_hook(lambda mod, inp, n=name: self._enter(n)))
            self.handles.append(m.register_forward_hook(lambda mod, inp, out, n=name: self._leave(n)))

    def _enter(self, name: str) -> None:
        self.started[name] = time.perf_counter()

    def _leave(self, name: str) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - self.started.pop(name)

    def routed(self, layer: int) -> float:
        """Seconds in layer `layer`'s routed experts: its MoE layer less its router and shared expert."""
        s = self.seconds
        return max(0.0, s.get(f"moe {layer}", 0.0) - s.get(f"gate {layer}", 0.0) -
                   s.get(f"shared {layer}", 0.0))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class DecodeRow:
    """One (context, batch) decode measurement; times in seconds a step."""
    batch: int
    context: int
    step_s: List[float]                 # untimed steps
    bandwidth: List[float]              # GB/s samples taken in turns with them
    bytes: StepBytes
    distinct: float                     # routed experts a layer selects, on average
    layers: List[float]                 # each block's seconds (the timed steps)
    routed: List[float]                 # each block's routed experts' seconds
    engram: List[float]                 # each Engram module's seconds
    kinds: str = ""                     # --breakdown: shares by module kind
    draft_s: Optional[float] = None     # the DSpark head's draft call
    stage_s: Optional[float] = None     # one DSpark stage in it

    @property
    def ms(self) -> float:
        return 1e3 * median(self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * 1e3 / self.ms

    @property
    def bandwidth_gbs(self) -> float:
        return median(self.bandwidth)

    @property
    def roofline_fraction(self) -> float:
        """The step's bytes over its time, against the read bandwidth."""
        return self.bytes.total / (self.ms / 1e3) / 1e9 / self.bandwidth_gbs


def random_ids(model, batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(3, model.args.vocab_size, (batch, n), generator=gen).to(model.ctx.device)


def time_decode(model, batch: int, context: int, steps: int, rounds: int, gen: torch.Generator,
                buf: torch.Tensor, breakdown: bool = False) -> DecodeRow:
    """`steps` decode steps of `batch` rows at positions context, context + 1, ... (after a short prefill) in
    `rounds` turns with a read-bandwidth sample; then as many again under a LayerTimer (and with
    `breakdown`, a KindTimer)."""
    from .launches import attribute
    model.reset()
    ids = random_ids(model, batch, WARM_UP + 2 * steps, gen)
    model.prefill(ids[:, :WARM_UP])
    times, bws = [], []
    per_round = max(1, steps // max(1, rounds))
    for i in range(steps):
        if i % per_round == 0:
            bws.append(read_bandwidth_sample(buf))
        t = time.perf_counter()
        model.decode(ids[:, WARM_UP + i:WARM_UP + i + 1], context + i)
        times.append(time.perf_counter() - t)
    timer, kinds = LayerTimer(model), KindTimer()
    try:
        with attribute(model, kinds) if breakdown else _nothing():
            kinds.restart()
            for i in range(steps, 2 * steps):
                model.decode(ids[:, WARM_UP + i:WARM_UP + i + 1], context + i)
            kinds.switch()
    finally:
        timer.close()
    s = timer.seconds
    n = model.args.n_layers
    distinct = sum(timer.distinct) / max(1, len(timer.distinct))
    return DecodeRow(batch, context, times, bws, step_bytes(model, batch, context + steps, distinct),
                     distinct, [s.get(f"layer {i}", 0.0) / steps for i in range(n)],
                     [timer.routed(i) / steps for i in range(n)],
                     [v / steps for k, v in s.items() if k.startswith("engram")],
                     kinds.shares() if breakdown else "")


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def time_draft(model, batch: int, context: int, gen: torch.Generator):
    """(seconds of one DSpark draft call after a decode step at `context`, seconds of one stage in it); Nones
    without a draft head. The call drafts a block of dspark_block_size positions through the stages, the
    head and the Markov head."""
    if model.mtp is None:
        return None, None
    model.reset()
    ids = random_ids(model, batch, WARM_UP + 2, gen)
    model.prefill(ids[:, :WARM_UP])
    out = model.decode(ids[:, WARM_UP:WARM_UP + 1], context)
    timer = LayerTimer(model)
    try:
        t = time.perf_counter()
        model.mtp.draft(ids[:, WARM_UP + 1], out.main_hidden, context)
        draft = time.perf_counter() - t
    finally:
        timer.close()
    stages = [v for k, v in timer.seconds.items() if k.startswith("stage")]
    return draft, sum(stages) / max(1, len(stages))


def time_prefill(model, tokens: int, gen: torch.Generator, breakdown: bool = False):
    """(tokens/s of one prompt of `tokens` positions, batch 1, one call; its shares by module kind with
    `breakdown`)."""
    from .launches import attribute
    model.reset()
    ids = random_ids(model, 1, tokens, gen)
    kinds = KindTimer()
    with attribute(model, kinds) if breakdown else _nothing():
        kinds.restart()
        t = time.perf_counter()
        model.prefill(ids)
        seconds = time.perf_counter() - t
        kinds.switch()
    return tokens / seconds, kinds.shares() if breakdown else ""


# ---- the released model from the mix ----

def released_model_bytes(opts: RuntimeOptions, widths: Optional[str] = None):
    """(the released config, one routed expert's stored bytes, the weights a released decode step touches as
    this placement holds them): the released config.json (or its --widths variant, all 40 layers) built on
    the meta device (exact bytes)."""
    from ...engine.memory import build_meta_model
    cfg = released_config(widths)
    if widths is not None:                  # the released Engram tables, at small widths
        cfg["engram_num_embeddings"] = engram_table_sizes(ModelArgs(**cfg))
    args = ModelArgs.from_dict(cfg, max_seq_len=4096, max_batch_size=1)
    model = build_meta_model(args, 1, 0, opts)
    moe = model.layers[0].ffn
    per_expert = sum(t[0].nbytes for pair in moe.stacked.values() for t in pair if t is not None)
    return args, per_expert, weight_read_bytes(model)


def released_step_bytes(released, opts: RuntimeOptions, batch: int, pos: int) -> StepBytes:
    """What a released decode step of `batch` rows at `pos` must read: its weights, the experts top-6 of 384
    gives the batch were its choices uniform (expected_distinct), the caches at `pos`, the token rows."""
    args, per_expert, weights = released
    distinct = expected_distinct(args.n_routed_experts, args.n_activated_experts, batch)
    return StepBytes(weights, int(distinct * args.n_layers * per_expert),
                     batch * cache_read_bytes(args, opts.packed_kv and not opts.golden, pos),
                     batch * token_row_bytes(args))


@dataclass
class Extrapolated:
    """The released model's decode step from one DecodeRow."""
    batch: int
    seconds: float                      # a step of the row's batch
    bytes: StepBytes                    # what it must read
    bandwidth_gbs: float                # the row's read bandwidth
    draft_seconds: Optional[float]      # the draft head's call (all its stages)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.seconds

    @property
    def roofline_fraction(self) -> float:
        return self.bytes.total / self.seconds / 1e9 / self.bandwidth_gbs

    def roofline_tokens_per_s(self, bandwidth_gbs: float) -> float:
        return self.batch * bandwidth_gbs * 1e9 / self.bytes.total


def extrapolate(row: DecodeRow, kinds: List[str], released, opts: RuntimeOptions) -> Extrapolated:
    """Each layer kind's mean seconds (its routed experts scaled by the distinct experts top-6 of 384 would
    select for the batch against those the bench's layers selected) times its count in the released 40,
    Engram's mean times its 2 layers, and the rest of the measured step as it is (embedding, head, final norm,
    Engram hashing, the call); the draft head: the bench's call plus its other stages."""
    args = released[0]
    scale = expected_distinct(args.n_routed_experts, args.n_activated_experts, row.batch) / \
        max(row.distinct, 1e-9)
    by_kind: Dict[str, List[float]] = {}
    for name, t, routed in zip(kinds, row.layers, row.routed):
        by_kind.setdefault(name, []).append(t + routed * (scale - 1))
    layers = sum(sum(by_kind[name]) / len(by_kind[name]) * count for name, *_, count in LAYER_KINDS)
    engram = RELEASED_ENGRAM * sum(row.engram) / max(1, len(row.engram))
    rest = max(0.0, row.ms / 1e3 - sum(row.layers) - sum(row.engram))
    draft = None
    if row.draft_s is not None:
        draft = row.draft_s + (args.n_mtp_layers - 1) * (row.stage_s or 0.0)
    return Extrapolated(row.batch, layers + engram + rest,
                        released_step_bytes(released, opts, row.batch, row.context), row.bandwidth_gbs, draft)


# ---- the command ----

def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def planned_bytes(args: ModelArgs, opts: RuntimeOptions, batch: int, prefill: int) -> int:
    """The memory plan's host bytes for what this bench runs on the CPU: the weights, the fp32 copies the CPU
    path keeps, the caches (args.max_batch_size rows of max_seq_len), and the larger workspace (the CPU
    path's stages and the expert kernel's) of a decode step of `batch` rows and a one-row prefill of
    `prefill` tokens (memory.py)."""
    from ...engine.memory import plan_memory, workspace_bytes
    plan = plan_memory(args, 1, opts, on_gpu=False)
    r = plan.worst
    stages = [max(workspace_bytes(plan.shapes, b, s, on_gpu=False).values()) +
              plan.host_workspace(b * s) for b, s in ((batch, 1), (1, max(1, prefill)))]
    return r.weights_bytes + r.dequant_bytes + r.cache_bytes + max(stages)


def run(opts, runtime: RuntimeOptions, layers: int, experts: int, contexts: List[int], batches: List[int],
        prefills: List[int], steps: int, bandwidth_gbs: float, breakdown: bool, as_json: bool,
        config: Optional[str] = None) -> List[dict]:
    """Build (once) and time the released-width model; print the table (or JSON lines); -> the records."""
    say = (lambda *a, **k: None) if as_json else print
    kinds = released_kinds(layers)
    max_seq = max(contexts) + 2 * steps + WARM_UP + 8
    args = released_args(layers, experts, max(max_seq, max(prefills, default=0) + 8), max(batches),
                         config=config)
    tag = "" if config is None else "-" + os.path.splitext(os.path.basename(config))[0]
    name = f"released{tag}-L{layers}-E{experts}"
    say(f"[released] {layers} layers ({', '.join(kinds)}; Engram in layer 1), {experts} routed experts a "
        f"layer, dim {args.dim}; building {name} under {opts.workdir} if not cached ...", flush=True)
    model = build(name, args, opts.workdir, opts.device, runtime, large=True)
    gen = torch.Generator().manual_seed(0)
    first = warm_up(model, gen)
    held = sum(p.nbytes for p in model.parameters())
    say(f"[released] {held / 1e9:.2f} GB held; first call {first:.2f} s (what the numerics derive from the "
        f"weights, built once)", flush=True)
    loaded_rss = peak_rss()
    buf = torch.ones(int(BANDWIDTH_GIB * 2 ** 30) // 4)
    released = released_model_bytes(runtime, config)
    rows = []
    for ctx in contexts:
        for b in batches:
            row = time_decode(model, b, ctx, steps, max(1, steps // 2), gen, buf, breakdown)
            row.draft_s, row.stage_s = time_draft(model, b, ctx, gen)
            rows.append(row)
            say(f"[released] context {ctx:6d} batch {b:3d}: decode {row.ms:8.1f} ms/step "
                f"({row.tokens_per_s:6.2f} tokens/s), reads {row.bytes.total / 1e9:6.3f} GB a step at "
                f"{row.bytes.total / row.ms / 1e6:5.1f} GB/s = {100 * row.roofline_fraction:4.1f} % of the "
                f"read bandwidth {row.bandwidth_gbs:5.1f} GB/s", flush=True)
            by_kind = {k: 1e3 * sum(t for n, t in zip(kinds, row.layers) if n == k) / kinds.count(k)
                       for k in dict.fromkeys(kinds)}
            say(f"[released] context {ctx:6d} batch {b:3d}: a layer of each kind: " + ", ".join(
                f"{k} {v:.1f} ms" for k, v in by_kind.items()) + f"; Engram "
                f"{1e3 * sum(row.engram) / max(1, len(row.engram)):.1f} ms; distinct experts a layer "
                f"{row.distinct:.1f}")
            if breakdown:
                say(f"[released] context {ctx:6d} batch {b:3d}: decode by module kind: {row.kinds}")
    pre = {}
    for n in prefills:
        tps, shares = time_prefill(model, n, gen, breakdown)
        pre[n] = tps
        say(f"[released] prefill {n:6d} tokens: {tps:8.2f} tokens/s" + (f"; by module kind: {shares}"
                                                                        if breakdown else ""), flush=True)
    rss = max(loaded_rss, peak_rss() - buf.nbytes)       # (the bandwidth buffer is the bench's)
    plan = planned_bytes(args, runtime, max(batches), max(prefills + [1]))
    say(f"[released] peak RSS {rss / 2 ** 30:.2f} GiB (the bandwidth buffer aside); the memory plan "
        f"{plan / 2 ** 30:.2f} GiB (weights, the CPU path's copies, caches, workspace; not the runtime)")
    records = []
    for row in rows:
        ext = extrapolate(row, kinds, released, runtime)
        at = ext.roofline_tokens_per_s(bandwidth_gbs)
        below = [n for n in pre if n <= row.context]
        rec = {"batch": row.batch, "context": row.context, "decode_ms": row.ms,
               "decode_tokens_per_s": row.tokens_per_s, "decode_read_bytes": row.bytes.total,
               "read_bytes": vars(row.bytes), "read_bandwidth_gbs": row.bandwidth_gbs,
               "roofline_fraction": row.roofline_fraction, "distinct_experts": row.distinct,
               "prefill_tokens": max(below) if below else None,
               "prefill_tokens_per_s": pre[max(below)] if below else None, "prefill": pre,
               "peak_rss_bytes": rss, "plan_bytes": plan,
               "layer_kind_ms": {k: 1e3 * sum(t for n, t in zip(kinds, row.layers) if n == k) /
                                 kinds.count(k) for k in dict.fromkeys(kinds)},
               "routed_ms": 1e3 * sum(row.routed),
               "engram_ms": 1e3 * sum(row.engram) / max(1, len(row.engram)),
               "released_seconds_per_step": ext.seconds, "released_tokens_per_s": ext.tokens_per_s,
               "released_read_bytes": ext.bytes.total, "released_roofline_fraction": ext.roofline_fraction,
               "released_roofline_tokens_per_s": ext.roofline_tokens_per_s(row.bandwidth_gbs),
               "bandwidth_gbs": bandwidth_gbs, "released_roofline_tokens_per_s_at_bandwidth": at,
               "released_tokens_per_s_at_bandwidth": at * ext.roofline_fraction,
               "draft_seconds": row.draft_s, "released_draft_seconds": ext.draft_seconds}
        records.append(rec)
        if as_json:
            print(json.dumps(rec), flush=True)
    if not as_json:
        print_released(records, bandwidth_gbs)
    return records


def print_released(records: List[dict], bandwidth_gbs: float) -> None:
    """The extrapolation's table, and the llama.cpp anchor beside it."""
    print("[released] the released model (40 layers, 384 experts; this placement's bytes) from the rows "
          "above:")
    for r in records:
        draft = "" if r["released_draft_seconds"] is None else \
            f"; a draft call {r['released_draft_seconds']:.2f} s"
        print(f"[released]   context {r['context']:6d} batch {r['batch']:3d}: "
              f"{r['released_seconds_per_step']:7.2f} s a step, {r['released_tokens_per_s']:6.2f} tokens/s, "
              f"{r['released_read_bytes'] / 1e9:6.2f} GB a step = "
              f"{100 * r['released_roofline_fraction']:4.1f} % "
              f"of its roofline here ({r['released_roofline_tokens_per_s']:.2f} tokens/s); at "
              f"{bandwidth_gbs:.0f} GB/s: roofline {r['released_roofline_tokens_per_s_at_bandwidth']:.2f} "
              f"tokens/s, at this fraction {r['released_tokens_per_s_at_bandwidth']:.2f}{draft}")
    a = LLAMA_CPP
    share = a["tokens_per_s"] * a["bytes_per_token"] / a["bandwidth_gbs"] / 1e9
    print(f"[released] llama.cpp (issue 61's anchor): {a['tokens_per_s']} tokens/s at "
          f"{a['bandwidth_gbs']:.0f} "
          f"GB/s from a 4-bit GGUF ({a['bytes_per_token'] / 1e9:.1f} GB a token): {100 * share:.0f} % of its "
          f"roofline")
