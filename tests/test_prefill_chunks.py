"""`generate.py --prefill-chunk` (inference/engine/prefill.py): a prompt prefilled in chunks against one call,
on the fixture's weights: at W = 2 within the end-to-end floor in the default order (the same floor as the
fixture's conformance tests), at W = 2 the bits of one call at W = 1 in --numerics invariant; chunk
boundaries that never cut an image span; the speculative loop, block capture and all-prefill logits with
chunks; one-line errors for chunk sizes that cannot work."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURE, fixture_file, fixture_model
from test_generate import assert_clean_error, run_cli

from inference.config import RuntimeOptions
from inference.engine.batch import Budget
from inference.engine.errors import InputError
from inference.engine.prefill import check_chunk, chunk_bounds, prefill

PREFILL = 557        # chunks of 512: [0, 512) and [512, 557), an odd boundary-crossing second chunk


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A score file of the fixture's tokens twice (560 positions: prefill 557, then 3 decode steps) and the
    fixture resharded for W = 2."""
    from test_tensor_parallel import reshard
    root = tmp_path_factory.mktemp("chunks")
    with open(fixture_file(os.path.join(FIXTURE, "score.json"))) as f:
        seq = json.load(f)["sequences"][0]
    (root / "score.json").write_text(json.dumps({"sequences": [(seq + seq[1:])[:PREFILL + 3]],
                                                 "prefill_len": PREFILL}))
    tensors = load_file(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    (root / "mp2").mkdir()
    for rank in range(2):
        save_file(reshard(tensors, 2, rank), str(root / "mp2" / f"model{rank}-mp2.safetensors"))
    shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), root / "mp2" / "tokenizer.json")
    return root


def score(setup, name, world, numerics, chunk=None):
    """generate.py --score on the long file -> its logits [4, 1, V] (ties broken by the lowest index: torch's
    choice among tied bf16 index scores depends on the tensor's shape, docs/numerics.md §13.1)."""
    out = setup / f"{name}.safetensors"
    ckpt = FIXTURE if world == 1 else str(setup / "mp2")
    args = ["--ckpt-path", ckpt, "--config", os.path.join(FIXTURE, "config.json"), "--device", "cpu",
            "--max-seq-len", "1024", "--deterministic-topk", "--numerics", numerics,
            "--score", str(setup / "score.json"), "--dump-logits", str(out)]
    proc = run_cli(args + ([] if chunk is None else ["--prefill-chunk", str(chunk)]), nproc=world)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = "calls of at most 512 tokens" if chunk else "one call per prompt"
    assert said in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return load_file(str(out))["logits"]


# Each CLI run prefills 557 tokens; a W = 1 chunked run adds nothing that these two tests and the in-process
# chunk tests (tests/test_invariant_model.py, tests/test_long_context.py) do not already prove.

def test_chunks_of_512_within_the_floor_in_the_default_order(setup):
    one = score(setup, "exact_one_w2", 2, "reference")
    chunked = score(setup, "exact_512_w2", 2, "reference", 512)
    d = (chunked - one).abs()
    print(f"W = 2, default order, chunks of 512 vs one call: max |d| {d.max():.3g}, mean {d.mean():.3g}")
    assert d.max() <= 0.25 and d.mean() <= 0.03


def test_chunks_of_512_give_the_bits_of_one_call_in_invariant_numerics(setup):
    one = score(setup, "inv_one_w1", 1, "invariant")
    assert torch.equal(score(setup, "inv_512_w2", 2, "invariant", 512), one)     # chunks and W = 2 at once


def test_chunk_sizes_that_cannot_work_are_one_line(setup):
    proc = run_cli(["--ckpt-path", FIXTURE, "--config", os.path.join(FIXTURE, "config.json"),
                    "--device", "cpu", "--score", str(setup / "score.json"),
                    "--dump-logits", str(setup / "x.safetensors"), "--max-seq-len", "1024",
                    "--prefill-chunk", "0"])
    assert_clean_error(proc, "--prefill-chunk must be a positive number of tokens, got 0")
    assert not os.path.exists(setup / "x.safetensors")
    for chunk, message in ((-3, "got -3"), (1025, "--prefill-chunk 1025 is larger than --max-seq-len 1024")):
        with pytest.raises(InputError, match=message):
            check_chunk(chunk, 1024)
    check_chunk(1024, 1024)


def test_chunk_bounds_never_cut_an_image_span():
    assert chunk_bounds(10, None) == [(0, 10)] and chunk_bounds(10, 16) == [(0, 10)]
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    # a boundary inside [5, 9) moves back to its start; a span longer than the chunk gets a chunk of its own
    assert chunk_bounds(12, 6, [(5, 9)]) == [(0, 5), (5, 11), (11, 12)]
    assert chunk_bounds(20, 4, [(2, 11)]) == [(0, 2), (2, 11), (11, 15), (15, 19), (19, 20)]
    for bounds in (chunk_bounds(30, 7, [(3, 10), (12, 13), (20, 29)]), chunk_bounds(30, 1, [(0, 30)])):
        assert bounds[0][0] == 0 and bounds[-1][1] == 30
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert not any(s < e < t for _, e in bounds for s, t in [(3, 10), (12, 13), (20, 29)])


def test_speculative_capture_and_all_prefill_logits_with_chunks(tmp_path):
    """Invariant numerics on the fixture: speculative greedy decoding after a prefill in chunks of 13 (the
    DSpark rings seeded chunk by chunk) gives the tokens of a prefill in one call; scoring with chunks of 16
    writes every prefill position's logits (the same bits) and one capture step per call."""
    from inference.engine.scoring import score as score_fn, score_with_capture
    from inference.engine.speculative import SpecOptions, speculative_generate
    with open(fixture_file(os.path.join(FIXTURE, "score.json"))) as f:
        seq = json.load(f)["sequences"][0]
    model = fixture_model(RuntimeOptions.from_profile("invariant"), temperature=0.0)
    runs = {}
    for chunk in (None, 13):
        model.reset()
        runs[chunk] = speculative_generate(model, seq[:40], Budget(8, -1, chunk),
                                           SpecOptions(0.0, 4, "chunked"))[0]
    assert runs[13] == runs[None] and len(runs[None]) == 8
    model.reset()
    whole = score_fn(model, [seq[:44]], 40, all_prefill_logits=True)
    model.reset()
    caps = str(tmp_path / "caps.safetensors")
    chunked = score_with_capture(model, [seq[:44]], 40, caps, all_prefill_logits=True, prefill_chunk=16)
    for key in ("prefill_logits", "logits"):
        assert torch.equal(chunked[key], whole[key]), key
    steps = load_file(caps)
    assert [int(steps[f"step{k:02d}.start_pos"]) for k in range(3)] == [0, 16, 32]   # then the 4 decode steps
    assert f"step{3 + 4:02d}.start_pos" not in steps and int(steps["step06.start_pos"]) == 43


def test_prefill_in_one_call_is_the_default_engine_path():
    """prefill() with no chunk makes one forward call (what every existing result was computed with)."""
    calls = []

    class Recorder:
        args = type("Args", (), {"temperature": 0.0})()
        nx = None                                          # greedy: the engine's argmax needs no numerics

        def prefill(self, ids, start=0, **kw):
            from inference.model import Output
            calls.append((ids.shape[1], start))
            return Output(torch.zeros(1, 5), None)

    prefill(Recorder(), torch.zeros(1, 9, dtype=torch.long))
    prefill(Recorder(), torch.zeros(1, 9, dtype=torch.long), chunk=4)
    assert calls == [(9, 0), (4, 0), (4, 4), (1, 8)]
