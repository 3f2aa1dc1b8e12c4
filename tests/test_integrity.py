"""Checkpoint integrity (issue 38): per-tensor checksums recorded by convert.py and checked by `convert.py
--verify` (`run.sh verify`), by a convert rerun and by `generate.py --verify`; a config that does not match
the checkpoint is one line before any memory plan or allocation."""
import hashlib
import json
import os
import shutil
import subprocess

import pytest
import torch

from conftest import FIXTURE, ROOT, TOKENIZER_CONFIG

import convert
import generate
from inference.config import ModelArgs
from inference.engine.checkpoint import CheckpointError, check_config_matches
from inference.safetensors_io import CopyRange, SafetensorsError, StreamWriter, read_header
from inference.tools.synthetic import write_synthetic_checkpoint
from test_convert import SMALL



def quiet(*_):
    pass


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A small synthetic HF checkpoint with the real tokenizer (generate.py reads it)."""
    tok = tmp_path_factory.mktemp("tok")
    shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), tok / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    d = tmp_path_factory.mktemp("hf")
    write_synthetic_checkpoint(ModelArgs.from_dict(SMALL), str(d), seed=3, shards=2, tokenizer_dir=str(tok))
    return d


@pytest.fixture
def out(hf, tmp_path):
    """Converted at W = 2 (verify, rerun) and W = 1 (generate.py runs in this process, one rank)."""
    for mp in (1, 2):
        convert.convert(str(hf), str(tmp_path), mp, log=quiet, progress=False)
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    return tmp_path


def flip_middle_byte(path):
    """Flip one bit of the data byte in the middle of the file; -> the name of the tensor holding it."""
    size = os.path.getsize(path)
    infos, _ = read_header(str(path))
    pos = size // 2
    name = next(n for n, i in infos.items() if i.offset <= pos < i.offset + i.nbytes)
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    return name


def verify_cli(capsys, ckpt):
    code = convert.main(["--verify", str(ckpt)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err.strip()


def one_error_line(err):
    lines = [line for line in err.replace("\r", "\n").splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def run_generate(capsys, args):
    """generate.main in this process (W = 1); the RNG state and thread count it sets are put back."""
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        code = generate.main(args)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def generate_args(ckpt, tmp_path, *extra, config=None, prompt=""):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(prompt)
    return ["--ckpt-path", str(ckpt), "--config", str(config or ckpt / "config.json"), "--device", "cpu",
            "--input-file", str(prompts), *extra]


# ----------------------------------------------------------------------------------------------------------
# Checksums as written

def test_manifest_records_every_tensors_sha256(out):
    ranks = json.loads((out / ".convert-mp2.json").read_text())["ranks"]
    for r in range(2):
        path = out / f"model{r}-mp2.safetensors"
        data = path.read_bytes()
        infos, _ = read_header(str(path))
        want = {n: hashlib.sha256(data[i.offset:i.offset + i.nbytes]).hexdigest() for n, i in infos.items()}
        assert ranks[str(r)]["tensor_sha256"] == want


def test_writer_hashes_the_bytes_it_writes(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 4)
    w = StreamWriter(str(tmp_path / "o.safetensors"), [("a", "U8", [1024]), ("b", "U8", [3])], checksums=True)
    with open(src, "rb") as f:
        w.write_tensor("a", [b"\x00" * 24, CopyRange(f.fileno(), 24, 1000)])
        w.write_tensor("b", [b"xyz"])
        w.close()
    assert w.digests() == {"a": hashlib.sha256(b"\x00" * 24 + src.read_bytes()[24:]).hexdigest(),
                           "b": hashlib.sha256(b"xyz").hexdigest()}
    w = StreamWriter(str(tmp_path / "p.safetensors"), [("a", "U8", [4])], checksums=True)
    with pytest.raises(SafetensorsError, match="out of order"):
        w.write_tensor("a", [b"xy"], offset=2)
    w.abort()


# ----------------------------------------------------------------------------------------------------------
# One flipped byte: named by verify, run.sh verify, a convert rerun and generate.py --verify

def test_verify_intact_then_one_flipped_byte(out, capsys):
    code, text, err = verify_cli(capsys, out)
    assert code == 0 and "every tensor matches" in text and "3 file(s)" in text   # mp1 and mp2
    path = out / "model1-mp2.safetensors"
    name = flip_middle_byte(path)
    code, _, err = verify_cli(capsys, out)
    line = one_error_line(err)
    assert code == 1 and line.startswith("error: ") and str(path) in line
    assert f"tensor {name} is damaged" in line


def test_run_sh_verify(out):
    name = flip_middle_byte(out / "model0-mp1.safetensors")
    r = subprocess.run(["bash", os.path.join(ROOT, "run.sh"), "verify", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    line = one_error_line(r.stderr)
    assert f"tensor {name} is damaged" in line and "model0-mp1.safetensors" in line


def test_convert_rerun_names_and_rewrites_a_damaged_file(hf, out):
    path = out / "model1-mp2.safetensors"
    before = path.read_bytes()
    name = flip_middle_byte(path)
    logs = []
    convert.convert(str(hf), str(out), 2, log=logs.append, progress=False)
    assert any(f"tensor {name} in {path}" in line and "rewriting" in line for line in logs), logs
    assert any("rank 0" in line and "verified, will skip" in line for line in logs)
    assert not any("nothing to do" in line for line in logs)
    assert path.read_bytes() == before
    logs.clear()
    convert.convert(str(hf), str(out), 2, log=logs.append, progress=False)
    assert any("nothing to do" in line for line in logs)


def test_generate_verify(out, tmp_path, capsys, monkeypatch):
    def stop(*a, **k):      # the next step after the checks: the memory plan
        raise generate.CLIError("stopped before the memory plan")
    from inference.engine import session
    monkeypatch.setattr(session, "rank_plan", stop)
    args = generate_args(out, tmp_path, "--verify", prompt="Hello")
    code, text, err = run_generate(capsys, args)
    assert "verified" in text and "every tensor matches" in text
    assert code == 1 and "stopped before the memory plan" in one_error_line(err)
    path = out / "model0-mp1.safetensors"
    name = flip_middle_byte(path)
    code, text, err = run_generate(capsys, args)
    line = one_error_line(err)
    assert code == 1 and f"tensor {name} is damaged" in line and str(path) in line


# ----------------------------------------------------------------------------------------------------------
# Checkpoints without checksums: one line, no crash

def test_converted_before_checksums(hf, out, tmp_path, capsys):
    manifest = out / ".convert-mp2.json"
    data = json.loads(manifest.read_text())
    for entry in data["ranks"].values():
        del entry["tensor_sha256"]      # the format before this change
    manifest.write_text(json.dumps(data))
    for f in (".convert-mp1.json", "model0-mp1.safetensors"):
        os.remove(out / f)
    code, _, err = verify_cli(capsys, out)
    line = one_error_line(err)
    assert code == 1 and "before convert.py recorded checksums" in line and "--force" in line
    logs = []
    convert.convert(str(hf), str(out), 2, log=logs.append, progress=False)
    assert any("not verified, will skip" in line for line in logs)
    assert any("nothing to do" in line for line in logs)
    # Not written by this convert.py at all (the fixture): no manifest to verify against.
    code, _, err = verify_cli(capsys, FIXTURE)
    assert code == 1 and "no .convert-mp1.json" in one_error_line(err)


def test_verify_truncated_file(out, capsys):
    path = out / "model1-mp2.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    code, _, err = verify_cli(capsys, out)
    assert code == 1 and "truncated" in one_error_line(err)


# ----------------------------------------------------------------------------------------------------------
# A config that does not match the checkpoint: one line before any memory plan or allocation

def test_released_config_with_a_tiny_checkpoint(out, tmp_path, capsys, monkeypatch):
    def no_allocation(*a, **k):
        raise AssertionError("the memory plan or the model build ran")
    from inference.engine import session
    for step in ("rank_plan", "prefill_chunk_for", "load_model"):       # the session's loading steps
        monkeypatch.setattr(session, step, no_allocation)
    args = generate_args(out, tmp_path, config=os.path.join(ROOT, "config.json"), prompt="Hello")
    code, _, err = run_generate(capsys, args)
    assert code == 1 and err.count("\n") == 1, err
    assert err.strip() == ("error: config dim 5120 but embed.weight has 128 columns: "
                           "wrong --config for this checkpoint?")


def test_config_matches_the_checkpoint(out):
    for mp in (1, 2):
        check_config_matches(str(out), ModelArgs.from_dict(SMALL), mp)
        check_config_matches(str(out), ModelArgs.from_dict(SMALL), mp, language_model_only=True)
    check_config_matches(FIXTURE, ModelArgs.from_file(os.path.join(FIXTURE, "config.json")), 1)


@pytest.mark.parametrize("change, message", [
    (dict(vocab_size=1024), r"config vocab_size 1024 but embed\.weight has 256 rows over 2 ranks"),
    (dict(n_layers=5, compress_ratios=[0, 2, 1, 1, 0, 0, 0]),
     r"config n_layers 5 but model0-mp2\.safetensors holds 4 layers"),
    (dict(n_routed_experts=16), r"config n_routed_experts 16 but model0-mp2\.safetensors holds 4 experts "
                                r"per layer over 2 ranks"),
    (dict(moe_inter_dim=32),
     r"config moe_inter_dim 32 but layers\.0\.ffn\.experts\.0\.w1\.weight has 64 rows"),
    (dict(expert_dtype=None), r"config expert_dtype null implies layers\.0\.ffn\.experts\.0\.w1\.weight "
                              r"F8_E4M3 but model0-mp2\.safetensors has F4 \(this checkpoint needs "
                              r"\"expert_dtype\": \"fp4\"\)"),
    (dict(q_lora_rank=96), r"config implies layers\.0\.attn\.wq_a\.weight F8_E4M3 \[96, 128\] but "
                           r"model0-mp2\.safetensors has F8_E4M3 \[64, 128\]"),
    (dict(vision_n_layers=0), r"config vision_n_layers 0 but model0-mp2\.safetensors holds 1 vision blocks"),
    (dict(vision_dim=32, vision_n_heads=1),
     r"config implies vision\.\S+ \w+ \[.*\] but model0-mp2\.safetensors has \w+ \[.*\]"),
])
def test_config_mismatch_names_the_key(out, change, message):
    with pytest.raises(CheckpointError, match=message + r": wrong --config for this checkpoint\?$"):
        check_config_matches(str(out), ModelArgs.from_dict({**SMALL, **change}), 2)
