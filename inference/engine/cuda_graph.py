"""CUDA graphs for decode steps: the default for generation on a GPU (`--eager` turns them off).

A decode step's shapes are fixed by the batch, but what it reads grows with the position: the window ring is
allocated whole, the compressed KV and the index keys grow by a row per group. So the captured step runs at a
tensor position (`Transformer.forward(..., step=DecodeStep)`: every position-dependent index is computed on
the device) and reads a *length bucket*, the smallest power of two above the position (at least MIN_BUCKET,
at most max_seq_len), its compressed rows past the position masked out of the index scores. One graph per
(batch size, bucket, parity of the position): a ratio-2 layer completes a group at odd positions only, and
then writes and publishes what it does not at even ones. A graph is captured the first time its key is met:
the step runs once on a side stream (that run is the step's result, and it builds what the layers derive from
their weights), then it is captured, reading its ids and position from static input buffers; every graph
allocates from one shared memory pool, which the memory plan counts (memory.graph_pool_bytes). A replay
copies the ids and the position into those buffers and writes the caches in place, as the eager step does.

Ties: which of several exactly tied index scores torch.topk keeps depends on the row's length, and the
bucket's rows are longer than the eager step's, so graphs imply deterministic top-k (ties broken by the
lowest index, the same in both). Numbers: the masked tensor-position step then gives the eager step's bits
(tests/test_cuda_graph.py, on CPU, in the exact, fast and invariant orders); a replay against eager logits,
bit for bit, is the device check's `cudagraph` phase (inference/tools/gpu_check/cudagraph.py).

Where a run cannot replay its decode steps from graphs (eager_reason: experts or Engram rows computed on the
host, scoring, speculative verification), generate.py says so in one line and runs them eagerly.
"""
import time
from dataclasses import replace
from typing import Dict, Optional, Tuple

import torch

from ..sampling import sample
from ..state import DecodeStep
from .errors import InputError

MIN_BUCKET = 256


def bucket(pos: int, max_seq_len: int, minimum: int = MIN_BUCKET) -> int:
    """The length bucket of a decode step at `pos`: the smallest power of two > pos (>= minimum), at most
    max_seq_len."""
    length = minimum
    while length <= pos:
        length *= 2
    return min(length, max_seq_len)


def eager_reason(device: str, opts, args, scoring: bool = False, speculative: bool = False) -> Optional[str]:
    """Why the decode steps of a run on `device` with RuntimeOptions `opts` and ModelArgs `args` cannot be
    replayed from CUDA graphs, in a few words; None when they can."""
    if not str(device).startswith("cuda"):
        return f"CUDA graphs need a CUDA device, not {device}"
    if opts.experts_on != "device":
        return "--experts-on host computes the routed experts on the host, between the GPU's kernels"
    if args.engram_layer_ids and opts.engram_on != "device":
        return f"--engram-on {opts.engram_on} looks the Engram rows up on the host"
    if scoring:
        return "scoring runs its forward calls as they come"
    if speculative:
        return "speculative decoding verifies drafts in calls of several positions"
    return None


def choose_graphs(requested: Optional[bool], device: str, opts, args, log, scoring: bool = False,
                  speculative: bool = False):
    """Whether a run's decode steps replay from CUDA graphs, and the RuntimeOptions they run with (graphs
    imply deterministic top-k). `requested`: None for the default (graphs on a GPU), True for --cuda-graph,
    False for --eager. A default run that cannot use them says why through `log` and runs eagerly; an
    explicit --cuda-graph that cannot is an InputError."""
    if requested is False:
        return False, opts
    why = eager_reason(device, opts, args, scoring, speculative)
    if why is None:
        return True, replace(opts, deterministic_topk=True)
    if requested:
        raise InputError(f"--cuda-graph: {why}")
    if str(device).startswith("cuda"):
        log(f"CUDA graphs off: {why}; decode steps run eagerly")
    return False, opts


class GraphedDecode:
    """Decode steps of `model` through CUDA graphs: `graphs(ids [B, 1], pos)` -> (next ids [B], logits
    [B, V]), as `generation.decode_step` returns them. `captured` graphs so far, in `capture_s` seconds."""

    def __init__(self, model):
        device = torch.device(model.ctx.device)
        if not model.ctx.opts.deterministic_topk:
            raise InputError("--cuda-graph needs --deterministic-topk: which of several tied index scores "
                             "torch.topk keeps depends on the row's length, and a graph reads a bucket's")
        why = eager_reason(device.type, model.ctx.opts, model.args)
        if why:
            raise InputError(f"--cuda-graph: {why}")
        self.model, self.device = model, device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: Dict[Tuple[int, int, int], tuple] = {}
        self.captured, self.capture_s = 0, 0.0

    def summary(self) -> str:
        return (f"CUDA graphs: {self.captured} captured in {self.capture_s:.1f} s "
                f"(batch, length bucket, parity: {', '.join(map(str, sorted(self.graphs)))})")

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, pos: int):
        key = (ids.shape[0], bucket(pos, self.model.args.max_seq_len), pos % 2)
        if key not in self.graphs:
            return self._capture(key, ids, pos)
        graph, static_ids, static_pos, out = self.graphs[key]
        static_ids.copy_(ids)
        static_pos.fill_(pos)
        graph.replay()
        return out[0].clone(), out[1].clone()

    def _step(self, ids: torch.Tensor, step: DecodeStep):
        """The step a graph holds: the model's decode at the tensor position, then the sampling."""
        logits = self.model.decode(ids, step).logits
        return sample(logits, self.model.args.temperature, self.model.nx), logits

    def _capture(self, key, ids: torch.Tensor, pos: int):
        start = time.perf_counter()
        batch, length, parity = key
        static_ids = ids.to(self.device).clone()
        static_pos = torch.full((), pos, dtype=torch.long, device=self.device)
        step = DecodeStep(static_pos, parity, length)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):                    # the step itself, eagerly: its result is returned
            next_ids, logits = self._step(static_ids, step)
            result = next_ids.clone(), logits.clone()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):   # recorded, not run
            next_ids, logits = self._step(static_ids, step)
        self.graphs[key] = (graph, static_ids, static_pos, (next_ids, logits))
        self.captured += 1
        self.capture_s += time.perf_counter() - start
        return result
