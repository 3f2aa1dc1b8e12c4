"""DSpark speculative decoding (docs/architecture.md §11.5): exactness against plain decoding, the
rejection-sampling rule, acceptance statistics, every rank deciding alike, and the DSpark outputs of the
scoring mode."""
import json
import os
import re
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from conftest import (FIXTURE, fixture_config, fixture_file, fixture_model, fixture_tensors, free_port,
                      tiny_model)
import ranks

import generate
import test_generate
from inference.engine import generation
from inference.engine.batch import Budget, PromptBatch
from inference.tools.parity import Tolerances
import inference.engine.speculative as speculative
from inference.engine.speculative import (SpecOptions, greedy_accept, sampled_accept, speculative_generate,
                                          speculative_generate_batch)

PROMPT_LEN = 23      # odd: the ratio-2 compressor ends the prefill inside a group
NEW = 40             # plain decoding's budget: max_seq_len - PROMPT_LEN, positions 23..62: the 16-token
                     # window crossed twice, 20 groups, and index_topk (16) and the candidate blocks (4 of 8)
                     # bind from position 34 on
# Default (exact) order: chunked verification multiplies the k+1 rows of a step in one GEMM where decoding
# multiplies one row; on some CPUs torch's fp32 GEMM rounds a row differently inside a k-row product (on an
# AVX-512/AMX Xeon: 70-95 % of outputs, by up to 1.2e-4), so a near tie can flip there. What holds on every
# CPU: chunked greedy equals plain greedy up to the first token whose plain top-1/top-2 margin is below twice
# the spread that DeepSeek's own code shows between two CPUs (2 x 0.160, the parity tool's tie margin).
# The invariant order holds it bit for bit, with no margin (test_invariant_chunked_is_plain_greedy).
TIE = Tolerances().tie_margin
FORCED = 31          # right drafts all the way: the first token, then 5 steps of 5 accepted drafts + 1
SAMPLED = 20         # sampled runs (T = 1): to position 42 (batch 1), past the window's wrap at 32 and the
                     # top-k binding at 34
SHORTER = 26         # the greedy budget of the MP 2 and invariant runs at batch 2: the longer prompt to
                     # position 48 (the window's wraps at 32 and 48 and the binding top-k crossed), the
                     # shorter one teacher-forced for 6 steps first
CLI_TIMEOUT = 240


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Many small ops: on a busy 2-core machine a second intra-op thread makes a decode step 30x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------
# The acceptance rules on a toy vocabulary
# ---------------------------------------------------------------------------------------------------------

def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit (0 if an outcome of probability 0 was observed)."""
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return 0.0
    expected = probs[keep] * counts.sum()
    assert expected.min() >= 5, "too few trials for the chi-square approximation"
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def toy_bigram(gen, vocab):
    """Target P and draft Q next-token tables [V, V] that disagree a lot, with zeros on both sides."""
    p = torch.rand(vocab, vocab, generator=gen, dtype=torch.float64) + 0.2
    q = torch.rand(vocab, vocab, generator=gen, dtype=torch.float64) + 0.2
    p[:, 0] = 0                           # drafts of token 0 must always be rejected
    q[:, 1] = 0                           # token 1 only ever comes from the residual
    q[:, 2] *= 8                          # the draft overrates token 2
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def speculative_pairs(p, q, trials, k, gen, rule):
    """The first two tokens after context token 3, generated speculatively with `rule`: counts [V, V]."""
    vocab = p.shape[0]
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for _ in range(trials):
        out = []
        while len(out) < 2:
            prev = out[-1] if out else 3
            drafts = []
            for _ in range(k):
                drafts.append(int(torch.multinomial(q[drafts[-1] if drafts else prev], 1, generator=gen)))
            ctx = [prev] + drafts
            a, y = rule(p[ctx].float(), q[ctx[:-1]].float(), torch.tensor(drafts), gen)
            out += drafts[:a] + [y]
        counts[out[0], out[1]] += 1
    return counts


def test_rejection_sampling_reproduces_the_target_distribution():
    """Joint law of the first two emitted tokens (36 cells) equals the target's; false-alarm rate 1e-3."""
    gen = torch.Generator().manual_seed(1234)
    p, q = toy_bigram(gen, 6)
    joint = p[3].unsqueeze(1) * p                                  # P(t1) P(t2 | t1)
    for k in (1, 3):
        counts = speculative_pairs(p, q, 6000, k, gen, sampled_accept)
        pval = chi2_pvalue(counts.flatten(), joint.flatten())
        print(f"k={k}: chi-square p-value {pval:.3f}")
        assert pval >= 1e-3, (k, pval)

    # The test has power: accepting every draft emits the draft's law, and is rejected.
    def accept_all(pp, qq, drafts, g):
        return len(drafts), int(torch.multinomial(pp[-1], 1, generator=g))
    counts = speculative_pairs(p, q, 3000, 3, gen, accept_all)
    assert chi2_pvalue(counts.flatten(), joint.flatten()) < 1e-3


class ToyModel(torch.nn.Module):
    """A stateless stand-in for the Transformer and its DSpark head: the main model's next-token law is the
    bigram table P (its logits, which the loop samples), the drafts are chained draws from the bigram table
    Q."""

    def __init__(self, p, q, blk=5, max_len=64):
        super().__init__()
        from inference import kernels
        from inference.config import RuntimeOptions
        self.args = SimpleNamespace(dspark_block_size=blk, max_seq_len=max_len, temperature=1.0)
        self.nx = kernels.numerics_for(RuntimeOptions(), "cpu")   # the loop samples with the model's numerics
        self.lp, self.lq = p.float().log(), q.float().log()
        self.anchor = torch.nn.Parameter(torch.zeros(1))       # the loop reads the device from here
        self.mtp = self

    def _output(self, ids, all_logits=False):
        from inference.model import Output
        logits = self.lp[ids]                                                   # [B, S, V]
        return Output(logits if all_logits else logits[:, -1], ids.float().unsqueeze(-1))

    def prefill(self, ids, start=0, images=None, token_types=None, all_logits=False):
        return self._output(ids, all_logits)

    def decode(self, ids, pos):
        return self._output(ids)

    def verify(self, ids, start, all_logits=True):
        return self._output(ids, all_logits)

    def rollback(self, keep_until):
        pass

    def seed(self, hidden, start_pos):
        pass

    def draft(self, x, hidden, start_pos, temperature=None):
        if start_pos == 0:
            return None
        blk = self.args.dspark_block_size
        ids = torch.zeros(x.shape[0], blk + 1, dtype=torch.long)
        ids[:, 0] = x
        for i in range(blk):
            ids[:, i + 1] = torch.multinomial(self.lq[ids[:, i]].exp(), 1).view(-1)
        return ids, self.lq[ids[:, :-1]], torch.zeros(x.shape[0], blk)


@pytest.mark.parametrize("verify", ["chunked", "sequential"])
def test_batch_rows_in_step_keep_the_target_distribution(verify, monkeypatch):
    """Two rows speculated together commit the shorter accepted block: each row's first two tokens still
    follow the target's joint law (chi-square, false-alarm rate 1e-3 per row), and the test has power."""
    gen = torch.Generator().manual_seed(99)
    p, q = toy_bigram(gen, 6)
    model = ToyModel(p, q)
    joints = [p[3].unsqueeze(1) * p, p[5].unsqueeze(1) * p]

    def counts(trials):
        c, uneven = torch.zeros(2, 36, dtype=torch.float64), 0
        for _ in range(trials):
            out, _, st = speculative_generate_batch(model, PromptBatch([[0, 3], [1, 5]]), Budget(5, -1),
                                                    SpecOptions(1.0, 3, verify))
            for b in range(2):
                c[b, out[b][0] * 6 + out[b][1]] += 1
            uneven += sum(r0[0] != r1[0] for r0, r1 in st.decisions)
        return c, uneven

    torch.manual_seed(2024)
    c, uneven = counts(3500)
    assert uneven > 500          # steps where one row accepted more than the other: the cut is exercised
    for b in range(2):
        pval = chi2_pvalue(c[b], joints[b].flatten())
        print(f"{verify}, row {b}: chi-square p-value {pval:.3f}")
        assert pval >= 1e-3, (b, pval)
    # Power: accepting every draft, through the same loop, is rejected.
    monkeypatch.setattr(speculative, "sampled_accept",
                        lambda pp, qq, d, g=None: (len(d), int(torch.multinomial(pp[-1], 1))))
    monkeypatch.setattr(speculative.Judge, "check", lambda self, logits, d, q: None)
    c, _ = counts(1500)
    assert chi2_pvalue(c[0], joints[0].flatten()) < 1e-3


def test_the_temperature_travels_with_the_calls(monkeypatch):
    """A greedy run on a model whose config samples at 1.0: every sampling of the main model's logits and
    every draft call is at 0.0, and the config is left as it was."""
    from inference.engine import prefill
    temps = []

    def recorded(sample):
        def at(logits, temperature, nx, *a, **k):
            temps.append(temperature)
            return sample(logits, temperature, nx, *a, **k)
        return at

    for module in (speculative, prefill):
        monkeypatch.setattr(module, "sample", recorded(module.sample))

    class Recording(ToyModel):
        def draft(self, *a, temperature=None):
            temps.append(temperature)
            return super().draft(*a)

    gen = torch.Generator().manual_seed(3)
    model = Recording(*toy_bigram(gen, 6))
    before = vars(model.args).copy()
    for verify in ("chunked", "sequential"):
        speculative_generate_batch(model, PromptBatch([[0, 3], [1, 5]]), Budget(8, -1),
                                   SpecOptions(0.0, 3, verify))
    assert vars(model.args) == before and model.args.temperature == 1.0
    assert len(temps) > 4 and set(temps) == {0.0}


def test_greedy_rule():
    logits = torch.tensor([[0., 5, 1], [3, 0, 1], [0, 0, 9], [1, 2, 0]])
    assert greedy_accept(logits, torch.tensor([1, 0, 2])) == (3, 1)     # all accepted, bonus argmax row 3
    assert greedy_accept(logits, torch.tensor([1, 2, 2])) == (1, 0)     # second draft wrong: argmax row 1
    assert greedy_accept(logits, torch.tensor([0, 0, 2])) == (0, 1)
    assert greedy_accept(logits[:1], torch.tensor([], dtype=torch.long)) == (0, 1)


# ---------------------------------------------------------------------------------------------------------
# A tiny model: the fixture's config and tokenizer, window 16, draft block 5, binding top-k, max_seq_len so
# that generation runs into it; its 8 layers cut to 6 that keep every layer role (window-only with Engram,
# ratio-2 KV and index source with Engram, ratio-2 reuser, ratio-1 KV, index and candidate source, ratio-1
# reuser, ratio-1 index-only source; the fixture's last two repeat the last two roles), DSpark reading the
# last three
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    config = fixture_config(window_size=16, dspark_block_size=5, max_seq_len=PROMPT_LEN + NEW, index_topk=16,
                            candidate_topk_blocks=4)
    assert config["compress_ratios"] == [0, 2, 2, 1, 1, 1, 1, 1, 0, 0]
    assert config["kv_source_layers"] == [1, 3] and config["candidate_source_layer"] == 3
    config.update(n_layers=6, compress_ratios=[0, 2, 2, 1, 1, 1, 0, 0], index_source_layers=[1, 3, 5],
                  dspark_target_layer_ids=[3, 4, 5])
    model = tiny_model(root, config, worlds=(1, 2), seed=7)
    cfg, dirs = model["config"], model["dirs"]
    gen = torch.Generator().manual_seed(0)
    prompt = [0] + torch.randint(4, config["vocab_size"] - 8, (PROMPT_LEN - 1,), generator=gen).tolist()
    # A batch of two prompts of different lengths (the shorter one is teacher-forced past its prefill).
    other = [0] + torch.randint(4, config["vocab_size"] - 8, (PROMPT_LEN - 7,), generator=gen).tolist()
    return {"config": cfg, "dirs": dirs, "root": root, "prompt": prompt, "batch": [other, prompt],
            "vocab": config["vocab_size"]}


def build(ckpt, rank=0, world=1, numerics="reference"):
    from encoding.tokenizer import load_tokenizer
    from inference.engine.checkpoint import load_checkpoint
    from inference.config import ModelArgs, RuntimeOptions
    from inference.model import Transformer
    from inference.parallel import ParallelContext
    args = ModelArgs.from_file(ckpt["config"], max_batch_size=2, temperature=0.0)
    # Stable top-k tie-breaking: bf16 index scores tie, and an extend call ranks them in other shapes.
    opts = RuntimeOptions.from_profile(numerics, deterministic_topk=True)
    path = ckpt["dirs"][world]
    model = Transformer(args, ParallelContext(world, rank), opts, tokenizer=load_tokenizer(path))
    load_checkpoint(model, path, rank, world)
    return model.eval()


@torch.inference_mode()
def plain_greedy(model, prompt, n):
    """generate.py's plain loop for one prompt (the same calls as generate()), recording each token's
    top-1/top-2 logit margin."""
    nxt, logits, _ = generation.prefill(model, torch.tensor([prompt]))
    tokens, margins = [], []
    while True:
        top2 = logits[0].topk(2).values
        tokens.append(int(nxt))
        margins.append(float(top2[0] - top2[1]))
        pos = len(prompt) + len(tokens) - 1
        if len(tokens) == n or pos + 1 >= model.args.max_seq_len:
            return tokens, margins
        nxt, logits = generation.decode_step(model, nxt.view(1, 1), pos)


@torch.inference_mode()
def plain_greedy_batch(model, prompts, n):
    """generation.generate() itself (right padding, prefill up to the shortest prompt, teacher forcing), its
    prefill and decode steps' logits recorded: per row the top-1/top-2 margin of every generated token."""
    logits = []                                    # one [B, V] per position from the shortest prompt's end on

    def recorded(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            logits.append(out[1])
            return out
        return call

    with mock.patch.object(generation, "prefill", recorded(generation.prefill)), \
            mock.patch.object(generation, "decode_step", recorded(generation.decode_step)):
        tokens, _ = generation.generate(model, PromptBatch(prompts), Budget(n, -1))
    top2 = torch.stack(logits).topk(2, dim=-1).values                          # [steps, B, 2]
    margins = (top2[..., 0] - top2[..., 1]).T                                  # [B, steps]
    first = [len(p) - min(len(q) for q in prompts) for p in prompts]
    return tokens, [margins[b, f:f + len(tokens[b])].tolist() for b, f in enumerate(first)]


def suite(model, prompt, batch, verifies, new=NEW + 10, batch1=True):
    """What both the MP 1 and the MP 2 tests check: greedy plain and speculative with each verification in
    `verifies` at batch 2, and a sampled run from a fixed seed. With `batch1`, also at batch 1: plain greedy
    (the reference of the draft-hook tests) and sampled runs with both verifications. Greedy speculative runs
    at batch 1 would repeat batch 2's checks: speculative_generate is the batch loop with one row, and the
    batch holds `prompt` as a row (the draft-hook tests run it at batch 1)."""
    out = {}
    if batch1:
        out["plain"], out["margins"] = plain_greedy(model, prompt, new)
        for verify in ("sequential", "chunked"):
            torch.manual_seed(5)
            tokens, st = speculative_generate(model, prompt, Budget(SAMPLED, -1), SpecOptions(1.0, 5, verify))
            out[f"sampled_{verify}"] = (tokens, st.decisions)
    out["plain2"], out["margins2"] = plain_greedy_batch(model, batch, new)
    for verify in verifies:
        tokens, _, st = speculative_generate_batch(model, PromptBatch(batch), Budget(new, -1),
                                                   SpecOptions(0.0, 5, verify))
        out[f"{verify}2"] = (tokens, st.decisions, st.plain_steps, st.mean_accepted, st.tokens_per_forward,
                             st.discarded)
    torch.manual_seed(6)
    tokens, _, st = speculative_generate_batch(model, PromptBatch(batch), Budget(SAMPLED, -1),
                                               SpecOptions(1.0, 5, "chunked"))
    out["sampled2"] = (tokens, st.decisions)
    return out


def check_chunked(name, got, plain, margins):
    """Chunked must equal plain decoding, except that a top-1/top-2 margin below TIE may flip a token; after
    the first mismatch the contexts differ, so that one is the only position that can be judged."""
    assert len(got) == len(plain)
    mismatch = [i for i, (a, b) in enumerate(zip(got, plain)) if a != b]
    if mismatch:
        i = mismatch[0]
        print(f"{name}: first difference from plain greedy at new token {i} (position {PROMPT_LEN + i}), "
              f"plain top-1/top-2 margin {margins[i]:.3g}")
        assert margins[i] < TIE, (f"{name}: chunked verification differs from plain decoding at new token "
                                  f"{i} where the top-1/top-2 margin is {margins[i]:.3g} >= {TIE}")
    else:
        print(f"{name}: identical to plain greedy ({len(got)} tokens)")


@pytest.fixture(scope="module")
def mp1(ckpt):
    model = build(ckpt)
    # Greedy chunked verification at batch 2 with the real drafts is the MP 2 test's (the same loop, the same
    # check against plain decoding); here with forced drafts (test_batch_of_two_forced_drafts).
    return model, suite(model, ckpt["prompt"], ckpt["batch"], ("sequential",))


def test_sequential_greedy_is_plain_greedy(mp1):
    _, r = mp1
    assert len(r["plain"]) == NEW                  # ran into max_seq_len: window and group boundaries crossed
    tokens, decisions, plain_steps, mean_acc, tpf, _ = r["sequential2"]
    assert [len(t) for t in tokens] == [NEW + 6, NEW] and tokens == r["plain2"]    # batch 2, row 1 = prompt
    assert plain_steps > 0                         # the end near max_seq_len is decoded plainly
    assert mp1[0].args.temperature == 0.0          # the sampled runs' 1.0 went with their calls
    print(f"real drafts (sequential, batch 2): mean accepted length {mean_acc:.2f}, {tpf:.2f} tokens per "
          f"forward")


def test_invariant_chunked_is_plain_greedy(ckpt):
    """Invariant order: chunked verification equals plain decoding bit for bit (no margin), across the
    16-token window's wraps at 32 and 48 and the binding top-k, at batch 2: the batch holds the batch-1
    tests' prompt as a row, and in this order a row's bits do not depend on its batch
    (tests/test_invariant_model.py)."""
    model = build(ckpt, numerics="invariant")
    plain2, _ = plain_greedy_batch(model, ckpt["batch"], SHORTER)
    tokens2, _, _ = speculative_generate_batch(model, PromptBatch(ckpt["batch"]), Budget(SHORTER, -1),
                                               SpecOptions(0.0, 5, "chunked"))
    assert [len(t) for t in plain2] == [SHORTER, SHORTER] and tokens2 == plain2


def test_batch_of_two_greedy_is_plain_batch_greedy(mp1, ckpt):
    """Sequential verification at batch 2 is generate() exactly."""
    model, r = mp1
    plain = r["plain2"]
    assert [len(t) for t in plain] == [NEW + 6, NEW]
    # plain2 is generation.generate()'s own output (plain_greedy_batch runs it)
    tokens, decisions, plain_steps, mean_acc, tpf, _ = r["sequential2"]
    assert tokens == plain
    assert plain_steps >= 5                       # the shorter prompt is teacher-forced first
    print(f"batch 2 (sequential): mean accepted length {mean_acc:.2f}, {tpf:.2f} tokens per forward")
    tokens, decisions = r["sampled2"]     # reproducible from its seed: the MP 2 test's ranks draw alike
    assert [len(t) for t in tokens] == [SAMPLED, SAMPLED] and len(decisions) > 0


def test_batch_of_two_forced_drafts(mp1, ckpt):
    """Both rows drafted right: 6 tokens per forward per sequence. One right, one random: the batch advances
    by the random row's block, the right row re-drafts what it had accepted, output unchanged."""
    model, r = mp1
    plain, lens = r["plain2"], [len(p) for p in ckpt["batch"]]
    gen = torch.Generator().manual_seed(4)

    def hook(noisy_rows):
        def draft(pos, d):
            for b in range(2):
                if b in noisy_rows:
                    d[b] = torch.randint(4, ckpt["vocab"], d[b].shape, generator=gen)
                else:
                    d[b] = torch.tensor(plain[b][pos - lens[b]:pos - lens[b] + d.shape[1]])
            return d
        return draft

    tokens, _, st = speculative_generate_batch(model, PromptBatch(ckpt["batch"]), Budget(FORCED, -1),
                                               SpecOptions(0.0, 5, "chunked"), draft_hook=hook(()))
    print(f"batch 2, forced drafts: {st.tokens_per_forward:.2f} tokens per forward per sequence")
    for b in range(2):
        check_chunked(f"forced row {b}", tokens[b], plain[b][:FORCED], r["margins2"][b])
    if tokens == [p[:FORCED] for p in plain]:
        assert st.mean_accepted == 5 and st.tokens_per_forward == 6
    tokens, _, st = speculative_generate_batch(model, PromptBatch(ckpt["batch"]), Budget(40, -1),
                                               SpecOptions(0.0, 5, "sequential"), draft_hook=hook((1,)))
    assert tokens == [p[:40] for p in plain]
    assert st.tokens_per_forward >= 1 and st.decisions and all(d[0] == (-1, -1) for d in st.decisions)


def test_forced_and_random_drafts(mp1, ckpt):
    model, r = mp1
    prompt, plain = ckpt["prompt"], r["plain"]
    right = lambda pos, d: torch.tensor(plain[pos - PROMPT_LEN:pos - PROMPT_LEN + len(d)])
    tokens, st = speculative_generate(model, prompt, Budget(FORCED, -1), SpecOptions(0.0, 5, "chunked"),
                                      draft_hook=right)
    print(f"forced drafts: mean accepted length {st.mean_accepted:.2f}, "
          f"{st.tokens_per_forward:.2f} tokens per main-model forward")
    check_chunked("forced drafts", tokens, plain[:FORCED], r["margins"])
    if tokens == plain[:FORCED]:
        assert st.steps == 5 and st.mean_accepted == 5 and st.tokens_per_forward == 6

    gen = torch.Generator().manual_seed(3)
    noise = lambda pos, d: torch.randint(4, ckpt["vocab"], d.shape, generator=gen)
    tokens, st = speculative_generate(model, prompt, Budget(40, -1), SpecOptions(0.0, 5, "chunked"),
                                      draft_hook=noise)
    print(f"random drafts: mean accepted length {st.mean_accepted:.2f}, "
          f"{st.tokens_per_forward:.2f} tokens per main-model forward")
    check_chunked("random drafts", tokens, plain[:40], r["margins"])
    assert st.tokens_per_forward >= 1


def test_eos_confidence_threshold_and_one_token_prompt(mp1, ckpt):
    model, r = mp1
    prompt, plain = ckpt["prompt"], r["plain"]
    right = lambda pos, d: torch.tensor(plain[pos - PROMPT_LEN:pos - PROMPT_LEN + len(d)])
    # EOS inside an accepted block: cut before it, like plain decoding.
    eos = plain[33]
    tokens, st = speculative_generate(model, prompt, Budget(100, eos), SpecOptions(0.0, 5, "sequential"),
                                      draft_hook=right)
    assert tokens == plain[:plain.index(eos)] and st.reason == "eos"
    # Threshold 1: no draft is confident enough, every step verifies nothing; threshold 0: all are verified.
    tokens, st = speculative_generate(model, prompt, Budget(12, -1), SpecOptions(0.0, 5, "sequential", 1.0))
    assert tokens == plain[:12] and st.drafted == 0 and st.steps + st.plain_steps == 11
    tokens, st = speculative_generate(model, prompt, Budget(12, -1), SpecOptions(0.0, 3, "sequential", 0.0))
    assert tokens == plain[:12] and st.drafted > 0
    # A one-token prompt: one plain decode step first (start_pos 0 only seeds the rings).
    one, _ = plain_greedy(model, prompt[:1], 15)
    tokens, st = speculative_generate(model, prompt[:1], Budget(15, -1), SpecOptions(0.0, 5, "sequential"))
    assert tokens == one and st.plain_steps >= 1


def test_the_step_hook_sees_every_committed_token_and_can_stop(mp1, ckpt):
    """on_step (what a chat prints while it streams, and where Ctrl-C stops it) gets every committed
    position's ids once, in order, with the right drafts accepted 5 at a time; asked to stop, the loop ends
    after the current step, the completion is what the hook saw, and the reason is "interrupted"."""
    model, r = mp1
    prompt, plain = ckpt["prompt"], r["plain"]
    right = lambda pos, d: torch.tensor([plain[pos - PROMPT_LEN:pos - PROMPT_LEN + d.shape[1]]])   # [1, k]
    seen = []
    tokens, reasons, _ = speculative_generate_batch(model, PromptBatch([prompt]), Budget(20, -1),
                                                    SpecOptions(0.0, 5, "sequential"), draft_hook=right,
                                                    on_step=lambda ids: bool(seen.append(int(ids[0]))))
    assert seen == tokens[0] == plain[:20] and reasons == ["length"]
    seen.clear()
    tokens, reasons, _ = speculative_generate_batch(model, PromptBatch([prompt]), Budget(20, -1),
                                                    SpecOptions(0.0, 5, "sequential"), draft_hook=right,
                                                    on_step=lambda ids: seen.append(int(ids[0])) or
                                                    len(seen) >= 3)
    # the prefill's token, then a step of 5 accepted drafts and the token after them: stopped at 7
    assert seen == tokens[0] == plain[:7] and reasons == ["interrupted"]


def test_sampled_runs_are_reproducible(mp1, ckpt):
    model, r = mp1
    for verify in ("sequential", "chunked"):
        tokens, decisions = r[f"sampled_{verify}"]
        assert len(tokens) == SAMPLED and all(0 <= t < ckpt["vocab"] for t in tokens)
        accepted = [a for a, _ in decisions]
        print(f"T = 1, {verify}: mean accepted length {sum(accepted) / len(accepted):.2f} over "
              f"{len(accepted)} steps")
    # the same seed, the same run (one verification suffices: the draws do not depend on it)
    torch.manual_seed(5)
    again, st = speculative_generate(model, ckpt["prompt"], Budget(SAMPLED, -1),
                                     SpecOptions(1.0, 5, "chunked"))
    assert (again, st.decisions) == r["sampled_chunked"]


# ---------------------------------------------------------------------------------------------------------
# MP 2: two gloo processes run the suite at batch 2 with chunked verification (sequential verification at
# MP 2 is test_cli_speculative_two_ranks); every rank must decide alike
# ---------------------------------------------------------------------------------------------------------


def _worker(rank, port, ckpt, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = build(ckpt, rank, 2)
        out = suite(model, ckpt["prompt"], ckpt["batch"], ("chunked",), new=SHORTER, batch1=False)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_mp2_same_decisions_on_every_rank_and_exactness(ckpt, tmp_path):
    args = {k: ckpt[k] for k in ("config", "dirs", "prompt", "batch")}
    ranks.spawn(_worker, (free_port(), args, str(tmp_path)))
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt") for i in range(2))
    assert r0 == r1                                # tokens, decisions and statistics, greedy and sampled
    assert [len(t) for t in r0["plain2"]] == [SHORTER, SHORTER]
    tokens, _, _, mean_acc, tpf, discarded = r0["chunked2"]
    print(f"MP 2, batch 2 (chunked): mean accepted length {mean_acc:.2f}, {tpf:.2f} tokens per forward, "
          f"{discarded} accepted drafts re-drafted")
    assert tpf >= 1
    for b in range(2):
        check_chunked(f"MP 2 batch row {b} chunked", tokens[b], r0["plain2"][b], r0["margins2"][b])


# ---------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------

def run_cli(args, nproc=1):
    """generate.py through test_generate.run_cli (MP 1 in this process, MP 2 under torchrun)."""
    return test_generate.run_cli(args, nproc=nproc, timeout=CLI_TIMEOUT)


def test_cli_speculative_two_ranks(ckpt):
    """Two prompts of different lengths in one batch of 2, at MP 2: the same completions as plain decoding."""
    root = ckpt["root"]
    (root / "prompts.txt").write_text("Hello! Who are you?\n\nWrite one line about the sea, please.",
                                      encoding="utf-8")
    base = ["--ckpt-path", ckpt["dirs"][2], "--config", ckpt["config"], "--device", "cpu", "--input-file",
            str(root / "prompts.txt"), "--max-new-tokens", "24", "--temperature", "0", "--deterministic-topk",
            "--max-batch-size", "2"]
    runs = {}
    for name, extra in (("plain", []), ("spec", ["--speculative", "dspark", "--spec-verify", "sequential"])):
        runs[name] = run_cli(base + ["--output", str(root / f"{name}.jsonl")] + extra, nproc=2)
        assert runs[name].returncode == 0, runs[name].stdout + runs[name].stderr
    completions = {n: [json.loads(line)["completion"]
                       for line in (root / f"{n}.jsonl").read_text().splitlines()] for n in runs}
    assert len(completions["plain"]) == 2 and completions["plain"][0] != completions["plain"][1]
    assert completions["spec"] == completions["plain"]
    assert "speculative (dspark, sequential verification, k=5):" in runs["spec"].stdout
    assert "mean accepted length" in runs["spec"].stdout
    assert "tokens per main-model forward" in runs["spec"].stdout


@pytest.mark.parametrize("argv, message", [
    (["--input-file", "x", "--spec-k", "3"], "need(s) --speculative dspark"),
    (["--input-file", "x", "--speculative", "dspark", "--spec-k", "0"], "--spec-k must be >= 1"),
    (["--input-file", "x", "--speculative", "dspark", "--spec-min-confidence", "2"], "in [0, 1]"),
    (["--input-file", "x", "--dspark"], "--dspark needs --score"),
    (["--score", "s.json", "--dump-logits", "o", "--speculative", "dspark"],
     "--speculative is for generation"),
])
def test_cli_option_errors(argv, message):
    o = generate.parse_args(["--ckpt-path", "c", "--config", "c.json", "--device", "cpu"] + argv)
    with pytest.raises(generate.CLIError, match=re.escape(message)):
        generate.check_options(o)


def test_cli_spec_k_larger_than_the_block(ckpt):
    o = generate.parse_args(["--ckpt-path", ckpt["dirs"][1], "--config", ckpt["config"], "--device", "cpu",
                             "--input-file", "x", "--speculative", "dspark", "--spec-k", "6"])
    generate.check_options(o)
    with pytest.raises(generate.CLIError, match="exceeds the draft block size"):
        generate.model_args(o, 1)


# ---------------------------------------------------------------------------------------------------------
# DSpark against the official reference (tests/fixtures/reference-tiny/README.md §5, §8.2, §8.3)
# ---------------------------------------------------------------------------------------------------------

def test_score_dspark_matches_reference_fixture(tmp_path):
    fixture = fixture_file(FIXTURE)
    out = tmp_path / "score.safetensors"
    proc = run_cli(["--ckpt-path", fixture, "--config", os.path.join(fixture, "config.json"),
                    "--device", "cpu", "--score", os.path.join(fixture, "score.json"),
                    "--dump-logits", str(out), "--dspark", "--temperature", "0"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours, ref = load_file(str(out)), load_file(os.path.join(fixture, "reference_logits.safetensors"))
    assert torch.equal(ours["dspark_draft_ids"], ref["dspark_draft_ids"])
    dl = (ours["dspark_logits"] - ref["dspark_logits"]).abs()
    dc = (ours["dspark_confidence"] - ref["dspark_confidence"]).abs()
    print(f"end to end: DSpark logits max |d| {dl.max():.4f} mean {dl.mean():.4f}; "
          f"confidence max {dc.max():.4f} mean {dc.mean():.4f}")
    assert dl.max() <= 0.25 and dl.mean() <= 0.03
    # The confidence is one number per row, so its error is that of a whole row rather than the mean of 1024
    # entries: end to end it carries the backbone's noise floor
    # (tests/fixtures/reference-tiny/README.md §8.1) at about 0.04 mean.
    # The layer-isolated test below shows DSpark itself matching to 1e-4.
    assert dc.max() <= 0.25 and dc.mean() <= 0.06


def test_dspark_layer_isolated_matches_reference_fixture():
    """tests/fixtures/reference-tiny/README.md §8.2, step 5: main_hidden built from the recorded streams, so
    only DSpark's own arithmetic counts."""
    model = fixture_model()
    ref, inter = fixture_tensors("reference_logits"), fixture_tensors("intermediates")
    res = []
    for k in range(21):
        streams = inter[f"step{k:02d}.block_out"]
        hidden = torch.cat([streams[t - 1].mean(dim=2) for t in model.args.dspark_target_layer_ids], dim=-1)
        out = model.mtp.draft(ref["generated_ids"][:, k], hidden, 0 if k == 0 else 300 + k)
        assert (out is None) == (k == 0)
        if out is not None:
            res.append(out)
    ids, logits, conf = (torch.stack(t) for t in zip(*res))
    dl, dc = (logits - ref["dspark_logits"]).abs(), (conf - ref["dspark_confidence"]).abs()
    print(f"layer-isolated: DSpark logits max |d| {dl.max():.2e} mean {dl.mean():.1e}; "
          f"confidence max {dc.max():.2e} mean {dc.mean():.1e}")
    assert torch.equal(ids, ref["dspark_draft_ids"])
    assert dl.max() <= 1e-2 and dc.max() <= 1e-2 and dl.mean() <= 1e-4 and dc.mean() <= 1e-4
