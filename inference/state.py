"""Objects shared by the attention layers of one model: RoPE tables and the cross-layer attention state."""
from dataclasses import dataclass, field
from typing import Optional

import torch

from .config import ModelArgs, RuntimeOptions
from .kernels import Numerics, numerics_for
from .parallel import ParallelContext
from .rope import precompute_freqs_cis


@dataclass
class SharedAttentionState:
    """Written by source layers and read by later layers in the same call (docs/architecture.md §6.3).

    `index_k` persists across calls on purpose: the official code reads a stale one (docs/numerics.md §14.1).
    """
    compress_kv: Optional[torch.Tensor] = None
    index_k: Optional[torch.Tensor] = None
    topk_idxs: Optional[torch.Tensor] = None
    candidates: Optional[torch.Tensor] = None
    index_k_at_call_start: Optional[torch.Tensor] = None   # extend's emulation of docs/numerics.md §14.1

    def reset(self):
        self.compress_kv = self.index_k = self.topk_idxs = self.candidates = None
        self.index_k_at_call_start = None


@dataclass
class DecodeStep:
    """A decode step whose position is a device tensor, so that one CUDA graph replays it at every position of
    a length bucket (inference/engine/cuda_graph.py). `pos`: [] int64 on the model's device. `parity`: pos %
    2, known when the graph is captured (a ratio-2 group completes at odd positions, and what a layer then
    writes and publishes differs: one graph per parity). `length`: the bucket, a multiple of 2 and > pos: a
    step reads length // ratio compressed rows, those past its position masked out of the index scores."""
    pos: torch.Tensor
    parity: int
    length: int


@dataclass
class ModelContext:
    """Everything a layer needs besides its own weights: config, parallelism, options, the numerics, RoPE,
    shared state. `numerics` is made from the options and the device when not given (numerics_for)."""
    args: ModelArgs
    par: ParallelContext = field(default_factory=ParallelContext.single)
    opts: RuntimeOptions = field(default_factory=RuntimeOptions)
    device: str = "cpu"
    numerics: Optional[Numerics] = None
    # Weights streamed from disk (--offload disk): what is derived from a routed expert is never kept.
    streamed: bool = False
    window_freqs: Optional[torch.Tensor] = None     # ratio-0 layers and DSpark: rope_theta, no YaRN
    compress_freqs: Optional[torch.Tensor] = None   # ratio > 0 layers: compress_rope_theta with YaRN
    shared: SharedAttentionState = field(default_factory=SharedAttentionState)
    # True during a prefill call or a chunk of one (the index-key owners publish as one call would).
    prefilling: bool = False
    # Set during a decode step whose position is a tensor (a CUDA graph's): the layers read it from here.
    step: Optional[DecodeStep] = None
    # True during the speculative verification of several positions: per-token computations whose rounding
    # depends on the tensor's size (fp32 GEMMs; transcendental ops on a few elements, vectorized or not) run
    # one position at a time, as a decode step runs them, so that verification equals decoding exactly; and
    # the indexer keeps each row's decode-step view of the published keys.
    decode_shapes: bool = False

    def __post_init__(self):
        a, nx = self.args, self.numerics
        if nx is None:
            nx = self.numerics = numerics_for(self.opts, self.device)
        if self.window_freqs is None:
            self.window_freqs = precompute_freqs_cis(a.rope_head_dim, a.max_seq_len, a.rope_theta, nx=nx,
                                                     device=self.device)
        if self.compress_freqs is None:
            self.compress_freqs = precompute_freqs_cis(
                a.rope_head_dim, a.max_seq_len, a.compress_rope_theta, a.original_seq_len, a.rope_factor,
                a.beta_fast, a.beta_slow, nx=nx, device=self.device)

    @property
    def act_dtype(self) -> torch.dtype:
        """Activations and caches: bf16 as in the official code, fp32 in golden numerics."""
        return self.numerics.act_dtype

    @property
    def keep_expert_layouts(self) -> bool:
        """Whether a routed expert keeps what is derived from its weights between calls: on the CPU, unless
        streamed from disk (off the CPU a step derives only what it selects, see the numerics)."""
        return torch.device(self.device).type == "cpu" and not self.streamed

    def per_position(self, fn, x: torch.Tensor, *args, dim: int = 1):
        """fn(x, *args), in an extend call evaluated one position (index along `dim`) at a time; tensor args
        are sliced alike. Tensor outputs (or tuples of them) are concatenated back. Batch size 1 (the
        speculative loop's): the gate's token axis is then the position axis."""
        if not self.decode_shapes or x.shape[dim] == 1 or self.numerics.rows_independent:
            return fn(x, *args)
        outs = [fn(x.narrow(dim, i, 1), *(a.narrow(dim, i, 1) if torch.is_tensor(a) else a for a in args))
                for i in range(x.shape[dim])]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(t, dim=dim) for t in zip(*outs))
        return torch.cat(outs, dim=dim)

    def freqs_for(self, layer_id: int) -> torch.Tensor:
        ratio = self.args.compress_ratios[layer_id]
        return self.compress_freqs if ratio > 0 else self.window_freqs
