"""Memory planner: the bytes one rank holds, by category, and whether that fits a GPU.

Weights and caches are exact: the Transformer is built on the meta device (shapes and dtypes, no storage)
for the rank, and the bytes of its parameters and cache buffers are summed by name. They are what the
loader allocates: the head, the Markov head, the confidence projection, the ratio-2 compressor projections
and the ViT norm weights are held in fp32 although stored as bf16 (`STORED_AS_BF16`), so `file_bytes` (the
tensor bytes of the converted shard) is smaller than `weights_bytes`.

The activation workspace is an estimate, stated term by term for the exact-order torch kernels
(inference/kernels/reference.py; hc_post in hyper.py, the indexer's score masking), per rank, for one
forward call of B rows of S tokens (n = B*S; T = S / ratio compressed positions), D = dim, hc = hc_mult,
with "streams" = n * (4*hc*D + 2*D*(1 + DSpark targets)) (the block's and the caller's bf16 streams, the
embedding and the kept DSpark inputs):

  hyper-connection post-mix  n * D * (16*hc + 4*hc^2 + 6): the streams, then hc_post's fp32 temporaries, the
                             largest being comb x residual [n, hc, hc, D]
  GEMM (widest output)       streams + n * (16*K + 6*N) + one row chunk of per-32-block partials and their
                             running sum (the partials at most 128 MiB), for the Linear [N, K] with the
                             widest output
  indexer scores             streams + 6 bytes * n * T at the smallest index-layer ratio (T = S at ratio 1):
                             the bf16 scores, their masked copy, the candidate mask and its complement (+10
                             with deterministic top-k, a bound on its int32 key per entry and the
                             comparison masks that fill it), plus the 2^26-element chunk
  sparse attention           streams + n * (3 * H_local * head_dim * 2 + (window + topk) * 8) + one block of
                             64 queries (gathered fp32 rows, scores, accumulators)
  compressed KV read         streams + B * T * (2 * head_dim + 3 * (head_dim + index_head_dim) if packed):
                             the window + compressed KV concatenation, and the bf16 result of reading a
                             packed cache (decoded in chunks; T of a decode step: max_seq_len / ratio)
  head                       B * vocab * 8 (fp32 logits of the last position, gathered)
  dequantization (GPU only)  3 * 4 * N * K for the quantized Linear with the most elements: off the CPU the
                             fp32 weight is rebuilt per call (on the CPU it is cached, i.e. held for good)

Each stage is multiplied by MARGIN (temporaries the terms leave out, allocator slack) and the workspace of a
call is the largest stage. On the tiny fixture model (CPU, allocations traced by the profiler) the stated
prefill workspace is 1.1-1.7 times the measured peak, never below it (tests/test_plan.py). The plan gives it
for a decode step (S = 1) and for a one-call prefill of `prefill_len` tokens per row (default: max_seq_len),
the longest prompt whose one-call prefill fits, and the largest prefill chunk that fits at the full context
(generate.py prefills in chunks of it when one call does not fit). RESERVE
stands for the CUDA context, cuBLAS/NCCL buffers and allocator slack (assumed, not measured). Loop-free or
fused kernels (--numerics fast, tilelang) need less; the estimate does not model them.

With --experts-on host (RuntimeOptions.experts_on) every routed expert of the rank, the main layers' and the
DSpark head's (one MoE class holds both), stays in host memory at its stored bytes (FP4 codes + UE8M0 scales,
or FP8 + scales: the shard's bytes, no dequantised copy) and is computed there by the host-expert kernel; the
GPU holds the rest. A long GPU call may copy its active experts over one at a time instead (kernels/experts.py
prefers_copy: one expert's bytes and its bf16 form, 87 MB at the released widths, left to MARGIN), so the GPU
workspace is the one above; what crosses per call, the tokens' [n, D] bf16 hidden rows each way, is left to
MARGIN. The host adds a workspace: per call of n tokens (all rows) n * top-k * (2 * moe_inter_dim + dim) * 4
bytes (every row's fp32 gate and up and its output; a bound for one rank, all k experts of a token being its
own), times MARGIN. A CPU-only run is the same placement with everything on the CPU: it also holds the fp32
copies of the other FP8/FP4 weights that the CPU path keeps once used (`dequant_bytes`), none with
--cpu-linears stored (RuntimeOptions.cpu_linears: those Linears computed from their stored bytes too).

Released config at W = 1 against the Hugging Face checkpoint's 510,286,023,000 tensor bytes: the plan gives
513,149,074,264 bytes (+0.56 %), the difference being, line by line, `wo_a` dequantized to bf16 with its
scales dropped (43 layers x (33,554,432 - 32,768) = +1,441,431,552), `head.weight` held in fp32
(+1,323,827,200), the Markov head in fp32 (+66,191,360), the ratio-2 compressor `wkv`/`wgate` of layers
2, 8, 14 in fp32 (+31,457,280), the ViT norm weights in fp32 (+133,120) and the confidence projection in fp32
(+10,752): +2,863,051,264 in all.
"""
import os
import re
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch

from ..config import CPU_LINEARS, ModelArgs, RuntimeOptions
from ..engram import EngramHasher
from ..layers import Linear
from ..model import Transformer
from ..parallel import ParallelContext

# Held in fp32 by the model although stored as bf16 (exact widening).
STORED_AS_BF16 = re.compile(r"^(head\.weight|mtp\.\d+\.markov_head\.head\.weight"
                            r"|mtp\.\d+\.confidence_head\.proj\.weight"
                            r"|layers\.\d+\.attn\.compressor\.(wkv|wgate)\.weight"
                            r"|vision\.blocks\.\d+\.norm[12]\.weight|vision\.norm\.weight)$")

GIB = 1 << 30
RESERVE = 2 * GIB
GEMM_CHUNK = 1 << 27        # inference/kernels/reference.py block_scaled_gemm: bytes of partials per chunk
SCORE_CHUNK = 1 << 26       # inference/kernels/reference.py index_scores: elements per query chunk
MARGIN = 1.2                # on every workspace stage: temporaries the terms leave out, allocator slack
PACKED_READ = 3             # bytes per value a packed-cache read adds: the decoded bf16, a copy of the codes

# Usable memory as the driver reports it (nvidia-smi totals).
GPUS = {"H100 80 GB": 81559 << 20, "H200 141 GB": 143771 << 20, "B200 180 GB": 183359 << 20}
# The GPUs a run with the routed experts on the host is planned for (tools/plan.py --experts-on host): the
# workstation cards' totals as nvidia-smi reports them elsewhere (not seen by this project), the others above.
HOST_GPUS = {"RTX 4090 24 GB": 24564 << 20, "RTX 5090 32 GB": 32607 << 20, "RTX 6000 Ada 48 GB": 49140 << 20,
             "H100 80 GB": GPUS["H100 80 GB"], "RTX PRO 6000 96 GB": 97887 << 20,
             "H200 141 GB": GPUS["H200 141 GB"], "B200 180 GB": GPUS["B200 180 GB"]}

# (key, label, name pattern): the first match wins.
WEIGHT_GROUPS = (
    ("embed_head", "embeddings, head, final norm", r"(embed|head|norm)\.weight$"),
    ("attention", "attention (compressor, indexer incl.)", r"layers\.\d+\.(attn\.|attn_norm\.)"),
    ("hyper", "hyper-connection mixes", r"layers\.\d+\.hc_"),
    ("routed_experts", "routed experts", r"layers\.\d+\.ffn\.experts\."),
    ("dense_experts", "router, shared expert, FFN norm", r"layers\.\d+\.(ffn\.|ffn_norm\.)"),
    ("engram_tables", "Engram tables", r"layers\.\d+\.engram\.embed\."),
    ("engram", "Engram projection and gate", r"layers\.\d+\.engram\."),
    ("dspark", "DSpark draft head (mtp.*)", r"mtp\."),
    ("vit", "ViT and aligner", r"(vision|aligner)\.|image_(start|end|newline)$"),
)
CACHE_GROUPS = (
    ("window_kv", "window KV rings", r"layers\.\d+\.attn\.kv_"),
    ("compressed_kv", "compressed KV", r"layers\.\d+\.attn\.compress_"),
    ("index_keys", "indexer keys", r"layers\.\d+\.attn\.indexer\.k_"),
    ("compressor_tails", "compressor tails", r"layers\.\d+\.attn\.compressor\.(kv|score)_state$"),
    ("dspark_rings", "DSpark rings", r"mtp\.\d+\.attn\.kv_"),
    ("engram_ids", "Engram token history and maps", r"engram_hasher\."),
    ("rope", "RoPE tables", r"rope\."),
)
LABELS = {k: label for k, label, _ in WEIGHT_GROUPS + CACHE_GROUPS}
# Every routed expert: the main layers' ("routed_experts") and the DSpark head's (within "dspark"), as one MoE
# class builds both; --experts-on host keeps them all in host memory.
HOST_EXPERTS = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.")


class PlanError(ValueError):
    pass


def category(name: str, groups) -> str:
    for key, _, pattern in groups:
        if re.match(pattern, name):
            return key
    raise PlanError(f"no memory category for tensor {name!r} (add one to inference/engine/memory.py)")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def parse_bytes(text: str) -> int:
    """'141GB' (10^9), '139GiB' (2^30), '512MiB', '2TB' or a plain byte count."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise PlanError(f"cannot read {text!r} as a size (e.g. 141GB, 139GiB)")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass
class RankPlan:
    rank: int
    weights: Dict[str, int]
    file_bytes: int                     # tensor bytes of the converted shard model{rank}-mp{W}
    caches: Dict[str, int]
    workspace: Dict[str, int]           # stage -> bytes of the stated workspace (see the module docstring)
    engram_on: str = "device"
    reserve: int = RESERVE
    experts_on: str = "device"
    routed_bytes: int = 0               # every routed expert (HOST_EXPERTS), at its stored bytes
    dequant_bytes: int = 0              # fp32 copies of the other FP8/FP4 Linears, kept by the CPU path
    # weight bytes a CPU decode token reads besides the routed experts, per --cpu-linears form (planned with
    # the experts on the host)
    cpu_decode_bytes: Dict[str, int] = field(default_factory=dict)
    graphs: int = 0                     # the CUDA graphs' memory pool (graph_pool_bytes), held for good

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def host_experts_bytes(self) -> int:
        """The routed experts' bytes held in host memory (--experts-on host), else 0."""
        return self.routed_bytes if self.experts_on == "host" else 0

    @property
    def host_bytes(self) -> int:
        """Weights kept in CPU memory instead: the Engram tables with --engram-on host, every routed expert
        with --experts-on host."""
        engram = self.weights.get("engram_tables", 0) if self.engram_on == "host" else 0
        return engram + self.host_experts_bytes

    @property
    def gpu_weights_bytes(self) -> int:
        off = self.weights.get("engram_tables", 0) if self.engram_on != "device" else 0
        return self.weights_bytes - off - self.host_experts_bytes

    @property
    def cache_bytes(self) -> int:
        return sum(self.caches.values())

    @property
    def workspace_bytes(self) -> int:
        return max(self.workspace.values(), default=0)

    def phase_bytes(self, phase: str) -> int:
        """Workspace of the decode or the prefill call alone."""
        return max((v for k, v in self.workspace.items() if k.startswith(phase)), default=0)

    @property
    def resident_bytes(self) -> int:
        """What every run needs on the GPU before the first call's activations (the CUDA graphs' pool
        included: captured once, it is held)."""
        return self.gpu_weights_bytes + self.cache_bytes + self.reserve + self.graphs

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + self.workspace_bytes


def build_meta_model(args: ModelArgs, world_size: int, rank: int, opts: Optional[RuntimeOptions] = None,
                     language_model_only: bool = False, build_dspark: bool = True) -> Transformer:
    """The model of one rank with every tensor on the meta device (no memory, exact shapes and dtypes). The
    kernel backend changes no shape: the torch one builds on any device. Nor do the placements: the Engram
    tables are built on the device (a host placement would reserve their host memory), the routed experts of
    --experts-on host stay on the meta device too, and the plan places them by category. The fast order with
    --cpu-linears stored holds the head in bf16 as stored (layers.ParallelHead): the build keeps the
    options."""
    opts = replace(opts or RuntimeOptions(), kernel_backend="torch", engram_on="device")
    return Transformer(args, ParallelContext(world_size, rank), opts, "meta", build_dspark=build_dspark,
                       language_model_only=language_model_only)


def meta_hasher(args: ModelArgs) -> Optional[EngramHasher]:
    """The Engram hasher the tokenizer would give (its token map sized by the vocabulary)."""
    if not args.engram_layer_ids:
        return None
    token_map = torch.zeros(args.vocab_size, dtype=torch.int64)
    with torch.device("meta"):          # the [batch, max_seq_len] history; the small maps stay on the CPU
        return EngramHasher(args, token_map, args.engram_compressed_vocab_size or args.vocab_size)


def weight_bytes(model: Transformer) -> Tuple[Dict[str, int], int]:
    """-> (bytes per category as held in memory, bytes as stored in the converted shard)."""
    out = {k: 0 for k, _, _ in WEIGHT_GROUPS}
    stored = 0
    for name, p in model.named_parameters():
        b = nbytes(p)
        out[category(name, WEIGHT_GROUPS)] += b
        stored += b // 2 if p.dtype == torch.float32 and STORED_AS_BF16.match(name) else b
    return out, stored


def routed_expert_bytes(model: Transformer) -> int:
    """Bytes of every routed expert's weights and scales (HOST_EXPERTS), as stored."""
    return sum(nbytes(p) for name, p in model.named_parameters() if HOST_EXPERTS.match(name))


def dequant_copy_bytes(model: Transformer) -> int:
    """fp32 bytes of the FP8/FP4 Linears other than the routed experts: the copies the CPU path keeps once
    it has used them (inference/kernels/numerics.py dequantized)."""
    return sum(m.in_features * m.out_features * 4 for name, m in model.named_modules()
               if isinstance(m, Linear) and m.kind in ("fp8", "fp4") and not HOST_EXPERTS.match(name + "."))


# Read once per decode token by a CPU-only run besides the routed experts: the main layers' and the head's
# parameters; not the embedding table nor the Engram tables (a few rows a token), nor the DSpark head, the ViT
# or the aligner (speculation and images only).
NOT_READ_PER_TOKEN = re.compile(r"^(embed\.|mtp\.|vision\.|aligner\.|image_(start|end|newline)$)|"
                                r"\.engram\.embed\.")


# Held in fp32 by default, in bf16 as stored by the fast order with --cpu-linears stored (its numerics'
# head_dtype, layers.ParallelHead).
STORED_FORM_BF16 = re.compile(r"^head\.weight$")


def cpu_decode_read_bytes(model: Transformer) -> Dict[str, int]:
    """Weight bytes one decode token reads on the CPU path besides the routed experts, per --cpu-linears form:
    each parameter as held (NOT_READ_PER_TOKEN aside); with fp32 an FP8/FP4 Linear as the fp32 copy it
    computes from (4 bytes a weight, its stored bytes and scales unread), with stored as held, the head in
    bf16 as the fast order holds it then (the exact order keeps it in fp32: 1.32 GB more a token)."""
    quantized = {name: m for name, m in model.named_modules()
                 if isinstance(m, Linear) and m.kind in ("fp8", "fp4")}
    total = {form: 0 for form in CPU_LINEARS}
    for name, p in model.named_parameters():
        if HOST_EXPERTS.match(name) or NOT_READ_PER_TOKEN.search(name):
            continue
        owner, _, leaf = name.rpartition(".")
        m = quantized.get(owner)
        widened = p.dtype == torch.float32 and STORED_FORM_BF16.match(name)
        total["stored"] += nbytes(p) // 2 if widened else nbytes(p)
        if m is None:
            total["fp32"] += nbytes(p)
        elif leaf == "weight":
            total["fp32"] += m.in_features * m.out_features * 4
    return total


def host_expert_workspace(args: ModelArgs, tokens: int) -> int:
    """Host bytes of the expert kernel's activations for one call of `tokens` tokens (all rows): every
    token's top-k rows, each its fp32 gate and up (2 * moe_inter_dim) and output (dim), times MARGIN; a bound
    for one rank (all k experts of a token may be its own)."""
    per_row = (2 * args.moe_inter_dim + args.dim) * 4
    return int(tokens * args.n_activated_experts * per_row * MARGIN)


def cache_bytes(model: Transformer, hasher: Optional[EngramHasher]) -> Dict[str, int]:
    out = {k: 0 for k, _, _ in CACHE_GROUPS}
    named = list(model.named_buffers())
    if hasher is not None:
        named += [(f"engram_hasher.{n}", b) for n, b in hasher.named_buffers()]
    ctx = model.ctx
    named += [("rope.window", ctx.window_freqs), ("rope.compress", ctx.compress_freqs)]
    for name, buf in named:
        out[category(name, CACHE_GROUPS)] += nbytes(buf)
    return out


@dataclass
class Shapes:
    """What the workspace estimate needs from a built model besides its config."""
    args: ModelArgs
    world_size: int
    deterministic_topk: bool
    widest: Tuple[int, int]           # (in, out) of the Linear with the widest output
    biggest_quantized: Tuple[int, int]  # (in, out) of the FP8/FP4 Linear with the most elements
    packed_kv: bool = False

    @classmethod
    def of(cls, model: Transformer) -> "Shapes":
        linears = [(m.in_features, m.out_features, m.kind) for m in model.modules() if isinstance(m, Linear)]
        widest = max(((k, n) for k, n, _ in linears), key=lambda t: (t[1], t[0]), default=(0, 0))
        quantized = max(((k, n) for k, n, kind in linears if kind in ("fp8", "fp4")),
                        key=lambda t: t[0] * t[1], default=(0, 0))
        opts = model.ctx.opts
        return cls(model.args, model.ctx.par.world_size, opts.deterministic_topk, widest, quantized,
                   opts.packed_kv and not opts.golden)


def workspace_bytes(shapes: Shapes, batch: int, seqlen: int, on_gpu: bool = True,
                    context: Optional[int] = None) -> Dict[str, int]:
    """Stated workspace of one call of `batch` rows of `seqlen` tokens, per stage (module docstring), whose
    last position is `context` - 1 (default: a decode step at max_seq_len, a prefill from position 0): the
    indexer scores and the compressed KV read grow with the context, the rest with the call's tokens."""
    a, w = shapes.args, shapes.world_size
    if context is None:
        context = a.max_seq_len if seqlen == 1 else seqlen
    n, d, hc = batch * seqlen, a.dim, a.hc_mult
    streams = n * (hc * d * 2 * 2 + d * 2 * (1 + len(a.dspark_target_layer_ids)))   # x twice, h, targets
    stages = {"hyper-connection post-mix": n * d * (16 * hc + 4 * hc * hc + 6)}
    k, out = shapes.widest
    if out:
        rows = min(n, max(1, GEMM_CHUNK // (max(1, k // 32) * out * 4)))     # rows per chunk of partials
        chunk = rows * (k // 32 + 1) * out * 4                              # partials + running sum
        stages["GEMM (widest output)"] = streams + n * (16 * k + 6 * out) + chunk
    ratios = [a.compress_ratios[i] for i in a.index_source_layers if i < a.n_layers]
    if ratios and seqlen > 1:
        t = context // min(ratios)
        per = 6 + (10 if shapes.deterministic_topk else 0)
        chunk = min(SCORE_CHUNK, n * (a.index_n_heads // w) * t) * 6
        stages["indexer scores"] = streams + per * n * t + chunk
    h_local = a.n_heads // w
    block = batch * min(seqlen, 64)                                         # one 64-query block
    attn_block = block * (64 * a.head_dim * 8 + h_local * 64 * 12 + h_local * a.head_dim * 8)
    per_token = 3 * h_local * a.head_dim * 2 + (a.window_size + a.index_topk) * 8
    stages["sparse attention"] = streams + n * per_token + attn_block
    kv_ratios = [a.compress_ratios[i] for i in a.kv_source_layers]
    if kv_ratios:
        # the visible compressed KV (and index keys) a call reads: every position of the context
        t = context // min(kv_ratios)
        per_value = PACKED_READ if shapes.packed_kv else 0
        stages["compressed KV read"] = streams + batch * t * (a.head_dim * (2 + per_value)
                                                              + a.index_head_dim * per_value)
    stages["head"] = batch * a.vocab_size * 8
    if on_gpu and shapes.biggest_quantized[0]:
        stages["dequantization"] = 3 * 4 * shapes.biggest_quantized[0] * shapes.biggest_quantized[1]
    return {k: int(v * MARGIN) for k, v in stages.items()}


@dataclass
class MemoryPlan:
    args: ModelArgs
    world_size: int
    engram_on: str
    prefill_len: int
    packed_kv: bool = True
    shapes: Optional[Shapes] = None
    ranks: List[RankPlan] = field(default_factory=list)
    experts_on: str = "device"

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda p: p.total_bytes)

    def host_workspace(self, tokens: int) -> int:
        """Host bytes of the expert kernel for a call of `tokens` tokens (all rows); 0 with the experts on
        the device."""
        return host_expert_workspace(self.args, tokens) if self.experts_on == "host" else 0

    def host_need(self, tokens: int) -> int:
        """Host memory the worst rank needs for its weights there and a call of `tokens` tokens."""
        return self.worst.host_bytes + self.host_workspace(tokens)

    def fits_decode(self, capacity: int) -> bool:
        r = self.worst
        return r.resident_bytes + r.phase_bytes("decode") <= capacity

    def longest_prefill(self, capacity: int, on_gpu: bool = True) -> int:
        """Longest prompt (tokens per row, at max_batch_size rows) whose one-call prefill fits next to the
        resident bytes; 0 if not even a decode step fits."""
        free = capacity - self.worst.resident_bytes
        batch = self.args.max_batch_size

        def fits(s: int) -> bool:
            return max(workspace_bytes(self.shapes, batch, s, on_gpu).values()) <= free

        return _largest(fits, self.args.max_seq_len)

    @property
    def min_chunk(self) -> int:
        """The smallest prefill chunk a verdict of "fits" accepts: one window (as --long-context)."""
        return min(self.args.window_size, self.args.max_seq_len)

    def default_chunk(self, capacity: int, on_gpu: bool = True) -> Optional[int]:
        """generate.py's default --prefill-chunk on this GPU: None (one call) when a prompt of max_seq_len
        prefills in one call, else the largest chunk that fits (0: not even one token)."""
        chunk = self.largest_chunk(capacity, on_gpu)
        return None if chunk >= self.args.max_seq_len else chunk

    def largest_chunk(self, capacity: int, on_gpu: bool = True) -> int:
        """Largest prefill chunk (tokens per row per call, at max_batch_size rows) that fits next to the
        resident bytes when its last position is max_seq_len - 1 (the most a chunk's workspace can be); 0 if
        not even one token does. The default of generate.py's --prefill-chunk on a GPU."""
        free = capacity - self.worst.resident_bytes
        a = self.args
        return _largest(lambda c: max(workspace_bytes(self.shapes, a.max_batch_size, c, on_gpu,
                                                      context=a.max_seq_len).values()) <= free, a.max_seq_len)


def _largest(fits, limit: int) -> int:
    """The largest n in [1, limit] with fits(n), for a fits that holds up to some n and fails above it."""
    if not fits(1):
        return 0
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def graph_count(args: ModelArgs) -> int:
    """How many CUDA graphs a run at max_batch_size rows captures at most: one per length bucket (powers of
    two from MIN_BUCKET up to max_seq_len) and parity of the position (engine/cuda_graph.py)."""
    from .cuda_graph import bucket
    positions = [0] + [1 << e for e in range(args.max_seq_len.bit_length())]
    buckets = {bucket(p, args.max_seq_len) for p in positions if p < args.max_seq_len}
    return 2 * len(buckets)


def graph_pool_bytes(args: ModelArgs, decode_workspace: int) -> int:
    """The CUDA graphs' shared memory pool: one decode step's workspace (each capture's temporaries, freed
    by its end, are reused by the next) and every graph's outputs, the [B, V] fp32 logits and [B] ids."""
    outputs = args.max_batch_size * (args.vocab_size * 4 + 8)
    return decode_workspace + graph_count(args) * int(outputs * MARGIN)


def plan_memory(args: ModelArgs, world_size: int, opts: Optional[RuntimeOptions] = None,
                ranks: Optional[List[int]] = None, prefill_len: Optional[int] = None,
                language_model_only: bool = False, build_dspark: bool = True,
                on_gpu: bool = True, cuda_graphs: bool = False) -> MemoryPlan:
    """Plan every rank (or only `ranks`) from meta builds of the model; `cuda_graphs`: decode steps replayed
    from CUDA graphs, whose pool is planned as resident (graph_pool_bytes)."""
    opts = opts or RuntimeOptions()
    prefill_len = min(prefill_len or args.max_seq_len, args.max_seq_len)
    plan = MemoryPlan(args, world_size, opts.engram_on, prefill_len, opts.packed_kv and not opts.golden,
                      experts_on=opts.experts_on)
    hasher = meta_hasher(args)
    for rank in (range(world_size) if ranks is None else ranks):
        model = build_meta_model(args, world_size, rank, opts, language_model_only, build_dspark)
        plan.shapes = plan.shapes or Shapes.of(model)
        weights, stored = weight_bytes(model)
        stages = {f"decode: {k}": v for k, v in workspace_bytes(plan.shapes, args.max_batch_size, 1,
                                                                on_gpu).items()}
        stages.update({f"prefill: {k}": v for k, v in workspace_bytes(plan.shapes, args.max_batch_size,
                                                                      prefill_len, on_gpu).items()})
        plan.ranks.append(RankPlan(rank, weights, stored, cache_bytes(model, hasher), stages, opts.engram_on,
                                   experts_on=opts.experts_on, routed_bytes=routed_expert_bytes(model),
                                   dequant_bytes=dequant_copy_bytes(model) if opts.cpu_linears == "fp32"
                                   else 0, cpu_decode_bytes=cpu_decode_read_bytes(model)
                                   if opts.experts_on == "host" else {}))
        if cuda_graphs:
            decode = max(v for k, v in stages.items() if k.startswith("decode"))
            plan.ranks[-1].graphs = graph_pool_bytes(args, decode)
    return plan


def rank_plan(args: ModelArgs, par: ParallelContext, opts: RuntimeOptions, device: str,
              language_model_only: bool = False, gpu_mem: Optional[int] = None,
              cuda_graphs: bool = False) -> MemoryPlan:
    """This rank's plan from one meta build of the model it will load: the loader's memory check and the
    default prefill chunk both read it (the build takes seconds at the released size)."""
    on_gpu = device.startswith("cuda") or gpu_mem is not None
    return plan_memory(args, par.world_size, opts, ranks=[par.rank], language_model_only=language_model_only,
                       on_gpu=on_gpu, cuda_graphs=cuda_graphs)


def capacity_of(device: str, gpu_mem: Optional[int] = None) -> Optional[int]:
    """The bytes a plan is judged against: the `gpu_mem` budget, else the CUDA device's; None on a CPU."""
    if gpu_mem is None and device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return gpu_mem


def host_memory() -> Optional[int]:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


@dataclass
class ContextPlan:
    """How long a context a setup holds when prompts are prefilled in chunks. The resident bytes grow with the
    context L through the caches (exact bytes per position, from meta builds at two lengths); a decode step's
    workspace and a chunk's grow with L (the indexer scores and the compressed KV a call reads). A context
    fits when a decode step and a prefill chunk of at least `min_chunk` tokens (one window) fit beside the
    resident bytes."""
    plan: MemoryPlan                   # at the config's max_seq_len
    per_position: float                # cache bytes per position of context (all rows), worst rank

    @property
    def min_chunk(self) -> int:
        return self.plan.args.window_size

    def resident(self, context: int) -> int:
        extra = context - self.plan.args.max_seq_len
        return int(self.plan.worst.resident_bytes + self.per_position * extra)

    def _ws(self, rows: int, context: int, on_gpu: bool = True) -> int:
        return max(workspace_bytes(self.plan.shapes, self.plan.args.max_batch_size, rows, on_gpu,
                                   context=context).values())

    def need(self, context: int, chunk: int) -> int:
        """GPU bytes at `context`: the resident bytes and the larger of a decode step's and a chunk's
        workspace."""
        return self.resident(context) + max(self._ws(1, context), self._ws(chunk, context))

    def largest_chunk(self, capacity: int, context: int) -> int:
        """The largest chunk that fits when its last position is context - 1; 0 if a decode step does not."""
        free = capacity - self.resident(context)
        if self._ws(1, context) > free:
            return 0
        return _largest(lambda c: self._ws(c, context) <= free, context)

    def longest_context(self, capacity: int, chunk: Optional[int] = None, limit: int = 1 << 20) -> int:
        """The longest context (positions per row, at most `limit`) whose decode step and prefill chunks
        (of `chunk` tokens, or the largest that fits but at least min_chunk) fit; 0 if none does."""
        def fits(context: int) -> bool:
            c = self.largest_chunk(capacity, context)
            return c >= min(chunk or self.min_chunk, context)
        return _largest(fits, limit)


def context_plan(args: ModelArgs, world_size: int, opts: Optional[RuntimeOptions] = None,
                 language_model_only: bool = False) -> ContextPlan:
    """Meta builds at the config's max_seq_len (every rank) and at twice it (the worst rank): the caches'
    bytes per position."""
    plan = plan_memory(args, world_size, opts, language_model_only=language_model_only)
    worst = plan.worst
    longer = plan_memory(replace(args, max_seq_len=2 * args.max_seq_len), world_size, opts,
                         ranks=[worst.rank], language_model_only=language_model_only)
    return ContextPlan(plan, (longer.worst.cache_bytes - worst.cache_bytes) / args.max_seq_len)


def verdict_line(plan: MemoryPlan, device: str, capacity: Optional[int] = None) -> str:
    """One line: what every run needs on the device, and (with a capacity) whether and how far it fits; with
    the experts on the host, what it needs in host memory too."""
    r = plan.worst
    decode = r.phase_bytes("decode")
    need = r.resident_bytes + decode
    where = ", experts on host" if plan.experts_on == "host" else ""
    graphs = f" + {gib(r.graphs)} CUDA graphs (up to {graph_count(plan.args)})" if r.graphs else ""
    line = (f"memory plan (rank {r.rank} of {plan.world_size}, Engram on {plan.engram_on}{where}): "
            f"{gib(r.gpu_weights_bytes)} weights + {gib(r.cache_bytes)} caches + {gib(decode)} decode "
            f"workspace{graphs} + {gib(r.reserve)} reserve = {gib(need)}")
    a = plan.args
    if capacity is None:
        if not device.startswith("cuda"):       # no reserve or GPU workspace; the CPU path caches more
            if plan.experts_on == "host":
                experts = plan.host_workspace(plan.prefill_len * a.max_batch_size)
                copies = (f"{gib(r.dequant_bytes)} fp32 copies of the other quantized weights (kept once "
                          f"used)" if r.dequant_bytes else "no copies of the other weights")
                return (f"memory plan (rank {r.rank} of {plan.world_size}, experts on host): "
                        f"{gib(r.weights_bytes)} weights ({gib(r.routed_bytes)} of them routed experts at "
                        f"their stored bytes) + {copies} + {gib(r.cache_bytes)} caches on {device}, plus the "
                        f"workspace of a call ({gib(experts)} for the experts of a one-call prefill of "
                        f"{plan.prefill_len:,} x {a.max_batch_size})")
            return (f"memory plan (rank {r.rank} of {plan.world_size}): {gib(r.weights_bytes)} weights + "
                    f"{gib(r.cache_bytes)} caches on {device}, plus fp32 copies of the quantized weights "
                    f"the CPU path caches as it uses them")
        return line + f" on {device}" + host_part(plan, plan.prefill_len)
    if need > capacity:
        return line + f" of {gib(capacity)} on {device}: does not fit" + host_part(plan, 1)
    chunk = plan.default_chunk(capacity)
    if chunk is None:
        return line + f" of {gib(capacity)} on {device}; prompts of {a.max_seq_len:,} tokens x " \
            f"{a.max_batch_size} rows prefill in one call" + host_part(plan, a.max_seq_len)
    return (line + f" of {gib(capacity)} on {device}; prefill in chunks of up to {chunk:,} tokens (one call: "
            f"prompts up to {plan.longest_prefill(capacity):,} tokens x {a.max_batch_size} rows)"
            + host_part(plan, chunk))


def host_part(plan: MemoryPlan, per_row: int) -> str:
    """'; host memory ...' with the experts on the host (calls of `per_row` tokens per row), else ''."""
    if plan.experts_on != "host":
        return ""
    r, tokens = plan.worst, per_row * plan.args.max_batch_size
    engram = r.host_bytes - r.host_experts_bytes
    parts = [f"{gib(r.host_experts_bytes)} routed experts"]
    parts += [f"{gib(engram)} Engram tables"] if engram else []
    parts.append(f"{gib(plan.host_workspace(tokens))} expert workspace")
    return f"; host memory for rank {r.rank}: {gib(plan.host_need(tokens))} ({' + '.join(parts)})"


def fix_hint(plan: MemoryPlan) -> str:
    hints = ["raise --mp"]
    if plan.engram_on == "device" and plan.args.engram_layer_ids:
        hints.append("--engram-on host")
    return ", ".join(hints) + ", lower --max-seq-len or the batch (--max-batch-size)"
