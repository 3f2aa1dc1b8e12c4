"""The CUDA route run on a CPU machine, on fake CUDA tensors (torch's FakeTensorMode): every tensor of a model
built on `cuda` carries its shape, dtype and device and no values, so what a GPU run runs on the torch route
(`--kernel-backend torch`: the fast order, and golden numerics) runs here: prefill, decode steps, an extend
and its rollback, a speculative step, the Engram tables on the host and on disk, sampling, the scoring loop;
on the fixture's shapes and on the released widths (two layers). An op that mixes a cuda and a cpu tensor
raises FakeTensorDeviceMismatchError. Every read of a value on the host (item, tolist, bool, int, a nonzero,
a bincount, a boolean-mask index, a copy to the host, cuda.synchronize) is recorded with its call site by the
launch counter's recorder (inference/tools/bench/launches.py), which hands back a stand-in (a bincount's
selections spread over the experts, empty masks) so that the run goes on; each phase's set is compared
with the one kept here, so a new sync fails the test. A decode step has none. The TileLang
wrappers' argument checks run on fake CUDA tensors with their kernels stubbed.

A CUDA build of torch is needed (PyPI's Linux wheels; no GPU): the CPU-only build cannot index a tensor of
another device, fake or not. `.ci/run` runs this file in its CUDA-build environment."""
import contextlib
import json
import os
from contextlib import contextmanager

import pytest
import torch

from conftest import FIXTURE, ROOT, fixture_file

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                reason="needs CUDA: a CUDA build of torch (no GPU needed); .ci/run has one")
aten = torch.ops.aten
RELEASED = os.path.join(ROOT, "config.json")
FAST = "reference"            # the default order on CUDA is the fast one


@contextmanager
def fake_cuda(monkeypatch):
    """The launch counter's recorder (inference/tools/bench/launches.py DeviceOps) inside its fake CUDA: every
    host sync recorded per phase (rec.phase) with its call site (rec.syncs), each op counted (rec.ops);
    reads of values on the host get stand-ins so that the run goes on."""
    from inference.tools.bench.launches import DeviceOps, fake_cuda as fake
    rec = DeviceOps("cuda", stand_in=True)
    with fake(rec), rec:
        yield rec


def fixture_shaped(**over):
    from inference.config import ModelArgs
    return ModelArgs.from_file(fixture_file(os.path.join(FIXTURE, "config.json")),
                               **{"max_batch_size": 3, "max_seq_len": 96, **over})


def released_two_layers(**over):
    """The released widths: a ratio-2 and a ratio-1 layer (KV, index and candidate sources), then the DSpark
    stage; 8 experts, the released vocabulary and Engram table sizes, no ViT."""
    from inference.config import ModelArgs
    with open(RELEASED) as f:
        c = json.load(f)
    c.update(n_layers=2, n_mtp_layers=1, compress_ratios=[2, 1, 0], kv_source_layers=[0, 1],
             index_source_layers=[0, 1], candidate_source_layer=1, dspark_target_layer_ids=[1],
             engram_layer_ids=[0], engram_num_embeddings=c["engram_num_embeddings"][:1], n_routed_experts=8,
             dspark_n_routed_experts=8, vision_n_layers=0, max_batch_size=3, max_seq_len=256, **over)
    return ModelArgs.from_dict(c)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from encoding.tokenizer import load_tokenizer, write_v41_tokenizer
    d = tmp_path_factory.mktemp("v41")
    write_v41_tokenizer(str(d))
    return {"fixture": load_tokenizer(FIXTURE), "released": load_tokenizer(str(d))}


def build(args, tokenizer, numerics="reference", par=None, **opts):
    from inference.config import RuntimeOptions
    from inference.model import Transformer
    o = RuntimeOptions.from_profile(numerics, **{"kernel_backend": "torch", **opts})
    return Transformer(args, par=par, opts=o, device="cuda", tokenizer=tokenizer)


def one_rank_of(world_size: int):
    """Rank 0 of `world_size` ranks, run alone: its collectives return rank 0's own share (all-gather: W
    copies of it), so the rank's slice of the model runs a forward with every shape a real rank 0 has."""
    from inference.parallel import ParallelContext

    class OneRankOf(ParallelContext):
        def all_reduce(self, x):
            return x

        def all_gather_cat(self, x, dim=-1):
            return torch.cat([x] * self.world_size, dim=dim)

        def broadcast_object(self, obj, src=0):
            return obj

        def barrier(self):
            pass

    return OneRankOf(world_size, 0, None)


def factory_checked_stub(calls=None):
    """A stand-in for tilelang_ops._compiled: the kernel's factory runs (its argument checks, a prim_func at
    these sizes), the kernel does not; `calls` collects (settings, name, args, prim_func, tensors)."""
    from inference.kernels import tilelang_ops as ops
    made = {}

    def compiled(settings, name, *args):
        ops._settings(settings)
        key = (name, args)
        if key not in made:
            made[key] = ops.FACTORIES[name](*args)

        def kernel(*tensors):
            if calls is not None:
                calls.append((settings, name, args, made[key], tensors))
        return kernel
    return compiled


def run_phases(rec, model, prompt=24, batch=2):
    """What a GPU run runs, phase by phase; the recorder's phase names the step."""
    from inference.engine import generation, scoring
    from inference.engine.batch import Budget, PromptBatch
    from inference.engine.speculative import SpecOptions, speculative_generate_batch
    v = model.args.vocab_size
    ids = torch.randint(4, v - 8, (batch, prompt + 8), device="cuda")
    rec.phase = "prefill"
    model.prefill(ids[:, :prompt])
    rec.phase = "decode"
    generation.decode_step(model, ids[:, prompt:prompt + 1], prompt, temperature=0.0)
    rec.phase = "decode, sampled"       # decode_step's call, at a temperature of its own
    generation.decode_step(model, ids[:, prompt + 1:prompt + 2], prompt + 1, temperature=1.0)
    rec.phase = "extend"
    model.verify(ids[:, prompt + 2:prompt + 6], prompt + 2)
    rec.phase = "rollback"
    model.rollback(prompt + 3)
    rec.phase = "prefill in chunks"
    generation.prefill(model, ids[:, :prompt], chunk=10, temperature=0.0)
    if model.mtp is not None:
        rec.phase = "speculative (prefill, then one step)"
        speculative_generate_batch(model, PromptBatch([[5] * prompt] * batch), Budget(6, -1),
                                   SpecOptions(0.0, 2))
    rec.phase = "scoring loop"
    scoring.score(model, [[5] * (prompt + 3)] * batch, prompt)
    return dict(rec.syncs)


LOOPED = {("bincount", "inference/kernels/experts.py:active_counts"),
          ("value read on the host (tolist)", "inference/kernels/experts.py:active_counts")}
EXPECTED_FAST = {
    # decode steps (greedy and sampled), the extend and its rollback: none
    # a prefill's routed experts loop over the active experts: their counts are read once per MoE layer
    "prefill": LOOPED,
    "prefill in chunks": LOOPED,
    # the speculative loop decides on the host what it accepts (that is the algorithm), then reads the
    # completions; its prefill loops as above; its draft and verification calls add none
    "speculative (prefill, then one step)": LOOPED | {
        ("cuda.synchronize", "inference/engine/speculative.py:_sync"),
        ("value read on the host (bool)",
         "inference/engine/speculative.py:speculative_generate_batch.<locals>.<listcomp>"),
        ("value read on the host (bool)", "inference/engine/speculative.py:speculative_generate_batch"),
        ("value read on the host (int)", "inference/engine/speculative.py:greedy_accept"),
        ("value read on the host (tolist)", "inference/engine/batch.py:read_completions")},
    # the scoring loop copies each forward's logits to the host and times each call
    "scoring loop": LOOPED | {("copy to the host", "inference/engine/scoring.py:score"),
                              ("cuda.synchronize", "inference/engine/generation.py:_sync")},
}


@pytest.mark.parametrize("shape", ["fixture", "released"])
def test_fast_route_syncs_and_devices(shape, tokenizers, monkeypatch):
    with fake_cuda(monkeypatch) as rec:
        args = fixture_shaped() if shape == "fixture" else released_two_layers()
        model = build(args, tokenizers[shape])
        assert type(model.nx).__name__ == "Fast" and model.nx.device.type == "cuda"
        assert all(p.device.type == "cuda" for p in model.parameters())
        rec.syncs.clear()
        got = run_phases(rec, model)
    print(json.dumps({k: sorted(v) for k, v in got.items()}, indent=1))
    assert {k: v for k, v in got.items() if v} == EXPECTED_FAST


def test_golden_numerics_on_cuda(tokenizers, monkeypatch):
    """Golden numerics (fp32, no quantisation) keep the exact order's expert loop: a sync per MoE in every
    call, decode steps included (golden is a parity baseline, not a serving mode)."""
    with fake_cuda(monkeypatch) as rec:
        model = build(fixture_shaped(), tokenizers["fixture"], "golden")
        assert model.nx.golden and model.ctx.act_dtype == torch.float32
        rec.syncs.clear()
        got = run_phases(rec, model)
    assert got["decode"] == LOOPED and got["prefill"] == LOOPED


@pytest.mark.parametrize("where", ["host", "disk"])
def test_engram_tables_off_the_device(where, tokenizers, monkeypatch):
    """The tables in host memory (or mapped from the shard file): the rows a call needs are selected and
    gathered on the host, then copied over; those are the only syncs a decode step adds."""
    with fake_cuda(monkeypatch) as rec:
        model = build(fixture_shaped(), tokenizers["fixture"], engram_on=where)
        for table in (layer.engram.embed for layer in model.layers if layer.engram is not None):
            if where == "disk":                      # what the loader maps from the shard file
                for name in ("weight", "scale"):
                    p = getattr(table, name)
                    table.attach(name, torch.empty(p.shape, dtype=p.dtype, device="cpu"))
            assert table.weight.device.type == "cpu"
        rec.syncs.clear()
        ids = torch.randint(4, 1000, (2, 30), device="cuda")
        model.prefill(ids[:, :24])
        rec.phase = "decode"
        model.decode(ids[:, 24:25], 24)
    looked_up = "inference/engram.py:ParallelEngramEmbedding.forward"
    assert rec.syncs["decode"] == {("boolean-mask index", looked_up), ("copy to the host", looked_up)}


def test_a_decode_step_runs_the_same_ops_at_every_batch_size(tokenizers, monkeypatch):
    """No Python loop grows with the batch in a fast decode step on a GPU (the routed experts indexed with
    shapes fixed by the batch and top-k): the same op count at batch 1 and 2, and at 3 (where batch x top-k
    passes the expert count, the other fixed form: every local expert on every token)."""
    counts = []
    with fake_cuda(monkeypatch) as rec:
        model = build(fixture_shaped(), tokenizers["fixture"])
        for batch in (1, 2, 3):
            ids = torch.randint(4, 1000, (batch, 30), device="cuda")
            model.prefill(ids[:, :24])
            rec.phase = f"decode at batch {batch}"
            model.decode(ids[:, 24:25], 24)
            counts.append(rec.ops[rec.phase])
    print("fast decode step ops on CUDA at batch 1, 2, 3:", counts)
    assert counts[0] == counts[1] and counts[2] > 0


def test_a_device_mismatch_is_caught(tokenizers, monkeypatch):
    from torch._subclasses import fake_tensor
    mismatch = getattr(fake_tensor, "FakeTensorDeviceMismatchError", RuntimeError)   # torch < 2.13: the base
    with fake_cuda(monkeypatch):
        model = build(fixture_shaped(), tokenizers["fixture"])
        with pytest.raises(mismatch, match="devices"):
            model.layers[0].attn.wq_a(torch.zeros(1, 1, model.args.dim, dtype=torch.bfloat16))   # on the CPU


def test_tilelang_wrappers_check_their_arguments_on_fake_cuda(monkeypatch):
    """The wrappers' checks (dtype, shape, contiguity, device) on fake CUDA tensors of the shapes the model
    passes, with the compiled kernels stubbed; wrong arguments are named in one line."""
    from inference.kernels import tilelang_ops as ops
    monkeypatch.setattr(ops, "_compiled", factory_checked_stub())
    with fake_cuda(monkeypatch):
        x = torch.zeros(3, 256, dtype=torch.bfloat16, device="cuda")
        q, s = ops.act_quant(x)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 8)
        w = torch.zeros(128, 256, dtype=torch.float8_e4m3fn, device="cuda")
        sc = torch.zeros(4, 8, dtype=torch.float8_e8m0fnu, device="cuda")
        assert ops.fp8_gemm(x, w, sc).shape == (3, 128)
        w4 = torch.zeros(128, 128, dtype=torch.float4_e2m1fn_x2, device="cuda")
        s4 = torch.zeros(128, 8, dtype=torch.float8_e8m0fnu, device="cuda")
        assert ops.fp4_gemm(x, w4, s4).shape == (3, 128)
        qa = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16, device="cuda")
        kv = torch.zeros(1, 50, 128, dtype=torch.bfloat16, device="cuda")
        idx = torch.zeros(1, 2, 16, dtype=torch.int32, device="cuda")
        sink = torch.zeros(8, device="cuda")
        assert ops.sparse_attn(qa, kv, sink, idx, 0.1).shape == qa.shape
        pre, post, comb = ops.hc_split_sinkhorn(torch.zeros(2, 24, device="cuda"),
                                                torch.zeros(3, device="cuda"), torch.zeros(24, device="cuda"),
                                                4, 20, 1e-6)
        assert comb.shape == (2, 4, 4)
        assert ops.index_scores(qa[..., :64].contiguous(), kv[..., :64].contiguous(),
                                torch.zeros(1, 2, 8, dtype=torch.bfloat16, device="cuda")).shape == (1, 2, 50)
        for bad, message in ((lambda: ops.fp8_gemm(x.float()[:, :100], w, sc), "x must be"),
                             (lambda: ops.fp8_gemm(x, w.t(), sc), "weight must be"),
                             (lambda: ops.sparse_attn(qa, kv.cpu(), sink, idx, 0.1),
                              "kv must be a CUDA tensor"),
                             (lambda: ops.act_quant(torch.zeros(256, 64, dtype=torch.bfloat16,
                                                                device="cuda").t()), "must be contiguous")):
            with pytest.raises(ValueError, match=message):
                bad()


# The fixture's o_groups = 2 admits W = 1 and 2 only; the released config W = 1, 2, 4 and 8.
@pytest.mark.parametrize("shape,world", [("fixture", 1), ("fixture", 2), ("released", 1), ("released", 2),
                                         ("released", 4), ("released", 8)])
def test_the_tilelang_route_passes_its_wrappers_checks(shape, world, tokenizers, monkeypatch):
    """A model on the TileLang route (the GPU taken as compute capability 9.0, the kernels stubbed, their
    factories run) as rank 0 of `world`: every call the model makes passes the wrappers' checks (dtypes,
    shapes, contiguity, devices) and the kernel factories accept its sizes (index scores at W = 8: 4 heads,
    padded to 8), in a prefill, a decode step and an extend; and the route adds no host sync to a decode step
    either."""
    from inference import kernels
    from inference.kernels import tilelang_ops as ops
    monkeypatch.setattr(kernels, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(kernels, "_tilelang_imports", lambda: True)
    calls = []
    monkeypatch.setattr(ops, "_compiled", factory_checked_stub(calls))
    with fake_cuda(monkeypatch) as rec:
        args = fixture_shaped() if shape == "fixture" else released_two_layers()
        model = build(args, tokenizers[shape], kernel_backend="auto", par=one_rank_of(world))
        assert type(model.nx).__name__ == "TileLang"
        ids = torch.randint(4, 1000, (2, 30), device="cuda")
        rec.syncs.clear()
        rec.phase = "prefill"
        model.prefill(ids[:, :24])
        rec.phase = "decode"
        model.decode(ids[:, 24:25], 24)
        rec.phase = "extend"
        model.verify(ids[:, 25:28], 25)
    assert rec.syncs["prefill"] == LOOPED      # the experts loop over their active ones (each GEMM a kernel)
    assert not rec.syncs["decode"] and not rec.syncs["extend"]      # fixed-shape experts, as the fast order
    heads = {args[0] for _, name, args, _, _ in calls if name == "index_scores"}
    assert heads == {ops.index_heads(model.args.index_n_heads // world)}, heads
    # every kernel was called: a prefill's expert loop runs the GEMMs (the stand-in bincount spreads its
    # selections over the experts), a decode step the expert GEMM kernel
    assert {name for _, name, _, _, _ in calls} == set(ops.FACTORIES)


def test_launches_stay_within_the_grid_and_int32_limits(monkeypatch):
    """More than 65,535 query rows in one call (CUDA's cap on a grid's y and z) and, past that, tensors of
    2^31 elements or more (TileLang's int32 indexing): every launch's grid, read from the kernel's prim_func
    at the call's sizes, and every tensor it receives stay within the limits, and the launches cover every
    row once."""
    from inference.kernels import tilelang_ops as ops
    calls = []
    monkeypatch.setattr(ops, "_compiled", factory_checked_stub(calls))
    with fake_cuda(monkeypatch):
        c = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="cuda")
        for b, m, n in ((1, 70_000, 4_096), (2, 70_000, 4_096), (3, 40_000, 600_000)):
            ops.sparse_attn(c(b, m, 64, 512), c(b, n, 512), c(64, dtype=torch.float32),
                            c(b, m, 640, dtype=torch.int32), 0.04)
            ops.index_scores(c(b, m, 4, 128), c(b, n // 2, 128), c(b, m, 4))
        ops.fp8_gemm(c(5_000_000, 512), c(2048, 512, dtype=torch.float8_e4m3fn),
                     c(64, 16, dtype=torch.float8_e8m0fnu))
    seen = {}
    for _, name, _, prim_func, tensors in calls:
        grid = ops.launch_grid(prim_func, *tensors)
        assert all(g <= limit for g, limit in zip(grid, ops.MAX_GRID)), (name, grid)
        assert max(t.numel() for t in tensors) <= ops.MAX_ELEMS, (name, [t.shape for t in tensors])
        if name in ("sparse_attn", "index_scores"):
            rows = seen.setdefault((name, tensors[0].shape[2]), [])
            rows.append(tensors[-1].shape[0] * tensors[-1].shape[1])
    assert any(len(r) > 1 for r in seen.values())          # a call was cut into launches
    # each (kernel, head count) call above: launches' rows add up to b * m
    assert sorted(sum(r) for r in seen.values()) == sorted(
        [70_000 + 140_000 + 120_000] * 2), seen


def test_the_step_a_cuda_graph_captures_reads_no_position_on_the_host(tokenizers, monkeypatch):
    """--cuda-graph's step (a tensor position, a length bucket): no host sync, and the same ops at every
    position of a bucket and parity, so one capture replays at all of them (engine/cuda_graph.py)."""
    from inference.engine.cuda_graph import bucket
    from inference.state import DecodeStep
    counts = {}
    with fake_cuda(monkeypatch) as rec:
        model = build(fixture_shaped(), tokenizers["fixture"], deterministic_topk=True)
        ids = torch.randint(4, 1000, (2, 30), device="cuda")
        model.prefill(ids[:, :24])
        rec.syncs.clear()
        for p in (40, 42, 41, 43):
            rec.phase = f"graphed step at {p}"
            step = DecodeStep(torch.tensor(p, device="cuda"), p % 2, bucket(p, 96, minimum=32))
            model.decode(ids[:, 24:25], step)
            counts[p] = rec.ops[rec.phase]
    assert not any(rec.syncs[f"graphed step at {p}"] for p in counts)
    assert counts[40] == counts[42] and counts[41] == counts[43], counts


def test_the_device_checks_in_process_phases_on_fake_cuda(tokenizers, monkeypatch, tmp_path, capsys):
    """What the device check runs in its own process on the GPU, on fake CUDA: the speed phase's timed
    decode steps and its launch count of one (its token ids must reach the model's device: the Engram lookup
    mixes them with CUDA tables) and the cudagraph phase's model and steps (the captured step run eagerly,
    as in the rehearsal: no graph on fake tensors; the checkpoint's values are not loaded: fake tensors hold
    none).
    What this proves: both phases run on CUDA tensors without a device mismatch, and the cudagraph phase
    compares what it should (each batch's steps of fp32 logits brought to the host, [steps, batch, vocab])
    and turns the comparison into its verdict and its line. Fake tensors hold no values, so whether the
    logits agree is the device's to say: the comparison is answered here, once equal, once not."""
    from inference.engine import checkpoint
    from inference.tools import gpu_check
    from inference.tools.gpu_check import cudagraph, speed

    class OnFakeCuda(gpu_check.Ctx):
        device = property(lambda self: "cuda")

    prompt, steps = 31, 2                           # across the 32 bucket, both parities
    compared, answer = [], [True]

    def equal(a, b):                                # fake logits have no values: record what is compared
        compared.append([(t.shape, t.dtype, t.device.type) for t in (a, b)])
        return answer[0]

    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda model, path: None)
    monkeypatch.setattr(torch, "equal", equal)
    monkeypatch.setattr(cudagraph, "REHEARSAL_CUDAGRAPH", (prompt, steps))

    with fake_cuda(monkeypatch):
        model = build(fixture_shaped(), tokenizers["fixture"], deterministic_topk=True)
        eager, replayed, launches = speed.decode_speed(model, 2, 16, 2, False, torch.Generator(), True)
        assert eager > 0 and replayed > 0 and launches > 100
        ctx = OnFakeCuda({}, FIXTURE, str(tmp_path), gpu_check.Clock(600), rehearse=True)
        capsys.readouterr()
        assert gpu_check.phase_cudagraph(ctx) is True
        agreed = capsys.readouterr().out
        answer[0] = False
        assert gpu_check.phase_cudagraph(ctx) is False
        differed = capsys.readouterr().out
    vocab = fixture_shaped().vocab_size
    assert compared == [[((steps, batch, vocab), torch.float32, "cpu")] * 2 for batch in (1, 4)] * 2
    for batch in (1, 4):
        assert f"cudagraph batch {batch}: {steps} steps from position {prompt}" in agreed
    assert agreed.count("identical logits") == 2 and "DIFFER" not in agreed
    assert differed.count("logits DIFFER") == 2


# the routing, its weights and the tokens copied into pinned buffers, then one wait for the three copies
HOST_EXPERTS = {("copy to the host", "inference/kernels/host_experts.py:PinnedStage.to_host"),
                ("cuda.synchronize", "inference/kernels/host_experts.py:PinnedStage.synchronize")}


@pytest.mark.parametrize("copy", [False, True])
def test_experts_on_the_host_beside_a_gpu(copy, tokenizers, monkeypatch):
    """--experts-on host on a GPU: the routed experts' tensors on the CPU, everything else on `cuda`; no
    device mismatch, and a decode step's only syncs are the routing's trip to the host (one wait per MoE
    layer for its three copies into pinned buffers, HostExperts' PinnedStage).
    The host kernel's torch path runs on the fake CPU tensors (the native one reads real memory); the
    routing's counts, read on the host, are stood in for. Both routes: the kernel, and the active experts
    copied over."""
    from inference.kernels import experts
    monkeypatch.setenv("DSV4_HOST_EXPERTS", "torch")
    # the routing read on the host (fake values): every selection on the first expert, so the kernel runs
    monkeypatch.setattr(experts, "active_counts", lambda idx, n: [idx.numel()] + [0] * (n - 1))
    monkeypatch.setattr(experts, "prefers_copy", lambda *a: copy)
    with fake_cuda(monkeypatch) as rec:
        model = build(fixture_shaped(), tokenizers["fixture"], experts_on="host")
        routed = {id(p) for n, p in model.named_parameters() if ".experts." in n}
        assert routed and all(p.device.type == ("cpu" if id(p) in routed else "cuda")
                              for p in model.parameters())
        rec.syncs.clear()
        ids = torch.randint(4, 1000, (2, 30), device="cuda")
        rec.phase = "prefill"
        model.prefill(ids[:, :24])
        rec.phase = "decode"
        model.decode(ids[:, 24:25], 24)
    print(json.dumps({k: sorted(v) for k, v in rec.syncs.items()}, indent=1))
    assert rec.syncs["decode"] == HOST_EXPERTS and rec.syncs["prefill"] == HOST_EXPERTS


def test_generation_replays_decode_steps_from_cuda_graphs_by_default(tokenizers, monkeypatch):
    """The capture path on fake CUDA: generate.py's default on a GPU turns graphs on (with deterministic
    top-k) and says nothing; GraphedDecode runs each new (batch, bucket, parity) step once eagerly on a side
    stream, captures it and replays it at the positions that follow (torch's stream, graph and capture
    calls stood in for: fake tensors have no driver). A mode that cannot use graphs says so in one line."""
    from inference.engine import generation
    from inference.engine.batch import Budget, PromptBatch
    from inference.engine.cuda_graph import GraphedDecode, choose_graphs

    class Stub:
        def __init__(self, *a, **k):
            self.replays = 0

        def wait_stream(self, other):
            pass

        def replay(self):
            self.replays += 1

    graphs = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", Stub)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stub())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: graphs.append(Stub()) or graphs[-1])
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    lines = []
    with fake_cuda(monkeypatch):
        from inference.config import RuntimeOptions
        args = fixture_shaped(max_seq_len=320)
        opts = RuntimeOptions.from_profile("reference", kernel_backend="torch")
        on, opts = choose_graphs(None, "cuda", opts, args, lines.append)
        assert on and opts.deterministic_topk and not lines
        off, _ = choose_graphs(None, "cuda", RuntimeOptions(experts_on="host"), args, lines.append)
        assert not off and lines == ["CUDA graphs off: --experts-on host computes the routed experts on the "
                                     "host, between the GPU's kernels; decode steps run eagerly"]
        model = build(args, tokenizers["fixture"], deterministic_topk=True)
        graphed = GraphedDecode(model)
        prompts = [[5 + i for i in range(252)], [7 + i for i in range(250)]]
        generation.generate(model, PromptBatch(prompts), Budget(10, -1), graphs=graphed)
    # decode steps at positions 250..260 of a batch of 2 (the longer prompt teacher-forced): buckets 256 and
    # 320 (max_seq_len), both parities, each captured once and replayed at the rest
    assert sorted(graphed.graphs) == [(2, 256, 0), (2, 256, 1), (2, 320, 0), (2, 320, 1)]
    assert graphed.captured == 4 and sum(g.replays for g in graphs) == 11 - 4
    assert graphed.summary().startswith("CUDA graphs: 4 captured in ")
