"""Engram hashing (docs/architecture.md §9.1-9.3): token map, layout and row ids."""
import json
import os

import pytest
import torch

from conftest import FIXTURE, ROOT, fixture_file
from inference.config import ModelArgs
from inference.engram import (DEAD, EngramError, EngramHasher, EngramLayout, build_compressed_token_map,
                              is_prime)

# ---------------------------------------------------------------------------------------------------------
# Released config + real tokenizer (no fixture needed)
# ---------------------------------------------------------------------------------------------------------

RELEASED_PRIMES = [
    [[16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183],
     [16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321],
     [16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463]],
    [[16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627],
     [16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769],
     [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889]],
]
RELEASED_MULTIPLIERS = [
    [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    [67716810739261, 51510806800915, 30921347202721, 82619226485591],
]


@pytest.fixture(scope="module")
def released_args():
    return ModelArgs.from_file(os.path.join(ROOT, "config.json"))


@pytest.fixture(scope="module")
def real_map(tmp_path_factory):
    from encoding.tokenizer import load_tokenizer, write_v41_tokenizer
    d = str(tmp_path_factory.mktemp("v41_tokenizer"))
    write_v41_tokenizer(d)
    return build_compressed_token_map(load_tokenizer(d), expected_size=99092)


def test_real_token_map(real_map):
    token_map, size = real_map
    assert size == 99092
    assert token_map.shape == (129280,) and token_map.dtype == torch.int64
    assert token_map[:3].tolist() == [0, 1, 2]  # pad compressed id = map[engram_pad_id] = 2
    assert int(token_map.max()) == size - 1


def test_released_layout(released_args):
    lay = EngramLayout(released_args, 99092)
    assert lay.primes.tolist() == RELEASED_PRIMES
    assert lay.primes.flatten(1).sum(1).tolist() == [384006168, 384016682]
    assert lay.offsets[0, :9].tolist() == [0, 16000057, 32000136, 48000217, 64000314, 80000435, 96000564,
                                           112000697, 128000880]
    assert lay.offsets[0, -1] == 368005705
    assert lay.offsets[1, :2].tolist() == [0, 16000477] and lay.offsets[1, 2] == 32000964
    assert lay.offsets[1, -1] == 368015793
    assert lay.multipliers.tolist() == RELEASED_MULTIPLIERS


def test_released_worked_example(released_args, real_map):
    token_map, size = real_map
    hasher = EngramHasher(released_args, token_map, size)
    assert hasher.pad == 2
    # Raw ids whose compressed ids are 0, 1234, 56789, 99091 (first id of each key).
    raw = [int((token_map == c).nonzero()[0]) for c in (0, 1234, 56789, 99091)]
    rows = hasher.hash(torch.tensor([raw]), 0)
    assert rows.shape == (1, 4, 2, 24)
    assert rows[0, :, 0, [0, 8, 16]].tolist() == [
        [5702652, 131476717, 257520185],
        [5993266, 137350223, 270517318],
        [4749976, 137539826, 259873627],
        [11404318, 133257355, 257564151],
    ]
    assert rows[0, 3, 1, [0, 8, 16]].tolist() == [12306562, 132290865, 268500474]


# ---------------------------------------------------------------------------------------------------------
# Fixture (reference-tiny)
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    fixture_file(FIXTURE)
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    args = ModelArgs.from_file(os.path.join(FIXTURE, "config.json"))
    tok = Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
    inter = load_file(os.path.join(FIXTURE, "intermediates.safetensors"))
    with open(os.path.join(FIXTURE, "tokens.json")) as f:
        tokens = json.load(f)
    return args, tok, inter, tokens


def test_fixture_token_map_and_layout(tiny):
    args, tok, inter, _ = tiny
    token_map, size = build_compressed_token_map(tok, args.engram_compressed_vocab_size)
    assert size == 725 == int(inter["engram_compressed_vocab_size"])
    assert torch.equal(token_map, inter["engram_token_map"])
    lay = EngramLayout(args, size)
    assert torch.equal(lay.primes, inter["engram_primes"])
    assert torch.equal(lay.offsets, inter["engram_offsets"])
    assert torch.equal(lay.multipliers, inter["engram_multipliers"])


def test_fixture_hashes_all_steps(tiny):
    args, tok, inter, tokens = tiny
    hasher = EngramHasher.from_tokenizer(args, tok)
    prompt, gen = tokens["prompt_ids"], tokens["generated_ids"]
    calls = [(prompt[:301], 0)] + [([gen[k - 1]], 300 + k) for k in range(1, 21)]
    for k, (ids, start_pos) in enumerate(calls):
        rows = hasher.hash(torch.tensor([ids]), start_pos)
        assert torch.equal(rows, inter[f"step{k:02d}.engram_hashes"]), f"step {k}"


def test_map_size_mismatch_names_both(tiny):
    _, tok, _, _ = tiny
    with pytest.raises(ValueError, match=r"725.*726"):
        build_compressed_token_map(tok, expected_size=726)


# ---------------------------------------------------------------------------------------------------------
# Properties, on the small default ModelArgs with a synthetic map
# ---------------------------------------------------------------------------------------------------------

def small_hasher(**kw) -> EngramHasher:
    args = ModelArgs(max_batch_size=4, max_seq_len=64, **kw)
    g = torch.Generator().manual_seed(0)
    token_map = torch.randint(0, 725, (1024,), generator=g)
    token_map[:4] = torch.arange(4)
    return EngramHasher(args, token_map, 725)


def reference_rows(h: EngramHasher, cids: list) -> torch.Tensor:
    """Scalar loop of docs/architecture.md §9.3 over compressed ids (DEAD allowed), for one sequence
    starting at 0."""
    lay = h.layout
    out = torch.zeros(len(cids), lay.n_layers, lay.n_cols, dtype=torch.int64)
    for p in range(len(cids)):
        toks, blocked = [], False
        for s in range(lay.max_ngram):
            blocked = blocked or p < s or cids[p - s] == DEAD
            toks.append(h.pad if blocked else cids[p - s])
        for i in range(lay.n_layers):
            r = 0
            for s, t in enumerate(toks):
                r ^= t * int(lay.multipliers[i, s])
                if s >= 1:
                    for hd in range(lay.n_heads):
                        col = (s - 1) * lay.n_heads + hd
                        out[p, i, col] = r % int(lay.primes[i, s - 1, hd]) + int(lay.offsets[i, col])
    return out


def test_split_calls_match_one_call():
    h = small_hasher()
    ids = torch.randint(4, 1024, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 5:8] = False
    mask[1, 11] = False
    full = h.hash(ids, 0, mask)
    h.reset()
    parts = [h.hash(ids[:, :7], 0, mask[:, :7]), h.hash(ids[:, 7:12], 7, mask[:, 7:12])]
    parts += [h.hash(ids[:, p:p + 1], p, mask[:, p:p + 1]) for p in range(12, 20)]
    assert torch.equal(torch.cat(parts, dim=1), full)


def test_batch_rows_independent():
    h = small_hasher()
    ids = torch.randint(4, 1024, (3, 10), generator=torch.Generator().manual_seed(2))
    together = h.hash(ids, 0)
    for b in range(3):
        h.reset()
        assert torch.equal(h.hash(ids[b:b + 1], 0), together[b:b + 1])


def test_matches_scalar_reference_and_dead_blocking():
    h = small_hasher()
    ids = torch.randint(4, 1024, (1, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 6] = False
    ids[0, 6] = 129264  # an image placeholder id outside the map must be ignored where masked
    rows = h.hash(ids, 0, mask)
    cids = [int(h.token_map[t]) if m else DEAD for t, m in zip(ids[0].tolist(), mask[0].tolist())]
    assert torch.equal(rows[0], reference_rows(h, cids))
    # The dead position hashes pads only; the next three positions look back as if the sequence began at 7.
    assert torch.equal(rows[0, 6], reference_rows(h, [h.pad])[0])
    h2 = small_hasher()
    assert torch.equal(rows[0, 7:10], h2.hash(ids[:, 7:10], 0)[0])
    # From 4 positions after the dead token on, rows equal those of the unmasked sequence.
    h2.reset()
    unmasked_ids = ids.clone()
    unmasked_ids[0, 6] = 5
    assert torch.equal(rows[0, 10:], h2.hash(unmasked_ids, 0)[0, 10:])


def test_limits_and_state():
    h = small_hasher()
    with pytest.raises(ValueError, match="max_seq_len = 64"):
        h.hash(torch.zeros(1, 2, dtype=torch.int64), 63)
    with pytest.raises(ValueError, match="max_batch_size = 4"):
        h.hash(torch.zeros(5, 1, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="out of range"):
        h.hash(torch.tensor([[1024]]), 0)
    assert len(h.state_dict()) == 0
    with pytest.raises(EngramError, match="725.*726"):
        EngramHasher(ModelArgs(engram_compressed_vocab_size=726), torch.arange(725), 725)


def test_row_sum_mismatch_names_both():
    with pytest.raises(ValueError, match=r"6126.*6127"):
        EngramLayout(ModelArgs(engram_num_embeddings=[6127, 6332]), 725)


def test_is_prime():
    assert [n for n in range(60) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43,
                                                     47, 53, 59]
    assert is_prime(16000057) and not is_prime(16000057 * 16000079)
