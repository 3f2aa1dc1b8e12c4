"""KV caches kept in their true low-precision formats; every read gives back exactly the bf16 values written.

The model rounds every value before it enters a cache: window KV (and the DSpark rings) to FP8 E4M3 with a
power-of-two scale per 32 values, compressed KV latents to FP4 E2M1 with an E4M3 scale per 16, indexer keys
to FP4 E2M1 with a power-of-two scale per 32 (all dims, the RoPE dims included). A bf16 buffer spends 2
bytes on each of those values; a PackedCache stores the codes and one scale byte per group: 528 instead of
1,024 bytes per 512-wide window entry, 288 instead of 1,024 per compressed entry, 68 instead of 256 per
128-wide index key.

Encoding starts from the rounded bf16 values themselves, so it needs no access to the scale the model
computed: any scale that puts every value of a group on the code grid gives the same values back, and one
of a few candidates always does (power-of-two scales: the smallest power of two >= amax / max code, which
only rescales the codes by powers of two; E4M3 scales: amax / 6, amax / 4 or the smallest scale 2^-9,
because the group's largest value always rounds to code 6 or 4 unless the scale was clamped to 2^-9).
Every write is checked bit for bit: a value off the grid (a kernel that rounds differently) is an error,
never a silent change (on a GPU an asynchronous device assertion, so that a decode step waits for nothing).
One write needs no check: a decode step's window row, which the ring rounds itself as it stores it
(store_rounding: the FP8 rounding's own codes, the same values as the model's rounding). Golden numerics,
which do not round, keep plain full-precision buffers.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from .quant import FP4_MAX, FP8_MAX, CodeTables, fp8_block_codes, pow2_scale

E4M3_MIN_SCALE = 2.0 ** -9     # the smallest E4M3 scale the compressed-KV rounding uses (an all-zero group)
DECODE_CHUNK = 1 << 22         # values decoded at a time on a read


@dataclass(frozen=True)
class Format:
    codes: str          # "e4m3" (one byte per value) or "e2m1" (two values per byte, low nibble first)
    block: int          # values per scale
    scale: str          # "ue8m0" (power of two, the exponent byte) or "e4m3"


FORMATS = {
    "fp8": Format("e4m3", 32, "ue8m0"),        # window KV, DSpark rings
    "fp4_e4m3": Format("e2m1", 16, "e4m3"),    # compressed KV latents
    "fp4_ue8m0": Format("e2m1", 32, "ue8m0"),  # indexer keys
}


class CacheFormatError(RuntimeError):
    pass


def entry_bytes(fmt: str, dim: int) -> int:
    """Bytes of one packed entry of `dim` values: codes plus one scale byte per block."""
    f = FORMATS[fmt]
    return (dim if f.codes == "e4m3" else dim // 2) + dim // f.block


def _scale_value(f: Format, s: torch.Tensor) -> torch.Tensor:
    """Scale bytes [..., G] -> fp32 [..., G]."""
    return s.view(torch.float8_e8m0fnu if f.scale == "ue8m0" else torch.float8_e4m3fn).float()


def _code_values(f: Format, codes: torch.Tensor, tables: Optional[CodeTables]) -> torch.Tensor:
    """Code bytes [..., C] -> fp32 values [..., D]."""
    if f.codes == "e4m3":
        return codes.view(torch.float8_e4m3fn).float()
    return (tables or CodeTables(codes.device)).fp4(codes)


def decode(fmt: str, codes: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16,
           tables: Optional[CodeTables] = None) -> torch.Tensor:
    """Packed codes [..., C] and scale bytes [..., G] -> values [..., D] in `dtype` (the model's rounding:
    code times scale in fp32, then one cast). `tables`: the device's CodeTables (made here when not given)."""
    f = FORMATS[fmt]
    v = _code_values(f, codes, tables).unflatten(-1, (scales.shape[-1], f.block))   # [..., G, block]
    out = torch.empty(v.shape, dtype=dtype, device=v.device)       # the fp32 product rounded as it is stored
    return torch.mul(v, _scale_value(f, scales).unsqueeze(-1), out=out).flatten(-2)


def _scale_bytes(f: Format, scale: torch.Tensor) -> torch.Tensor:
    """Candidate scales [..., G] fp32 -> their bytes (a power of two: the UE8M0 cast, exact; E4M3: a cast)."""
    if f.scale == "ue8m0":
        return scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    return scale.clamp(max=FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _codes(f: Format, v: torch.Tensor, tables: CodeTables) -> torch.Tensor:
    """Scaled values v [..., D] fp32 -> code bytes [..., C]: E4M3 by the cast; E2M1 by the nearest magnitude
    (bucketize against the midpoints), the sign bit kept (-0.0 included), two codes per byte, low nibble
    first. On-grid values get their exact code; others some code, which the round trip then refuses."""
    if f.codes == "e4m3":
        return v.to(torch.float8_e4m3fn).view(torch.uint8)
    c = torch.bucketize(v.clamp(-6.0, 6.0).abs(), tables.e2m1_bounds, out_int32=True) + torch.signbit(v) * 8
    c = c.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def encode(fmt: str, x: torch.Tensor, tables: Optional[CodeTables] = None):
    """Rounded values x [..., D] -> (codes [..., C] uint8, scales [..., G] uint8) from which `decode` gives x
    back bit for bit; CacheFormatError if some group is not on the format's grid (on a GPU an asynchronous
    device assertion: no host sync).

    Scales: a power-of-two format has one candidate (the smallest power of two >= amax / max code), whose
    code times scale must give each x; an E4M3 scale has three (amax / 6, amax / 4, 2^-9), the first whose
    round trip reproduces a group wins. (The codes keep the sign of zero: comparing values suffices.)"""
    f = FORMATS[fmt]
    tables = tables or CodeTables(x.device)
    g = x.unflatten(-1, (x.shape[-1] // f.block, f.block))                            # [..., G, block]
    amax = torch.linalg.vector_norm(g, float("inf"), dim=-1, dtype=torch.float32)     # [..., G], exact
    if f.scale == "ue8m0":
        top, floor = (FP8_MAX, 1e-4) if f.codes == "e4m3" else (FP4_MAX, 6 * 2.0 ** -126)  # amax / top normal
        scale = pow2_scale(amax, floor, top)                                          # [..., G]
        codes = _codes(f, (g / scale.unsqueeze(-1)).flatten(-2), tables)              # [..., C]
        back = _code_values(f, codes, tables).unflatten(-1, g.shape[-2:]) * scale.unsqueeze(-1)   # exact
        sbytes, ok = _scale_bytes(f, scale), back.flatten(-2) == x                    # ok [..., D]
    else:
        codes, sbytes, ok = _encode_e4m3_scaled(fmt, f, g, amax, x, tables)
    message = (f"KV cache value not on the {fmt} grid: the values written were not rounded the way the cache "
               f"format assumes (a kernel that rounds differently?)")
    if x.device.type == "cpu":
        if not bool(ok.all()):
            raise CacheFormatError(message)
    else:       # checked on the device, without a host sync in the step (a failure stops the next sync)
        torch._assert_async(ok.all(), message)
    return codes, sbytes


def round_to_codes(fmt: str, x: torch.Tensor):
    """Unrounded values x [..., D] -> (codes [..., D] uint8, scale bytes [..., G]) of x rounded as the model
    rounds a window KV row (act_quant's FP8 per 32, quant.fp8_block_codes): the same values as the rounding,
    then `encode`, with nothing to check (the codes are the rounding). The "fp8" format only."""
    if fmt != "fp8":
        raise ValueError(f"round_to_codes makes the fp8 format's codes, not {fmt}'s")
    f = FORMATS[fmt]
    g = x.unflatten(-1, (x.shape[-1] // f.block, f.block))                            # [..., G, block]
    # the maxima by one max-norm on every device (a decode row is small: its operations cost more than speed)
    amax = torch.linalg.vector_norm(g, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)   # [.., G, 1]
    q, scale = fp8_block_codes(g, amax)                                              # [.., G, block], [.., 1]
    return q.view(torch.uint8).flatten(-2), _scale_bytes(f, scale.squeeze(-1))


def _encode_e4m3_scaled(fmt: str, f: Format, g: torch.Tensor, amax: torch.Tensor, x: torch.Tensor,
                        tables: CodeTables):
    """encode's candidates for an E4M3 scale: (codes, scale bytes, ok [..., G]: a group reproduced)."""
    candidates = [amax / 6, amax / 4, torch.full_like(amax, E4M3_MIN_SCALE)]
    want = x.view(torch.int16 if x.element_size() == 2 else torch.int32)
    codes = sbytes = ok = None
    for cand in reversed(candidates):            # the first candidate that reproduces a group wins
        s = _scale_bytes(f, cand)
        c = _codes(f, (g / _scale_value(f, s).unsqueeze(-1)).flatten(-2), tables)
        back = decode(fmt, c, s, x.dtype, tables).view(want.dtype)
        good = (back == want).unflatten(-1, s.shape[-1:] + (f.block,)).all(-1)       # [..., G]
        if codes is None:
            codes, sbytes, ok = c, s, good
        else:
            pick = good.repeat_interleave(c.shape[-1] // s.shape[-1], dim=-1)
            codes, sbytes, ok = torch.where(pick, c, codes), torch.where(good, s, sbytes), ok | good
    return codes, sbytes, ok


class PackedCache(nn.Module):
    """A cache of shape [*lead, D] stored as codes [*lead, C] and scale bytes [*lead, G]. Index it like the
    bf16 buffer it replaces, on the leading dims: `cache[:b, first:last] = values`, `cache[:b]`."""

    def __init__(self, shape, fmt: str, dtype=torch.bfloat16, tables: Optional[CodeTables] = None):
        """`tables`: the CodeTables of the cache's device (the model's numerics hold them)."""
        super().__init__()
        f = FORMATS[fmt]
        self.tables = tables or CodeTables(torch.empty(0).device)
        *lead, dim = shape
        if dim % f.block:
            raise ValueError(f"cache width {dim} is not a multiple of the {fmt} block {f.block}")
        self.fmt, self.dim, self.dtype = fmt, dim, dtype
        code_bytes = dim if f.codes == "e4m3" else dim // 2
        self.register_buffer("codes", torch.zeros(*lead, code_bytes, dtype=torch.uint8), persistent=False)
        self.register_buffer("scales", torch.zeros(*lead, dim // f.block, dtype=torch.uint8),
                             persistent=False)

    @property
    def shape(self) -> torch.Size:
        return torch.Size([*self.codes.shape[:-1], self.dim])

    def __getitem__(self, key) -> torch.Tensor:
        """Decode in row chunks straight into the result: the fp32 temporaries stay small whatever the
        context length."""
        codes, scales = self.codes[key], self.scales[key]
        out = torch.empty(*codes.shape[:-1], self.dim, dtype=self.dtype, device=codes.device)
        flat_c, flat_s = codes.reshape(-1, codes.shape[-1]), scales.reshape(-1, scales.shape[-1])
        flat_out = out.view(-1, self.dim)
        rows = max(1, DECODE_CHUNK // self.dim)
        if flat_out.shape[0] <= rows:
            return decode(self.fmt, codes, scales, self.dtype, self.tables)
        for r0 in range(0, flat_out.shape[0], rows):
            flat_out[r0:r0 + rows] = decode(self.fmt, flat_c[r0:r0 + rows], flat_s[r0:r0 + rows], self.dtype,
                                            self.tables)
        return out

    def __setitem__(self, key, value: torch.Tensor) -> None:
        codes, scales = encode(self.fmt, value.to(self.dtype), self.tables)
        self.codes[key] = codes
        self.scales[key] = scales

    def store_rounding(self, key, x: torch.Tensor) -> None:
        """cache[key] = x rounded as the model rounds what enters this cache, from the rounding's own codes
        (round_to_codes: the values of rounding x and storing them, without a round trip; "fp8" caches)."""
        codes, scales = round_to_codes(self.fmt, x)
        self.codes[key] = codes
        self.scales[key] = scales

    def rows(self, batch: slice, index: torch.Tensor) -> torch.Tensor:
        """cache[i, index[i, j]] for the batch rows `batch` (b of them): index [b, k] (int64, each in range)
        -> [b, k, D], only those rows decoded (a decode step reads what it attends to, whatever the
        context)."""
        return decode(self.fmt, _take(self.codes[batch], index), _take(self.scales[batch], index), self.dtype,
                      self.tables)


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [b, T, C], index [b, k] -> t[i, index[i, j]] [b, k, C]."""
    return t.gather(1, index.unsqueeze(-1).expand(-1, -1, t.shape[-1]))


def gather_rows(cache, batch: slice, index: torch.Tensor) -> torch.Tensor:
    """Rows index [b, k] (int64, in range) of the batch rows `batch` (b of them) of a cache (a PackedCache,
    or a plain [B, T, D] buffer) -> [b, k, D]."""
    if isinstance(cache, PackedCache):
        return cache.rows(batch, index)
    return _take(cache[batch], index)


def register_cache(owner: nn.Module, name: str, shape, fmt: str, ctx) -> None:
    """A plain buffer in the activation dtype (fp32 activations, which are never rounded to the formats, or
    packing turned off), else a PackedCache."""
    if ctx.keeps_full_precision_caches:
        owner.register_buffer(name, torch.zeros(*shape, dtype=ctx.act_dtype), persistent=False)
    else:
        setattr(owner, name, PackedCache(shape, fmt, tables=ctx.numerics.tables))
