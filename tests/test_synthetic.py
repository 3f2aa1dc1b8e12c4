"""inference/synthetic.py: released tensor inventory, HF config round trip, formats, determinism."""
import dataclasses
import glob
import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURE, ROOT, fixture_file

from inference.config import ModelArgs
from inference.safetensors_io import tensor_nbytes
from inference.tools.synthetic import (RUNTIME_FIELDS, hf_config, hf_tensor_specs, pow2_exponent, quant_fp4,
                                 write_synthetic_checkpoint)

TINY = dict(n_layers=2, n_mtp_layers=1, compress_ratios=[0, 2, 0], kv_source_layers=[1],
            index_source_layers=[1], candidate_source_layer=-1, engram_layer_ids=[1],
            engram_num_embeddings=[100], dspark_target_layer_ids=[1], original_seq_len=0,
            vision_n_layers=1, vision_dim=64, vision_n_heads=2, vision_inter_dim=96)
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def released() -> ModelArgs:
    return ModelArgs.from_file(os.path.join(ROOT, "config.json"))


def test_released_inventory():
    specs = hf_tensor_specs(released())
    assert len(specs) == 96085
    assert len({n for n, _, _ in specs}) == 96085
    assert sum(tensor_nbytes(d, s) for _, d, s in specs) == 510_286_023_000
    by_dtype = Counter()
    for _, d, s in specs:
        by_dtype[d] += tensor_nbytes(d, s)
    assert {d: round(b / 1e9, 2) for d, b in by_dtype.items()} == \
        {"I8": 278.59, "F8_E4M3": 204.02, "F8_E8M0": 23.56, "BF16": 3.95, "F32": 0.17}
    per = Counter(".".join(n.split(".")[:2]) for n, _, _ in specs if n.startswith(("layers.", "mtp.")))
    assert [per[f"layers.{i}"] for i in (0, 1, 2, 14, 20, 24)] == [2334, 2340, 2342, 2348, 2341, 2337]
    assert [per[f"mtp.{k}"] for k in range(3)] == [801, 798, 802]
    shapes = {n: (d, s) for n, d, s in specs}
    assert shapes["layers.14.engram.embed.weight"] == ("F8_E4M3", [384016682, 256])
    assert shapes["layers.14.engram.embed.scale"] == ("F8_E8M0", [384016682, 8])
    assert shapes["layers.3.ffn.experts.383.w2.weight"] == ("I8", [5120, 1152])
    assert shapes["layers.3.ffn.experts.383.w2.scale"] == ("F8_E8M0", [5120, 72])
    assert shapes["mtp.0.main_proj.scale"] == ("F8_E8M0", [160, 480])
    assert shapes["mtp.2.confidence_head.proj.weight"] == ("BF16", [1, 5376])
    assert shapes["aligner.w1.weight"] == ("BF16", [5120, 9216])


@pytest.mark.parametrize("overrides", [{}, TINY, dict(TINY, dtype="bf16", expert_dtype=None)])
def test_hf_config_round_trip(tmp_path, overrides):
    args = ModelArgs.from_dict(overrides) if overrides else released()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config(args)))
    back = ModelArgs.from_file(str(path))
    skip = set(RUNTIME_FIELDS)
    assert {k: v for k, v in dataclasses.asdict(back).items() if k not in skip} == \
        {k: v for k, v in dataclasses.asdict(args).items() if k not in skip}


def test_pow2_exponent_exact():
    amax = torch.tensor([448.0, 448.00003, 447.99997, 224.0, 1.0, 6.0, 3.0, 1e-3])
    assert pow2_exponent(amax, 448.0).tolist() == [0, 1, 0, -1, -8, -6, -7, -18]
    assert pow2_exponent(torch.tensor([6.0, 6.0000005, 3.0]), 6.0).tolist() == [0, 1, -1]


def test_fp4_round_to_nearest_even():
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.26, -0.74, -3.4, 0.0] + [0.0] * 20])
    packed, scale = quant_fp4(x)
    assert scale.tolist() == [[127]]
    u = packed.view(torch.uint8)[0]
    codes = torch.stack([u & 0xF, u >> 4], -1).view(-1)
    assert [E2M1[c] for c in codes[:12].tolist()] == [0, 1, 1, 2, 2, 4, 4, 6, -0.5, -0.5, -3, 0]


def test_write_formats_and_determinism(tmp_path):
    args = ModelArgs.from_dict(TINY)
    a, b = tmp_path / "a", tmp_path / "b"
    write_synthetic_checkpoint(args, str(a), seed=3, shards=3)
    write_synthetic_checkpoint(args, str(b), seed=3, shards=1, tokenizer_dir=str(a))
    index = json.loads((a / "model.safetensors.index.json").read_text())
    files = sorted(glob.glob(str(a / "model-*.safetensors")))
    assert [os.path.basename(f) for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    ta = {}
    for f in files:
        part = load_file(f)
        assert all(index["weight_map"][n] == os.path.basename(f) for n in part)
        ta.update(part)
    tb = load_file(str(b / "model-00001-of-00001.safetensors"))
    specs = hf_tensor_specs(args)
    assert set(ta) == set(tb) == set(index["weight_map"]) == {n for n, _, _ in specs}
    assert index["metadata"]["total_size"] == sum(tensor_nbytes(d, s) for _, d, s in specs)
    for n in ta:  # the shard count does not change any value
        assert torch.equal(ta[n].view(torch.uint8), tb[n].view(torch.uint8)) if ta[n].element_size() == 1 \
            else torch.equal(ta[n], tb[n]), n
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json", "inference/config.json"):
        assert (a / f).is_file() and (b / f).is_file()
    assert ModelArgs.from_file(str(a / "inference" / "config.json")) == args
    assert {"image_start", "layers.0.ffn.gate.bias_vl", "mtp.0.ffn.gate.bias_vl", "mtp.0.main_proj.weight",
            "vision.blocks.0.mlp.w1.weight", "mtp.0.markov_head.head.weight",
            "layers.1.engram.embed.scale"} <= set(ta)

    # FP8 32x32 blocks: the scale is the smallest power of two that fits, so block maxima are in [224, 448].
    w, s = ta["layers.0.attn.wq_b.weight"].float(), ta["layers.0.attn.wq_b.scale"].float()
    n, k = w.shape
    block_max = w.abs().view(n // 32, 32, k // 32, 32).amax(dim=(1, 3))
    assert bool((block_max >= 224).all()) and bool((block_max <= 448).all())
    deq = w * s.repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert abs(deq.std().item() * k ** 0.5 - 1) < 0.1
    # MXFP4 experts: per row and 32 inputs, the largest magnitude is 3, 4 or 6.
    u = ta["layers.0.ffn.experts.1.w2.weight"].view(torch.uint8)
    vals = torch.tensor(E2M1)[torch.stack([u & 0xF, u >> 4], -1).view(u.shape[0], -1).long()]
    group_max = vals.abs().view(vals.shape[0], -1, 32).amax(-1)
    assert bool((group_max >= 3).all())
    assert ta["layers.0.ffn.experts.1.w2.scale"].shape == (vals.shape[0], vals.shape[1] // 32)
    # Engram table: per-row per-32 scales.
    e = ta["layers.1.engram.embed.weight"].float()
    assert bool((e.abs().view(100, -1, 32).amax(-1) >= 224).all())
    # the fixture's measured statistics: small attention-input norm, unit Engram gate weights
    for name, mean in (("layers.0.attn_norm.weight", 0.025), ("layers.0.ffn_norm.weight", 0.2),
                       ("layers.1.engram.q_weight", 1.0)):
        assert abs(ta[name].float().mean().item() - mean) < 0.05 * mean
    assert ta["layers.0.hc_attn_fn"].float().std().item() < 2 * (4 * args.dim) ** -0.5

    write_synthetic_checkpoint(args, str(a), seed=3, shards=2, tokenizer_dir=str(a))  # stale shards go
    assert len(glob.glob(str(a / "model-*.safetensors"))) == 2

    c = tmp_path / "c"
    write_synthetic_checkpoint(args, str(c), seed=4, shards=1, tokenizer_dir=str(a))
    tc = load_file(str(c / "model-00001-of-00001.safetensors"))
    assert not torch.equal(tc["embed.weight"], tb["embed.weight"])


def test_cli(tmp_path):
    fixture_file(FIXTURE)
    out = tmp_path / "hf"
    config = os.path.join(FIXTURE, "config.json")
    r = subprocess.run([sys.executable, "-m", "inference.tools.synthetic", "--config", config,
                        "--out", str(out), "--shards", "2", "--tokenizer", FIXTURE, "--workers", "1"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert len(glob.glob(str(out / "model-*-of-00002.safetensors"))) == 2
    back = ModelArgs.from_file(str(out / "config.json"))
    fixture = ModelArgs.from_file(os.path.join(FIXTURE, "config.json"))
    assert dataclasses.replace(back, **{f: getattr(fixture, f) for f in RUNTIME_FIELDS}) == fixture
