"""The launch counter (inference/tools/bench/launches.py, `python -m inference.tools.bench launches`): today's
counts of a decode step and of a prefill call pinned as upper bounds, per shape, route and batch, so that a
change that adds device work to a step fails here (a count, not a timing); a CUDA decode step reads nothing
on the host. The CUDA routes run on fake CUDA tensors (a CUDA build of torch, no GPU; .ci/run's oldest end
has one); the CPU orders on real tensors of random weights.

When a change lowers a count, lower its bound here to the printed figure (and docs/benchmarks.md §5)."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

needs_cuda_build = pytest.mark.skipif(
    not torch.backends.cuda.is_built(),
    reason="needs CUDA: a CUDA build of torch (no GPU needed); .ci/run has one")

# (shape, route, batch) -> (decode launches, prefill launches) at most; a prompt of 301 tokens (the released
# geometry: 9, a small call whose experts take the decode step's fixed shapes; a decode step's count does not
# depend on the context). A cast that copies counts (the convention of the official code's figures).
BOUNDS = {
    ("fixture", "tilelang", 1): (1378, 2245),
    ("fixture", "tilelang", 4): (1378, 2245),
    ("fixture", "torch", 1): (3557, 7126),
    ("fixture", "torch", 4): (3629, 7126),
    ("released", "tilelang", 1): (5146, 5692),
    ("released", "torch", 1): (15466, 17164),
    ("fixture", "exact", 1): (7974, 14688),
    ("fixture", "fast", 1): (4284, 7043),
    ("fixture", "invariant", 1): (15335, 25868),     # (its GEMMs take a path by the values)
}


def check(shape, route, batch, prompt=301):
    from inference.tools.bench.launches import count_route
    got = count_route(shape, route, batch, prompt)
    decode, prefill = BOUNDS[(shape, route, batch)]
    print(shape, route, batch, "decode", got["decode"]["launches"], "prefill", got["prefill"]["launches"])
    assert got["decode"]["launches"] <= decode, (got["decode"]["launches"], got["decode"]["places"])
    assert got["prefill"]["launches"] <= prefill, got["prefill"]["launches"]
    return got


@needs_cuda_build
@pytest.mark.parametrize("route", ["tilelang", "torch"])
@pytest.mark.parametrize("batch", [1, 4])
def test_cuda_routes_on_the_fixture(route, batch):
    got = check("fixture", route, batch)
    assert got["decode"]["syncs"] == 0, got["decode"]["sync_sites"]
    # the prefill's routed experts read their counts once per MoE layer: a bincount and its list
    assert set(got["prefill"]["sync_sites"]) == {
        "bincount at inference/kernels/experts.py:active_counts",
        "value read on the host (tolist) at inference/kernels/experts.py:active_counts"}


@needs_cuda_build
@pytest.mark.parametrize("route", ["tilelang", "torch"])
def test_cuda_routes_at_the_released_geometry(route):
    """40 layers with the released roles, 384 experts top-6."""
    got = check("released", route, 1, prompt=9)
    assert got["decode"]["syncs"] == 0, got["decode"]["sync_sites"]
    # every module kind is there, and the routed experts of a decode step are a few launches per layer
    assert all(got["decode"]["kinds"].get(k, 0) > 0 for k in ("attention", "indexer", "compressor",
                                                              "routed experts", "shared expert", "gate",
                                                              "Engram", "hyper-connections", "norms"))
    if route == "tilelang":     # 17 a layer: 3 expert GEMMs, 2 row launches, SwiGLU, the combine, 4 casts
        assert got["decode"]["kinds"]["routed experts"] <= 17 * 40


def test_a_cast_is_a_launch_when_it_copies():
    """`.to(dtype)` is an alias in its schema (it returns its input when the dtype is already the one asked
    for), so the rule that skips views must not skip it: a cast that copies is one launch, one that does not
    is none."""
    from inference.tools.bench.launches import DeviceOps
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    counter = DeviceOps("cpu")
    with counter:
        counter.phase = "decode"
        y = x.float()                                   # a copy
        x.bfloat16(), y.to(torch.float32), y.view(4, 2, 32)
        x.to(torch.float8_e4m3fn)                       # a copy
    assert counter.total("decode") == 2


@pytest.mark.parametrize("route", ["exact", "fast", "invariant"])
def test_cpu_orders_on_the_fixture(route):
    got = check("fixture", route, 1)
    assert got["decode"]["syncs"] is None                      # a CPU run has no device to wait for


def test_the_command_prints_json_and_refuses_a_bad_route(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "inference.tools.bench", "launches", *a],  # noqa
                                    cwd=ROOT, capture_output=True, text=True, timeout=300)
    r = run("--shapes", "fixture", "--routes", "fast", "--batches", "1", "--prompt", "40", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["route"], x["phase"]) for x in rows] == [("fast", "decode"), ("fast", "prefill")]
    assert rows[0]["launches"] > 0 and set(rows[0]["kinds"]) <= {
        "attention", "indexer", "compressor", "routed experts", "shared expert", "gate", "Engram",
        "hyper-connections", "norms", "embedding", "head", "sampling", "call setup"}
    r = run("--routes", "cuda")
    assert r.returncode == 2 and "unknown route 'cuda'" in r.stderr and "Traceback" not in r.stderr
