"""RoPE tables (plain and YaRN) and the interleaved-pair rotation of the language model
(docs/architecture.md §7). The powers, the table's cos / sin and the rotation come from the model's numerics
(`nx`), whose orders evaluate them differently."""
import math

import torch


def precompute_freqs_cis(rope_dim: int, max_seq_len: int, base: float, original_seq_len: int = 0,
                         factor: float = 1.0, beta_fast: int = 32, beta_slow: int = 1, *, nx,
                         device=None) -> torch.Tensor:
    """Rotation table for positions < max_seq_len (nx.rope_table: complex64 [max_seq_len, rope_dim/2], or an
    order's own layout of the same values); YaRN whenever original_seq_len > 0 (no mscale)."""
    if device is not None and torch.device(device).type == "meta":
        # A memory plan needs the shape only (and meta arange / outer go through decompositions that import
        # torch._dynamo: a second of start-up, and a hold on the process group past its destruction).
        return nx.rope_table(torch.empty(rope_dim // 2, device="meta"), max_seq_len)
    freqs = 1.0 / nx.pow(base, torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim)
    if original_seq_len > 0:
        def corr(rot):  # dimension index at which `rot` full rotations happen over the original context
            return rope_dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
        span = max(high - low, 0.001)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device=device) - low) / span).clamp(0, 1)
        smooth = 1 - ramp
        # This exact form (not ramp itself) is what the reference computes; it can differ by an ulp.
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return nx.rope_table(freqs, max_seq_len)


def apply_rotary_(x: torch.Tensor, freqs_cis: torch.Tensor, nx, inverse: bool = False) -> torch.Tensor:
    """Rotate the last rope_dim dims of x [B, S, ..., rope_dim] in place; freqs_cis: S rows of the table
    [S, ...], or each row's own [B, S, ...] (rows at their own positions). A table row is [n] complex or
    [n, 2] real (the numerics' layout).

    Pairs (2i, 2i+1) are complex numbers multiplied by e^{+-j theta} in fp32, rounded back to x's dtype.
    """
    b, s = x.shape[:2]
    lead = freqs_cis.dim() - (1 if freqs_cis.is_complex() else 2)          # 1: [S, ...]; 2: [B, S, ...]
    tail = freqs_cis.shape[lead:]
    f = freqs_cis.view(b if lead == 2 else 1, s, *([1] * (x.dim() - 3)), *tail)
    x.copy_(nx.rotate(x.float().unflatten(-1, (-1, 2)), f, inverse).flatten(-2))
    return x
