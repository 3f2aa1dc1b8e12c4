"""Model construction, configuration checks and the strict loader."""
import os

import pytest
import torch

from conftest import FIXTURE, ROOT, fixture_file
from inference.engine.checkpoint import CheckpointError, load_checkpoint
from inference.config import ConfigError, ModelArgs, RuntimeOptions
from inference.model import Block, Transformer
from inference.parallel import ParallelContext
from inference.state import ModelContext

GIB = 2 ** 30


def released():
    return ModelArgs.from_file(os.path.join(ROOT, "config.json"))


@pytest.fixture(scope="module")
def released_w1():
    """The released model at W = 1 on meta, built once for the tests that only read it (a build of its
    64,000 modules takes seconds)."""
    return Transformer(released(), device="meta")


@pytest.mark.parametrize("world,total,engram,experts,rest", [
    (1, 477.9, 188.8, 275.7, 13.4), (4, 122.1, 47.2, 68.9, 5.9), (8, 62.7, 23.6, 34.5, 4.7)])
def test_meta_build_memory_plan(world, total, engram, experts, rest, released_w1):
    """Every shape of the released config, checked through the per-rank bytes of docs/checkpoint.md §6."""
    model = released_w1 if world == 1 else Transformer(released(), ParallelContext(world, 0), device="meta")
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    eng = sum(v for n, v in sizes.items() if ".engram.embed." in n)
    exp = sum(v for n, v in sizes.items() if ".experts." in n)
    tot = sum(sizes.values())
    assert abs(tot / GIB - total) <= 0.06          # the table rounds each figure to 0.1 GiB
    assert round(eng / GIB, 1) == engram and round(exp / GIB, 1) == experts
    assert round((tot - eng - exp) / GIB, 1) == rest
    assert all(p.device.type == "meta" for p in model.parameters())


def test_meta_build_tensor_count(released_w1):
    # 96,085 HF tensors minus the 43 `wo_a.scale` that conversion folds into bf16 `wo_a`
    model = released_w1
    assert len(dict(model.named_parameters())) == 96085 - 43
    # per-layer HF counts of docs/checkpoint.md §1.3, each minus its wo_a.scale
    assert sum(1 for n, _ in model.named_parameters() if n.startswith("layers.1.")) == 2340 - 1
    assert sum(1 for n, _ in model.named_parameters() if n.startswith("layers.20.")) == 2341 - 1
    assert sum(1 for n, _ in model.named_parameters() if n.startswith("mtp.2.")) == 802 - 1


def test_block_builds_alone():
    """A single block needs only a ModelContext: no globals, no Transformer."""
    args = ModelArgs()
    ctx = ModelContext.build(args)
    block = Block(1, ctx)
    names = {n for n, _ in block.named_parameters()}
    assert "attn.compressor.wgate.weight" in names and "attn.indexer.wk.weight" in names
    assert block.attn.compressor.wkv.weight.dtype == torch.float32         # ratio-2 compressor in fp32


def test_config_errors():
    with pytest.raises(ConfigError, match="unknown config key"):
        ModelArgs.from_dict({"dim": 8, "not_a_key": 1})
    with pytest.raises(ConfigError, match="compress_ratios"):
        ModelArgs.from_dict({"n_layers": 2, "n_mtp_layers": 1, "compress_ratios": [0, 0]})
    with pytest.raises(ConfigError, match="world size 3 does not divide"):
        released().validate(3)
    with pytest.raises(ConfigError, match="numerics"):
        RuntimeOptions.from_profile("golden-ish")
    assert RuntimeOptions.from_profile("fixed").fix_index_k_publish


def test_layer_roles_released(released_w1):
    model = released_w1
    roles = {i: (l.attn.compressor is not None, l.attn.indexer is not None)
             for i, l in enumerate(model.layers)}
    assert [i for i, (c, _) in roles.items() if c] == [2, 8, 14, 20]
    assert [i for i, (_, x) in roles.items() if x] == [2, 8, 14, 20, 24, 28, 32, 36]
    assert model.layers[20].attn.indexer.is_candidate_source
    assert all(model.layers[i].attn.indexer.uses_candidates for i in (24, 28, 32, 36))
    assert not model.layers[14].attn.indexer.uses_candidates
    assert [i for i, l in enumerate(model.layers) if l.engram is not None] == [1, 14]
    assert model.layers[20].attn.compressor.wkv.weight.dtype == torch.bfloat16


# ---- strict loader -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fixture_tensors():
    fixture_file(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    from safetensors.torch import load_file
    return load_file(os.path.join(FIXTURE, "model0-mp1.safetensors"))


def fixture_model():
    return Transformer(ModelArgs.from_file(os.path.join(FIXTURE, "config.json")))


def write(tmp_path, tensors, name="model0-mp1.safetensors"):
    from safetensors.torch import save_file
    save_file(tensors, os.path.join(tmp_path, name))
    return str(tmp_path)


def test_loader_bad_checkpoints(tmp_path, fixture_tensors):
    t = dict(fixture_tensors)
    missing = {k: v for k, v in t.items() if k != "layers.3.attn.wq_a.weight"}
    with pytest.raises(CheckpointError, match=r"1 missing \(e\.g\. layers\.3\.attn\.wq_a\.weight\)"):
        load_checkpoint(fixture_model(), write(tmp_path / "a", missing) if os.makedirs(tmp_path / "a") is None
                        else None)
    extra = dict(t, **{"layers.0.attn.bogus": torch.zeros(2)})
    os.makedirs(tmp_path / "b")
    with pytest.raises(CheckpointError, match=r"1 unexpected \(e\.g\. layers\.0\.attn\.bogus\)"):
        load_checkpoint(fixture_model(), write(tmp_path / "b", extra))
    shaped = dict(t, **{"norm.weight": torch.zeros(255, dtype=torch.bfloat16)})
    os.makedirs(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"norm\.weight has shape \[255\], expected \[256\]"):
        load_checkpoint(fixture_model(), write(tmp_path / "c", shaped))
    os.makedirs(tmp_path / "d")
    write(tmp_path / "d", t, "model0-mp2.safetensors")
    write(tmp_path / "d", t, "model1-mp2.safetensors")
    with pytest.raises(CheckpointError, match=r"world size 1.*holds shards for world size 2"):
        load_checkpoint(fixture_model(), str(tmp_path / "d"))
    os.makedirs(tmp_path / "e")
    with open(tmp_path / "e" / "model0-mp1.safetensors", "wb") as f:
        f.write(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(fixture_model(), str(tmp_path / "e"))


def test_loader_aliases_and_widening(tmp_path, fixture_tensors):
    t = dict(fixture_tensors)
    t["mtp.0.embed.weight"] = t["embed.weight"].clone()        # a tied alias is accepted and ignored
    model = fixture_model()
    load_checkpoint(model, write(tmp_path, t))
    assert model.head.weight.dtype == torch.float32
    assert torch.equal(model.head.weight, fixture_tensors["head.weight"].float())
    w = model.layers[0].ffn.experts[0].w1.weight
    assert torch.equal(w.view(torch.uint8),
                       fixture_tensors["layers.0.ffn.experts.0.w1.weight"].view(torch.uint8))
