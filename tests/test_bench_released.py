"""`python -m inference.tools.bench models --models released`: the released widths against the memory roofline
(inference/tools/bench/released.py). The command runs whole on small widths (--widths: the fixture's config);
its arithmetic is checked against independent computations: the bytes a step reads, the distinct experts of
a batch, the released mix and the extrapolation from it. Figures are never asserted, only their relations."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from inference.config import ModelArgs, RuntimeOptions
from inference.kv_cache import entry_bytes
from inference.tools.bench import released as rel
from inference.tools.bench.common import LAYER_KINDS, MIN_RELEASED_LAYERS, ROOT, released_args, released_kinds

FIXTURE_CONFIG = os.path.join(ROOT, "tests", "fixtures", "reference-tiny", "config.json")


def test_the_released_mix_holds_every_kind_and_counts_the_released_40():
    """One layer of each kind (Engram in a second window layer), sharers added alternately by ratio; the
    kinds' released counts add up to config.json's 40 layers, and each kind's ratio and roles are the
    released layers' (KV sources 2, 8, 14, 20; index sources 2, 8, 14, 20, 24, 28, 32, 36; candidates 20)."""
    assert sum(k[-1] for k in LAYER_KINDS) == 40
    cfg = ModelArgs.from_file(os.path.join(ROOT, "config.json"))
    for name, ratio, kv, index, candidate, count in LAYER_KINDS:
        layers = [i for i in range(40) if cfg.compress_ratios[i] == ratio and
                  (i in cfg.kv_source_layers) == kv and (i in cfg.index_source_layers) == index and
                  (i == cfg.candidate_source_layer) == candidate]
        assert len(layers) == count, name
    assert released_kinds(7) == ["window", "window", "ratio-2 source", "ratio-2", "ratio-1 source",
                                 "ratio-1 index source", "ratio-1"]
    assert released_kinds(10).count("ratio-2") == 3 and released_kinds(10).count("ratio-1") == 2
    args = released_args(9, 8, 512, 2)
    assert args.dim == 5120 and args.n_routed_experts == 8 and args.n_layers == 9
    assert args.engram_layer_ids == [1] and args.compress_ratios[:9] == [0, 0, 2, 2, 2, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="needs at least 7 layers"):
        released_kinds(MIN_RELEASED_LAYERS - 1)


def test_distinct_experts_of_a_batch():
    """expected_distinct against a simulation: B tokens each choosing top-6 of 384 uniformly."""
    rng = random.Random(0)
    for batch in (1, 4, 16):
        seen = [len({e for _ in range(batch) for e in rng.sample(range(384), 6)}) for _ in range(4000)]
        assert abs(sum(seen) / len(seen) - rel.expected_distinct(384, 6, batch)) < 0.15
    assert rel.expected_distinct(384, 6, 1) == pytest.approx(6)


def test_cache_bytes_a_step_reads():
    """cache_read_bytes by hand for the released config at position 1023 (1,024 positions): every layer's
    full window ring of FP8 entries (512 codes + 16 scales), and per index source the 512 compressed rows it
    gathers (256 codes + 32 E4M3 scales) and the index keys it scores (64 codes + 4 scales): 1,024 of them
    at ratio 1, 512 at ratio 2."""
    a = ModelArgs.from_file(os.path.join(ROOT, "config.json"))
    window = 40 * 128 * (512 + 16)
    gathered = 8 * 512 * (256 + 32)
    keys = 3 * 512 * (64 + 4) + 5 * 1024 * (64 + 4)
    assert rel.cache_read_bytes(a, True, 1023) == window + gathered + keys
    assert entry_bytes("fp8", 512) == 528
    early = rel.cache_read_bytes(a, True, 9)          # 10 positions: a short ring, 10 / 5 keys, all gathered
    assert early == 40 * 10 * 528 + 3 * 5 * (288 + 68) + 5 * 10 * (288 + 68)


def test_extrapolation_is_the_kinds_times_their_released_counts():
    """extrapolate by hand: each kind's mean layer time times its released count, the routed experts scaled
    by the distinct experts 384 would give the batch, Engram times 2, and what is not a layer as measured."""
    kinds = released_kinds(7)
    layers = [0.010, 0.012, 0.020, 0.015, 0.030, 0.025, 0.014]
    routed = [0.004] * 7
    row = rel.DecodeRow(batch=4, context=1024, step_s=[0.2, 0.2, 0.2], bandwidth=[20.0, 22.0, 21.0],
                        bytes=rel.StepBytes(1_000_000_000, 0, 0, 0), distinct=20.0, layers=layers,
                        routed=routed, engram=[0.003])
    args = ModelArgs.from_file(os.path.join(ROOT, "config.json"))
    released = (args, 18_800_640, 9_000_000_000)
    ext = rel.extrapolate(row, kinds, released, RuntimeOptions())
    scale = rel.expected_distinct(384, 6, 4) / 20.0
    per_kind = {"window": (0.010 + 0.012) / 2, "ratio-2 source": 0.020, "ratio-2": 0.015,
                "ratio-1 source": 0.030, "ratio-1 index source": 0.025, "ratio-1": 0.014}
    want = sum((per_kind[n] + 0.004 * (scale - 1)) * c for n, *_, c in LAYER_KINDS) + 2 * 0.003 + \
        (0.2 - sum(layers) - 0.003)
    assert ext.seconds == pytest.approx(want)
    assert ext.tokens_per_s == pytest.approx(4 / want) and ext.bandwidth_gbs == 21.0
    assert ext.bytes.experts == int(rel.expected_distinct(384, 6, 4) * 40 * 18_800_640)
    assert ext.roofline_tokens_per_s(186.0) == pytest.approx(4 * 186e9 / ext.bytes.total)
    assert row.roofline_fraction == pytest.approx(1e9 / 0.2 / 1e9 / 21.0)


def test_the_command_on_small_widths(tmp_path):
    """The whole command as a user runs it (--json), on the fixture's widths with the released mix: one
    object per (context, batch) with the fields scripts read, each consistent with the others (tokens/s from
    ms, the roofline share from the bytes, the time and the bandwidth, the bytes the sum of their parts, the
    weights those the model holds), the prefill figure; bad flags refused in one line."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "inference.tools.bench", "models", "--models", "released", "--widths",
           FIXTURE_CONFIG, "--experts", "8", "--contexts", "40,70", "--batches", "1,2", "--prefills", "24",
           "--decode-steps", "2", "--experts-on", "host", "--cpu-linears", "stored", "--numerics", "fast",
           "--workdir", str(tmp_path), "--json"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["context"], r["batch"]) for r in records] == [(40, 1), (40, 2), (70, 1), (70, 2)]
    for r in records:
        assert {"batch", "context", "decode_ms", "decode_tokens_per_s", "decode_read_bytes",
                "read_bandwidth_gbs", "roofline_fraction", "prefill_tokens_per_s", "peak_rss_bytes",
                "released_tokens_per_s"} <= set(r)
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["decode_ms"])
        assert r["decode_read_bytes"] == sum(r["read_bytes"].values())
        assert r["roofline_fraction"] == pytest.approx(
            r["decode_read_bytes"] / (r["decode_ms"] / 1e3) / 1e9 / r["read_bandwidth_gbs"])
        assert r["released_tokens_per_s"] == pytest.approx(r["batch"] / r["released_seconds_per_step"])
        assert r["prefill_tokens"] == 24 and r["prefill_tokens_per_s"] > 0 and r["peak_rss_bytes"] > 0
        assert r["distinct_experts"] <= min(8, 3 * r["batch"])
    # the weights a step reads: the blocks' and the head's parameters as held, no routed expert, embedding,
    # Engram table or DSpark stage (an independent walk over the converted shard's tensors; the ratio-2 KV
    # source's compressor projections, layer 2 in the mix, are held in fp32: twice their stored bytes)
    from safetensors import safe_open
    shard = next(str(p) for p in tmp_path.glob("*-mp1/model0-mp1.safetensors"))
    with safe_open(shard, "pt") as f:
        total = 0
        for name in f.keys():
            if ".ffn.experts." in name or name.startswith(("embed.", "mtp.")) or ".engram.embed." in name:
                continue
            t = f.get_slice(name)
            n = 1
            for d in t.get_shape():
                n *= d
            size = n * {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "F4": 1}[t.get_dtype()] // \
                (2 if t.get_dtype() == "F4" else 1)
            total += 2 * size if name.startswith("layers.2.attn.compressor.w") else size
    assert records[0]["read_bytes"]["weights"] == total
    bad = subprocess.run(cmd[:6] + ["--layers", "5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--layers 5: the released mix needs at least 7" in bad.stderr
    bad = subprocess.run(cmd[:6] + ["--batches", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--batches takes positive integers" in bad.stderr


def test_bench_models_with_the_experts_on_the_host_makes_openmp_passive(monkeypatch):
    """As generate.py: `bench models --experts-on host` sets OMP_WAIT_POLICY=PASSIVE before torch loads
    (torch's idle OpenMP workers would spin on the cores the host kernel needs); a value the user set wins,
    and other runs leave it alone."""
    from types import SimpleNamespace
    from inference.tools.bench import __main__ as bench_main
    seen = []
    monkeypatch.setattr(bench_main.importlib, "import_module", lambda name: SimpleNamespace(
        main=lambda rest: seen.append(os.environ.get("OMP_WAIT_POLICY"))))
    for argv, preset, want in [(["models", "--experts-on", "host"], None, "PASSIVE"),
                               (["models", "--experts-on=host"], None, "PASSIVE"),
                               (["models", "--experts-on", "host"], "ACTIVE", "ACTIVE"),
                               (["models"], None, None), (["experts"], None, None)]:
        if preset is None:
            monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        else:
            monkeypatch.setenv("OMP_WAIT_POLICY", preset)
        bench_main.main(argv)
        assert seen[-1] == want, argv
