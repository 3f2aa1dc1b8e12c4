"""Every row at its own position (inference/engine/scheduler.py, model.decode with positions per row).

Checked against the official calls, which share nothing with the per-row code: a sequence run through the
scheduler beside others that join and leave at random steps gets, in the invariant order, the tokens and
logits of its prompt prefilled alone and decoded one int position at a time (batch 1); a decode step with
every row at one position given per row equals the shared-position step bit for bit in every order; a
request that fails on its own leaves the others' numbers untouched."""
import random

import pytest
import torch

from conftest import fixture_model
from inference.config import RuntimeOptions
from inference.engine.scheduler import Scheduler, Sequence
from inference.sampling import sample

ROWS = 4
# a top-k of 16 compressed rows (the fixture's own 512 keeps every row): the indexer's selection, the
# candidate blocks and the stale published keys (docs/numerics.md §14.1) all matter past position 33
OVERRIDES = dict(max_batch_size=ROWS, index_topk=16)


def opts(order: str) -> RuntimeOptions:
    return RuntimeOptions.from_profile(order, deterministic_topk=True)


@pytest.fixture(scope="module")
def model():
    return fixture_model(opts("invariant"), **OVERRIDES)


def sequences(n: int, seed: int):
    """n sequences: prompts of 5 to 90 tokens, replies of 1 to 16, some sampled with a seed."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        ids = [rng.randrange(10, 1000) for _ in range(rng.randint(5, 90))]
        sampled = k % 3 == 2
        out.append(Sequence(ids, rng.randint(1, 16), 0.8 if sampled else 0.0, 0.9 if sampled else 1.0,
                            seed=1000 + k if sampled else None, all_logits=k % 4 == 1))
    return out


def alone(model, seq: Sequence):
    """The official calls at batch 1: the prompt in one prefill, then decode steps at int positions, sampled
    as the scheduler samples a row (its own generator). -> (tokens, prompt logits, each token's logits)."""
    model.reset()
    gen = None if seq.seed is None else torch.Generator().manual_seed(seq.seed)
    out = model.prefill(torch.tensor([seq.ids]), all_logits=seq.all_logits).logits
    prompt = out[0] if seq.all_logits else None
    last = out[:, -1] if seq.all_logits else out
    tokens, logits = [], []
    while True:
        t = int(sample(last, seq.temperature, model.nx, gen, seq.top_p)[0])
        tokens.append(t)
        logits.append(last[0])
        if len(tokens) == seq.max_new:
            return tokens, prompt, logits
        last = model.decode(torch.tensor([[t]]), len(seq.ids) + len(tokens) - 1).logits


def run(model, seqs, joins, chunk=None):
    """The sequences through the scheduler, sequence k submitted at step joins[k] -> per sequence (tokens,
    prompt logits, each token's logits)."""
    model.reset()
    sched = Scheduler(model, ROWS, eos_id=-1, chunk=chunk)
    got = {id(s): ([], None, []) for s in seqs}

    def on_token(seq, token, logits):
        got[id(seq)][2].append(logits.clone())

    def on_prompt(seq, logits):
        got[id(seq)] = (got[id(seq)][0], logits.clone(), got[id(seq)][2])

    step = 0
    while step <= max(joins) or not sched.idle():
        for s, j in zip(seqs, joins):
            if j == step:
                sched.submit(s)
        sched.step(on_token, on_prompt)
        step += 1
    return [(s.tokens, got[id(s)][1], got[id(s)][2]) for s in seqs]


def test_each_sequence_equals_its_run_alone_whatever_joins_beside_it(model, monkeypatch):
    chunk = 7                  # rows still in their prompts between decode steps; odd chunks cut groups
    seqs = sequences(7, seed=0)
    rng = random.Random(5)
    joins = sorted(rng.randrange(0, 25) for _ in seqs)
    seqs[1].ids, seqs[1].all_logits, joins[1] = seqs[0].ids[::-1], seqs[0].all_logits, joins[0]   # one call
    want = [alone(model, Sequence(s.ids, s.max_new, s.temperature, s.top_p, s.seed, s.all_logits))
            for s in seqs]
    rows, prefill = [], model.prefill
    monkeypatch.setattr(model, "prefill",
                        lambda ids, *a, **kw: rows.append(ids.shape[0]) or prefill(ids, *a, **kw))
    got = run(model, seqs, joins, chunk)
    assert max(rows) == 2                                 # the two prompts of one length: one call a chunk
    for k, (w, g) in enumerate(zip(want, got)):
        assert g[0] == w[0], f"sequence {k}: tokens"
        assert torch.equal(torch.stack(g[2]), torch.stack(w[2])), f"sequence {k}: logits"
        if seqs[k].all_logits:
            assert torch.equal(g[1], w[1]), f"sequence {k}: prompt logits"
    assert max(len(s.ids) + s.max_new for s in seqs) > 64 + 1              # past the window ring
    assert {s.seed is not None for s in seqs} == {True, False}


@pytest.mark.parametrize("order", ["exact", "fast", "invariant"])
def test_positions_given_per_row_at_one_position_give_the_shared_step_s_bits(order):
    m = fixture_model(opts(order), **OVERRIDES)
    prompt = torch.randint(10, 1000, (3, 71), generator=torch.Generator().manual_seed(0))
    outs = []
    for per_row in (False, True):
        m.reset()
        last, logits = m.prefill(prompt).logits, []
        for i in range(6):                                   # both parities; ratio-2 groups complete
            at = torch.full((3,), 71 + i) if per_row else 71 + i
            last = m.decode(last.argmax(-1, keepdim=True), at).logits
            logits.append(last)
        outs.append(torch.stack(logits))
    assert torch.equal(outs[0], outs[1])


def test_a_request_that_fails_alone_leaves_the_others_bits(model):
    seqs = sequences(3, seed=7)
    bad = Sequence([5] * (model.args.max_seq_len + 1), 3)                # longer than the context
    errors = []
    want = run(model, seqs, [0, 1, 2])
    model.reset()
    sched = Scheduler(model, ROWS, eos_id=-1)
    for s in seqs:
        s.tokens, s.finish, s.done, s.row = [], None, 0, -1
    got = {id(s): [] for s in seqs}
    for step in range(200):
        if step < 3:
            sched.submit(seqs[step])
        if step == 1:
            sched.submit(bad)
        sched.step(lambda s, t, lg: got[id(s)].append(lg.clone()), None,
                   lambda s, e: errors.append((s, str(e))))
        if step > 3 and sched.idle():
            break
    assert [s for s, _ in errors] == [bad] and "max_seq_len" in errors[0][1] and bad.finish == "error"
    for s, w in zip(seqs, want):
        assert s.tokens == w[0] and torch.equal(torch.stack(got[id(s)]), torch.stack(w[2]))
    with pytest.raises(ValueError, match="max_seq_len"):                 # without on_error: raised
        sched.submit(Sequence([5] * (model.args.max_seq_len + 1), 1))
        sched.step(lambda *a: None)
