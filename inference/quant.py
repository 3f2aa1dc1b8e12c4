"""Number formats and the pure-torch kernels that define the reference numerics (spec numerics.md).

Every function here reproduces the rounding points of the official TileLang kernels; a GPU backend may
replace them (inference/kernels.py is the single dispatch point), never change them.
"""
import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
C448 = torch.tensor(1.0 / 448.0, dtype=torch.float32).item()  # fl32(1/448), multiplied, not divided
C6 = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()      # fl32(1/6)

# E2M1 code -> value (bit 3 = sign, low 3 bits = magnitude index), spec numerics.md §1.
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def ceil_pow2(y: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= y for positive normal fp32 y, from the bits (never a rounding cast)."""
    bits = y.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def ue8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte e -> 2^(e-127) in fp32 (byte 0 is 2^-127, not zero)."""
    if s.dtype == torch.float8_e8m0fnu:
        s = s.view(torch.uint8)
    out = (s.to(torch.int32) << 23).view(torch.float32)
    return torch.where(s == 0, 2.0 ** -127, out)  # byte 0 is the fp32 subnormal 2^-127


def float_to_ue8m0(s: torch.Tensor) -> torch.Tensor:
    """Exact power of two (fp32) -> UE8M0 storage."""
    bits = (s.float().contiguous().view(torch.int32) >> 23) & 0xFF
    return bits.to(torch.uint8).view(torch.float8_e8m0fnu)


def _group(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.unflatten(-1, (x.shape[-1] // block, block))


def act_quant(x: torch.Tensor, block: int = 32):
    """Per-`block` FP8 quantization along the last dim with power-of-two scales.

    Returns (q float8_e4m3fn [..., K], s fp32 [..., K/block]).
    """
    g = _group(x.float(), block)                                   # [..., K/b, b]
    amax = g.abs().amax(-1).clamp_min(1e-4)
    s = ceil_pow2(amax * C448)                                     # [..., K/b]
    q = (g / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


def fp8_qdq_(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """In-place FP8 fake-quant (window KV): x <- bf16(e4m3(x/s) * s)."""
    q, s = act_quant(x, block)
    x.copy_((_group(q.float(), block) * s.unsqueeze(-1)).flatten(-2))
    return x


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] to the E2M1 grid, ties to the even code
    (0.25->0, 0.75->1, 2.5->2, ...)."""
    a = v.abs()
    r = torch.where(a <= 0.25, 0.0,
        torch.where(a < 0.75, 0.5,
        torch.where(a <= 1.25, 1.0,
        torch.where(a < 1.75, 1.5,
        torch.where(a <= 2.5, 2.0,
        torch.where(a < 3.5, 3.0,
        torch.where(a <= 5.0, 4.0, 6.0)))))))
    return torch.copysign(r, v)


def fp4_qdq_e8m0_(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """In-place FP4 fake-quant with power-of-two scales per 32 (indexer queries and keys)."""
    g = _group(x.float(), block)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    s = ceil_pow2(amax * C6)
    v = (g / s).clamp(-FP4_MAX, FP4_MAX)
    x.copy_((e2m1_round(v) * s).flatten(-2))
    return x


def fp4_qdq_e4m3_(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """In-place FP4 fake-quant with E4M3 scales per 16 (compressed KV latents); s is not a power of two."""
    g = _group(x.float(), block)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -9)
    s = (amax / 6.0).clamp_max(FP8_MAX).to(torch.float8_e4m3fn).float()
    v = (g / s).clamp(-FP4_MAX, FP4_MAX)
    x.copy_((e2m1_round(v) * s).flatten(-2))
    return x


def unpack_fp4(w: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 [N, K/2] (low nibble = even element) -> fp32 values [N, K]."""
    b = w.view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2).long()   # [N, K]
    table = torch.tensor(E2M1_TABLE, dtype=torch.float32, device=w.device)
    return table[codes]


def dequant_fp8_weight(w: torch.Tensor, s: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E4M3 [N, K] with UE8M0 [ceil(N/b), ceil(K/b)] block scales -> fp32 [N, K] (exact)."""
    n, k = w.shape
    sf = ue8m0_to_float(s).repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.float() * sf


def dequant_fp4_weight(w: torch.Tensor, s: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP4 [N, K/2] with UE8M0 [N, K/32] row scales -> fp32 [N, K] (exact)."""
    return unpack_fp4(w) * ue8m0_to_float(s).repeat_interleave(block, 1)


def block_scaled_gemm(x: torch.Tensor, w_deq: torch.Tensor, block: int = 32, max_bytes: int = 1 << 27):
    """FP8 x FP8 / FP8 x FP4 GEMM semantics: act_quant(x), exact per-32 block products summed in fp32,
    block partials added in increasing K order, output rounded to bf16.

    `w_deq` is the dequantized fp32 weight [N, K]; with power-of-two activation scales the scaled block
    products are the same numbers the kernel forms.
    """
    q, s = act_quant(x, block)
    a = (_group(q.float(), block) * s.unsqueeze(-1))                # [..., K/b, b]
    lead = a.shape[:-2]
    a = a.reshape(-1, a.shape[-2], block).transpose(0, 1)           # [K/b, M, b]
    n = w_deq.shape[0]
    wb = w_deq.view(n, -1, block).permute(1, 2, 0)                  # [K/b, b, N]
    kb, m = a.shape[0], a.shape[1]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    rows = max(1, max_bytes // max(1, kb * n * 4))
    for r0 in range(0, m, rows):
        parts = torch.bmm(a[:, r0:r0 + rows], wb)                   # [K/b, rows, N]
        acc = parts[0].clone()
        for i in range(1, kb):
            acc += parts[i]
        out[r0:r0 + rows] = acc
    return out.to(torch.bfloat16).view(*lead, n)
