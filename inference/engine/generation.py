"""The generate loop: prefill, decode step and the batched loop around them, as the official runtime runs
them (prompts right-padded in one buffer; prefill up to the shortest prompt, then one position per step,
longer prompts teacher-forced). Prefill and decode step are separate functions so each can be read and timed
alone (runner.py runs a batch of prepared prompts through this loop, or the speculative one). A step hook
(on_step) lets a caller see each step's tokens and end the loop: the chat (chat.py) prints its reply and
stops on Ctrl-C that way."""
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..sampling import sample
from .batch import Budget, PromptBatch, prompt_buffer, read_completions
from .errors import InputError
from .prefill import prefill
from .prompts import check_prompt_lengths


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
def generate(model, batch: PromptBatch, budget: Budget, stats: Optional[Stats] = None, graphs=None,
             on_step: Optional[StepHook] = None) -> Tuple[List[List[int]], List[str]]:
    """Batched generation, prompts right-padded as in the official loop; the prefill in calls of at most
    budget.prefill_chunk positions; decode steps replayed from CUDA graphs with `graphs` (a
    cuda_graph.GraphedDecode). `on_step(next_ids)` runs after every step on every rank (for printing and a
    StopFlag); when it returns True the loop ends there.

    Returns per prompt the completion ids (EOS excluded, at most budget.max_new_tokens) and the finish reason
    ("eos", "length", or "interrupted" for a row that on_step stopped early).
    """
    stats = stats if stats is not None else Stats()
    args, eos_id = model.args, budget.eos_id
    device = next(model.parameters()).device
    lens = [len(t) for t in batch.ids]
    check_prompt_lengths(lens, args.max_seq_len)
    total_len = min(args.max_seq_len, budget.max_new_tokens + max(lens))
    bsz, shortest = len(batch.ids), min(lens)

    try:
        tokens, types = prompt_buffer(batch.ids, total_len, device, batch.token_types)
    except ValueError as e:
        raise InputError(str(e)) from None
    in_prompt = tokens != -1
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)

    prev, stopped = 0, False
    for cur in range(shortest, total_len):
        if cur == shortest:
            next_ids, _, _ = _timed(stats, "prefill", bsz * cur, device, prefill, model, tokens[:, :cur],
                                    token_types=None if types is None else types[:, :cur],
                                    images=batch.images, chunk=budget.prefill_chunk)
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

    return read_completions(tokens, lens, budget.max_new_tokens, eos_id, stopped)
