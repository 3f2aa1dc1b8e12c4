"""Sampling as the official runtime does it: Gumbel-max over fp32 probabilities (numerics §13)."""
from typing import Optional

import torch


def sample(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator] = None):
    """logits [..., V] fp32 -> ids [...]. T = 0: argmax (first maximal index)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1, dtype=torch.float32)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return probs.div_(noise).argmax(dim=-1)
