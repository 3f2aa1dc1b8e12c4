"""RoPE tables (plain and YaRN) and the interleaved-pair rotation of the language model
(docs/architecture.md §7)."""
import math

import torch


def precompute_freqs_cis(rope_dim: int, max_seq_len: int, base: float, original_seq_len: int = 0,
                         factor: float = 1.0, beta_fast: int = 32, beta_slow: int = 1,
                         device=None, invariant: bool = False) -> torch.Tensor:
    """Complex64 table [max_seq_len, rope_dim/2]; YaRN whenever original_seq_len > 0 (no mscale).

    invariant: the frequencies' powers and the table's cos / sin evaluated in fp64 from basic operations and
    rounded once to fp32 (a vectorised fp32 pow, cos or sin may round its last bit differently on another
    instruction set), returned as a real table [max_seq_len, rope_dim/2, 2]."""
    if device is not None and torch.device(device).type == "meta":
        # A memory plan needs the shape only (and meta arange / outer go through decompositions that import
        # torch._dynamo: a second of start-up, and a hold on the process group past its destruction).
        if invariant:
            return torch.empty(max_seq_len, rope_dim // 2, 2, device="meta")
        return torch.empty(max_seq_len, rope_dim // 2, dtype=torch.complex64, device="meta")
    if invariant:
        from .kernels.invariant import pow_
        exps = (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim).double()
        freqs = (1.0 / pow_(base, exps).float()).to(device)
    else:
        freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
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
    if invariant:
        from .kernels.invariant import rope_table
        return rope_table(freqs, max_seq_len).to(device)
    t = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last rope_dim dims of x [B, S, ..., rope_dim] in place; freqs_cis [S, rope_dim/2].

    Pairs (2i, 2i+1) are complex numbers multiplied by e^{+-j theta} in fp32, rounded back to x's dtype.
    """
    b, s = x.shape[:2]
    if not freqs_cis.is_complex():               # an invariant table [S, rope_dim/2, 2] of cos, sin
        from .kernels.invariant import rotate
        f = freqs_cis.view(1, s, *([1] * (x.dim() - 3)), -1, 2)
        x.copy_(rotate(x.float().unflatten(-1, (-1, 2)), f, inverse).flatten(-2))
        return x
    f = freqs_cis.view(1, s, *([1] * (x.dim() - 3)), -1)
    if inverse:
        f = f.conj()
    z = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    x.copy_(torch.view_as_real(z * f).flatten(-2))
    return x
