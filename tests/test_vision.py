"""Vision path (docs/architecture.md §10): geometry, preprocessing, token spans, image loading,
ViT + Aligner."""
import base64
import copy
import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from inference.config import ModelArgs
from inference.vision import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, Aligner, ImageCountError,
                              ImageLoadError, VisionTransformer, encode_image, expand_image_tokens,
                              image_geometry, image_span_embeddings, image_token_types, load_image,
                              prepare_vl_inputs, preprocess_image)

# ---------------------------------------------------------------------------------------------------------
# Geometry (docs/architecture.md §10.1)
# ---------------------------------------------------------------------------------------------------------

# Worked sizes (docs/architecture.md §10.1): W0 x H0 -> (bh, bw), ViT grid, LLM grid, tokens.
SPEC_TABLE = [
    (640, 480, (490, 644), (35, 46), (12, 16), 206),
    (1920, 1080, (966, 1708), (69, 122), (23, 41), 968),
    (4000, 3000, (1134, 1512), (81, 108), (27, 36), 1001),
    (100, 100, (546, 546), (39, 39), (13, 13), 184),
    (300, 5000, (4900, 294), (350, 21), (117, 7), 938),
    (20000, 50, (56, 20006), (4, 1429), (2, 477), 958),
    (50, 20000, (16800, 42), (1200, 3), (400, 1), 802),
]


@pytest.mark.parametrize("w0,h0,b,vit,llm,tokens", SPEC_TABLE)
def test_geometry_spec_table(w0, h0, b, vit, llm, tokens):
    assert image_geometry(w0, h0, ModelArgs()) == (*b, *vit, *llm, tokens)


# Edge cases, worked by hand from the steps of docs/architecture.md §10.1 (released config: M = 1024,
# min_pixels = 544²).
EDGE_CASES = [
    # 1x1: f = 544 -> 544x544 -> 39x39 patches.
    (1, 1, None, (546, 546, 39, 39, 13, 13, 184)),
    # 1x1000: f = sqrt(295.936) = 17.2028 -> int 17 x int 17202.79 = 17202 (truncation) -> 2 x 1229 patches.
    (1, 1000, None, (17206, 28, 1229, 2, 410, 1, 822)),
    # 10000²: 715² patches is too many; solver w_f = h_f = 31.47 -> beta = 31*42/1e4 -> 1302.
    (10000, 10000, None, (1302, 1302, 93, 93, 31, 31, 994)),
    # 16x30000: 1432 tokens; rho = 1875 -> w_f = 0.39 < 1 -> (511*42, 42).
    (16, 30000, None, (21462, 42, 1533, 3, 511, 1, 1024)),
    # 10x20000: upscaled to 12x24328 (f = 1.2164), 1162 tokens, then the w_f < 1 branch.
    (10, 20000, None, (21462, 42, 1533, 3, 511, 1, 1024)),
    # 60000x16: 1432 tokens; h_f = 0.52 < 1 -> (42, 1021*42).
    (60000, 16, None, (42, 42882, 3, 3063, 1, 1021, 1024)),
    # max_wh_ratio 2: 2000x500 is clipped to 1000x500 -> 72x36 patches.
    (2000, 500, 2.0, (504, 1008, 36, 72, 12, 24, 302)),
    (1500, 1000, 2.0, (1008, 1512, 72, 108, 24, 36, 890)),
]


@pytest.mark.parametrize("w0,h0,ratio,expected", EDGE_CASES)
def test_geometry_edge_cases(w0, h0, ratio, expected):
    assert image_geometry(w0, h0, ModelArgs(vision_max_wh_ratio=ratio)) == expected


@pytest.mark.parametrize("w0,h0", [(1, 1), (7, 3), (13, 10000), (10000, 13), (544, 544), (543, 545),
                                   (5000, 5000), (100000, 3), (3, 100000), (1025, 1023), (2**15, 2**14)])
def test_geometry_invariants(w0, h0):
    args = ModelArgs()
    bh, bw, vh, vw, lh, lw, n = image_geometry(w0, h0, args)
    assert bh == 14 * vh and bw == 14 * vw and vh > 0 and vw > 0
    assert (lh, lw) == (math.ceil(vh / 3), math.ceil(vw / 3))
    assert n == lh * (lw + 1) + 2 <= args.vision_max_n_token


def _noise_image(w, h, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}.get(mode)
    shape = (h, w, channels) if channels else (h, w)
    return Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8), mode)


@pytest.mark.parametrize("w0,h0", [(640, 480), (100, 100), (300, 5000)])
def test_preprocess_shapes(w0, h0):
    args = ModelArgs()
    bh, bw, vh, vw, lh, lw, n = image_geometry(w0, h0, args)
    im = preprocess_image(_noise_image(w0, h0), args)
    assert im.patches.shape == (vh * vw, 3, 14, 14) and im.patches.dtype == torch.bfloat16
    assert (im.n_vit_h, im.n_vit_w, im.n_llm_h, im.n_llm_w, im.n_tokens) == (vh, vw, lh, lw, n)


def test_preprocess_patch_order_and_normalisation():
    # 644x490 is already its own bucket, so pad leaves the pixels unchanged.
    img = _noise_image(644, 490, seed=1)
    im = preprocess_image(img, ModelArgs())
    assert (im.n_vit_h, im.n_vit_w) == (35, 46)
    px = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).double()  # [3, 490, 644]
    expected = ((px / 255 - 0.5) / 0.5).to(torch.bfloat16)
    for y, x in [(0, 0), (0, 45), (1, 0), (17, 23), (34, 45)]:
        block = expected[:, 14 * y:14 * y + 14, 14 * x:14 * x + 14]
        assert torch.equal(im.patches[y * 46 + x], block), (y, x)
    flat = Image.new("RGB", (644, 490), (0, 127, 255))
    p = preprocess_image(flat, ModelArgs()).patches
    assert p[:, 0].eq(-1).all() and p[:, 2].eq(1).all()
    assert p[:, 1].eq(torch.tensor((127 / 255 - 0.5) / 0.5).bfloat16()).all()


def test_preprocess_pad_vs_plain_resize():
    grey = torch.tensor((127 / 255 - 0.5) / 0.5).bfloat16()
    red = Image.new("RGB", (400, 100), (255, 0, 0))
    # Released config: aspect-preserving pad -> the bucket (112 x 406 after upscaling) gets grey bars.
    padded = preprocess_image(red, ModelArgs(vision_min_pixels=1000))
    assert (padded.n_vit_h, padded.n_vit_w) == (8, 29)
    assert padded.patches[:, 1].eq(grey).any()
    # W0 >= ratio * H0 with the ratio set: plain resize to the bucket, no grey anywhere.
    resized = preprocess_image(red, ModelArgs(vision_min_pixels=1000, vision_max_wh_ratio=2.0))
    assert (resized.n_vit_h, resized.n_vit_w) == (8, 15)
    assert resized.patches[:, 0].eq(1).all() and resized.patches[:, 1].eq(-1).all()


# ---------------------------------------------------------------------------------------------------------
# Token spans (docs/architecture.md §10.2)
# ---------------------------------------------------------------------------------------------------------

def test_image_token_types():
    assert image_token_types(2, 3) == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]
    assert image_token_types(1, 1) == [IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END]
    assert len(image_token_types(12, 16)) == 206


def test_expand_image_tokens():
    args = ModelArgs(vision_n_layers=1)
    t = args.image_token_id
    ids, types, starts = expand_image_tokens([5, t, 6, 7, t], [(1, 2), (2, 1)], args)
    assert starts == [1, 8]
    assert ids == [5] + [t] * 5 + [6, 7] + [t] * 6
    assert types == [TEXT, 0, 1, 1, 2, 3, TEXT, TEXT, 0, 1, 2, 1, 2, 3]
    assert expand_image_tokens([1, 2], [], args) == ([1, 2], [TEXT, TEXT], [])


def test_expand_count_errors():
    args = ModelArgs(vision_n_layers=1)
    t = args.image_token_id
    with pytest.raises(ImageCountError, match="2 image placeholder.*1 image"):
        expand_image_tokens([t, 1, t], [(1, 1)], args)
    with pytest.raises(ImageCountError, match="0 image placeholder"):
        expand_image_tokens([1, 2], [(1, 1)], args)
    with pytest.raises(ImageCountError, match="vision is disabled"):
        expand_image_tokens([t], [(1, 1)], ModelArgs(vision_n_layers=0))
    # The count check runs before any image is read.
    with pytest.raises(ImageCountError):
        prepare_vl_inputs([t, t], ["/nonexistent/a.png"], args)


def test_prepare_vl_inputs(tmp_path):
    args = ModelArgs(vision_n_layers=1, vision_min_pixels=1000)
    t = args.image_token_id
    path = tmp_path / "a.png"
    _noise_image(112, 70).save(path)
    ids, types, images = prepare_vl_inputs([9, t, 10], [{"type": "image", "url": str(path)}], args)
    assert len(images) == 1 and images[0].start == 1
    assert (images[0].n_llm_h, images[0].n_llm_w) == (2, 3)
    assert ids == [9] + [t] * 10 + [10] and types[1:11] == image_token_types(2, 3)


def test_image_span_embeddings():
    rows = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    s, nl, e = torch.full((4,), -1.0), torch.full((4,), -2.0), torch.full((4,), -3.0)
    span = image_span_embeddings(rows, 2, 3, s.bfloat16(), nl.bfloat16(), e.bfloat16())
    assert span.dtype == torch.bfloat16 and span.shape == (10, 4)
    types = image_token_types(2, 3)
    assert span[[i for i, k in enumerate(types) if k == IMAGE]].float().equal(rows)
    assert span[[i for i, k in enumerate(types) if k == IMAGE_NEW_LINE]].eq(-2).all()
    assert span[0].eq(-1).all() and span[-1].eq(-3).all() and types[-1] == IMAGE_END


# ---------------------------------------------------------------------------------------------------------
# Image loading (docs/architecture.md §10.1)
# ---------------------------------------------------------------------------------------------------------

def _png_bytes(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_load_image_sources(tmp_path):
    img = _noise_image(20, 10, seed=3)
    raw = _png_bytes(img)
    b64 = base64.b64encode(raw).decode()
    path = tmp_path / "x.png"
    path.write_bytes(raw)
    records = [raw, {"data": raw}, {"data": b64}, {"source": {"type": "base64", "data": b64}},
               {"source": {"type": "url", "url": str(path)}}, {"url": f"data:image/png;base64,{b64}"},
               {"url": str(path)}, {"url": {"url": str(path)}}, {"url": f"file://{path}"}, str(path), img]
    want = np.asarray(img)
    for rec in records:
        got = load_image(rec)
        assert got.mode == "RGB" and np.array_equal(np.asarray(got), want), type(rec)
    # Other modes are converted to RGB.
    assert load_image(_png_bytes(_noise_image(5, 4, mode="RGBA"))).mode == "RGB"
    assert load_image(_png_bytes(_noise_image(5, 4, mode="L"))).mode == "RGB"


def test_load_image_errors(tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"this is not an image")
    with pytest.raises(ImageLoadError, match="broken.png.*cannot decode"):
        load_image({"url": str(bad)}, index=2)
    with pytest.raises(ValueError, match="image 0.*missing.png.*not found"):
        load_image({"url": str(tmp_path / "missing.png")}, index=0)
    with pytest.raises(ImageLoadError, match="base64"):
        load_image({"data": "@@@ not base64 @@@"})
    with pytest.raises(ImageLoadError, match="data: URL must be base64"):
        load_image({"url": "data:image/png,abcd"})
    with pytest.raises(ImageLoadError, match="no 'data', 'source' or 'url'"):
        load_image({"type": "image"})
    with pytest.raises(ImageLoadError, match="not found"):
        load_image(base64.b64encode(b"garbage").decode())  # a bare str is a path or URL, not base64
    with pytest.raises(ImageLoadError, match="cannot decode"):
        load_image({"data": base64.b64encode(b"garbage").decode()})
    with pytest.raises(ImageLoadError, match="image 1.*cannot decode"):
        prepare_vl_inputs([129264] * 2, [_png_bytes(_noise_image(4, 4)), b"xx"], ModelArgs(vision_n_layers=1))


# ---------------------------------------------------------------------------------------------------------
# ViT + Aligner (docs/architecture.md §10.3, §10.4)
# ---------------------------------------------------------------------------------------------------------

SMALL = dict(vision_n_layers=2, vision_dim=256, vision_n_heads=4, vision_inter_dim=96, dim=128,
             vision_min_pixels=1000)


class _Tower(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.vision = VisionTransformer(args)
        self.aligner = Aligner(args)


def _random_tower(args, seed=0):
    tower = _Tower(args)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1 + 0.2 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            else:
                p.copy_(r / math.sqrt(p.size(1)))
    return tower


class _Reference:
    """Straightforward float64 ViT + Aligner; `rnd` is applied at the bf16 rounding points (or identity)."""

    def __init__(self, sd, args, rnd):
        self.w = {k: v.double() for k, v in sd.items()}
        self.args, self.rnd = args, rnd
        self.dim, self.n_heads, self.p = args.vision_dim, args.vision_n_heads, args.vision_patch_size
        self.hd = self.dim // self.n_heads

    def norm(self, x, name):
        return self.rnd(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.w[name + ".weight"])

    def linear(self, x, name, bias=True):
        return self.rnd(x @ self.w[name + ".weight"].T + (self.w[name + ".bias"] if bias else 0))

    def patch_embed(self, px):
        # A strided convolution over the normalised pixels px [3, bh, bw].
        dim, p = self.dim, self.p
        kernel = self.w["vision.patch_embed.proj.weight"].view(dim, 3, p, p)
        x = F.conv2d(px[None].double(), kernel, self.w["vision.patch_embed.proj.bias"], stride=p)
        return self.rnd(x[0].flatten(1).T)                                              # [N, dim]

    def rope(self, t, nh, nw):
        # Complex rotation of (dim i, dim i + hd/2) by angle i of [y * f_0.., x * f_0..].
        hd = self.hd
        inv_f = torch.tensor([self.args.vision_rope_theta ** (-2 * i / (hd // 2)) for i in range(hd // 4)],
                             dtype=torch.float64)
        ys, xs = torch.meshgrid(torch.arange(nh), torch.arange(nw), indexing="ij")
        angles = torch.cat([ys.reshape(-1, 1) * inv_f, xs.reshape(-1, 1) * inv_f], dim=1)   # [N, hd/2]
        rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]                     # [N, 1, hd/2]
        z = torch.complex(t[..., :hd // 2], t[..., hd // 2:]) * rot
        return self.rnd(torch.cat([z.real, z.imag], dim=-1))

    def attn_core(self, qkv, nh, nw):
        # [N, 3*dim] -> RoPE on q, k -> softmax(q k^T / sqrt(hd)) v, fp32-exact softmax, one rounding.
        dim, hd = self.dim, self.hd
        q, k, v = (qkv[:, j * dim:(j + 1) * dim].reshape(-1, self.n_heads, hd) for j in range(3))
        q, k = self.rope(q, nh, nw), self.rope(k, nh, nw)
        scores = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(hd)
        return self.rnd(torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)).reshape(-1, dim)

    def mlp_act(self, g):
        gate, up = g[:, :self.args.vision_inter_dim], g[:, self.args.vision_inter_dim:]
        return self.rnd(self.rnd(gate * torch.sigmoid(gate)) * up)

    def block(self, x, i, nh, nw):
        b = f"vision.blocks.{i}."
        o = self.attn_core(self.linear(self.norm(x, b + "norm1"), b + "attn.wqkv"), nh, nw)
        x = self.rnd(x + self.linear(o, b + "attn.wo"))
        g = self.linear(self.norm(x, b + "norm2"), b + "mlp.w1", bias=False)
        return self.rnd(x + self.linear(self.mlp_act(g), b + "mlp.w2", bias=False))

    def aligner(self, x, nh, nw):
        # Explicit 3x3 gather with zero padding: f[c*9 + ky*3 + kx] = grid[3i + ky, 3j + kx, c].
        dim = self.dim
        grid = x.view(nh, nw, dim)
        lh, lw = math.ceil(nh / 3), math.ceil(nw / 3)
        f = torch.zeros(lh * lw, dim * 9, dtype=torch.float64)
        for i in range(lh):
            for j in range(lw):
                for ky in range(3):
                    for kx in range(3):
                        if 3 * i + ky < nh and 3 * j + kx < nw:
                            f[i * lw + j, torch.arange(dim) * 9 + ky * 3 + kx] = grid[3 * i + ky, 3 * j + kx]
        h = self.linear(f, "aligner.w1")
        h = self.rnd(0.5 * h * (1 + torch.erf(h / math.sqrt(2))))
        return self.linear(h, "aligner.w2")

    def __call__(self, px):
        nh, nw = px.size(1) // self.p, px.size(2) // self.p
        x = self.patch_embed(px)
        for i in range(self.args.vision_n_layers):
            x = self.block(x, i, nh, nw)
        return self.aligner(self.norm(x, "vision.norm"), nh, nw)


def _pixels(img):
    return (torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).double() / 255 - 0.5) / 0.5


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def tower_and_images():
    args = ModelArgs(**SMALL)
    # 112x70 and 98x56 are their own buckets (no resize): 5x8 and 4x7 patches, both padded by the aligner.
    imgs = [_noise_image(112, 70, seed=5), _noise_image(98, 56, seed=6)]
    return args, _random_tower(args), imgs


def test_vit_aligner_fp32_matches_reference(tower_and_images):
    # The same module in fp32 against the float64 reference without rounding: checks layouts and conventions.
    args, tower, imgs = tower_and_images
    tower32 = copy.deepcopy(tower).float()
    sd = tower.state_dict()
    for img in imgs:
        im = preprocess_image(img, args)
        px = _pixels(img)
        patches = torch.stack([px[:, 14 * y:14 * y + 14, 14 * x:14 * x + 14]
                               for y in range(im.n_vit_h) for x in range(im.n_vit_w)]).float()
        with torch.no_grad():
            got = encode_image(tower32.vision, tower32.aligner, patches, im.n_vit_h, im.n_vit_w)
        want = _Reference(sd, args, rnd=lambda t: t)(_pixels(img))
        assert got.dtype == torch.float32 and got.shape == (im.n_llm_h * im.n_llm_w, args.dim)
        assert _rel(got, want) < 1e-5


def _bf16(t):
    return t.to(torch.bfloat16).double()


def test_vit_aligner_bf16_end_to_end(tower_and_images):
    # Two bf16 chains that differ in one rounding decision decorrelate from there on, so end to end the
    # distance is the bf16 noise of the whole chain (~0.5%), whatever the reference; the stage test below
    # is the tight one.
    args, tower, imgs = tower_and_images
    sd = tower.state_dict()
    for img in imgs:
        im = preprocess_image(img, args)
        with torch.no_grad():
            got = encode_image(tower.vision, tower.aligner, im.patches, im.n_vit_h, im.n_vit_w)
        assert got.dtype == torch.bfloat16 and got.shape == (im.n_llm_h * im.n_llm_w, args.dim)
        want = _Reference(sd, args, rnd=_bf16)(_bf16(_pixels(img)))
        assert _rel(got, want) < 2e-2


def test_vit_aligner_bf16_stages(tower_and_images):
    # Every stage of the bf16 path, fed its own captured bf16 input, against the reference stage that rounds
    # at the same points: differences are isolated last-bit flips from the GEMM summation order.
    # SDPA runs on the math backend, whose rounding points (fp32 softmax, bf16 output) the reference follows;
    # CPU/GPU flash kernels round the probabilities to bf16 as well (~1 ulp more).
    args, tower, imgs = tower_and_images
    ref = _Reference(tower.state_dict(), args, rnd=_bf16)
    io_of = {}

    def record(name):
        return lambda module, inputs, output: io_of.__setitem__(name, (inputs[0].double(), output.double()))

    hooks = [m.register_forward_hook(record(name)) for name, m in tower.named_modules() if name]
    try:
        for img in imgs:
            im = preprocess_image(img, args)
            nh, nw = im.n_vit_h, im.n_vit_w
            with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
                encode_image(tower.vision, tower.aligner, im.patches, nh, nw)
            checks = [(io_of["vision.patch_embed"][1], ref.patch_embed(_bf16(_pixels(img))))]
            for i in range(args.vision_n_layers):
                b = f"vision.blocks.{i}."
                x, out = io_of[b[:-1]]
                for name in ["norm1", "norm2"]:
                    checks.append((io_of[b + name][1], ref.norm(io_of[b + name][0], b + name)))
                for name, bias in [("attn.wqkv", True), ("attn.wo", True),
                                   ("mlp.w1", False), ("mlp.w2", False)]:
                    checks.append((io_of[b + name][1], ref.linear(io_of[b + name][0], b + name, bias)))
                checks += [
                    (io_of[b + "attn.wo"][0], ref.attn_core(io_of[b + "attn.wqkv"][1], nh, nw)),
                    (io_of[b + "norm2"][0], _bf16(x + io_of[b + "attn.wo"][1])),
                    (io_of[b + "mlp.w2"][0], ref.mlp_act(io_of[b + "mlp.w1"][1])),
                    (out, _bf16(io_of[b + "norm2"][0] + io_of[b + "mlp.w2"][1])),
                ]
            checks.append((io_of["vision.norm"][1], ref.norm(io_of["vision.norm"][0], "vision.norm")))
            checks.append((io_of["aligner"][1], ref.aligner(io_of["aligner"][0], nh, nw)))
            for k, (got, want) in enumerate(checks):
                assert _rel(got, want) < 1e-3, f"stage {k}"
    finally:
        for h in hooks:
            h.remove()


def test_encode_is_per_image(tower_and_images):
    args, tower, imgs = tower_and_images
    a, b = (preprocess_image(img, args) for img in imgs)
    alone = encode_image(tower.vision, tower.aligner, a.patches, a.n_vit_h, a.n_vit_w)
    encode_image(tower.vision, tower.aligner, b.patches, b.n_vit_h, b.n_vit_w)
    again = encode_image(tower.vision, tower.aligner, a.patches.clone(), a.n_vit_h, a.n_vit_w)
    assert torch.equal(alone, again)


def test_released_names_shapes_dtypes_on_meta():
    args = ModelArgs(vision_n_layers=32, dim=5120)
    with torch.device("meta"):
        tower = _Tower(args)
    params = dict(tower.named_parameters())
    assert len(params) == 263
    expected = {
        "vision.patch_embed.proj.weight": (1024, 588), "vision.patch_embed.proj.bias": (1024,),
        "vision.norm.weight": (1024,),
        "aligner.w1.weight": (5120, 9216), "aligner.w1.bias": (5120,),
        "aligner.w2.weight": (5120, 5120), "aligner.w2.bias": (5120,),
    }
    for i in range(32):
        b = f"vision.blocks.{i}."
        expected.update({
            b + "norm1.weight": (1024,), b + "norm2.weight": (1024,),
            b + "attn.wqkv.weight": (3072, 1024), b + "attn.wqkv.bias": (3072,),
            b + "attn.wo.weight": (1024, 1024), b + "attn.wo.bias": (1024,),
            b + "mlp.w1.weight": (5632, 1024), b + "mlp.w2.weight": (1024, 2816),
        })
    assert {k: tuple(v.shape) for k, v in params.items()} == expected
    for k, v in params.items():
        assert v.is_meta
        assert v.dtype == (torch.float32 if "norm" in k else torch.bfloat16), k
    # A forward on meta tensors runs (shape check without memory).
    with torch.device("meta"):
        out = encode_image(tower.vision, tower.aligner, torch.empty(35 * 46, 3, 14, 14, dtype=torch.bfloat16),
                           35, 46)
    assert out.shape == (12 * 16, 5120) and out.dtype == torch.bfloat16
