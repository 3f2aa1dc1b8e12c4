"""Invariant numerics end to end (`--numerics invariant`): the same bits for a sequence scored alone or inside
a batch, prefilled in one call or in chunks, with 1, 2 or 4 threads, at W = 1 or 2, and on every machine (the
SHA-256 digests in tests/fixtures/invariant_digests.json were computed on another CPU than yours, probably).
Every comparison here is bit for bit: the order of every reduction is fixed by construction."""
import hashlib
import json
import os

import pytest
import torch

from conftest import FIXTURE, FIXTURES, fixture_file, fixture_model, free_port
import ranks
from inference.config import RuntimeOptions
from inference.engine.scoring import score

DIGESTS = os.path.join(FIXTURES, "invariant_digests.json")
LEN = 96            # tokens prefilled in the chunk tests: past the 64-token window, several groups


def invariant(**kw) -> RuntimeOptions:
    return RuntimeOptions.from_profile("invariant", deterministic_topk=True, **kw)


@pytest.fixture(scope="module")
def model():
    return fixture_model(invariant(), max_batch_size=3)


@pytest.fixture(scope="module")
def seq():
    with open(fixture_file(os.path.join(FIXTURE, "score.json"))) as f:
        return json.load(f)["sequences"][0][:LEN]


def logits_of(model, seqs, prefill_len):
    model.reset()
    return score(model, seqs, prefill_len)["logits"]                 # [L - P + 1, B, V]


def test_a_row_alone_and_inside_a_batch_of_three(model, seq):
    """Prefilled to 60, then decoded across the 64-token window to 76; the other rows end before and
    after it."""
    g = torch.Generator().manual_seed(0)
    others = [torch.randint(4, 1000, (n,), generator=g).tolist() for n in (63, 85)]
    alone = logits_of(model, [seq[:76]], 60)[:, 0]
    batch = logits_of(model, [others[0], seq[:76], others[1]], 60)[:, 1]
    assert torch.equal(alone, batch[:alone.shape[0]])


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_in_one_call_and_in_chunks(model, seq, chunk):
    """Chunks of 7 and 64 all the way; chunks of 1 across the 64-token window (positions 56..71), the rest
    in one call before and one after."""
    ids = torch.tensor([seq])
    model.reset()
    whole = model.prefill(ids, all_logits=True).logits               # [1, L, V]
    model.reset()
    bounds = [0, *range(56, 72), LEN] if chunk == 1 else [*range(0, LEN, chunk), LEN]
    parts = [model.prefill(ids[:, a:b], a, all_logits=True).logits for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(parts, dim=1), whole)


def test_one_two_and_four_threads(model, seq):
    """A prefill of 50 and 3 decode steps (a decode step on a busy 2-core machine at 4 threads costs as much
    as the prefill: more steps repeat the same ops)."""
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            runs.append(logits_of(model, [seq[:53]], 50))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


# ---------------------------------------------------------------------------------------------------------
# W = 2 (gloo) against W = 1
# ---------------------------------------------------------------------------------------------------------

def _worker(rank, port, ckpt_dir, seq, out_dir):
    import torch.distributed as dist
    from encoding.tokenizer import load_tokenizer
    from inference.config import ModelArgs
    from inference.engine.checkpoint import load_checkpoint
    from inference.model import Transformer
    from inference.parallel import ParallelContext
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        par = ParallelContext(2, rank)
        args = ModelArgs.from_file(os.path.join(FIXTURE, "config.json"))
        model = Transformer(args, par, invariant(), tokenizer=load_tokenizer(FIXTURE))
        load_checkpoint(model, ckpt_dir, rank, 2)
        out = score(model, [seq], 40)["logits"]
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_the_w1_bits(model, seq, tmp_path):
    from safetensors.torch import load_file, save_file
    from test_tensor_parallel import reshard
    ckpt = tmp_path / "mp2"
    ckpt.mkdir()
    full = load_file(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    for rank in range(2):
        save_file(reshard(full, 2, rank), str(ckpt / f"model{rank}-mp2.safetensors"))
    # a prefill of 40 and 8 decode steps: both parities of the ratio-2 groups, every step all-reduced
    ranks.spawn(_worker, (free_port(), str(ckpt), seq[:48], str(tmp_path)))
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt") for i in range(2))
    assert torch.equal(r0, r1) and r0.shape[0] == 9
    assert torch.equal(r0, logits_of(model, [seq[:48]], 40))


# ---------------------------------------------------------------------------------------------------------
# Across machines: digests of the logits
# ---------------------------------------------------------------------------------------------------------

def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# The fixture's weights under three other configurations (keys that change behaviour, not shapes): a short
# window with a binding top-k, fewer routed experts with softmax routing and a short Sinkhorn, other RoPE
# scaling. Their digests pin the attention, routing and RoPE paths that the fixture's own config leaves slack.
OTHER_CONFIGS = {
    "window16": dict(window_size=16, index_topk=16, candidate_topk_blocks=4),
    "top2-softmax": dict(n_activated_experts=2, score_func="softmax", route_scale=1.0, hc_sinkhorn_iters=5),
    "yarn8": dict(rope_factor=8, compress_rope_theta=40000.0, original_seq_len=64, window_size=32),
}


def digest_cases():
    """name -> (model builder, sequences, prefill_len): the fixture and three other small configurations."""
    with open(fixture_file(os.path.join(FIXTURE, "score.json"))) as f:
        spec = json.load(f)
    short = [spec["sequences"][0][:120]]
    cases = {"fixture": (lambda: fixture_model(invariant()), spec["sequences"], spec["prefill_len"])}
    for name, keys in OTHER_CONFIGS.items():
        cases[name] = (lambda keys=keys: fixture_model(invariant(), **keys), short, 100)
    return cases


@pytest.mark.parametrize("name", sorted(digest_cases()))
def test_logits_digest_is_the_same_on_every_machine(name):
    with open(fixture_file(DIGESTS)) as f:
        want = json.load(f)[name]
    build, seqs, prefill_len = digest_cases()[name]
    out = logits_of(build(), seqs, prefill_len)
    assert digest(out) == want, f"{name}: the invariant logits moved ({digest(out)}); a bug or an order " \
                                f"that is not fixed by construction"
