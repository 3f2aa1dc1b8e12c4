"""Sampling as the official runtime does it: Gumbel-max over fp32 probabilities (docs/numerics.md §11)."""
from typing import Optional

import torch


def sample(logits: torch.Tensor, temperature: float, nx, generator: Optional[torch.Generator] = None,
           top_p: float = 1.0):
    """logits [..., V] fp32 -> ids [...]. T = 0: argmax (first maximal index). The softmax and the Exp(1)
    noise come from the model's numerics `nx`. top_p < 1 (a project addition, for the server): only the
    most likely tokens whose probabilities sum to top_p stay candidates (nucleus sampling)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = nx.softmax(logits.float() / max(temperature, 1e-5), -1)
    if top_p < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True)
        outside = ranked.cumsum(-1) - ranked > top_p        # the mass before a token already reaches top_p
        probs = probs.scatter(-1, order, ranked.masked_fill(outside, 0.0))
    return probs.div_(nx.exponential_like(probs, generator)).argmax(dim=-1)
