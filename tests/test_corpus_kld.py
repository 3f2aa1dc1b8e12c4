"""`parity corpus` and `parity kld` (inference/tools/corpus.py, kld.py): llama.cpp's KL-divergence base
from the reference-tiny fixture, read back by a reader written here from the format alone; resumption after a
kill or a full disk, byte for byte; the statistics against a model with one expert changed; W = 1, W = 2,
--offload disk, batching, and the reference's own floor."""
import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import FIXTURE, ROOT, fixture_file, fixture_model
from inference.config import RuntimeOptions
from inference.tools import corpus, parity

CONFIG = os.path.join(FIXTURE, "config.json")
CTX = 64                      # the fixture's window: scored positions 32..62
BOS = 0


# ---------------------------------------------------------------------------------------------------------
# A reader of the format, written from llama.cpp's layout (not from inference/tools/kld.py)
# ---------------------------------------------------------------------------------------------------------

def read_kld(path):
    """-> (n_ctx, n_vocab, tokens int [n_chunk, n_ctx], scale [n_chunk, R], min_lp [n_chunk, R],
    q uint16 [n_chunk, R, V], log-probs fp64 [n_chunk, R, V] as llama.cpp decodes them)."""
    data = open(path, "rb").read()
    assert data[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<iii", data, 8)
    tokens = np.frombuffer(data, "<i4", n_chunk * n_ctx, 20).reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = n_ctx - 1 - n_ctx // 2
    start = 20 + 4 * n_chunk * n_ctx
    assert len(data) == start + n_chunk * rows * nv * 2, "rows per chunk"
    raw = np.frombuffer(data, "<u2", offset=start).reshape(n_chunk, rows, nv)
    head = np.ascontiguousarray(raw[..., :4]).view("<f4")                     # [n_chunk, R, 2]
    q = raw[..., 4:4 + n_vocab]
    lp = (head[..., :1] * q.astype(np.float32) + head[..., 1:]).astype(np.float64)   # fp32 math, as llama.cpp
    return n_ctx, n_vocab, tokens, head[..., 0], head[..., 1], q, lp


def llama_kld(base_lp, test_lp):
    """Per position: KL(base || test) over the base entries above -16 nats, and the two top-1 ids."""
    pb = np.exp(base_lp)
    kld = np.where(base_lp > -16, pb * (base_lp - test_lp), 0).sum(-1)
    return kld, base_lp.argmax(-1), test_lp.argmax(-1)


# ---------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------

def run_tool(argv):
    """python -m inference.tools.parity ARGV in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = parity.main(list(argv))
    finally:
        torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()


def corpus_args(ckpt, folder, *extra, chunks=2, name="base"):
    return ["corpus", "--ckpt-path", str(ckpt), "--config", CONFIG, "--text", str(TEXT), "--ctx", str(CTX),
            "--chunks", str(chunks), "--device", "cpu", "--threads", "1", "--no-progress",
            "--kld-base", os.path.join(folder, f"{name}.kld"),
            "--topk-out", os.path.join(folder, f"{name}.safetensors"), "--topk", "8", *extra]


def score(ckpt, folder, *extra, chunks=2, name="base"):
    os.makedirs(folder, exist_ok=True)
    code, out, err = run_tool(corpus_args(ckpt, folder, *extra, chunks=chunks, name=name))
    assert code == 0, out + err
    return os.path.join(folder, f"{name}.kld"), out


def files_of(folder, name="base"):
    """Every file a finished run leaves, by name -> bytes."""
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))
            if f.startswith(name + ".")}


TEXT = None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fixture scored on a two-chunk corpus (the start of its README): the reference, a model with one
    expert changed, and --numerics fast."""
    global TEXT
    fixture_file(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    tmp = tmp_path_factory.mktemp("corpus")
    TEXT = tmp / "corpus.txt"
    readme = open(os.path.join(FIXTURE, "README.md"), encoding="utf-8").read()
    TEXT.write_text(readme[:4000], encoding="utf-8")
    paths = {"tmp": tmp}
    paths["ref"], _ = score(FIXTURE, str(tmp / "ref"))
    # Expert 0 of block 4, its w2 scales raised by 3 in UE8M0 (x8), as tests/test_parity.py does.
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    tensors["layers.4.ffn.experts.0.w2.scale"].view(torch.uint8).add_(3)
    bad = tmp / "perturbed_ckpt"
    bad.mkdir()
    save_file(tensors, str(bad / "model0-mp1.safetensors"))
    shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), bad / "tokenizer.json")
    paths["perturbed"], _ = score(bad, str(tmp / "perturbed"))
    paths["fast"], _ = score(FIXTURE, str(tmp / "fast"), "--numerics", "fast")
    return paths


def model_logits(ids, numerics="reference"):
    """The fixture model's fp32 logits [CTX, V] for one chunk's evaluated ids, computed here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = fixture_model(RuntimeOptions.from_profile(numerics), max_seq_len=CTX, max_batch_size=1)
        logits = model.prefill(torch.tensor([ids]), all_logits=True).logits
    finally:
        torch.set_num_threads(threads)
    return logits[0].float()


# ---------------------------------------------------------------------------------------------------------
# The file, read back independently
# ---------------------------------------------------------------------------------------------------------

def test_kld_file_holds_the_models_log_probs_by_llama_cpps_protocol(runs):
    from encoding.tokenizer import load_tokenizer
    n_ctx, n_vocab, tokens, scale, min_lp, q, lp = read_kld(runs["ref"])
    assert (n_ctx, n_vocab, tokens.shape) == (CTX, 1024, (2, CTX))
    assert os.path.getsize(runs["ref"]) == 20 + 4 * 2 * CTX + 2 * 31 * (1024 + 4) * 2    # 31 rows a chunk
    # The ids: the text tokenized here, a BOS first, cut into chunks; the file keeps the original ids.
    text = TEXT.read_text(encoding="utf-8")
    ids = [BOS] + load_tokenizer(FIXTURE).encode(text, add_special_tokens=False).ids
    assert tokens.reshape(-1).tolist() == ids[:2 * CTX]
    assert tokens[1, 0] != BOS
    first = CTX // 2
    for c in range(2):
        evaluated = tokens[c].tolist()
        evaluated[0] = BOS                                   # each chunk runs with BOS in its first place
        ref = model_logits(evaluated).log_softmax(-1).double().numpy()      # fp32 log-softmax [CTX, V]
        scored = ref[first:CTX - 1]                          # positions 32..62: the next tokens 33..63
        above = scored > min_lp[c][:, None] + scale[c][:, None] / 2
        # Every code within scale / 2 of the true log-prob (plus the decode's fp32 rounding, ~1e-6 at 16
        # nats), and below the 16-nat floor the floor: a bound from above.
        err = np.abs(lp[c] - scored)
        assert (err[above] <= (scale[c][:, None] / 2 + 5e-6).repeat(n_vocab, 1)[above]).all(), err.max()
        assert (scored[~above] <= lp[c][~above] + 5e-6).all()
        lo = np.maximum(scored.min(-1), scored.max(-1) - 16)
        assert np.allclose(scale[c], (scored.max(-1) - lo) / 65535, rtol=1e-4)
        assert (q[c].max(-1) == 65535).all()
        if c == 1:
            # Not the logits of the chunk as it stands (its own first token instead of BOS).
            own = model_logits(tokens[c].tolist()).log_softmax(-1).double().numpy()[first:CTX - 1]
            assert np.abs(lp[c] - own).max() > 100 * scale[c].max()


def test_compact_file_holds_exact_targets_and_top_k(runs):
    from safetensors import safe_open
    _, _, tokens, _, _, _, lp = read_kld(runs["ref"])
    with safe_open(runs["ref"].replace(".kld", ".safetensors"), framework="pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    assert meta["format"] == "kld-compact" and int(meta["topk"]) == 8
    assert torch.equal(t["tokens"], torch.from_numpy(tokens.copy()))
    evaluated = tokens[0].tolist()
    evaluated[0] = BOS
    logits = model_logits(evaluated)[CTX // 2:CTX - 1]
    ref = logits.double().log_softmax(-1)
    targets = torch.from_numpy(tokens[0, CTX // 2 + 1:].astype(np.int64))
    assert torch.allclose(t["target_logprob"][0].double(), ref.gather(1, targets[:, None]).squeeze(1),
                          atol=1e-5)
    assert torch.allclose(t["logsumexp"][0].double(), logits.double().logsumexp(-1), atol=1e-5)
    assert torch.equal(t["topk_ids"][0].long(), logits.topk(8).indices)
    assert torch.allclose(t["topk_logprobs"][0].double(), ref.topk(8).values, atol=1e-5)
    manifest = json.load(open(runs["ref"] + ".manifest.json"))
    assert manifest["n_chunk"] == 2 and manifest["bos"] == {"rule": "yes", "id": BOS}
    assert manifest["corpus"]["sha256"] == corpus.sha256_file(str(TEXT))
    assert manifest["companions"] == {"kld": "base.kld", "compact": "base.safetensors"}


# ---------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------

def figure(out, label):
    return float(re.search(re.escape(label) + r"\s*(-?[\d.]+)", out).group(1))


def test_kld_of_the_base_against_itself_is_zero(runs):
    code, out, _ = run_tool(["kld", runs["ref"], runs["ref"]])
    assert code == 0, out
    assert figure(out, "Mean    KLD:") == 0 and figure(out, "Maximum KLD:") == 0
    assert "Same top p: 100.000 ± 0.000 %" in out and "first affected: none" in out and "PASS" in out
    # The compact file against the base: equal up to the 16-bit rows.
    code, out, _ = run_tool(["kld", runs["ref"], runs["ref"].replace(".kld", ".safetensors")])
    assert code == 0 and "shared top-k support" in out and figure(out, "Mean    KLD:") < 1e-6


def test_one_changed_expert_shows_and_the_first_affected_chunk_is_named(runs):
    _, _, _, _, _, _, base = read_kld(runs["ref"])
    _, _, _, _, _, _, test = read_kld(runs["perturbed"])
    kld, top_b, top_t = llama_kld(base, test)                          # [2, 31]
    assert kld.mean() > 1e-4
    code, out, _ = run_tool(["kld", runs["ref"], runs["perturbed"], "--max-kld", "1e-5"])
    assert code == 1 and "FAIL" in out
    assert abs(figure(out, "Mean    KLD:") - kld.mean()) < 2e-6
    assert abs(figure(out, "Maximum KLD:") - kld.max()) < 2e-6
    assert abs(figure(out, "Same top p:") - 100 * (top_b == top_t).mean()) < 2e-3
    c, p = (int(x) for x in np.argwhere(kld > 1e-6)[0])
    where = f"chunk {c} (corpus tokens {c * CTX}..{(c + 1) * CTX - 1}), position {p + CTX // 2}:"
    assert f"first affected: {where}" in out
    # PPL(Q) from the test file's own rows, as llama.cpp reads them
    _, _, tokens, _, _, _, _ = read_kld(runs["ref"])
    nll = -np.take_along_axis(test, tokens[:, CTX // 2 + 1:, None].astype(np.int64), -1)
    ppl = np.exp(nll.mean())
    assert abs(figure(out, "Mean PPL(Q)                   :") - ppl) < 1e-3 * ppl


def test_engine_prompt_logprobs_against_the_base(runs, tmp_path):
    """vLLM's prompt_logprobs of the same model, one request per chunk, top-5 and the prompt token."""
    _, _, tokens, _, _, _, _ = read_kld(runs["ref"])
    requests = []
    for c in range(2):
        ids = tokens[c].tolist()
        ids[0] = BOS
        lp = model_logits(ids).double().log_softmax(-1)
        seq = [None]
        for t in range(1, CTX):
            keep = set(lp[t - 1].topk(5).indices.tolist()) | {ids[t]}
            seq.append({str(i): {"logprob": lp[t - 1, i].item(), "rank": 1} for i in keep})
        requests.append({"prompt_token_ids": ids, "prompt_logprobs": seq})
    engine = tmp_path / "vllm.json"
    engine.write_text(json.dumps(requests))
    for a, b in ((runs["ref"], str(engine)), (str(engine), runs["ref"])):
        code, out, _ = run_tool(["kld", a, b])
        assert code == 0, out
        assert "shared top-k support" in out and figure(out, "Mean    KLD:") < 1e-6
        assert "Same top p: 100.000" in out
    # Another text is an input error (exit status 2), not a failed check.
    requests[1]["prompt_token_ids"][5] += 1
    engine.write_text(json.dumps(requests))
    code, _, err = run_tool(["kld", runs["ref"], str(engine)])
    assert code == 2 and "sequence 1 has token" in err


# ---------------------------------------------------------------------------------------------------------
# Killed, rerun: the same bytes
# ---------------------------------------------------------------------------------------------------------

def test_killed_and_rerun_gives_the_same_bytes(runs):
    tmp = runs["tmp"]
    ref_dir, kill_dir = str(tmp / "six_ref"), str(tmp / "six_kill")
    score(FIXTURE, ref_dir, chunks=6)
    os.makedirs(kill_dir)
    args = corpus_args(FIXTURE, kill_dir, chunks=6)
    journal = os.path.join(kill_dir, "base.kld.partial.json")
    proc = subprocess.Popen([sys.executable, "-m", "inference.tools.parity", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if json.load(open(journal))["chunks_done"] >= 2:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and os.path.isfile(journal), "the run ended before the kill"
    state = json.load(open(journal))
    assert 2 <= state["chunks_done"] < 6
    assert not os.path.exists(os.path.join(kill_dir, "base.kld"))
    # A batch cut short mid-write: bytes past the last commit, dropped when the run continues.
    with open(os.path.join(kill_dir, "base.kld.partial"), "ab") as f:
        f.write(b"\x55" * 1000)
    # Other settings are refused, by name.
    code, _, err = run_tool(args + ["--batch", "2"])
    assert code == 2 and "batch: 1 then, 2 now" in err
    code, out, err = run_tool(args)
    assert code == 0, out + err
    assert f"continuing the partial run of {journal}: {state['chunks_done']} of 6 chunks done" in out
    assert files_of(kill_dir) == files_of(ref_dir)
    assert not os.path.exists(journal)


def test_a_full_disk_is_one_line_and_no_corrupt_file(runs, monkeypatch):
    tmp = runs["tmp"]
    folder = str(tmp / "full")
    os.makedirs(folder)
    real, calls = corpus._pwrite, []

    def disk_fills(fd, data, pos):
        calls.append(pos)
        if len(calls) == 10:     # 3 writes start the files, 5 a chunk (.kld rows, 4 tensors): chunk 1's
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(folder, "base.kld.partial"))
        real(fd, data, pos)

    monkeypatch.setattr(corpus, "_pwrite", disk_fills)
    code, _, err = run_tool(corpus_args(FIXTURE, folder))
    errors = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1, err
    assert errors[0].startswith("error: writing ") and "No space left on device" in errors[0]
    assert "the chunks committed so far (1 of 2) are kept" in errors[0]
    assert not os.path.exists(os.path.join(folder, "base.kld"))
    assert not os.path.exists(os.path.join(folder, "base.safetensors"))
    monkeypatch.setattr(corpus, "_pwrite", real)
    assert run_tool(corpus_args(FIXTURE, folder))[0] == 0
    assert files_of(folder) == files_of(str(tmp / "ref"))
    # Too little space is found before any work.
    monkeypatch.setattr(corpus.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 10))
    empty = str(tmp / "no_room")
    os.makedirs(empty)
    code, _, err = run_tool(corpus_args(FIXTURE, empty))
    assert code == 2 and "GB free on its disk" in err and os.listdir(empty) == []


def test_bad_inputs_are_one_line(runs, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    cases = [(["--text", str(short)], "fewer than one chunk of --ctx 64"),
             (["--ctx", "2"], "--ctx must be at least 3"),
             (["--topk-out", str(tmp_path / "x.bin")], "name it *.safetensors")]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([1, 2, 5000] * 50))
    cases.append((["--tokens", str(ids), "--text", None], "token 5000 at index 2 is outside the vocabulary"))
    for extra, message in cases:
        args = corpus_args(FIXTURE, str(tmp_path))
        for k, v in zip(extra[::2], extra[1::2]):
            i = args.index(k) if k in args else None
            if i is not None:
                del args[i:i + 2]
            if v is not None:
                args += [k, v]
        code, _, err = run_tool(args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (message, err)


# ---------------------------------------------------------------------------------------------------------
# W = 1, W = 2, --offload disk, batching; the floor
# ---------------------------------------------------------------------------------------------------------

def test_offload_disk_invariant_batching_and_prefill_chunks_write_the_same_file(runs):
    tmp = runs["tmp"]
    streamed, out = score(FIXTURE, str(tmp / "disk"), "--offload", "disk")
    assert "offload: " in out and "units run" in out
    assert open(streamed, "rb").read() == open(runs["ref"], "rb").read()
    # In the invariant order a chunk's numbers depend neither on its batch nor on the prefill's calls (here
    # [0, 24), [24, 48), [48, 64): the scored positions 32..62 come from two calls).
    one, _ = score(FIXTURE, str(tmp / "inv1"), "--numerics", "invariant")
    two, _ = score(FIXTURE, str(tmp / "inv2"), "--numerics", "invariant", "--batch", "2")
    parts, _ = score(FIXTURE, str(tmp / "inv3"), "--numerics", "invariant", "--prefill-chunk", "24")
    assert open(one, "rb").read() == open(two, "rb").read() == open(parts, "rb").read()


def test_the_experts_at_their_stored_bytes_make_a_base_inside_the_fast_floor(runs):
    """A CPU server's base with the routed experts and the other Linears computed from their stored bytes
    (the session's loading flags, as generate.py takes them): its distance to the reference's base is the
    fast order's (the host kernel sums the same exact products in its own order; on an AVX-512 machine the
    fixture's numbers come out as the fast order's bits), and the placement is part of the run's identity."""
    tmp = runs["tmp"]
    stored, _ = score(FIXTURE, str(tmp / "stored"), "--numerics", "fast", "--experts-on", "host",
                      "--cpu-linears", "stored")
    manifest = json.load(open(stored + ".manifest.json"))
    assert [manifest[k] for k in ("experts_on", "cpu_linears", "numerics")] == ["host", "stored", "fast"]
    assert json.load(open(runs["fast"] + ".manifest.json"))["experts_on"] == "device"
    _, _, tok_ref, _, _, _, base = read_kld(runs["ref"])
    _, _, tok, _, _, _, got = read_kld(stored)
    assert np.array_equal(tok_ref, tok)
    kl_stored, _, _ = llama_kld(base, got)
    kl_fast, _, _ = llama_kld(base, read_kld(runs["fast"])[-1])
    print(f"mean KLD against the reference: stored bytes {kl_stored.mean():.3g}, fast {kl_fast.mean():.3g}")
    assert kl_stored.mean() <= 2 * kl_fast.mean()


def test_two_ranks_and_the_floor(runs):
    from safetensors.torch import load_file, save_file
    from test_tensor_parallel import reshard
    tmp = runs["tmp"]
    mp2 = tmp / "mp2"
    mp2.mkdir()
    tensors = load_file(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    for rank in range(2):
        save_file(reshard(tensors, 2, rank), str(mp2 / f"model{rank}-mp2.safetensors"))
    shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), mp2 / "tokenizer.json")
    w2_dir = str(tmp / "w2")
    os.makedirs(w2_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = corpus_args(mp2, w2_dir)[:-6] + ["--kld-base", os.path.join(w2_dir, "base.kld")]   # no top-K
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(launcher + ["-m", "inference.tools.parity", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    w2 = os.path.join(w2_dir, "base.kld")
    _, _, tok1, _, _, _, base = read_kld(runs["ref"])
    _, _, tok2, _, _, _, other = read_kld(w2)
    assert np.array_equal(tok1, tok2)
    floor, _, _ = llama_kld(base, other)
    assert 0 < floor.mean() < 5e-3                    # W = 2 sums in another order: close, not equal
    code, out, _ = run_tool(["kld", runs["ref"], runs["perturbed"], "--floor", w2, "--max-kld", "inf",
                             "--min-same-top", "0"])
    assert code == 0, out
    test, _, _ = llama_kld(base, read_kld(runs["perturbed"])[-1])
    line = re.search(r"Mean    KLD: +([\d.]+) ± +[\d.]+ +([\d.]+) ±", out)
    assert abs(float(line.group(1)) - test.mean()) < 2e-6 and abs(float(line.group(2)) - floor.mean()) < 2e-6
    assert f"is {test.mean() / floor.mean():.3g}x the floor's" in out
    # --numerics fast is a floor too; a check on the ratio can fail
    code, out, _ = run_tool(["kld", runs["ref"], runs["perturbed"], "--floor", runs["fast"], "--max-kld",
                             "inf", "--min-same-top", "0", "--max-floor-ratio", "1"])
    assert code == 1 and "mean KLD / floor" in out and "FAILED" in out
