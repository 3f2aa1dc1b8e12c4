"""The official generate loop's batch layout, shared by generate.py's generate() and the speculative loop:
prompts left-aligned in a [B, total_len] buffer padded with -1, completions read back from it; what a batch
is (PromptBatch) and how far it runs (Budget)."""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch


@dataclass(frozen=True)
class PromptBatch:
    """The prompts of one batch: each one's ids, and when any has images, each one's token types (TEXT = -1)
    and its [ImageInput] (None for both in a batch of text)."""
    ids: List[List[int]]
    token_types: Optional[List[List[int]]] = None
    images: Optional[list] = None


@dataclass(frozen=True)
class Budget:
    """How far a batch runs: at most max_new_tokens a row, a row ends at eos_id; the prefill in calls of at
    most prefill_chunk positions (None: one call)."""
    max_new_tokens: int
    eos_id: int
    prefill_chunk: Optional[int] = None


def prompt_buffer(prompts: List[List[int]], total_len: int, device,
                  token_types: Optional[List[List[int]]] = None):
    """-> ids [B, total_len] (-1 past each prompt) and token types [B, total_len] (TEXT = -1) or None.
    Images are merged in the prefill only, which ends at the shortest prompt: a span past it is an error."""
    tokens = torch.full((len(prompts), total_len), -1, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    if token_types is None:
        return tokens, None
    types = torch.full_like(tokens, -1)
    for b, t in enumerate(token_types):
        types[b, :len(t)] = torch.tensor(t, dtype=torch.long)
    if (types[:, min(len(p) for p in prompts):] >= 0).any():
        raise ValueError("image spans must fit in the prefill chunk (the shortest prompt of the batch)")
    return tokens, types


def read_completions(tokens: torch.Tensor, lens: List[int], max_new_tokens: int, eos_id: int,
                     stopped: bool = False) -> Tuple[List[List[int]], List[str]]:
    """Per row: the ids after its prompt (at most max_new_tokens, EOS excluded) and the finish reason,
    "eos" or "length", or "interrupted" when the loop was `stopped` early (a step hook asked) before the row
    ended either way."""
    completions, reasons = [], []
    for b, row in enumerate(tokens.tolist()):
        row = [t for t in row[lens[b]:lens[b] + max_new_tokens] if t != -1]
        if eos_id in row:
            completions.append(row[:row.index(eos_id)])
            reasons.append("eos")
        else:
            completions.append(row)
            reasons.append("interrupted" if stopped and len(row) < max_new_tokens else "length")
    return completions, reasons
