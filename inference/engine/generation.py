"""The generate loop: prefill, decode step and the batched loop around them, as the official runtime runs
them (prompts right-padded in one buffer; prefill up to the shortest prompt, then one position per step,
longer prompts teacher-forced). Prefill and decode step are separate functions so each can be read and timed
alone; `complete` runs a batch of prepared prompts, plainly or with DSpark speculative decoding. A step hook
(on_step) lets a caller see each step's tokens and end the loop: the chat (chat.py) prints its reply and
stops on Ctrl-C that way."""
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..sampling import sample
from .batch import prompt_buffer, read_completions
from .errors import InputError
from .prefill import prefill
from .prompts import Completion, Prompt, check_prompt_lengths, finish_completion, vision_inputs
from .speculative import SpecStats, speculative_generate_batch


@dataclass
class Stats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    def add(self, phase: str, tokens: int, seconds: float) -> None:
        """Count `tokens` and `seconds` to the "prefill" or the "decode" phase."""
        if phase == "prefill":
            self.prefill_tokens += tokens
            self.prefill_s += seconds
        else:
            self.decode_tokens += tokens
            self.decode_s += seconds

    def summary(self) -> str:
        def rate(n, s):
            return f"{n} tokens in {s:.2f} s ({n / s:.1f} tokens/s)" if s > 0 else f"{n} tokens"
        return (f"prefill: {rate(self.prefill_tokens, self.prefill_s)}; "
                f"decode: {rate(self.decode_tokens, self.decode_s)}")



def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def next_ids_of(model, logits: torch.Tensor, temperature: Optional[float] = None) -> torch.Tensor:
    """The ids sampled from logits [..., V] fp32 at `temperature` (None: the config's; 0 = argmax), with the
    model's numerics (the softmax and the Exp(1) noise depend on the order)."""
    return sample(logits, model.args.temperature if temperature is None else temperature, model.nx)


def decode_step(model, ids: torch.Tensor, pos: int,
                temperature: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """ids [B, 1] at position pos -> (sampled next ids [B], logits [B, V])."""
    logits = model.decode(ids, pos).logits
    return next_ids_of(model, logits, temperature), logits


def _timed(stats: Stats, phase: str, n_tokens: int, device: torch.device, fn: Callable, *args, **kw):
    start = time.perf_counter()
    out = fn(*args, **kw)
    _sync(device)
    stats.add(phase, n_tokens, time.perf_counter() - start)
    return out


StepHook = Callable[[torch.Tensor], bool]   # the ids [B] just chosen -> stop now?


@torch.inference_mode()
def generate(model, prompt_tokens: List[List[int]], max_new_tokens: int, eos_id: int,
             prompt_token_types: Optional[List[List[int]]] = None, images: Optional[list] = None,
             stats: Optional[Stats] = None, prefill_chunk: Optional[int] = None,
             graphs=None, on_step: Optional[StepHook] = None) -> Tuple[List[List[int]], List[str]]:
    """Batched generation, prompts right-padded as in the official loop; the prefill in calls of at most
    `prefill_chunk` positions (None: one call); decode steps replayed from CUDA graphs with `graphs` (a
    cuda_graph.GraphedDecode). `on_step(next_ids)` runs after every step on every rank (for printing and a
    StopFlag); when it returns True the loop ends there.

    Returns per prompt the completion ids (EOS excluded, at most max_new_tokens) and the finish reason
    ("eos", "length", or "interrupted" for a row that on_step stopped early).
    """
    stats = stats if stats is not None else Stats()
    args = model.args
    device = next(model.parameters()).device
    lens = [len(t) for t in prompt_tokens]
    check_prompt_lengths(lens, args.max_seq_len)
    total_len = min(args.max_seq_len, max_new_tokens + max(lens))
    bsz, shortest = len(prompt_tokens), min(lens)

    try:
        tokens, types = prompt_buffer(prompt_tokens, total_len, device, prompt_token_types)
    except ValueError as e:
        raise InputError(str(e)) from None
    in_prompt = tokens != -1
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)

    prev, stopped = 0, False
    for cur in range(shortest, total_len):
        if cur == shortest:
            next_ids, _, _ = _timed(stats, "prefill", bsz * cur, device, prefill, model, tokens[:, :cur],
                                    token_types=None if types is None else types[:, :cur], images=images,
                                    chunk=prefill_chunk)
        else:
            step = decode_step if graphs is None else lambda _, ids, pos: graphs(ids, pos)
            next_ids, _ = _timed(stats, "decode", bsz, device, step, model, tokens[:, prev:cur], prev)
        # Rows still inside their prompt keep the prompt token (teacher forcing).
        next_ids = torch.where(in_prompt[:, cur], tokens[:, cur], next_ids)
        tokens[:, cur] = next_ids
        finished |= ~in_prompt[:, cur] & (next_ids == eos_id)
        prev = cur
        stop = on_step is not None and on_step(next_ids)   # every rank calls it at every step (a collective)
        if finished.all():
            break
        if stop:
            stopped = cur < total_len - 1
            break

    return read_completions(tokens, lens, max_new_tokens, eos_id, stopped)



@dataclass
class SpecOptions:
    """Speculative decoding with the DSpark draft head (see speculative.py)."""
    temperature: float
    k: Optional[int] = None                    # drafts verified per step (default: the block size)
    verify: str = "chunked"                    # chunked | sequential
    min_confidence: Optional[float] = None


def complete(model, prompts: List[Prompt], max_new_tokens: int, eos_id: int, stats: Stats,
             spec: Optional[SpecOptions] = None, spec_stats: Optional[SpecStats] = None,
             prefill_chunk: Optional[int] = None, graphs=None,
             on_step: Optional[StepHook] = None) -> Tuple[List[List[int]], List[str]]:
    """One batch of prepared prompts -> completion ids and finish reasons. Timings go to `stats`; with `spec`
    the speculative loop runs instead of plain decoding and its statistics are added to `spec_stats`.
    `on_step`: see generate(); the speculative loop calls it once per committed position."""
    types, images = vision_inputs(prompts)
    if spec is None:
        return generate(model, [p.ids for p in prompts], max_new_tokens, eos_id, prompt_token_types=types,
                        images=images, stats=stats, prefill_chunk=prefill_chunk, graphs=graphs,
                        on_step=on_step)
    try:
        completions, reasons, st = speculative_generate_batch(
            model, [p.ids for p in prompts], max_new_tokens, eos_id, spec.temperature, spec.k, spec.verify,
            spec.min_confidence, token_types=types, images=images, prefill_chunk=prefill_chunk,
            on_step=on_step)
    except ValueError as e:
        raise InputError(str(e)) from None
    if spec_stats is not None:
        spec_stats.add(st)
    stats.add("prefill", st.prefill_tokens, st.prefill_s)
    stats.add("decode", max(0, st.new_tokens - len(prompts)), st.decode_s)   # first tokens: the prefill's
    return completions, reasons


@dataclass
class Runner:
    """A loaded model and what the batches of one run share: the budget, EOS, timings, the speculative
    options and statistics, and the JSONL record file (rank 0 only; None elsewhere)."""
    model: Any
    tokenizer: Any
    max_new_tokens: int
    eos_id: int
    spec: Optional[SpecOptions] = None
    stats: Stats = field(default_factory=Stats)
    spec_stats: Optional[SpecStats] = None
    records: Any = None
    rank: int = 0
    prefill_chunk: Optional[int] = None       # positions per prefill call (None: one call)
    graphs: Any = None                        # --cuda-graph: decode steps as CUDA graphs (cuda_graph.py)
    busy_s: float = 0.0                       # seconds inside run(): generating, not waiting for input

    def __post_init__(self):
        if self.spec is not None and self.spec_stats is None:
            self.spec_stats = SpecStats()

    def finish(self, seconds: float, label: str = "total") -> List[str]:
        """Close what the run opened; the summary lines: timings (`label` `seconds`), the weight stream's
        figures, speculation."""
        if self.records is not None:
            self.records.close()
        lines = [f"{self.stats.summary()}; {label} {seconds:.2f} s"]
        if self.graphs is not None:
            lines.append(self.graphs.summary())
        if self.model.weight_stream is not None:
            lines.append(self.model.weight_stream.close())
        if self.spec is not None:
            k = self.spec.k or self.model.args.dspark_block_size
            lines.append(self.spec_stats.summary(self.spec.verify, k))
        return lines

    def run_all(self, prompts: List[Prompt], max_batch_size: int):
        """-> (prompt, completion or None off rank 0), in order. Prompts with images run one at a time (every
        span must fit in the prefill chunk), text prompts in batches of max_batch_size."""
        size = 1 if any(p.images for p in prompts) else max_batch_size
        for start in range(0, len(prompts), size):
            chunk = prompts[start:start + size]
            yield from zip(chunk, self.run(chunk, [f"prompt {start + n + 1}" for n in range(len(chunk))]))

    def run(self, prompts: List[Prompt], names: List[str], always_warn: bool = False,
            on_step: Optional[StepHook] = None) -> List[Optional[Completion]]:
        """One batch on every rank; rank 0 gets the parsed completions (and writes their records), the
        other ranks None. Unparsable replies get a warning when they ended with EOS, or always_warn.
        on_step: see generate()."""
        start = time.perf_counter()
        try:
            ids, reasons = complete(self.model, prompts, self.max_new_tokens, self.eos_id, self.stats,
                                    self.spec, self.spec_stats, self.prefill_chunk, self.graphs, on_step)
        finally:
            self.busy_s += time.perf_counter() - start
        if self.rank != 0:
            return [None] * len(prompts)
        done = []
        for prompt, completion, reason, name in zip(prompts, ids, reasons, names):
            c = finish_completion(self.tokenizer, prompt, completion, reason, name,
                                  always_warn or reason == "eos", self.max_new_tokens)
            if self.records is not None:
                self.records.write(json.dumps(c.record, ensure_ascii=False) + "\n")
                self.records.flush()
            done.append(c)
        return done
