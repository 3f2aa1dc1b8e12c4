"""Sampling as the official runtime does it: Gumbel-max over fp32 probabilities (docs/numerics.md §11)."""
from typing import Optional

import torch


def sample(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator] = None,
           invariant: bool = False):
    """logits [..., V] fp32 -> ids [...]. T = 0: argmax (first maximal index)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    if invariant:
        # The same law from invariant pieces: the softmax, and Exp(1) noise as -log(U) of the generator's
        # uniform bits (exponential_ evaluates its log with the vector unit's rounding).
        from .kernels import invariant as inv
        probs = inv.softmax(logits.float() / max(temperature, 1e-5), -1)
        u = torch.rand(probs.shape, generator=generator, dtype=torch.float64, device=probs.device)
        noise = (-inv._log64(1.0 - u)).float()
        return probs.div_(noise).argmax(dim=-1)
    probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1, dtype=torch.float32)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return probs.div_(noise).argmax(dim=-1)
