"""`--offload disk` (inference/engine/offload.py): the blocks' weights streamed from the shard file give the
same logits, bit for bit, as the model held in memory, in every summation order; between blocks nothing of
them stays in memory but the two reused buffers; a forward that fails mid-way leaves the stream usable;
and generate.py's flag gives the in-memory run's file (the draft head's outputs included)."""
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURE, fixture_file
from test_generate import run_cli

from encoding.tokenizer import load_tokenizer
from inference.config import ModelArgs, RuntimeOptions
from inference.engine.checkpoint import load_model
from inference.engine.errors import InputError
from inference.engine.offload import streamed_names
from inference.engine.scoring import score
from inference.kernels import Derived
from inference.parallel import ParallelContext

SCORE = os.path.join(FIXTURE, "score.json")


# The prefill length of these runs: past the 64-token window, so that the decode steps read a wrapped ring.
# Every forward streams every block whatever its length; the fixture's 301 would only cost time.
PREFILL = 70


def fixture_score_inputs():
    """The fixture's score sequences and the prefill length of these tests."""
    with open(fixture_file(SCORE)) as f:
        seqs = json.load(f)["sequences"]
    assert min(len(s) for s in seqs) > PREFILL + 6
    return seqs, PREFILL


def load(numerics: str, offload: str, batch: int):
    args = ModelArgs.from_file(os.path.join(FIXTURE, "config.json"), max_batch_size=batch)
    opts = RuntimeOptions.from_profile(numerics, engram_on="disk" if offload == "disk" else "device")
    return load_model(FIXTURE, args, ParallelContext.single(), opts, "cpu", load_tokenizer(FIXTURE),
                      log=lambda *a: None, offload=offload)


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].nan_to_num(), b[k].nan_to_num()), k     # bitwise (NaN where a row ended)
        assert torch.equal(a[k].isnan(), b[k].isnan()), k


@pytest.mark.parametrize("numerics", ["reference", "fast", "invariant"])
def test_streamed_scoring_is_bitwise_the_in_memory_scoring(numerics):
    seqs, p = fixture_score_inputs()
    seqs = [s[:p + 6] for s in seqs]      # the prefill and 5 decode steps: more steps prove nothing more
    memory = score(load(numerics, "none", len(seqs)), seqs, p, all_prefill_logits=True)
    model = load(numerics, "disk", len(seqs))
    streamed = score(model, seqs, p, all_prefill_logits=True)
    assert_same(memory, streamed)
    st = model.weight_stream.stats
    n_forwards = len(memory["logits"])
    assert st.blocks_run == n_forwards * (model.args.n_layers + 1)           # the blocks and the head
    shard = os.path.getsize(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    assert 0 < st.bytes_read < n_forwards * shard + shard        # every block read once per forward
    model.weight_stream.close()


def test_between_blocks_only_two_buffers_are_held():
    seqs, p = fixture_score_inputs()
    model = load("fast", "disk", len(seqs))
    stream = model.weight_stream
    score(model, [s[:p + 2] for s in seqs], p)
    params = dict(model.named_parameters())
    names = streamed_names(model)
    assert names[0] == "embed.weight"                                    # mapped, not streamed
    assert all(params[n].is_meta for n in names[1:])                    # released after every unit
    assert not any(params[n].is_meta for n in params if n not in names and ".engram.embed." not in n)
    assert not model.embed.weight.is_meta and model.head.weight.is_meta
    assert model.mtp is None        # the draft head (resident, about a block) is built only for --dspark
    block_bytes = [sum(e.info.nbytes * (2 if e.dtype == torch.float32 and e.info.dtype == "BF16" else 1)
                       for e in entries) for entries in stream.blocks]
    held = sum(t.nbytes for t in stream.slots if t is not None)
    # block_bytes: the 8 blocks, then the head; each slot is one buffer of the largest (64-byte aligned)
    assert held <= 2 * (max(block_bytes) + 64 * max(len(e) for e in stream.blocks)), (held, block_bytes)
    assert held < sum(block_bytes) / 2                            # far less than the whole
    # No layout derived from a streamed weight survives its block (the dequantized copies are dropped); the
    # resident Engram modules keep theirs (which shows that the check sees what a forward keeps).
    kept = {name: len(m.derived) for layer in model.layers for name, m in layer.named_modules()
            if isinstance(getattr(m, "derived", None), Derived)}
    assert all(n == 0 for name, n in kept.items() if not name.startswith("engram")), kept
    assert any(n > 0 for name, n in kept.items() if name.startswith("engram")), kept
    stream.close()


def test_a_forward_that_fails_mid_way_leaves_the_stream_usable():
    seqs, p = fixture_score_inputs()
    seqs = [s[:p + 3] for s in seqs]
    expected = score(load("reference", "none", len(seqs)), seqs, p)
    model = load("reference", "disk", len(seqs))
    fired = []

    def fail_once(module, args):
        if not fired:
            fired.append(True)
            raise RuntimeError("injected")
    hook = model.layers[3].attn.register_forward_pre_hook(fail_once)
    with pytest.raises(RuntimeError, match="injected"):
        score(model, seqs, p)
    hook.remove()
    model.reset()
    assert_same(expected, score(model, seqs, p))
    model.weight_stream.close()


def test_a_shard_that_does_not_match_is_named(tmp_path):
    from safetensors.torch import save_file
    tensors = load_file(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    name = "layers.2.attn.wo_b.weight"
    tensors[name] = tensors[name][:, :-32].contiguous()
    save_file(tensors, str(tmp_path / "model0-mp1.safetensors"))
    with pytest.raises(InputError, match=rf"tensor {name} is .* expected"):
        args = ModelArgs.from_file(os.path.join(FIXTURE, "config.json"))
        load_model(str(tmp_path), args, ParallelContext.single(), RuntimeOptions(engram_on="disk"), "cpu",
                   load_tokenizer(FIXTURE), log=lambda *a: None, offload="disk")


def test_cli_offload_disk_writes_the_in_memory_file(tmp_path):
    seqs, p = fixture_score_inputs()
    spec = tmp_path / "score.json"
    spec.write_text(json.dumps({"sequences": [s[:p + 6] for s in seqs], "prefill_len": p}))
    outs = {}
    for offload in ("none", "disk"):
        outs[offload] = tmp_path / f"{offload}.safetensors"
        proc = run_cli(["--ckpt-path", FIXTURE, "--config", os.path.join(FIXTURE, "config.json"),
                        "--device", "cpu", "--threads", "1", "--score", str(spec), "--dump-logits",
                        str(outs[offload]), "--all-prefill-logits", "--dspark", "--offload", offload])
        assert proc.returncode == 0, proc.stdout + proc.stderr
    # 6 forwards of 8 blocks and the head, plus the draft head's own calls of the (streamed) head
    units = re.search(r"offload: (\d+) units run \(blocks and head\)", proc.stdout + proc.stderr)
    assert units and int(units.group(1)) > 6 * 9, proc.stdout + proc.stderr
    assert_same(load_file(str(outs["none"])), load_file(str(outs["disk"])))


def test_offload_on_a_gpu_is_refused_before_anything_is_built():
    import generate
    o = generate.parse_args(["--ckpt-path", FIXTURE, "--config", "c.json", "--score", "s.json",
                             "--dump-logits", "x.safetensors", "--offload", "disk", "--device", "cuda:0"])
    with pytest.raises(InputError, match=r"^--offload disk runs on the CPU \(not cuda:0\)$"):
        generate.check_options(o)
