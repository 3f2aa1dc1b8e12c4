"""What a layer needs besides its weights: the model's context (config, parallelism, options, numerics, RoPE
tables), the descriptor of the call it is part of (ForwardCall), what its layers hand on to the layers after
them within the call (Handoff), and the index keys published across calls (PublishedKeys)."""
import enum
from dataclasses import dataclass, field, replace
from typing import Dict, Optional

import torch

from .config import ModelArgs, RuntimeOptions
from .kernels import Numerics, RoutedExperts, numerics_for, routed_experts_for
from .parallel import ParallelContext
from .rope import precompute_freqs_cis


class PublishedKeys:
    """The index-key cache an index-key owner last published: what every indexer scores against, kept on
    purpose across calls (the official code reads a stale one, docs/numerics.md §14.1). State of the model,
    like the caches: the model makes one and gives it to each indexer when it is built.

    In a batch a scheduler runs (rows at their own positions, prompts prefilled into named rows) an owner
    publishes for some rows only: the rows of its call, of them those whose group completed. `over` lists
    those publications on top of `cache`, newest last, each (batch rows, complete [b] bool or None: all of
    them, cache); a publication for all the rows of an earlier one replaces it."""

    def __init__(self):
        self.cache = None
        self.over = []

    def publish(self, cache, rows: Optional[slice] = None, complete: Optional[torch.Tensor] = None) -> None:
        """`cache` published for every row, or for the batch rows `rows` (those of them whose `complete` is
        True, when given)."""
        if rows is None:
            self.cache, self.over = cache, []
        elif complete is None:
            self.over = [e for e in self.over if not _within(e[0], rows)] + [(rows, None, cache)]
        elif self.over and self.over[-1][1] is complete:       # the same rows again: the newest wins
            self.over[-1] = (rows, complete, cache)
        else:
            self.over.append((rows, complete, cache))

    def keys(self, rows: slice, t: int) -> torch.Tensor:
        """The published keys of the batch rows `rows`, their first t entries [b, t, D]: per row, from the
        cache last published for it."""
        base = self.cache if self.cache is not None else self.over[0][2]    # no row reads what none published
        keys = base[rows, :t]
        for at, complete, cache in self.over:
            if complete is None and _within(rows, at):
                keys = cache[rows, :t]
                continue
            first, last = max(at.start, rows.start), min(at.stop, rows.stop)
            if first >= last:
                continue
            mask = torch.zeros(rows.stop - rows.start, dtype=torch.bool, device=keys.device)
            part = slice(first - rows.start, last - rows.start)
            mask[part] = True if complete is None else complete[first - at.start:last - at.start]
            keys = torch.where(mask.view(-1, 1, 1), cache[rows, :t], keys)
        return keys

    def reset(self) -> None:
        self.cache, self.over = None, []


def _within(a: slice, b: slice) -> bool:
    """Whether the rows of slice a lie within those of slice b."""
    return b.start <= a.start and a.stop <= b.stop


@dataclass(frozen=True)
class Handoff:
    """What a call's layers hand on to the layers after them, passed down the blocks loop with the streams
    (each layer returns the one it was given, or a new one with what it added):

    published_at_start  the index keys published when the call began (a verification's stale rows,
                        docs/numerics.md §14.1)
    topk                the latest index source's selection [B, S, k] (compressed rows, -1 = none)
    candidates          the candidate source's blocks [B, S, T] (bool), once it has run in the call
    rows                a decode step's compressed rows of (cache, topk), gathered and decoded once for every
                        layer that reads them: (cache, topk, rows [B, k, hd], indices [B, 1, k])"""
    published_at_start: Optional[object] = None
    topk: Optional[torch.Tensor] = None
    candidates: Optional[torch.Tensor] = None
    rows: Optional[tuple] = None


@dataclass
class DecodeStep:
    """A decode step whose position is a device tensor, so that one CUDA graph replays it at every position of
    a length bucket (inference/engine/cuda_graph.py). `pos`: [] int64 on the model's device, one position
    for every row, or [B]: each row at its own position. `parity`: pos % 2 of a shared position, known when
    the graph is captured (a ratio-2 group completes at odd positions, and what a layer then writes and
    publishes differs: one graph per parity); None for positions per row, where every row computes its
    group's latent and only the rows whose group completes make it visible. `length`: the bucket, a
    multiple of 2 and > every pos: a step reads length // ratio compressed rows, those past a row's position
    masked out of its index scores. `first_row`: the caches' batch row of the step's first row (positions
    per row: the rows of a scheduler's batch that run the step)."""
    pos: torch.Tensor
    parity: Optional[int]
    length: int
    first_row: int = 0

    @staticmethod
    def rows(pos: torch.Tensor, length: Optional[int] = None, first_row: int = 0) -> "DecodeStep":
        """Each row at its own position: pos [B] int64 on the model's device, the caches' rows [first_row,
        first_row + B); `length` (the bucket) by default the smallest even number past the largest position
        (read from the device: a host sync)."""
        if length is None:
            top = int(pos.max()) + 1
            length = top + top % 2
        return DecodeStep(pos.view(-1), None, length, first_row)


class Kind(enum.Enum):
    """What kind of call a forward is; each layer branches on it once."""
    PREFILL = "prefill"     # a prompt's first call (start 0): every row sees only the call's own rows
    CHUNK = "chunk"         # a prompt's prefill continued at start > 0, several positions
    DECODE = "decode"       # one position per row (also a prompt's last chunk of one position)
    VERIFY = "verify"       # several positions at start > 0 checked as decode steps (speculative drafts)
    DRAFT = "draft"         # the DSpark block: its own attention lists, positions after the main model's


@dataclass(frozen=True)
class RatioPlan:
    """For the layers of compression ratio r: `keys` compressed rows readable (end // r; a graph's bucket
    // r), `visible` [S] the rows each query may see ((position + 1) // r), and where the call's new
    compressed entries go: their cache `rows` [n] and the RoPE position of each (its group's first token).

    Positions per row: `visible` [B, 1], `rows` and `rope_pos` [B, 1] (each row's current group, written
    whether or not it completes: an incomplete group's row is past what the row sees, and is written again
    when it completes), `complete` [B] bool: the rows whose group completes (whose keys an owner publishes;
    None at ratio 1: every row)."""
    keys: int
    visible: torch.Tensor
    rows: torch.Tensor
    rope_pos: torch.Tensor
    complete: Optional[torch.Tensor] = None

    @property
    def new(self) -> int:
        return self.rows.shape[-1]


def window_prefill_idx(s: int, window: int, device=None) -> torch.Tensor:
    """[S, min(S, W)]: query t lists positions max(0, t-W+1) + e, -1 for positions after t."""
    n = min(s, window)
    t = torch.arange(s, device=device).unsqueeze(1)
    pos = (t - window + 1).clamp_min(0) + torch.arange(n, device=device)
    return torch.where(pos > t, -1, pos).to(torch.int32)


def window_decode_idx(pos, window: int, device=None) -> torch.Tensor:
    """[W]: ring slots oldest first, (pos mod W)+1 ... pos mod W; slots not yet written are -1 (pos: an int
    or a [1] tensor)."""
    slots = (torch.arange(window, device=device) + pos % window + 1) % window
    return torch.where(slots > pos, -1, slots).to(torch.int32)


def window_extend_idx(start: int, s: int, window: int, device=None) -> torch.Tensor:
    """[S, W] decode-layout lists over [ring before the call (W rows) | chunk rows (S)]: for the query at
    position q, slot o stands for position pi = q - ((q - o) mod W); ring row if pi < start, else
    row W + pi - start; -1 if pi < 0."""
    q = torch.arange(start, start + s, device=device).unsqueeze(1)                 # [S, 1]
    slots = (torch.arange(window, device=device) + q % window + 1) % window          # [S, W] oldest first
    pos = q - (q - slots) % window
    idx = torch.where(pos < start, slots, window + pos - start)
    return torch.where(pos < 0, -1, idx).to(torch.int32)


@dataclass(frozen=True)
class ForwardCall:
    """What one forward call is: made once by the Transformer's prefill, decode or verify (or DSpark's draft)
    and passed down to every layer as an argument, with what follows from the positions computed once for all
    layers. Its geometry (kind to ring_slots) is apart from its policy (Policy: what the call publishes, and
    whether per-token computations run position by position).

    kind       Kind (above).
    start      the first position, an int; None in a CUDA graph's step, whose position is a tensor only.
    length     positions per row in the call (S).
    positions  [S] int64 on the model's device: RoPE rows, cache rows (a graph replays them from here).
    parity     start % 2 (a graph's: known when it is captured).
    window     [S, n] int32 sliding-window lists (-1 = none) in the layout of the kind: PREFILL over the
               call's rows, DECODE over the ring, CHUNK and VERIFY over [ring | the call's rows].
    ratios     {r: RatioPlan} for each compression ratio of the model.
    ring_slots [S] the window ring's slot of each position (position mod window).
    policy     Policy (below).
    first_row  None: the official layout, the call's b rows are the batch, cache rows [0, b); an int: the
               cache row of the call's first row, in a batch a scheduler runs (a prompt prefilled into the
               rows it names while the others keep their state; a decode step of its rows), the index keys
               then published for the call's rows only.
    rope_rows  a RoPE table's rows at the call's positions, looked up once per table (rope()).

    Positions per row (a decode step of rows at their own positions, DecodeStep.rows): start None, parity
    None, positions and ring_slots [B, 1], window [B, 1, W], the ratios' plans per row (RatioPlan)."""
    kind: Kind
    start: Optional[int]
    length: int
    positions: torch.Tensor
    parity: Optional[int]
    window: torch.Tensor
    ratios: Dict[int, RatioPlan]
    ring_slots: torch.Tensor
    policy: "Policy"
    first_row: Optional[int] = None
    rope_rows: Dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def rope(self, table: torch.Tensor) -> torch.Tensor:
        """table[positions]: the rotations of the call's positions ([S, ...], or [B, 1, ...] per row), looked
        up once per table and call."""
        rows = self.rope_rows.get(id(table))
        if rows is None:
            rows = self.rope_rows[id(table)] = table[self.positions]
        return rows

    @property
    def per_row(self) -> bool:
        """Whether every row is at its own position (positions [B, 1])."""
        return self.positions.dim() == 2

    def batch_rows(self, b: int) -> slice:
        """The caches' batch rows of the call's b rows."""
        first = self.first_row or 0
        return slice(first, first + b)

    def row_index(self, b: int) -> torch.Tensor:
        """[b, 1] the caches' batch row of each of the call's b rows (to index a cache row by row)."""
        rows = self.batch_rows(b)
        return torch.arange(rows.start, rows.stop, device=self.positions.device).view(-1, 1)

    def ring_key(self, b: int):
        """Where a decode step's window row goes in a ring [max_batch, W, D]: each row's slot."""
        return (self.row_index(b) if self.per_row else self.batch_rows(b)), self.ring_slots

    def compressed_key(self, ratio: int, b: int):
        """Where the call's new compressed entries (or index keys) of the ratio-`ratio` layers go in a cache
        [max_batch, T, D]: the plan's rows of the call's batch rows, or each row's own group's row (positions
        per row)."""
        rows = self.ratios[ratio].rows
        return (self.row_index(b) if self.per_row else self.batch_rows(b)), rows

    @staticmethod
    def prefill(start: int, s: int, args: ModelArgs, device,
                first_row: Optional[int] = None) -> "ForwardCall":
        """A prompt's positions [start, start + s): its first call (start 0) or its next chunk (into the
        caches' batch rows from `first_row` on, when given); its index-key owners publish as one call over the
        whole prompt would."""
        call = ForwardCall._positions(start, s, args, device, s > 1, Policy(publish=True, one_by_one=False))
        return call if first_row is None else replace(call, first_row=first_row)

    @staticmethod
    def decode(pos: int, args: ModelArgs, device, always_publish: bool = False) -> "ForwardCall":
        """One decode step at position `pos` (every row). `always_publish`: the stale-key fix."""
        return ForwardCall._positions(pos, 1, args, device, False, Policy(always_publish, one_by_one=False))

    @staticmethod
    def verify(start: int, s: int, args: ModelArgs, device, rows_independent: bool,
               always_publish: bool = False) -> "ForwardCall":
        """Positions [start, start + s) checked as s decode steps (speculative drafts): per-token computations
        run position by position unless the numerics' rows are independent of each other."""
        return ForwardCall._positions(start, s, args, device, False,
                                      Policy(always_publish, one_by_one=s > 1 and not rows_independent))

    @staticmethod
    def _positions(start: int, s: int, args: ModelArgs, device, chunk: bool,
                   policy: "Policy") -> "ForwardCall":
        """The geometry of positions [start, start + s): a prompt's first call (start 0: the call's own rows),
        a decode step (s = 1: the ring), or a prompt's chunk / a verification (the ring, then the call's
        rows)."""
        w = args.window_size
        if start == 0:
            kind, window = Kind.PREFILL, window_prefill_idx(s, w, device)
        elif s == 1:
            kind, window = Kind.DECODE, window_decode_idx(start, w, device).unsqueeze(0)
        else:
            kind = Kind.CHUNK if chunk else Kind.VERIFY
            window = window_extend_idx(start, s, w, device)
        positions = torch.arange(start, start + s, device=device)
        ratios = {}
        for r in sorted({r for r in args.compress_ratios if r > 0}):
            first, end = start // r, (start + s) // r                  # groups completed in the call
            rows = torch.arange(first, end, device=device)
            ratios[r] = RatioPlan(end, (positions + 1) // r, rows, rows * r)
        return ForwardCall(kind, start, s, positions, start % 2, window, ratios, positions % w, policy)

    @staticmethod
    def graph_step(step: DecodeStep, args: ModelArgs, always_publish: bool = False) -> "ForwardCall":
        """A decode step at the tensor position step.pos, reading the bucket step.length (no int position)."""
        if step.parity is None:
            return ForwardCall._rows_step(step, args, always_publish)
        pos = step.pos.view(1)
        ratios = {}
        for r in sorted({r for r in args.compress_ratios if r > 0}):
            rows = pos // r
            if r > 1 and step.parity == 0:        # (ratio 2) a group completes at odd positions only
                rows = rows[:0]
            ratios[r] = RatioPlan(step.length // r, (pos + 1) // r, rows, rows * r)
        window = window_decode_idx(pos, args.window_size, pos.device).unsqueeze(0)
        return ForwardCall(Kind.DECODE, None, 1, pos, step.parity, window, ratios, pos % args.window_size,
                           Policy(always_publish, one_by_one=False))

    @staticmethod
    def _rows_step(step: DecodeStep, args: ModelArgs, always_publish: bool) -> "ForwardCall":
        """A decode step of rows at their own positions step.pos [B]: per-row RoPE rows, ring slots, window
        lists and compressed-row plans; one call whatever the positions' parities (per-row masks, no
        per-row loop)."""
        pos = step.pos.view(-1, 1)                                             # [B, 1]
        ratios = {}
        for r in sorted({r for r in args.compress_ratios if r > 0}):
            rows = pos // r                                                    # [B, 1] each row's group
            complete = ((pos + 1) % r == 0).view(-1) if r > 1 else None      # [B]; ratio 1: every row
            ratios[r] = RatioPlan(step.length // r, (pos + 1) // r, rows, rows * r, complete)
        window = window_decode_idx(pos, args.window_size, pos.device).unsqueeze(1)   # [B, 1, W]
        return ForwardCall(Kind.DECODE, None, 1, pos, None, window, ratios, pos % args.window_size,
                           Policy(always_publish, one_by_one=False), first_row=step.first_row)

    @staticmethod
    def draft(start: int, s: int, device) -> "ForwardCall":
        """The DSpark block at positions [start, start + s) (its attention makes its own lists)."""
        positions = torch.arange(start, start + s, device=device)
        return ForwardCall(Kind.DRAFT, start, s, positions, start % 2, positions[:0], {}, positions[:0],
                           Policy(publish=False, one_by_one=False))

    @property
    def window_rows(self) -> int:
        """How many window rows precede the compressed rows in attention's KV: the call's own rows (PREFILL),
        the ring (DECODE), the ring then the call's rows (CHUNK, VERIFY)."""
        if self.kind == Kind.PREFILL:
            return self.length
        return self.window.shape[-1] + (self.length if self.kind in (Kind.CHUNK, Kind.VERIFY) else 0)

    def offset_rows(self, topk: torch.Tensor) -> torch.Tensor:
        """A top-k list of compressed rows [..., k] (-1 = none) as indices past the window rows, the
        official code's convention (parity captures)."""
        return torch.where(topk >= 0, topk + self.window_rows, -1)

    def per_position(self, fn, x: torch.Tensor, *args, dim: int = 1):
        """fn(x, *args), evaluated one position (index along `dim`) at a time when the policy says
        one_by_one; tensor args are sliced alike. Tensor outputs (or tuples of them) are concatenated back.
        Batch size 1 (the speculative loop's): the gate's token axis is then the position axis."""
        if not self.policy.one_by_one or x.shape[dim] == 1:
            return fn(x, *args)
        outs = [fn(x.narrow(dim, i, 1), *(a.narrow(dim, i, 1) if torch.is_tensor(a) else a for a in args))
                for i in range(x.shape[dim])]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(t, dim=dim) for t in zip(*outs))
        return torch.cat(outs, dim=dim)


@dataclass(frozen=True)
class Policy:
    """How a call treats what it computes, apart from where its positions are.

    publish    the index-key owners publish their keys as one call over the whole prompt would (a prefill;
               every call with the stale-key fix, docs/numerics.md §14.1).
    one_by_one per-token computations whose rounding depends on the tensor's size (fp32 GEMMs, transcendental
               functions on a few elements) run one position at a time, as a decode step runs them, so that a
               verification equals decoding exactly (VERIFY, in an order whose rows depend on each other)."""
    publish: bool
    one_by_one: bool


@dataclass(frozen=True)
class ModelContext:
    """Everything a layer needs besides its own weights and the call: config, parallelism, options, the
    numerics, the RoPE tables. Made whole by ModelContext.build (every field computed first, then the frozen
    object made once); nothing is set on it afterwards, and nothing about a call lives here (that is the
    ForwardCall's)."""
    args: ModelArgs
    par: ParallelContext
    opts: RuntimeOptions
    device: str
    numerics: Numerics
    window_freqs: torch.Tensor       # ratio-0 layers and DSpark: rope_theta, no YaRN
    compress_freqs: torch.Tensor     # ratio > 0 layers: compress_rope_theta with YaRN
    # How the MoE layers apply their routed experts (kernels/experts.py), chosen with the numerics.
    routed_experts: RoutedExperts
    # Weights streamed from disk (--offload disk): what is derived from a routed expert is never kept.
    streamed: bool = False

    @staticmethod
    def build(args: ModelArgs, par: Optional[ParallelContext] = None, opts: Optional[RuntimeOptions] = None,
              device: str = "cpu", streamed: bool = False,
              numerics: Optional[Numerics] = None) -> "ModelContext":
        """The context of a model built on `device`: its numerics chosen from the options (numerics_for,
        unless given) with the method of its routed experts (routed_experts_for), its RoPE tables made with
        the numerics."""
        par, opts = par or ParallelContext.single(), opts or RuntimeOptions()
        nx = numerics or numerics_for(opts, device)
        a = args
        window = precompute_freqs_cis(a.rope_head_dim, a.max_seq_len, a.rope_theta, nx=nx, device=device)
        compress = precompute_freqs_cis(a.rope_head_dim, a.max_seq_len, a.compress_rope_theta,
                                        a.original_seq_len, a.rope_factor, a.beta_fast, a.beta_slow, nx=nx,
                                        device=device)
        routed = routed_experts_for(opts, device, nx, streamed)
        return ModelContext(args, par, opts, device, nx, window, compress, routed, streamed)

    @property
    def act_dtype(self) -> torch.dtype:
        """Activations and caches: bf16 as in the official code, fp32 in golden numerics."""
        return self.numerics.act_dtype

    @property
    def always_publish(self) -> bool:
        """The index-key owners publish at every call (the stale-key fix, docs/numerics.md §14.1)."""
        return self.opts.fix_index_k_publish

    @property
    def keeps_full_precision_caches(self) -> bool:
        """Plain caches in the activation dtype: the numerics do not round cached values (golden), or packing
        is off; otherwise FP8 / FP4 codes and scales (kv_cache.PackedCache)."""
        return not self.numerics.rounds_caches or not self.opts.packed_kv

    @property
    def experts_device(self) -> str:
        """Where the routed experts' weights live: the model's device, or host memory with --experts-on host
        (a meta build stays on meta)."""
        if self.opts.experts_on == "host" and torch.device(self.device).type != "meta":
            return "cpu"
        return self.device

    @property
    def keep_expert_layouts(self) -> bool:
        """Whether a routed expert keeps what is derived from its weights between calls: on the CPU, unless
        streamed from disk or held at stored precision for the host-expert kernel (off the CPU a step
        derives only what it selects, see the numerics)."""
        return (torch.device(self.device).type == "cpu" and not self.streamed
                and self.opts.experts_on != "host")

    def freqs_for(self, layer_id: int) -> torch.Tensor:
        ratio = self.args.compress_ratios[layer_id]
        return self.compress_freqs if ratio > 0 else self.window_freqs
