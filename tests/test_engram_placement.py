"""Engram tables on the host or on disk (--engram-on): the same logits, bit for bit, as on the device."""
import json
import os

import pytest
import torch

from conftest import FIXTURE, fixture_file, fixture_model

from inference.config import ConfigError, RuntimeOptions
from inference.engine.scoring import score
from inference.engram import ParallelEngramEmbedding
from inference.parallel import ParallelContext


@pytest.fixture(scope="module")
def scored():
    case = json.load(open(fixture_file(os.path.join(FIXTURE, "score.json"))))
    # A prefill of 70 (past the 64-token window) and 5 decode steps: every position looks its rows up the
    # same way, so the fixture's 301 would only cost time.
    p = case["prefill_len"] = 70
    case["sequences"] = [s[:p + 6] for s in case["sequences"]]
    out = {}
    for where in ("device", "host", "disk"):
        model = fixture_model(RuntimeOptions(engram_on=where))
        logits = score(model, case["sequences"], case["prefill_len"])["logits"]
        out[where] = (model, logits)
    return case, out


def test_host_and_disk_logits_are_bit_identical(scored):
    _, out = scored
    ref = out["device"][1]
    assert ref.numel() > 0 and torch.isfinite(ref).all()
    for where in ("host", "disk"):
        assert torch.equal(out[where][1].view(torch.int32), ref.view(torch.int32)), where


def test_tables_live_where_asked_and_only_looked_up_rows_move(scored):
    case, out = scored
    shard = os.path.join(FIXTURE, "model0-mp1.safetensors")
    for where, (model, _) in out.items():
        embeds = [layer.engram.embed for layer in model.layers if layer.engram is not None]
        a = model.args
        for e in embeds:
            assert e.weight.device.type == "cpu" and not e.weight.is_meta
            if where == "disk":        # a view of the memory-mapped shard, not a copy
                assert e.weight.untyped_storage().nbytes() == os.path.getsize(shard)
            # every position looks up (max_ngram - 1) * n_heads rows of head_dim E4M3 + head_dim/32 scales
            cols = (a.engram_max_ngram_size - 1) * a.engram_n_heads
            rows = len(case["sequences"][0]) * cols
            expect = 0 if where == "device" else rows * (a.engram_head_dim + a.engram_head_dim // 32)
            assert e.bytes_moved == expect


def test_sharded_host_lookup_matches_device_per_rank(monkeypatch):
    """W = 2 without a process group: each rank's partial rows (before the all-reduce) agree bitwise, and a
    host rank copies only the rows it holds."""
    monkeypatch.setattr(ParallelContext, "all_reduce", lambda self, x: x)
    g = torch.Generator().manual_seed(0)
    rows, dim = 101, 64
    weight = (torch.randn(rows + 1, dim, generator=g) * 8).to(torch.float8_e4m3fn)
    scale = torch.randint(120, 135, (rows + 1, dim // 32), generator=g).to(torch.uint8)
    ids = torch.randint(0, rows, (2, 7, 6), generator=g)
    for rank in range(2):
        par = ParallelContext(2, rank)
        outs = {}
        for where in ("device", "host"):
            m = ParallelEngramEmbedding(rows, dim, par, where)
            part = slice(m.start, m.start + m.part)
            m.weight.data.copy_(weight[part])
            m.scale.data.view(torch.uint8).copy_(scale[part])
            outs[where] = (m(ids), m.bytes_moved)
        assert torch.equal(outs["host"][0].view(torch.int16), outs["device"][0].view(torch.int16))
        held = ((ids >= m.start) & (ids < m.start + m.part)).sum().item()
        assert outs["host"][1] == held * (dim + dim // 32) and 0 < held < ids.numel()


def test_unknown_placement_is_one_line():
    with pytest.raises(ConfigError, match="unknown Engram placement 'gpu'"):
        RuntimeOptions.from_profile("reference", engram_on="gpu")
