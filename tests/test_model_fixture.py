"""Conformance with the official reference on the tiny fixture
(tests/fixtures/reference-tiny/README.md §8)."""

import pytest
import torch

from conftest import fixture_model, fixture_tensors
from inference.hyper import hc_pre
from inference.state import ForwardCall, Handoff

STEPS = 21


@pytest.fixture(scope="module")
def fx():
    return fixture_model(), fixture_tensors("reference_logits"), fixture_tensors("intermediates")


def step_inputs(ref, k):
    """Teacher forcing: the prompt at step 0, then generated_ids[k-1] at position 300 + k."""
    if k == 0:
        return ref["prompt_ids"], 0
    return ref["generated_ids"][:, k - 1:k], 300 + k


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def test_layer_isolated(fx):
    """Each block fed the recorded input stream and collapse weights reproduces the recorded outputs."""
    model, ref, inter = fx
    model.reset()
    worst = {"block_out": 0.0, "pre_mix": 0.0, "engram": 0.0, "logits": 0.0, "final_norm": 0.0}
    with torch.inference_mode():
        for k in range(STEPS):
            ids, pos = step_inputs(ref, k)
            r = lambda name: inter[f"step{k:02d}.{name}"]
            hashes = model.engram_hasher.hash(ids, pos)
            assert torch.equal(hashes, r("engram_hashes")), f"step {k}: engram hashes"
            streams = model.embed(ids).unsqueeze(2).repeat(1, 1, 4, 1)
            worst["engram"] = max(worst["engram"], rel(model.layers[0].engram(streams, hashes[:, :, 0]),
                                                       r("engram_out")[0]),
                                  rel(model.layers[1].engram(r("block_out")[0], hashes[:, :, 1]),
                                      r("engram_out")[1]))
            call = (ForwardCall.prefill(0, ids.shape[1], model.args, "cpu") if pos == 0
                    else ForwardCall.decode(pos, model.args, "cpu"))
            handoff = Handoff(published_at_start=model.published.cache)
            for layer in range(8):
                x = r("engram_out")[layer] if layer < 2 else r("block_out")[layer - 1]
                if layer == 0:
                    pre = torch.zeros(*x.shape[:3])
                    pre[..., 0] = 1
                else:
                    pre = r("block_pre_mix")[layer - 1]
                out, pre_next, handoff = model.layers[layer](x, call, pre, None, handoff)
                worst["block_out"] = max(worst["block_out"], rel(out, r("block_out")[layer]))
                worst["pre_mix"] = max(worst["pre_mix"],
                                       (pre_next - r("block_pre_mix")[layer]).abs().max().item())
                if layer in (1, 3, 5, 7):
                    assert torch.equal(call.offset_rows(handoff.topk), r(f"indexer_idxs.layer{layer}")), \
                        f"step {k} layer {layer}: indexer selection"
                if layer == 3:
                    assert torch.equal(handoff.candidates, r("candidates").bool()), \
                        f"step {k}: candidates"
            normed = model.norm(hc_pre(r("block_out")[7], r("block_pre_mix")[7], model.nx))
            worst["final_norm"] = max(worst["final_norm"], rel(normed, r("final_norm")))
            worst["logits"] = max(worst["logits"],
                                  (model.head(normed) - ref["step_logits"][k]).abs().max().item())
            if k == 0:
                all_logits = model.head(normed, all_positions=True)
                assert (all_logits - ref["prefill_all_logits"]).abs().max().item() <= 1e-4
    print("layer-isolated worst:", worst)
    assert worst["engram"] <= 1e-3
    assert worst["block_out"] <= 1e-3
    assert worst["pre_mix"] <= 1e-4
    assert worst["final_norm"] <= 1e-3
    assert worst["logits"] <= 1e-4


def run_teacher_forced(model, ref, dspark=True):
    model.reset()
    logits, drafts = [], []
    for k in range(STEPS):
        ids, pos = step_inputs(ref, k)
        out, main_hidden = model.prefill(ids) if pos == 0 else model.decode(ids, pos)
        logits.append(out)
        if dspark:
            res = model.mtp.draft(ref["generated_ids"][:, k], main_hidden, pos)
            if k > 0:
                drafts.append(res)
    return torch.stack(logits), drafts


def test_end_to_end_teacher_forced(fx):
    model, ref, _ = fx
    logits, drafts = run_teacher_forced(model, ref)
    d = (logits - ref["step_logits"]).abs()
    print(f"step_logits max |d| {d.max():.4f} mean {d.mean():.5f}")
    assert d.max() <= 0.25 and d.mean() <= 0.03
    assert torch.equal(logits.argmax(-1), ref["step_logits"].argmax(-1))
    ids = torch.stack([x[0] for x in drafts])
    dl = (torch.stack([x[1] for x in drafts]) - ref["dspark_logits"]).abs()
    dc = (torch.stack([x[2] for x in drafts]) - ref["dspark_confidence"]).abs()
    print(f"dspark logits max |d| {dl.max():.4f} mean {dl.mean():.5f}; confidence max {dc.max():.4f}")
    assert torch.equal(ids, ref["dspark_draft_ids"])
    assert dl.max() <= 0.25 and dl.mean() <= 0.03 and dc.max() <= 0.25


def test_dspark_does_not_feed_back(fx):
    model, ref, _ = fx
    with_spec, _ = run_teacher_forced(model, ref, dspark=True)
    without, _ = run_teacher_forced(model, ref, dspark=False)
    assert torch.equal(with_spec, without)


def test_reset_changes_nothing(fx):
    model, ref, _ = fx
    ids, _ = step_inputs(ref, 0)
    model.reset()
    model.prefill(ids[:, :50])
    b = model.prefill(ids).logits    # a longer prefill over stale state
    model.reset()
    c = model.prefill(ids).logits
    assert torch.equal(b, c)


def test_batch_of_two_right_padded(fx):
    """Two prompts of different lengths in one batch, run like the official generate loop (prefill the
    shortest length, then one position per call, the longer row teacher-forced from its prompt), give each
    row what it gets alone, up to the batch-composition noise of docs/numerics.md §13.2."""
    _, ref, _ = fx
    model = fixture_model(max_batch_size=2)
    text = torch.cat([ref["prompt_ids"], ref["generated_ids"]], dim=1)[0]        # 322 tokens
    total, lens = 306, [301, 290]         # row 0 teacher-forced over 290..300, then both rows decode
    batch = torch.stack([text[:total], text[6:6 + total]])

    def run(rows):
        """Logits predicting positions short..total-1, keyed by the position of the last input token."""
        model.reset()
        short = min(lens[i] for i in rows)
        outs = {short - 1: model.prefill(batch[rows, :short]).logits}
        for pos in range(short, total - 1):
            outs[pos] = model.decode(batch[rows, pos:pos + 1], pos).logits
        return outs

    both = run([0, 1])
    for i in (0, 1):
        alone = run([i])
        got = torch.stack([both[p][i] for p in sorted(alone)])
        want = torch.stack([alone[p][0] for p in sorted(alone)])
        d = (got - want).abs()
        assert d.max() <= 0.25 and d.mean() <= 0.03, (i, d.max().item(), d.mean().item())
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * d.max()
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
