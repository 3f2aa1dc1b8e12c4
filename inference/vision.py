"""Vision path (docs/architecture.md §10): image loading and resizing, image-span token layout, ViT, Aligner.

The ViT and the Aligner are replicated on every rank (no tensor parallelism). Parameters are allocated empty
(the loader fills them); build under `torch.device("meta")` to allocate nothing at all.
"""
import base64
import binascii
import io
import math
import os
import urllib.request
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps
from torch import nn

from .config import ModelArgs

# Token types (docs/architecture.md §3.2, §10.2).
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3

HTTP_TIMEOUT_S = 30
PAD_COLOR = (127, 127, 127)


class VisionError(ValueError):
    pass


class ImageLoadError(VisionError):
    pass


class ImageCountError(VisionError):
    pass


# ---------------------------------------------------------------------------------------------------------
# Image loading (docs/architecture.md §10.1)
# ---------------------------------------------------------------------------------------------------------

def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n] + "..."


def _b64decode(text: str, name: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageLoadError(f"{name}: invalid base64 data ({e})") from None


def _read_url(url: str, name: str) -> bytes:
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise ImageLoadError(f"{name}: data: URL must be base64-encoded (';base64,' missing)")
        return _b64decode(payload, name)
    if url.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as r:
                return r.read()
        except Exception as e:  # URLError, timeouts, HTTP errors: all mean "cannot read this image"
            raise ImageLoadError(f"{name}: cannot download ({e})") from None
    path = url[len("file://"):] if url.startswith("file://") else url
    try:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ImageLoadError(f"{name}: file not found") from None
    except OSError as e:
        raise ImageLoadError(f"{name}: cannot read file ({e.strerror or e})") from None


def _record_bytes(record, name: str) -> Tuple[bytes, str]:
    """Raw encoded bytes of an image record and a readable name for it."""
    if isinstance(record, (bytes, bytearray)):
        return bytes(record), f"{name} (inline data, {len(record)} bytes)"
    if isinstance(record, str):
        label = f"{name} ({_short(record)})"
        return _read_url(record, label), label
    if not isinstance(record, dict):
        raise ImageLoadError(f"{name}: unsupported image record of type {type(record).__name__}")
    data = record.get("data")
    if data:
        if isinstance(data, (bytes, bytearray)):
            return bytes(data), f"{name} (inline data, {len(data)} bytes)"
        label = f"{name} (inline base64, {len(data)} chars)"
        return (_read_url(data, label) if data.startswith("data:") else _b64decode(data, label)), label
    source = record.get("source")
    if source:
        if isinstance(source, dict):
            if source.get("data"):
                return _record_bytes({"data": source["data"]}, name)
            if source.get("url"):
                return _record_bytes(source["url"], name)
            raise ImageLoadError(f"{name}: image source has neither 'data' nor 'url'")
        return _record_bytes(source, name)
    url = record.get("url")
    if isinstance(url, dict):  # image_url blocks may carry {"url": ...}
        url = url.get("url")
    if url:
        return _record_bytes(url, name)
    raise ImageLoadError(f"{name}: image record has no 'data', 'source' or 'url'")


def load_image(record, index: Optional[int] = None) -> Image.Image:
    """Decode an image record (bytes, base64, data:/http(s)/file URL, path, dict record, PIL image) to RGB."""
    name = "image" if index is None else f"image {index}"
    if isinstance(record, Image.Image):
        return record.convert("RGB")
    data, label = _record_bytes(record, name)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image.convert("RGB")
    except Exception as e:  # Pillow raises many types (UnidentifiedImageError, OSError, bomb errors, ...)
        raise ImageLoadError(f"{label}: cannot decode image ({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------------------------------------------------
# Resizing and patches (docs/architecture.md §10.1)
# ---------------------------------------------------------------------------------------------------------

def _llm_grid(bh: int, bw: int, p: int, r: int) -> Tuple[int, int]:
    return math.ceil((bh // p) / r), math.ceil((bw // p) / r)


def _n_tokens(nh: int, nw: int) -> int:
    return nh * (nw + 1) + 2


def image_geometry(width: int, height: int, args: ModelArgs) -> Tuple[int, int, int, int, int, int, int]:
    """-> (bh, bw, n_vit_h, n_vit_w, n_llm_h, n_llm_w, n_tokens) for a decoded image of width x height."""
    p, r = args.vision_patch_size, args.vision_downsample_ratio
    cell, m = p * r, args.vision_max_n_token
    w, h = width, height
    if args.vision_max_wh_ratio is not None and w > h * args.vision_max_wh_ratio:
        w = h * args.vision_max_wh_ratio
    if 0 < w * h < args.vision_min_pixels:
        f = math.sqrt(args.vision_min_pixels / (w * h))
        w, h = int(w * f), int(h * f)  # truncation, as the official code
    bw, bh = math.ceil(w / p) * p, math.ceil(h / p) * p
    nh, nw = _llm_grid(bh, bw, p, r)
    if _n_tokens(nh, nw) > m:
        # Largest whole-cell grid of the same aspect ratio with nh * (nw + 1) + 2 <= m.
        rho = h / w
        w_f = math.sqrt((m - 2) / rho + 0.25) - 0.5
        h_f = w_f * rho
        if w_f < 1:
            bh, bw = (m - 2) // 2 * cell, cell
        elif h_f < 1:
            bh, bw = cell, (m - 3) * cell
        else:
            beta = min(math.floor(w_f) * cell / w, math.floor(h_f) * cell / h)
            bh, bw = math.floor(h * beta / p) * p, math.floor(w * beta / p) * p
        nh, nw = _llm_grid(bh, bw, p, r)
        if bh <= 0 or bw <= 0 or _n_tokens(nh, nw) > m:
            raise VisionError(f"cannot fit a {width}x{height} image into {m} tokens "
                              f"(got {bh}x{bw} pixels, {_n_tokens(nh, nw)} tokens)")
    return bh, bw, bh // p, bw // p, nh, nw, _n_tokens(nh, nw)


@dataclass
class ImageInput:
    """One preprocessed image, ready for `encode_image` and for the span of docs/architecture.md §10.2."""
    patches: torch.Tensor  # [n_vit_h * n_vit_w, 3, p, p] bf16, row-major patch order
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int
    start: int = -1        # span start in the expanded ids (set by prepare_vl_inputs)

    @property
    def n_tokens(self) -> int:
        return _n_tokens(self.n_llm_h, self.n_llm_w)


def preprocess_image(image: Image.Image, args: ModelArgs) -> ImageInput:
    image = image.convert("RGB")
    w0, h0 = image.size
    bh, bw, n_vit_h, n_vit_w, n_llm_h, n_llm_w, _ = image_geometry(w0, h0, args)
    ratio = args.vision_max_wh_ratio
    if ratio is not None and w0 >= ratio * h0:
        image = image.resize((bw, bh))
    else:
        image = ImageOps.pad(image, (bw, bh), color=PAD_COLOR)
    v = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)  # [3, bh, bw]
    v = v.float() / 255
    v = ((v - 0.5) / 0.5).to(torch.bfloat16)
    p = args.vision_patch_size
    patches = v.view(3, n_vit_h, p, n_vit_w, p).permute(1, 3, 0, 2, 4)  # [n_vit_h, n_vit_w, 3, p, p]
    patches = patches.reshape(n_vit_h * n_vit_w, 3, p, p)
    return ImageInput(patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w)


# ---------------------------------------------------------------------------------------------------------
# Token layout and prompt expansion (docs/architecture.md §10.2)
# ---------------------------------------------------------------------------------------------------------

def image_token_types(n_llm_h: int, n_llm_w: int) -> List[int]:
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]


def check_image_count(n_placeholders: int, n_images: int, args: ModelArgs) -> None:
    if (n_placeholders or n_images) and args.vision_n_layers <= 0:
        raise ImageCountError(f"the prompt has {n_placeholders} image placeholder(s) and {n_images} "
                              f"image(s) were given, but vision is disabled (vision_n_layers = 0)")
    if n_placeholders != n_images:
        raise ImageCountError(f"the prompt has {n_placeholders} image placeholder(s) "
                              f"(token id {args.image_token_id}) but {n_images} image(s) were given")


def expand_image_tokens(ids: Sequence[int], grids: Sequence[Tuple[int, int]], args: ModelArgs):
    """Replace the i-th `image_token_id` in ids by image i's span.

    grids: (n_llm_h, n_llm_w) per image. Returns (expanded ids, token types, span start per image).
    """
    tid = args.image_token_id
    check_image_count(sum(1 for t in ids if t == tid), len(grids), args)
    out_ids, types, starts = [], [], []
    it = iter(grids)
    for t in ids:
        if t != tid:
            out_ids.append(t)
            types.append(TEXT)
            continue
        span = image_token_types(*next(it))
        starts.append(len(out_ids))
        out_ids.extend([tid] * len(span))  # every span position carries image_token_id
        types.extend(span)
    return out_ids, types, starts


def image_runs(ids: Sequence[int], token_id: int) -> List[Tuple[int, int]]:
    """[start, end) of every maximal run of `token_id` in ids."""
    runs, start = [], None
    for i, t in enumerate(list(ids) + [None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i))
            start = None
    return runs


def place_expanded_images(ids: Sequence[int], images: Sequence[ImageInput], args: ModelArgs,
                          names: Sequence[str]) -> List[int]:
    """Ids already expanded (another engine's exact tokens) and their images, in order -> token types; sets
    each image's `.start`. Image i takes the next n_llm_h * (n_llm_w + 1) + 2 positions of the current run of
    image_token_id (two images with no text between them share one run); every run must be used up exactly.
    names: how an error names image i (e.g. its path)."""
    runs = image_runs(ids, args.image_token_id)
    types = [TEXT] * len(ids)
    k = 0
    for s, e in runs:
        pos = s
        while pos < e:
            if k == len(images):
                raise ImageCountError(f"image span [{pos}, {e}) (image token id {args.image_token_id}) has "
                                      f"no image: {len(images)} image(s) given for {len(runs)} span(s) (list "
                                      f"them in 'images')")
            im = images[k]
            if pos + im.n_tokens > e:
                raise VisionError(f"image span [{s}, {e}) holds {e - pos} position(s) from {pos} for image "
                                  f"{k} ({names[k]}), whose {im.n_llm_h}x{im.n_llm_w} grid takes "
                                  f"{im.n_tokens} (n_llm_h * (n_llm_w + 1) + 2)")
            im.start = pos
            types[pos:pos + im.n_tokens] = image_token_types(im.n_llm_h, im.n_llm_w)
            pos += im.n_tokens
            k += 1
    if k < len(images):
        raise ImageCountError(f"{len(images)} image(s) given but the image spans (runs of image token id "
                              f"{args.image_token_id}) hold only {k}: image {k} ({names[k]}) has no span")
    return types


def prepare_vl_inputs(ids: Sequence[int], records: Sequence, args: ModelArgs):
    """Load and preprocess the images, expand the placeholders -> (ids, token types, [ImageInput])."""
    check_image_count(sum(1 for t in ids if t == args.image_token_id), len(records), args)  # before decoding
    images = [preprocess_image(load_image(rec, i), args) for i, rec in enumerate(records)]
    out_ids, types, starts = expand_image_tokens(ids, [(im.n_llm_h, im.n_llm_w) for im in images], args)
    for im, s in zip(images, starts):
        im.start = s
    return out_ids, types, images


# ---------------------------------------------------------------------------------------------------------
# ViT (docs/architecture.md §10.3) and Aligner (docs/architecture.md §10.4)
# ---------------------------------------------------------------------------------------------------------

class VisionLinear(nn.Module):
    """Plain bf16 linear with optional bias (replicated)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype=torch.bfloat16):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class VisionRMSNorm(nn.Module):
    """RMSNorm with an fp32 weight: normalise in fp32, multiply by the weight, cast back
    (docs/numerics.md §6)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.float()
        u = u * torch.rsqrt(u.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * u).to(x.dtype)


def vision_rope(n_h: int, n_w: int, head_dim: int, theta: float, device=None):
    """cos, sin [n_h * n_w, 1, head_dim // 2] fp32 for the 2-D split-half RoPE of a patch grid."""
    half = head_dim // 2
    inv_f = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))
    fy = torch.outer(torch.arange(n_h, dtype=torch.float32, device=device), inv_f)  # [n_h, half/2]
    fx = torch.outer(torch.arange(n_w, dtype=torch.float32, device=device), inv_f)  # [n_w, half/2]
    q = inv_f.numel()
    angles = torch.cat([fy[:, None, :].expand(n_h, n_w, q), fx[None, :, :].expand(n_h, n_w, q)], dim=-1)
    angles = angles.reshape(n_h * n_w, 1, half)
    return angles.cos(), angles.sin()


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, hd]: dim i pairs with dim i + hd/2 at angle i; fp32 math, result in x's dtype."""
    u = x.float()
    x1, x2 = u.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        p = args.vision_patch_size
        self.proj = VisionLinear(3 * p * p, args.vision_dim, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # [N, 3, p, p] -> [N, 3*p*p] in (c, y, x) order -> [N, dim]
        return self.proj(patches.flatten(1).to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.vision_n_heads
        self.head_dim = args.vision_dim // args.vision_n_heads
        self.wqkv = VisionLinear(args.vision_dim, 3 * args.vision_dim, bias=True)
        self.wo = VisionLinear(args.vision_dim, args.vision_dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        q, k, v = self.wqkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)  # each [N, H, hd]
        q, k = apply_vision_rope(q, cos, sin), apply_vision_rope(k, cos, sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))               # [1, H, N, hd]
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)    # non-causal
        return self.wo(o[0].transpose(0, 1).reshape(n, -1))                         # [N, dim]


class VisionMLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.inter_dim = args.vision_inter_dim
        self.w1 = VisionLinear(args.vision_dim, 2 * args.vision_inter_dim, bias=False)  # gate ‖ up
        self.w2 = VisionLinear(args.vision_inter_dim, args.vision_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).split(self.inter_dim, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm1 = VisionRMSNorm(args.vision_dim)
        self.attn = VisionAttention(args)
        self.norm2 = VisionRMSNorm(args.vision_dim)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """Parameters `patch_embed.*`, `blocks.{i}.*`, `norm.*` (attach as `vision` to get `vision.*` names)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vision_dim % args.vision_n_heads or (args.vision_dim // args.vision_n_heads) % 4:
            raise VisionError(f"vision_dim {args.vision_dim} / vision_n_heads {args.vision_n_heads} must be "
                              f"a head dim divisible by 4 (2-D split-half RoPE)")
        self.head_dim = args.vision_dim // args.vision_n_heads
        self.rope_theta = args.vision_rope_theta
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.vision_n_layers))
        self.norm = VisionRMSNorm(args.vision_dim)

    def forward(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """patches [n_vit_h * n_vit_w, 3, p, p] of one image -> [n_vit_h * n_vit_w, vision_dim]."""
        assert patches.size(0) == n_vit_h * n_vit_w, "patch count does not match the grid"
        x = self.patch_embed(patches)                                               # [N, dim]
        cos, sin = vision_rope(n_vit_h, n_vit_w, self.head_dim, self.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """3x3 merge + MLP into the language model width (attach as `aligner`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        r = self.ratio = args.vision_downsample_ratio
        self.w1 = VisionLinear(args.vision_dim * r * r, args.dim, bias=True)
        self.w2 = VisionLinear(args.dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        r, c = self.ratio, x.size(-1)
        grid = x.view(n_vit_h, n_vit_w, c)
        grid = F.pad(grid, (0, 0, 0, -n_vit_w % r, 0, -n_vit_h % r))  # zeros at the bottom and right
        nh, nw = grid.size(0) // r, grid.size(1) // r
        # f[c * r*r + ky * r + kx] = grid[r*i + ky, r*j + kx, c]; cells row-major
        f = grid.view(nh, r, nw, r, c).permute(0, 2, 4, 1, 3).reshape(nh * nw, c * r * r)
        return self.w2(F.gelu(self.w1(f)))                                          # [nh * nw, dim]


def encode_image(vision: VisionTransformer, aligner: Aligner, patches: torch.Tensor,
                 n_vit_h: int, n_vit_w: int) -> torch.Tensor:
    """One image -> aligner rows [n_llm_h * n_llm_w, dim] (row-major cells)."""
    return aligner(vision(patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)


def image_span_embeddings(rows: torch.Tensor, n_llm_h: int, n_llm_w: int, image_start: torch.Tensor,
                          image_newline: torch.Tensor, image_end: torch.Tensor) -> torch.Tensor:
    """Embeddings of a whole span (docs/architecture.md §10.5): [n_llm_h * (n_llm_w + 1) + 2, dim] in
    image_start's dtype."""
    d, dtype = rows.size(-1), image_start.dtype
    grid = rows.to(dtype).view(n_llm_h, n_llm_w, d)
    newline = image_newline.to(dtype).view(1, 1, d).expand(n_llm_h, 1, d)
    body = torch.cat([grid, newline], dim=1).view(-1, d)                            # [n_llm_h*(n_llm_w+1), d]
    return torch.cat([image_start.view(1, d), body, image_end.to(dtype).view(1, d)])
