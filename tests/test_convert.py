"""convert.py: layout, split table, byte-identity with save_file, FP8 recast, resume, errors."""
import glob
import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURE, ROOT, fixture_file

import convert
from inference.config import ModelArgs
from inference.safetensors_io import save_tensors
from inference.tools.synthetic import write_synthetic_checkpoint

# A small config covering every tensor family: Engram tables whose rows do not divide by 2 or 4 (padding),
# ratio-2 and ratio-1 KV sources, an index-only source, two DSpark stages and a one-block vision tower.
SMALL = dict(
    vocab_size=512, dim=128, moe_inter_dim=64, n_layers=4, n_mtp_layers=2, n_heads=4, head_dim=64,
    rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=64, n_routed_experts=8, n_activated_experts=2,
    window_size=32, compress_ratios=[0, 2, 1, 1, 0, 0], kv_source_layers=[1, 2],
    index_source_layers=[1, 2, 3],
    candidate_source_layer=2, index_n_heads=8, index_head_dim=32, engram_layer_ids=[0, 1],
    engram_num_embeddings=[611, 637], engram_n_heads=2, engram_head_dim=32, dspark_block_size=4,
    dspark_target_layer_ids=[2, 3], dspark_markov_rank=32, dspark_n_routed_experts=4, vision_n_layers=1,
    vision_dim=64, vision_n_heads=2, vision_inter_dim=96,
)
E2M1 = torch.tensor(convert.E2M1_VALUES)
# The official converter decodes the E2M1 code 0x8 (-0) as +0.0, so its FP8 recast writes byte 0x00 there.
E2M1_OFFICIAL = E2M1.clone()
E2M1_OFFICIAL[8] = 0.0


def quiet(*_):
    pass


def run_convert(hf, out, mp, **kw):
    kw.setdefault("log", quiet)
    kw.setdefault("progress", False)
    return convert.convert(str(hf), str(out), mp, **kw)


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    tok = tmp_path_factory.mktemp("tok")
    (tok / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    (tok / "tokenizer_config.json").write_text('{"fake": "config"}')
    d = tmp_path_factory.mktemp("small_hf")
    write_synthetic_checkpoint(ModelArgs.from_dict(SMALL), str(d), seed=1, shards=3, tokenizer_dir=str(tok))
    return d


@pytest.fixture(scope="module")
def small_out(small_hf, tmp_path_factory):
    outs = {}
    for mp in (1, 2, 4):
        outs[mp] = tmp_path_factory.mktemp(f"small_mp{mp}")
        run_convert(small_hf, outs[mp], mp)
    return outs


# ----------------------------------------------------------------------------------------------------------
# An independent, in-memory implementation of the official rules (substring key rule, save_file).

def official_convert(hf_dir, out_dir, world, expert_dtype=None):
    state = {}
    for f in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        state.update(load_file(f))
    experts = [(n.startswith("mtp."), int(m.group(1)))
               for n in state if (m := re.search(r"experts\.(\d+)\.", n))]
    n_main = 1 + max([e for mtp, e in experts if not mtp], default=-1)
    n_mtp = 1 + max([e for mtp, e in experts if mtp], default=n_main - 1)
    ranks = [{} for _ in range(world)]
    for name, t in state.items():
        if re.fullmatch(r"mtp\.\d+\.(embed|head)\.weight", name):
            continue
        parts = name.split(".")
        special = any(s in name for s in ("hc", "attn_sink", "tie2eid", "tid2eid", "ape", "image_"))
        key = parts[-1] if special else parts[-2]
        for r in range(world):
            if "experts" in name and "shared_experts" not in name:
                e, n = int(parts[parts.index("experts") + 1]), (n_mtp if name.startswith("mtp.") else n_main)
                if r * n // world <= e < (r + 1) * n // world:
                    ranks[r][name] = t
            elif ".engram.embed." in name:
                c = math.ceil(t.shape[0] / world)
                part = t[r * c:(r + 1) * c]
                if part.shape[0] < c:
                    fill = torch.zeros if name.endswith("weight") else torch.ones
                    pad = fill(c - part.shape[0], *t.shape[1:], dtype=torch.float32).to(t.dtype)
                    part = torch.cat([part, pad])
                ranks[r][name] = part.contiguous()
            elif key in ("embed", "wq_b", "wo_a", "head", "attn_sink", "weights_proj"):
                ranks[r][name] = t.chunk(world, 0)[r].contiguous()
            elif key == "wo_b":
                ranks[r][name] = t.chunk(world, 1)[r].contiguous()
            else:
                ranks[r][name] = t
    for r, tensors in enumerate(ranks):
        for name in [n for n in tensors if n.endswith(".wo_a.weight")]:
            w, s = tensors[name], tensors.pop(name[:-6] + "scale")
            bn, bk = w.shape[0] // s.shape[0], w.shape[1] // s.shape[1]
            s = s.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            tensors[name] = (w.float() * s).to(torch.bfloat16)
        routed = [n for n in tensors if ".experts." in n and n.endswith(".weight") and ".shared_" not in n]
        for name in routed:
            if tensors[name].dtype != torch.int8:
                continue
            scale = name[:-6] + "scale"
            if expert_dtype == "fp8":
                tensors[name], tensors[scale] = recast_reference(tensors[name], tensors[scale])
            else:
                tensors[name] = tensors[name].view(torch.float4_e2m1fn_x2)
        save_file(tensors, os.path.join(out_dir, f"model{r}-mp{world}.safetensors"))


def unpack_fp4(packed, table=E2M1):
    u = packed.view(torch.uint8)
    codes = torch.stack([u & 0xF, u >> 4], -1).view(u.shape[0], -1)
    return table[codes.long()]


def recast_reference(w, s):
    """The official recast in float arithmetic: S = max_n s / 2^6, value = e4m3(E2M1 * s / S)."""
    vals = unpack_fp4(w, E2M1_OFFICIAL)
    n, k = vals.shape
    sf = s.float()
    big = sf.view(n // 32, 32, k // 32).amax(1) / 64
    ratio = sf / big.repeat_interleave(32, 0)
    new = (vals.view(n, k // 32, 32) * ratio.unsqueeze(-1)).view(n, k).to(torch.float8_e4m3fn)
    return new, big.to(torch.float8_e8m0fnu)


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


# ----------------------------------------------------------------------------------------------------------

def test_writer_bytes_match_save_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "z.f32": torch.randn(3, 5, generator=g), "a.bf16": torch.randn(2, 7, generator=g).bfloat16(),
        "m.i8": torch.randint(-128, 127, (5,), dtype=torch.int8, generator=g),
        "e4m3": torch.randn(4, 32, generator=g).to(torch.float8_e4m3fn),
        "e8m0": torch.rand(4, 1, generator=g).to(torch.float8_e8m0fnu),
        "fp4": torch.randint(0, 255, (2, 3), dtype=torch.uint8, generator=g).view(torch.float4_e2m1fn_x2),
        "i64": torch.arange(3), "f16": torch.ones(2, dtype=torch.float16),
        "bool": torch.ones(3, dtype=torch.bool),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "u8": torch.arange(3, dtype=torch.uint8),
    }
    save_file(tensors, tmp_path / "ref.safetensors")
    save_tensors(tensors, str(tmp_path / "mine.safetensors"))
    mine = read_bytes(tmp_path / "mine.safetensors")
    assert mine == read_bytes(tmp_path / "ref.safetensors")
    assert b"__metadata__" not in mine


def test_mp1_matches_fixture_layout(tmp_path):
    fixture_file(FIXTURE)
    args = ModelArgs.from_file(os.path.join(FIXTURE, "config.json"))
    hf = tmp_path / "hf"
    write_synthetic_checkpoint(args, str(hf), shards=4, tokenizer_dir=FIXTURE)
    run_convert(hf, tmp_path / "out", 1)
    entries = header(tmp_path / "out" / "model0-mp1.safetensors")
    got = {n: (e["dtype"], e["shape"]) for n, e in entries.items()}
    with open(os.path.join(FIXTURE, "tensors.tsv")) as f:
        rows = [line.split("\t") for line in f.read().splitlines()[1:]]
    assert got == {n: (d, json.loads(s)) for n, d, s in rows}
    assert os.path.isfile(tmp_path / "out" / "tokenizer.json")


@pytest.mark.parametrize("mp", [1, 2, 4])
def test_identical_to_official_rules(small_hf, small_out, tmp_path, mp):
    official_convert(str(small_hf), str(tmp_path), mp)
    for r in range(mp):
        name = f"model{r}-mp{mp}.safetensors"
        assert read_bytes(small_out[mp] / name) == read_bytes(tmp_path / name), name
    assert read_bytes(small_out[mp] / "tokenizer.json") == read_bytes(small_hf / "tokenizer.json")
    assert not os.path.exists(small_out[mp] / "config.json")


@pytest.mark.parametrize("mp", [2, 4])
def test_ranks_reassemble_to_mp1(small_out, mp):
    full = load_file(small_out[1] / "model0-mp1.safetensors")
    parts = [load_file(small_out[mp] / f"model{r}-mp{mp}.safetensors") for r in range(mp)]
    seen = set()
    for name, t in full.items():
        rule, _ = convert.split_rule(name)
        have = [p[name] for p in parts if name in p]
        seen.add(name)
        if rule == "expert":
            assert len(have) == 1
            got = have[0]
        elif rule == "engram":
            got = torch.cat([h.view(torch.uint8) for h in have])[:t.shape[0]].view(t.dtype)
            pad = torch.cat([h.view(torch.uint8) for h in have])[t.shape[0]:]
            assert pad.numel() > 0 and bool((pad == (0 if name.endswith("weight") else 127)).all())
        elif rule in ("dim0", "dim1"):
            dim = 0 if rule == "dim0" else 1
            got = torch.cat([h.view(torch.uint8) if h.element_size() == 1 else h for h in have], dim)
            got = got.view(t.dtype) if t.element_size() == 1 else got
        else:
            raw = [h.view(torch.uint8) if h.element_size() == 1 else h for h in have]
            assert len(have) == mp and all(torch.equal(h, raw[0]) for h in raw)
            got = have[0]
        a, b = (x.view(torch.uint8) if x.element_size() == 1 else x for x in (got, t))
        assert got.dtype == t.dtype and torch.equal(a, b), name
    assert seen == set().union(*parts)


def test_fp8_experts_lossless_and_official(small_hf, small_out, tmp_path):
    run_convert(small_hf, tmp_path / "fp8", 2, expert_dtype="fp8")
    official_convert(str(small_hf), str(tmp_path), 2, expert_dtype="fp8")
    n_checked = 0
    for r in range(2):
        name = f"model{r}-mp2.safetensors"
        assert read_bytes(tmp_path / "fp8" / name) == read_bytes(tmp_path / name)
        fp8, fp4 = load_file(tmp_path / "fp8" / name), load_file(small_out[2] / name)
        for n, w in fp8.items():
            if ".experts." not in n or ".shared_" in n or not n.endswith(".weight"):
                continue
            assert w.dtype == torch.float8_e4m3fn
            s8, s4 = fp8[n[:-6] + "scale"].float(), fp4[n[:-6] + "scale"].float()
            deq8 = w.float() * s8.repeat_interleave(32, 0).repeat_interleave(32, 1)
            deq4 = unpack_fp4(fp4[n]) * s4.repeat_interleave(32, 1)
            assert torch.equal(deq8, deq4), n
            n_checked += 1
    assert n_checked == 2 * (8 * 3 * 4 // 2 + 4 * 3 * 2 // 2)


def test_fp8_recast_wide_scale_spread(tmp_path):
    # Row scales spread far apart inside a block: the smallest rows underflow E4M3 (lossy,
    # docs/checkpoint.md §3.5); the converter must still round exactly like e4m3(E2M1 * s / S) in float
    # arithmetic.
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for e in range(2):
        tensors[f"layers.0.ffn.experts.{e}.w1.weight"] = torch.randint(-128, 128, (64, 64), dtype=torch.int8,
                                                                        generator=g)
        tensors[f"layers.0.ffn.experts.{e}.w1.scale"] = \
            torch.randint(95, 150, (64, 4), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    hf = write_ckpt(tmp_path / "hf", tensors)
    run_convert(hf, tmp_path / "out", 2, expert_dtype="fp8")
    official_convert(str(hf), str(tmp_path), 2, expert_dtype="fp8")
    for r in range(2):
        name = f"model{r}-mp2.safetensors"
        assert read_bytes(tmp_path / "out" / name) == read_bytes(tmp_path / name)


def test_fp8_recast_sign_of_zero(tmp_path):
    """E2M1 -0 (code 0x8) becomes E4M3 +0 (byte 0x00) as in the official converter; a negative value too
    small for E4M3 becomes -0 (0x80), as a float cast makes it; +0 stays 0x00."""
    w = torch.zeros(64, 32, dtype=torch.uint8)
    w[:, 0] = 0x88                  # two -0 codes
    w[:, 1] = 0x00                  # two +0 codes
    w[:, 2] = 0x99                  # -0.5, -0.5
    scales = torch.full((64, 2), 127, dtype=torch.uint8)
    scales[1, :] = 127 + 40         # row 1 sets the block scale: 2^40 / 2^6 = 2^34, so other rows underflow
    tensors = {"layers.0.ffn.experts.0.w1.weight": w.view(torch.int8),
               "layers.0.ffn.experts.0.w1.scale": scales.view(torch.float8_e8m0fnu),
               "layers.0.ffn.experts.1.w1.weight": w.clone().view(torch.int8),
               "layers.0.ffn.experts.1.w1.scale": scales.clone().view(torch.float8_e8m0fnu)}
    hf = write_ckpt(tmp_path / "hf", tensors)
    run_convert(hf, tmp_path / "out", 1, expert_dtype="fp8")
    out = load_file(tmp_path / "out" / "model0-mp1.safetensors")["layers.0.ffn.experts.0.w1.weight"]
    b = out.view(torch.uint8)
    assert (b[:, 0:2] == 0x00).all() and (b[:, 2:4] == 0x00).all()     # -0 and +0 codes: +0
    assert (b[0, 4:6] == 0x80).all()              # -0.5 * 2^-34: underflows to -0
    assert (b[1, 4:6] == 0xE0).all()              # -0.5 * 2^40 / 2^34 = -32: sign, exponent 5 + 7
    official_convert(str(hf), str(tmp_path), 1, expert_dtype="fp8")
    assert read_bytes(tmp_path / "out" / "model0-mp1.safetensors") == \
        read_bytes(tmp_path / "model0-mp1.safetensors")


def test_dry_run_writes_nothing(small_hf, tmp_path, capsys):
    out = tmp_path / "never"
    assert convert.main(["--hf-ckpt-path", str(small_hf), "--save-path", str(out), "--model-parallel", "2",
                         "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "rank 1: model1-mp2.safetensors" in text and "peak memory" in text
    assert "backbone 8, DSpark 4" in text
    assert not out.exists()


def test_rerun_skips_and_force(small_hf, tmp_path):
    out = tmp_path / "out"
    run_convert(small_hf, out, 2)
    before = os.stat(out / "model0-mp2.safetensors").st_mtime_ns
    logs = []
    run_convert(small_hf, out, 2, log=logs.append)
    assert any("nothing to do" in line for line in logs)
    assert os.stat(out / "model0-mp2.safetensors").st_mtime_ns == before
    # A different expert dtype would overwrite the same file names: refused without --force.
    with pytest.raises(convert.ConvertError, match="--force"):
        run_convert(small_hf, out, 2, expert_dtype="fp8")
    run_convert(small_hf, out, 2, expert_dtype="fp8", force=True)
    assert header(out / "model0-mp2.safetensors")["layers.0.ffn.experts.0.w1.weight"]["dtype"] == "F8_E4M3"


def test_kill_and_resume(small_hf, small_out, tmp_path):
    out = tmp_path / "out"
    # Slow the writer down so that the kill lands while rank 1 is being written.
    code = ("import sys, time; sys.path.insert(0, %r); import convert\n"
            "from inference import safetensors_io as io\n"
            "orig = io.StreamWriter.write_tensor\n"
            "def slow(self, *a):\n"
            "    time.sleep(0.002 if self.path.endswith('model0-mp2.safetensors') else 0.05)\n"
            "    return orig(self, *a)\n"
            "io.StreamWriter.write_tensor = slow\n"
            "sys.exit(convert.main(sys.argv[1:]))\n") % ROOT
    proc = subprocess.Popen([sys.executable, "-c", code, *cli(small_hf, out, 2, "--workers", "1")],
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    partial = out / "model1-mp2.safetensors.partial"

    def rank0_recorded():
        try:
            return "0" in json.loads((out / ".convert-mp2.json").read_text())["ranks"]
        except (OSError, ValueError):
            return False

    deadline = time.time() + 60
    while not (partial.exists() and rank0_recorded()) and time.time() < deadline:
        assert proc.poll() is None, "conversion finished before it could be interrupted"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "model0-mp2.safetensors").exists() and not (out / "model1-mp2.safetensors").exists()
    logs = []
    run_convert(small_hf, out, 2, log=logs.append)
    assert any("rank 0" in line and "skip" in line for line in logs)
    for r in range(2):
        name = f"model{r}-mp2.safetensors"
        assert read_bytes(out / name) == read_bytes(small_out[2] / name)
    assert not partial.exists()


# ----------------------------------------------------------------------------------------------------------
# Errors: one line, exit code 2, nothing written

def write_ckpt(d, tensors, index=True, shard="model-00001-of-00001.safetensors"):
    os.makedirs(d, exist_ok=True)
    save_file(tensors, os.path.join(d, shard), metadata={"format": "pt"})
    if index:
        with open(os.path.join(d, convert.INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": {n: shard for n in tensors}}, f)
    return d


def minimal(vocab=16, heads=4, experts=4):
    return {"embed.weight": torch.zeros(vocab, 8, dtype=torch.bfloat16),
            "layers.0.attn.attn_sink": torch.zeros(heads),
            **{f"layers.0.ffn.experts.{e}.w1.weight": torch.zeros(32, 16, dtype=torch.int8)
               for e in range(experts)}}


def expect_error(capsys, args, pattern):
    assert convert.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert re.search(pattern, err), err


def cli(hf, out, mp=2, *extra):
    return ["--hf-ckpt-path", str(hf), "--save-path", str(out), "--model-parallel", str(mp), *extra]


def test_error_missing_shard(tmp_path, capsys):
    hf = write_ckpt(tmp_path / "hf", minimal())
    with open(hf / convert.INDEX_FILE) as f:
        index = json.load(f)
    index["weight_map"]["norm.weight"] = "model-00002-of-00002.safetensors"
    with open(hf / convert.INDEX_FILE, "w") as f:
        json.dump(index, f)
    expect_error(capsys, cli(hf, tmp_path / "out"), r"model-00002-of-00002\.safetensors.*missing")
    assert not (tmp_path / "out").exists()


def test_error_incomplete_shards(tmp_path, capsys):
    hf = write_ckpt(tmp_path / "hf", minimal())
    with open(hf / convert.INDEX_FILE) as f:
        index = json.load(f)
    index["weight_map"]["norm.weight"] = "model-00001-of-00001.safetensors"
    with open(hf / convert.INDEX_FILE, "w") as f:
        json.dump(index, f)
    expect_error(capsys, cli(hf, tmp_path / "out"),
                 r"incomplete: 1 tensor.*missing, 0 unexpected.*mid-upload")
    assert not (tmp_path / "out").exists()


def test_error_truncated_and_corrupt(tmp_path, capsys):
    hf = write_ckpt(tmp_path / "hf", minimal())
    shard = hf / "model-00001-of-00001.safetensors"
    data = read_bytes(shard)
    shard.write_bytes(data[:-10])
    expect_error(capsys, cli(hf, tmp_path / "out"), r"model-00001-of-00001\.safetensors.*truncated")
    shard.write_bytes(data[:8] + b"#" + data[9:])
    expect_error(capsys, cli(hf, tmp_path / "out"), r"corrupt")
    shard.write_bytes(data[:5])
    expect_error(capsys, cli(hf, tmp_path / "out"), r"truncated")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tensors, mp, pattern", [
    (minimal(experts=6), 4, r"does not divide the routed expert counts \(backbone 6, DSpark 6\)"),
    (minimal(vocab=18), 4, r"does not divide vocab_size: dim 0 of embed\.weight has size 18"),
    (minimal(heads=6), 4, r"does not divide n_heads: dim 0 of layers\.0\.attn\.attn_sink has size 6"),
])
def test_error_model_parallel_does_not_divide(tmp_path, capsys, tensors, mp, pattern):
    hf = write_ckpt(tmp_path / "hf", tensors)
    expect_error(capsys, cli(hf, tmp_path / "out", mp), pattern)


def test_error_unknown_names(tmp_path, capsys):
    hf = write_ckpt(tmp_path / "hf", {**minimal(), "layers.0.attn.mystery.weight": torch.zeros(2),
                                      "extra_thing": torch.zeros(1)})
    expect_error(capsys, cli(hf, tmp_path / "out"),
                 r"unknown tensor name\(s\).*extra_thing, layers\.0\.attn\.mystery")


def test_error_unwritable_output(tmp_path, capsys):
    hf = write_ckpt(tmp_path / "hf", minimal())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    expect_error(capsys, cli(hf, blocker), r"exists and is not a directory")
    expect_error(capsys, cli(hf, blocker / "sub"), r"cannot create output directory")
    if os.geteuid() != 0:  # root ignores permissions
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        expect_error(capsys, cli(hf, ro), r"not writable")


def test_cli_subprocess_error_exit_code(tmp_path):
    args = cli(tmp_path / "nope", tmp_path / "o")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), *args],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: --hf-ckpt-path {tmp_path / 'nope'} is not a directory"


def test_name_normalization_and_tied_skip(tmp_path):
    tensors = {"model.embed.weight": torch.ones(4, 8, dtype=torch.bfloat16),
               "model.layers.0.self_attn.attn_sink": torch.zeros(2),
               "model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(4),
               "model.layers.0.mlp.shared_experts.w1.weight_scale_inv":
                   torch.ones(1, 1).to(torch.float8_e8m0fnu),
               "model.mtp.0.embed.weight": torch.ones(4, 8, dtype=torch.bfloat16),
               "mtp.0.head.weight": torch.ones(4, 8, dtype=torch.bfloat16)}
    hf = write_ckpt(tmp_path / "hf", tensors, index=False)
    run_convert(hf, tmp_path / "out", 2)
    names = set(header(tmp_path / "out" / "model1-mp2.safetensors"))
    assert names == {"embed.weight", "layers.0.attn.attn_sink", "layers.0.ffn.gate.bias",
                     "layers.0.ffn.shared_experts.w1.scale"}


def test_parse_bytes():
    assert convert.parse_bytes("2GB") == 2 * 10 ** 9
    assert convert.parse_bytes("512MiB") == 512 << 20
    assert convert.parse_bytes("1e9") == 10 ** 9
    assert convert.parse_bytes("4096") == 4096
    with pytest.raises(convert.ConvertError):
        convert.parse_bytes("lots")
