"""Sampling as the official runtime does it: Gumbel-max over fp32 probabilities (docs/numerics.md §11)."""
from typing import Optional

import torch


def sample(logits: torch.Tensor, temperature: float, nx, generator: Optional[torch.Generator] = None):
    """logits [..., V] fp32 -> ids [...]. T = 0: argmax (first maximal index). The softmax and the Exp(1)
    noise come from the model's numerics `nx`."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = nx.softmax(logits.float() / max(temperature, 1e-5), -1)
    return probs.div_(nx.exponential_like(probs, generator)).argmax(dim=-1)
