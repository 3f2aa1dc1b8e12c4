"""A prompt's prefill, in one forward call or in chunks.

A chunk is a forward call at start_pos > 0 with `prefill=True`: it computes what one call over the whole
prompt computes (the window ring, the compressor's open group, the index keys and the Engram history carry
over), so peak memory grows with the chunk, not with the prompt. In `--numerics invariant` the logits are the
same bits as one call's; in the other orders the GEMMs and attention lists take other shapes, a measured
distance (docs/numerics.md §16.6). Image spans are never cut: a chunk boundary that would fall inside one
moves to the span's start (or, for a span longer than the chunk, its end).
"""
from typing import Callable, List, Optional, Tuple

import torch

from ..sampling import sample
from .errors import InputError
from .memory import MemoryPlan, capacity_of


def check_chunk(chunk: Optional[int], max_seq_len: int) -> None:
    """One line for a chunk size that cannot work."""
    if chunk is None:
        return
    if chunk < 1:
        raise InputError(f"--prefill-chunk must be a positive number of tokens, got {chunk}")
    if chunk > max_seq_len:
        raise InputError(f"--prefill-chunk {chunk} is larger than --max-seq-len {max_seq_len}")


def chunk_bounds(length: int, chunk: Optional[int],
                 spans: List[Tuple[int, int]] = ()) -> List[Tuple[int, int]]:
    """[start, end) of each call prefilling positions [0, length) in chunks of at most `chunk` positions
    (None: one call), no boundary inside an image span [a, b)."""
    if chunk is None or chunk >= length:
        return [(0, length)]
    bounds, start = [], 0
    while start < length:
        end = min(start + chunk, length)
        for a, b in spans:
            if a < end < b:                                  # the boundary cuts this span
                end = a if a > start else b
        bounds.append((start, end))
        start = end
    return bounds


def image_spans(images) -> List[Tuple[int, int]]:
    """[start, end) of every image span of every row (vision.ImageInput with .start set)."""
    return sorted((img.start, img.start + img.n_tokens) for row in images or [] for img in row or [])


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, token_types: Optional[torch.Tensor] = None, images=None,
            all_logits: bool = False, chunk: Optional[int] = None,
            on_chunk: Optional[Callable[[Optional[torch.Tensor], int], None]] = None,
            temperature: Optional[float] = None):
    """ids [B, P] at positions [0, P), in calls of at most `chunk` positions (None: one call) ->
    (next ids [B] sampled at `temperature` (None: the config's), logits [B, V] of the last position or
    [B, P, V] with all_logits, main_hidden [B, s, n_targets*D] of the last call or None).
    on_chunk(main_hidden, start) runs after each call (the DSpark draft head seeds its rings there)."""
    parts = []
    spans = image_spans(images) if chunk is not None else ()
    for start, end in chunk_bounds(ids.shape[1], chunk, spans):
        types = None if token_types is None else token_types[:, start:end]
        logits, hidden = model.prefill(ids[:, start:end], start, images=images, token_types=types,
                                       all_logits=all_logits)
        if on_chunk is not None:
            on_chunk(hidden, start)
        parts.append(logits)
    t = model.args.temperature if temperature is None else temperature
    next_ids = sample(logits[:, -1] if all_logits else logits, t, model.nx)     # the engine samples
    return next_ids, torch.cat(parts, dim=1) if all_logits else logits, hidden


def prefill_chunk_for(requested: Optional[int], args, plan: Optional[MemoryPlan], device: str, log=print,
                      gpu_mem: Optional[int] = None) -> Optional[int]:
    """The positions per prefill call: `requested` (checked), else one call when the memory `plan` (rank_plan:
    the one the loader checks) lets a prompt of max_seq_len prefill in one call on this GPU (or the `gpu_mem`
    budget), else the largest chunk it allows; on a CPU one call (no memory bound is known; --prefill-chunk
    bounds the prefill's memory), and no plan is needed. Says which it chose."""
    check_chunk(requested, args.max_seq_len)
    if requested is not None:
        log(f"prefill: calls of at most {requested:,} tokens (--prefill-chunk)")
        return requested
    if not device.startswith("cuda") and gpu_mem is None:
        log(f"prefill: one call per prompt on {device} (--prefill-chunk N bounds its memory)")
        return None
    if plan is None:
        raise ValueError("prefill_chunk_for: on a GPU the default chunk needs the memory plan")
    chunk = plan.default_chunk(capacity_of(device, gpu_mem))    # the chunk tools/plan.py's verdict names
    if not chunk:                               # 0: load_model's memory check names the problem
        log(f"prefill: one call per prompt (the memory plan fits {args.max_seq_len:,} tokens x "
            f"{args.max_batch_size} rows)")
        return None
    small = f", under one window ({plan.min_chunk:,}): many calls a prompt" if chunk < plan.min_chunk else ""
    log(f"prefill: chunks of {chunk:,} tokens, the largest the memory plan fits on {device} beside a context "
        f"of {args.max_seq_len:,} tokens x {args.max_batch_size} rows{small} (--prefill-chunk N overrides)")
    return chunk
