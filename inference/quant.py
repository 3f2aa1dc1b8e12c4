"""Number formats: E4M3 / UE8M0 / E2M1 constants, scale conversions, FP4 unpacking and weight dequantization.

The kernels that use them (activation quantization, the cache round trips, the block-scaled GEMM) live in
inference/kernels/: reference.py (CPU-exact), fast.py (loop-free), invariant.py and tilelang_ops.py (GPU),
each behind its order's class of the one numerics interface (inference/kernels/numerics.py).
"""
import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
C448 = torch.tensor(1.0 / 448.0, dtype=torch.float32).item()  # fl32(1/448), multiplied, not divided
C6 = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()      # fl32(1/6)

# E2M1 code -> value (bit 3 = sign, low 3 bits = magnitude index).
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def e2m1_values(device=None, dtype=torch.float32) -> torch.Tensor:
    """E2M1_TABLE as a tensor on `device`, computed there from the codes (no copy from the host, so it can be
    made inside a captured CUDA graph): magnitude index m < 2 -> m / 2, else 2^(m/2 - 1) (1 + (m odd) / 2)."""
    c = torch.arange(16, device=device)
    m = c & 7
    mag = torch.where(m < 2, m * 0.5, torch.pow(2.0, (m >> 1) - 1) * (1 + (m & 1) * 0.5))
    return torch.where(c >= 8, -mag, mag).to(dtype)


class CodeTables:
    """The formats' decode tables on one device, made once (a model's numerics hold them, so that no step
    rebuilds one): the E2M1 values [16], and byte -> (low nibble's value, high nibble's value) [256, 2] fp32,
    which unpacks two FP4 codes per byte in one lookup."""

    def __init__(self, device=None):
        if device is not None and torch.device(device).type == "meta":    # a memory plan: shapes only
            self.e2m1, self.e2m1_pairs, self.e2m1_bounds = (torch.empty(*s, device="meta")
                                                            for s in ((16,), (256, 2), (7,)))
            self.e2m1_pairs_bf16 = torch.empty(256, 2, dtype=torch.bfloat16, device="meta")
            return
        self.e2m1 = e2m1_values(device)                                            # [16] fp32
        b = torch.arange(256, device=device)
        self.e2m1_pairs = torch.stack([self.e2m1[b & 0xF], self.e2m1[b >> 4]], dim=-1)   # [256, 2]
        self.e2m1_pairs_bf16 = self.e2m1_pairs.bfloat16()   # the same values (exact in bf16)
        mags = self.e2m1[:8]
        self.e2m1_bounds = (mags[:-1] + mags[1:]) / 2        # [7] the midpoints between E2M1 magnitudes

    def fp4(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """FP4 codes, two per byte (uint8 or float4_e2m1fn_x2) [..., C] -> values [..., 2C] in `dtype`, low
        nibble first."""
        table = {torch.float32: self.e2m1_pairs, torch.bfloat16: self.e2m1_pairs_bf16}.get(dtype)
        if table is None:
            table = self.e2m1_pairs.to(dtype)
        return table[packed.view(torch.uint8).int()].flatten(-2)


def ceil_pow2(y: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= y for positive normal fp32 y, from the bits (never a rounding cast)."""
    bits = y.float().contiguous().view(torch.int32)
    # a non-zero mantissa carries into the exponent; the mask keeps the exponent alone
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


# For amax = 1.m x 2^e, amax / top in fp32 (divided, or multiplied by fl(1 / top): the same) is at most
# 2^(e - shift) while the mantissa bits m <= threshold, and above it past that: its smallest power of two >=
# is 2^(e - shift), or twice that (tests/test_numerics.py checks every mantissa against ceil_pow2).
_POW2_OVER = {FP8_MAX: (0x600000, 8), FP4_MAX: (0x400000, 2)}     # top -> (threshold, shift)


def pow2_scale(amax: torch.Tensor, floor: float, top: float) -> torch.Tensor:
    """ceil_pow2(max(amax, floor) / top) for fp32 amax >= 0 and top 448 or 6 (floor >= top x 2^-126, so that
    the quotient is a normal number): the same powers of two as the clamp, the division and ceil_pow2, in
    three operations on amax's bits (the clamp; an add that carries into the exponent exactly when the
    quotient's mantissa would be non-zero, the exponent lowered by `shift` at once; the mask). Finite amax
    only: NaN or inf give some power of two, not NaN or inf."""
    threshold, shift = _POW2_OVER[top]
    bits = amax.clamp_min(floor).view(torch.int32)
    return ((bits + (0x7FFFFF - threshold - (shift << 23))) & 0x7F800000).view(torch.float32)


def block_amax(g: torch.Tensor) -> torch.Tensor:
    """max |g| over the last dim in fp32 (exact): [..., b] -> [..., 1]."""
    if g.is_cuda:        # one launch
        return torch.linalg.vector_norm(g, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    return g.abs().amax(-1, keepdim=True).float()    # torch's CPU max-norm over 32 values is ~2x slower


def fp8_block_codes(g: torch.Tensor, amax: torch.Tensor):
    """act_quant's rounding of blocks g [..., b] with their maxima amax [..., 1] fp32 (block_amax, or one
    max-norm): (E4M3 codes of g / s [..., b], s [..., 1] fp32), s the smallest power of two >= max(amax,
    1e-4) / 448. No clamp before the cast: |g / s| <= 448 but for the rounding of amax / 448, and torch's E4M3
    cast gives 448 there as the clamp would. The quotient is formed in fp32 and rounded to E4M3 as it is
    stored (one kernel on a GPU; a temporary and a copy on the CPU)."""
    s = pow2_scale(amax, 1e-4, FP8_MAX)
    return torch.div(g, s, out=torch.empty(g.shape, dtype=torch.float8_e4m3fn, device=g.device)), s


def ue8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte e -> 2^(e-127) in fp32 (byte 0 is the fp32 subnormal 2^-127, not zero; 255 is NaN): torch's
    own conversion of float8_e8m0fnu, exact."""
    return s.view(torch.float8_e8m0fnu).float()


def float_to_ue8m0(s: torch.Tensor) -> torch.Tensor:
    """Exact power of two (fp32) -> UE8M0 storage."""
    bits = (s.float().contiguous().view(torch.int32) >> 23) & 0xFF
    return bits.to(torch.uint8).view(torch.float8_e8m0fnu)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] to the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even code
    (0.25->0, 0.75->1, 2.5->2, ...). E2M1 keeps one mantissa bit: in the binade [2^e, 2^(e+1)) the grid's
    step is 2^(e-1), below 1 (the subnormal codes) 0.5. |v| / step rounded half to even and multiplied back
    is exact, and an even multiple of the step is the even code."""
    a = v.abs()
    binade = (a.view(torch.int32) & 0x7F800000).view(torch.float32)       # 2^floor(log2 |v|), 0 for 0
    step = (binade * 0.5).clamp_min(0.5)
    return torch.copysign(torch.round(a / step) * step, v)


def unpack_fp4(w: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 [N, K/2] (low nibble = even element) -> fp32 values [N, K]."""
    b = w.view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2).long()   # [N, K]
    return e2m1_values(w.device)[codes]


def dequant_fp8_weight(w: torch.Tensor, s: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E4M3 [N, K] with UE8M0 [ceil(N/b), ceil(K/b)] block scales -> fp32 [N, K] (exact)."""
    n, k = w.shape
    sf = ue8m0_to_float(s).repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.float() * sf


def dequant_fp4_weight(w: torch.Tensor, s: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP4 [N, K/2] with UE8M0 [N, K/32] row scales -> fp32 [N, K] (exact)."""
    return unpack_fp4(w) * ue8m0_to_float(s).repeat_interleave(block, 1)
