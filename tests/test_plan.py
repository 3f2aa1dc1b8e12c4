"""Memory planner (inference/engine/memory.py, inference/tools/plan.py): exact weight and cache bytes against
real tensors and converted shard files, the released totals, the stated workspace against a measured peak,
and the loader's pre-load check."""
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from conftest import FIXTURE, ROOT, fixture_file

from inference.config import ModelArgs, RuntimeOptions
from inference.engine.memory import GIB, PlanError, gib, parse_bytes, plan_memory, workspace_bytes
from inference.parallel import ParallelContext
from inference.safetensors_io import read_header

FIXTURE_CONFIG = os.path.join(FIXTURE, "config.json")
RELEASED_CONFIG = os.path.join(ROOT, "config.json")
HF_TENSOR_BYTES = 510_286_023_000   # the released checkpoint's index: metadata.total_size


def real_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def shard_tensor_bytes(path: str):
    """(sum of the header's tensor sizes, file size minus the 8-byte length and the header)."""
    infos, _ = read_header(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return sum(i.nbytes for i in infos.values()), os.path.getsize(path) - 8 - n


@pytest.fixture(scope="module")
def fixture_mp2(tmp_path_factory):
    """The fixture converted by convert.py at --model-parallel 2 (the checkpoint alone is its input)."""
    import convert
    src = tmp_path_factory.mktemp("fixture_src")
    for name in ("model0-mp1.safetensors", "tokenizer.json"):
        shutil.copy(fixture_file(os.path.join(FIXTURE, name)), src / name)
    out = tmp_path_factory.mktemp("fixture_mp2")
    convert.convert(str(src), str(out), 2, log=lambda *_: None, progress=False)
    return out


def test_weights_equal_the_fixture_model_w1():
    from conftest import fixture_model
    model = fixture_model()
    r = plan_memory(model.args, 1).ranks[0]
    assert r.weights_bytes == real_bytes(model.parameters())
    engram = [p for n, p in model.named_parameters() if ".engram.embed." in n]
    assert r.weights["engram_tables"] == real_bytes(engram) > 0
    header, payload = shard_tensor_bytes(os.path.join(FIXTURE, "model0-mp1.safetensors"))
    assert r.file_bytes == header == payload


def test_weights_equal_converted_shards_w2(fixture_mp2):
    from inference.engine.checkpoint import load_checkpoint
    from inference.model import Transformer
    args = ModelArgs.from_file(FIXTURE_CONFIG)
    plan = plan_memory(args, 2)
    for rank in range(2):
        model = Transformer(args, ParallelContext(2, rank))
        load_checkpoint(model, str(fixture_mp2), rank, 2)
        assert plan.ranks[rank].weights_bytes == real_bytes(model.parameters())
        header, payload = shard_tensor_bytes(str(fixture_mp2 / f"model{rank}-mp2.safetensors"))
        assert plan.ranks[rank].file_bytes == header == payload


@pytest.mark.parametrize("packed", [True, False])
def test_cache_bytes_equal_the_buffers_a_real_model_allocates(packed):
    import re
    from encoding.tokenizer import load_tokenizer
    from inference.model import Transformer
    args = ModelArgs.from_file(FIXTURE_CONFIG, max_batch_size=3, max_seq_len=256)
    opts = RuntimeOptions(packed_kv=packed)
    model = Transformer(args, opts=opts, tokenizer=load_tokenizer(FIXTURE))
    caches = plan_memory(args, 1, opts).ranks[0].caches
    real = real_bytes(model.buffers())                  # the Engram hasher is a submodule: included
    real += real_bytes([model.ctx.window_freqs, model.ctx.compress_freqs])
    assert caches["engram_ids"] == real_bytes(model.engram_hasher.buffers()) > 3 * 256 * 8
    # The planner sizes the Engram token map by vocab_size; the tokenizer's may differ by its added tokens.
    vocab_diff = (len(model.engram_hasher.token_map) - args.vocab_size) * 8
    assert sum(caches.values()) + vocab_diff == real
    window = real_bytes(b for n, b in model.named_buffers() if re.match(r"layers\.\d+\.attn\.kv_cache", n))
    # per entry: bf16 values, or E4M3 codes + a scale byte per 32 / E2M1 codes + a scale byte per 16
    hd = args.head_dim
    win, comp = (hd + hd // 32, hd // 2 + hd // 16) if packed else (2 * hd, 2 * hd)
    assert caches["window_kv"] == window == args.n_layers * 3 * args.window_size * win
    assert caches["compressed_kv"] == 3 * comp * (256 // 2 + 256 // 1)     # sources 1 (ratio 2), 3 (ratio 1)


def test_released_weights_against_the_checkpoint_total():
    """W = 1: within 1 % of the checkpoint's tensor bytes, and exactly the itemised difference."""
    args = ModelArgs.from_file(RELEASED_CONFIG)
    plan = plan_memory(args, 1)
    w = plan.ranks[0].weights_bytes
    layers = args.n_layers + args.n_mtp_layers
    wo_a = layers * (8192 * 4096 * 2 - (8192 * 4096 + 256 * 128))   # FP8 + scales -> bf16
    head = args.vocab_size * args.dim * 2                            # bf16 -> fp32
    markov = args.vocab_size * args.dspark_markov_rank * 2
    compressor = 3 * 2 * args.head_dim * args.dim * 2               # ratio-2 wkv, wgate of layers 2, 8, 14
    vit_norms = (2 * args.vision_n_layers + 1) * args.vision_dim * 2
    confidence = (args.dim + args.dspark_markov_rank) * 2
    assert w - HF_TENSOR_BYTES == wo_a + head + markov + compressor + vit_norms + confidence == 2_863_051_264
    assert abs(w - HF_TENSOR_BYTES) < 0.01 * HF_TENSOR_BYTES
    # The Engram tables: 768,022,850 rows of 256 E4M3 values and 8 UE8M0 scales.
    assert plan.ranks[0].weights["engram_tables"] == 768_022_850 * 264


def test_released_mp4_engram_host_and_device():
    """64K context, batch 4, 4 x H200: the Engram tables are the difference; both run, and the prefill
    limits differ."""
    from inference.tools.plan import verdicts
    args = ModelArgs.from_file(RELEASED_CONFIG, max_seq_len=65536, max_batch_size=4)
    h200 = {"H200": 143771 << 20}
    out = {}
    for where in ("host", "device"):
        plan = plan_memory(args, 4, RuntimeOptions(engram_on=where), ranks=[0])
        out[where] = (plan.ranks[0], verdicts(plan, h200)["H200"])
    host, device = out["host"][0], out["device"][0]
    rows = -(-384006168 // 4) + -(-384016682 // 4)          # ceil(rows / W) per table
    assert device.gpu_weights_bytes - host.gpu_weights_bytes == rows * 264 == host.host_bytes
    assert device.cache_bytes == host.cache_bytes
    assert out["host"][1]["fits_decode"] and out["device"][1]["fits_decode"]
    assert out["host"][1]["longest_prefill"] > 3 * out["device"][1]["longest_prefill"] > 0


def peak_allocated(fn) -> int:
    """Peak of the bytes allocated during fn() and not yet freed (CPU allocator events of the profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("batch, seqlen", [(1, 128), (2, 256)])
def test_stated_workspace_bounds_the_measured_peak(batch, seqlen):
    from conftest import fixture_model
    from inference.layers import Linear
    model = fixture_model(max_batch_size=2)
    for m in model.modules():                       # the CPU path keeps these: held, not workspace
        if isinstance(m, Linear) and m.scale is not None:
            model.nx.dequantized(m.held())
    ids = torch.randint(3, model.args.vocab_size, (batch, seqlen), generator=torch.Generator().manual_seed(0))
    measured = peak_allocated(lambda: model.prefill(ids))
    shapes = plan_memory(model.args, 1).shapes
    stated = max(workspace_bytes(shapes, batch, seqlen, on_gpu=False).values())
    assert measured <= stated <= 2 * measured


def test_cli_json_and_verdicts(capsys):
    from inference.tools.plan import main
    assert main(["--config", FIXTURE_CONFIG, "--mp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = plan_memory(ModelArgs.from_file(FIXTURE_CONFIG), 2)
    assert out["weights_bytes"] == plan.ranks[0].weights_bytes and len(out["ranks"]) == 2
    assert out["total_bytes"] == plan.ranks[0].total_bytes
    assert set(out["fits"]) == {"H100 80 GB", "H200 141 GB", "B200 180 GB"} and all(out["fits"].values())
    assert main(["--config", FIXTURE_CONFIG, "--gpu-mem", "1MB"]) == 0
    text = capsys.readouterr().out
    assert "1MB (--gpu-mem)" in text and "does not fit" in text and "raise --mp" in text
    assert main(["--config", FIXTURE_CONFIG, "--mp", "3"]) == 1
    assert "world size 3" in capsys.readouterr().err


def test_parse_bytes():
    assert parse_bytes("141GB") == 141 * 10 ** 9 and parse_bytes("139GiB") == 139 * GIB
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("1000") == 1000
    with pytest.raises(PlanError, match="141 gigs"):
        parse_bytes("141 gigs")


def test_loader_refuses_a_model_that_does_not_fit():
    from inference.engine.checkpoint import CheckpointError, load_model
    args = ModelArgs.from_file(FIXTURE_CONFIG)
    lines = []
    with pytest.raises(CheckpointError, match="raise --mp.*--engram-on host"):
        load_model(FIXTURE, args, ParallelContext.single(), RuntimeOptions(), log=lines.append,
                   gpu_mem=1 << 20)
    assert any(line.startswith("memory plan") for line in lines)
    assert not any("load model" in line for line in lines)      # stopped before reading the shard


def test_a_memory_plan_does_not_import_torch_dynamo():
    """Meta-device ops that torch decomposes import torch._dynamo: a second of every run's start-up, and (it
    imports torch.distributed.nn) a hold on the process group past its destruction. The plan avoids them."""
    code = ("import sys; from inference.config import ModelArgs, RuntimeOptions; "
            "from inference.engine.memory import plan_memory; "
            f"a = ModelArgs.from_file({FIXTURE_CONFIG!r}); plan_memory(a, 2); "
            "plan_memory(a, 1, RuntimeOptions.from_profile('invariant')); "
            "print(sorted(m for m in sys.modules "
            "if m.startswith(('torch._dynamo', 'torch.distributed.nn'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_released_mp8_verdict_counts_chunked_prefill():
    """The README's setup (MP 8, 64K context, batch 4): a one-call prefill of 64K x 4 fits no GPU, but
    generate.py prefills in chunks by default, so every GPU "fits", with the chunk generate.py picks (at least
    one window); the one-call limit stays as information, and the loader's verdict line says the same."""
    from inference.engine.memory import GPUS, verdict_line
    from inference.engine.prefill import prefill_chunk_for
    from inference.tools.plan import render, verdicts
    args = ModelArgs.from_file(RELEASED_CONFIG, max_seq_len=65536, max_batch_size=4)
    plan = plan_memory(args, 8, ranks=[0])
    ver = verdicts(plan, GPUS)
    text = render(plan, ver, "config.json", {"packed": {"per_token": 1, "rings_per_sequence": 1},
                                             "bf16": {"per_token": 1, "rings_per_sequence": 1}})
    assert "decode only" not in text and "does not fit" not in text
    for name, v in ver.items():
        assert v["fits"] and not v["fits_one_call"], name
        assert args.window_size <= v["prefill_chunk"] == v["largest_chunk"] < args.max_seq_len, name
        assert (f"{name:<14} ({gib(v['capacity'])}): fits: prefill in chunks of {v['prefill_chunk']:,} "
                f"tokens (generate.py's default, the largest that fits); one call fits up to "
                f"{v['longest_prefill']:,} tokens per row (batch 4)") in text
    h100 = ver["H100 80 GB"]
    assert prefill_chunk_for(None, args, plan, "cpu", log=lambda *_: None,
                             gpu_mem=h100["capacity"]) == h100["prefill_chunk"]
    assert f"prefill in chunks of up to {h100['prefill_chunk']:,} tokens" in verdict_line(
        plan, "cuda:0", h100["capacity"])


def test_verdicts_one_call_decode_only_and_a_given_chunk(capsys):
    """The fixture (window 64): one call on every listed GPU; a budget that fits a decode step and a chunk of
    63 tokens but not 64 is "decode only"; --prefill-chunk C is judged as given."""
    from inference.tools.plan import main, verdicts
    args = ModelArgs.from_file(FIXTURE_CONFIG)
    plan = plan_memory(args, 1, ranks=[0])
    assert main(["--config", FIXTURE_CONFIG]) == 0
    text = capsys.readouterr().out
    assert text.count(f"fits: prompts of {args.max_seq_len:,} tokens x {args.max_batch_size} rows prefill in "
                      f"one call") == 3
    r, window = plan.worst, args.window_size

    def chunk_bytes(c):
        return max(workspace_bytes(plan.shapes, args.max_batch_size, c, context=args.max_seq_len).values())
    tight = r.resident_bytes + max(r.phase_bytes("decode"), chunk_bytes(window - 1))
    assert chunk_bytes(window) > tight - r.resident_bytes
    v = verdicts(plan, {"tight": tight})["tight"]
    assert v["fits_decode"] and not v["fits"] and v["largest_chunk"] == window - 1
    assert main(["--config", FIXTURE_CONFIG, "--gpu-mem", str(tight)]) == 0
    assert f"decode only: a prefill chunk fits up to {window - 1} tokens (< one window ({window}))" \
        in capsys.readouterr().out
    roomy = r.resident_bytes + max(r.phase_bytes("decode"), chunk_bytes(200))
    for chunk, fits in ((100, True), (300, False)):
        assert main(["--config", FIXTURE_CONFIG, "--gpu-mem", str(roomy), "--prefill-chunk", str(chunk),
                     "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert list(out["fits"].values()) == [fits] and list(out["prefill_chunk"].values()) == [chunk]
        assert 200 <= list(out["largest_chunk"].values())[0] < 300
    assert main(["--config", FIXTURE_CONFIG, "--prefill-chunk", "0"]) == 1
    assert "--prefill-chunk must be in 1..512" in capsys.readouterr().err


def test_one_meta_build_serves_the_memory_check_and_the_prefill_chunk(monkeypatch):
    """generate.py's order: rank_plan, then the default prefill chunk and the loader's memory check, both
    from that plan (a GPU budget, so that both read it): the model is built on the meta device once, and the
    chunk the prefill takes is the one the loader's verdict names."""
    from encoding.tokenizer import load_tokenizer
    from inference.engine import memory
    from inference.engine.checkpoint import load_model
    from inference.engine.prefill import prefill_chunk_for
    builds, real = [], memory.build_meta_model
    monkeypatch.setattr(memory, "build_meta_model", lambda *a, **k: builds.append(a[2]) or real(*a, **k))
    args, par, opts = ModelArgs.from_file(FIXTURE_CONFIG), ParallelContext.single(), RuntimeOptions()
    probe = plan_memory(args, 1, ranks=[0], on_gpu=True)
    r = probe.worst
    budget = r.resident_bytes + max(r.phase_bytes("decode"), max(workspace_bytes(
        probe.shapes, args.max_batch_size, 100, context=args.max_seq_len).values()))
    builds.clear()
    plan = memory.rank_plan(args, par, opts, "cpu", gpu_mem=budget)
    lines = []
    chunk = prefill_chunk_for(None, args, plan, "cpu", lines.append, gpu_mem=budget)
    assert chunk is not None and 100 <= chunk < args.max_seq_len
    load_model(FIXTURE, args, par, opts, "cpu", load_tokenizer(FIXTURE), log=lines.append, gpu_mem=budget,
               plan=plan)
    assert builds == [0]
    assert any(f"prefill in chunks of up to {chunk:,} tokens" in line for line in lines), lines


# ---- the routed experts in host memory (--experts-on host) ----

def routed_formula(args: ModelArgs, world_size: int):
    """(main layers', DSpark head's) routed-expert bytes per rank from the config alone: 3 projections of
    dim x moe_inter_dim, FP4 codes (half a byte) and one UE8M0 scale byte per 32 weights."""
    per_expert = 3 * args.dim * args.moe_inter_dim * 17 // 32
    main = args.n_layers * args.n_routed_experts * per_expert
    dspark = args.n_mtp_layers * args.dspark_n_routed_experts * per_expert
    return main // world_size, dspark // world_size


@pytest.fixture(scope="module")
def released_host_table():
    """The host table of the released model at MP 1 and 2, batch 1, Engram on the host (five meta builds)."""
    from inference.engine.memory import HOST_GPUS
    from inference.tools.plan import host_table
    return host_table(RELEASED_CONFIG, [1, 2], ["host"], [1], HOST_GPUS, None, 1 << 20, None)


@pytest.mark.parametrize("world_size, engram", [(1, "device"), (2, "host")])
def test_host_experts_move_exactly_the_routed_bytes(world_size, engram):
    """Released config: the host placement takes every routed expert (the main layers' and the DSpark head's,
    one MoE class builds both) off the GPU at its stored bytes, and nothing else; GPU + host bytes are the
    device placement's weights, with the Engram tables on either side."""
    args = ModelArgs.from_file(RELEASED_CONFIG)
    main, dspark = routed_formula(args, world_size)
    assert world_size > 1 or main == 288_777_830_400
    device = plan_memory(args, world_size, ranks=[0]).ranks[0]
    opts = RuntimeOptions(experts_on="host", engram_on=engram)
    host = plan_memory(args, world_size, opts, ranks=[0]).ranks[0]
    assert device.host_bytes == 0 and device.gpu_weights_bytes == device.weights_bytes
    assert host.weights == device.weights and host.caches == device.caches
    assert host.weights["routed_experts"] == main and host.routed_bytes == main + dspark
    assert host.gpu_weights_bytes + host.host_bytes == device.weights_bytes
    tables = host.weights["engram_tables"] if engram == "host" else 0
    assert device.gpu_weights_bytes - host.gpu_weights_bytes == main + dspark + tables == host.host_bytes


def test_host_decode_estimate_arithmetic(released_host_table):
    """tokens/s = bandwidth / (top-k experts x 3 projections at stored bytes x the MoE layers)."""
    from inference.tools.plan import decode_estimate
    args = ModelArgs.from_file(RELEASED_CONFIG)
    per_token = args.n_activated_experts * 3 * args.dim * args.moe_inter_dim * 17 // 32 * args.n_layers
    assert per_token == 4_512_153_600
    d = decode_estimate(released_host_table["plan"], 50.0, "given")
    assert d["bytes_per_token"] == per_token and d["expert_bytes"] == per_token // (6 * 40)
    assert d["tokens_per_s"] == pytest.approx(50e9 / per_token) and d["bandwidth"] == "given"
    w2 = plan_memory(args, 2, RuntimeOptions(experts_on="host"), ranks=[1])
    assert decode_estimate(w2, 50.0, "given")["bytes_per_token"] == per_token   # MP reads the same bytes


def test_cpu_only_decode_estimate_reads_the_rest_of_the_model(released_host_table):
    """CPU only, a decode token also reads every other weight of the main layers and the head as the CPU path
    holds it: counted here from the parameters' dtypes (FP8 / FP4 weights at 4 bytes per element, their scales
    unread), not the planner's walk over Linear modules; not the embedding and Engram tables (rows), the
    DSpark head, the ViT or the aligner."""
    from inference.engine.memory import build_meta_model
    from inference.tools.plan import decode_estimate
    model = build_meta_model(ModelArgs.from_file(RELEASED_CONFIG), 1, 0, RuntimeOptions(experts_on="host"))
    skip = ("embed.", "mtp.", "vision.", "aligner.", "image_")
    read = stored = 0
    for name, p in model.named_parameters():
        if name.startswith(skip) or ".engram.embed." in name or ".ffn.experts." in name:
            continue
        stored += p.numel() * (2 if name == "head.weight" else p.element_size())   # (a bf16 head, stored)
        if p.dtype == torch.float8_e4m3fn:
            read += p.numel() * 4
        elif p.dtype == torch.float4_e2m1fn_x2:
            read += p.numel() * 2 * 4                       # two elements a byte
        elif p.dtype != torch.float8_e8m0fnu:
            read += p.numel() * p.element_size()
    d = decode_estimate(released_host_table["plan"], 50.0, "given")
    assert d["cpu_only_other_bytes"] == read
    assert 25 * GIB < read < 27 * GIB                       # 20.4 GiB of it fp32 copies of FP8 Linears
    assert d["cpu_only_tokens_per_s"] == pytest.approx(50e9 / (d["bytes_per_token"] + read))
    # --cpu-linears stored: those Linears read as stored (scales included), no copy held, the head in bf16
    assert d["cpu_only_stored_other_bytes"] == stored and 9 * GIB < stored < 10 * GIB
    assert d["cpu_only_stored_tokens_per_s"] == pytest.approx(50e9 / (d["bytes_per_token"] + stored))
    args = ModelArgs.from_file(RELEASED_CONFIG, max_batch_size=1, max_seq_len=4096)
    plan = plan_memory(args, 1, RuntimeOptions(experts_on="host", cpu_linears="stored"), on_gpu=False)
    assert plan.worst.dequant_bytes == 0 and released_host_table["cpu_only"]["dequant_bytes"] > 20 * GIB


def test_host_table_rows_for_seven_gpus_at_mp_1_and_2(released_host_table):
    """One row per GPU of HOST_GPUS at MP 1 then 2: the GPU holds the rest of the model, the node's host
    memory is every rank's routed experts and Engram tables plus the expert workspace of the chunk; with the
    Engram tables on the host every size from 24 GB holds a context."""
    from inference.engine.memory import HOST_GPUS, host_expert_workspace
    from inference.tools.plan import render_host_table
    args = ModelArgs.from_file(RELEASED_CONFIG)
    rows = released_host_table["rows"]
    assert [(r["gpu"], r["mp"]) for r in rows] == [(g, w) for w in (1, 2) for g in HOST_GPUS]
    for w in (1, 2):
        main, dspark = routed_formula(args, w)
        tables = w * sum(-(-n // w) for n in args.engram_num_embeddings) * 264     # ceil(rows / W) per rank
        mine = [r for r in rows if r["mp"] == w]
        for r in mine:
            assert r["fits"] and r["batch"] == 1 and r["capacity"] == HOST_GPUS[r["gpu"]]
            assert r["chunk"] >= args.window_size
            ws = w * host_expert_workspace(ModelArgs.from_file(RELEASED_CONFIG, max_batch_size=1), r["chunk"])
            assert r["host_workspace_bytes"] == ws
            assert r["host_bytes"] == r["host_weights_bytes"] + ws
            assert r["host_weights_bytes"] == w * (main + dspark) + tables
            assert r["resident_bytes"] <= r["gpu_bytes"] <= r["capacity"]
        assert [r["chunk"] for r in mine] == sorted(r["chunk"] for r in mine)   # grows with the GPU
    text = render_host_table(rows, released_host_table["cpu_only"],
                             {"bandwidth_gbps": 50.0, "bandwidth": "given", "bytes_per_token": 4_512_153_600,
                              "experts_per_token": 6, "expert_bytes": 18_800_640, "moe_layers": 40,
                              "tokens_per_s": 11.08, "cpu_only_other_bytes": 27_697_321_408,
                              "cpu_only_tokens_per_s": 1.55, "cpu_only_stored_other_bytes": 11_219_000_000,
                              "cpu_only_stored_tokens_per_s": 3.18}, 1 << 20)
    assert text.count("| yes |") == 14
    assert "RTX 4090 24 GB | 1 | host | 1 | " in text and "at most 11.1 tokens/s" in text
    assert "CPU only, the other weights too: + 27.697 GB a token" in text and "at most 1.6 tokens/s" in text
    assert "with --cpu-linears stored (no copies, 22.20 GiB less memory) + 11.219 GB = at most 3.2" in text


def test_host_table_cpu_only_line(released_host_table):
    """MP 1, everything in host memory: every weight (routed experts at their stored bytes), the fp32 copies
    of the other FP8/FP4 weights, the caches and the workspace."""
    cpu = released_host_table["cpu_only"]
    main, dspark = routed_formula(ModelArgs.from_file(RELEASED_CONFIG), 1)
    assert cpu["weights_bytes"] == 513_149_074_264 and cpu["routed_bytes"] == main + dspark
    assert cpu["host_bytes"] == (cpu["weights_bytes"] + cpu["dequant_bytes"] + cpu["cache_bytes"]
                                 + cpu["workspace_bytes"])
    assert cpu["chunk"] == 2048 and cpu["max_seq_len"] == 65536
    assert 0 < cpu["dequant_bytes"] < 4 * (cpu["weights_bytes"] - cpu["routed_bytes"])


def test_host_table_cli_json_and_bad_values(capsys, monkeypatch):
    """--experts-on host --json on the fixture: the keys, a bandwidth given or measured; a bad value is one
    line naming the flag."""
    from inference.tools.bench import experts as bench_experts
    from inference.tools.plan import main
    base = ["--config", FIXTURE_CONFIG, "--experts-on", "host", "--mp", "1", "2"]
    assert main(base + ["--host-bandwidth", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"rows", "cpu_only", "decode", "limit"} and len(out["rows"]) == 14
    assert set(out["rows"][0]) == {"gpu", "capacity", "mp", "engram_on", "batch", "gpu_weights_bytes", "fits",
                                   "context", "chunk", "resident_bytes", "gpu_bytes", "host_weights_bytes",
                                   "host_workspace_bytes", "host_bytes"}
    assert set(out["cpu_only"]) == {"mp", "max_seq_len", "batch", "chunk", "weights_bytes", "routed_bytes",
                                    "dequant_bytes", "cache_bytes", "workspace_bytes", "host_bytes"}
    d = out["decode"]
    assert d["bandwidth"] == "given" and d["bandwidth_gbps"] == 40.0
    assert d["tokens_per_s"] == pytest.approx(40e9 / d["bytes_per_token"])
    monkeypatch.setattr(bench_experts, "read_bandwidth", lambda: 12.5)
    assert main(base[:-1] + ["--gpu-mem", "24GB"]) == 0
    text = capsys.readouterr().out
    assert "12.5 GB/s of host reads (measured)" in text and "| 24GB (--gpu-mem) | 1 | device | 1 |" in text
    positive = "--host-bandwidth must be a positive figure in GB/s, got"
    for bad, says in ((["--host-bandwidth", "-3"], f"{positive} -3"),
                      (["--host-bandwidth", "0"], f"{positive} 0"),
                      (["--long-context"], "--long-context and --experts-on host are separate tables"),
                      (["--prefill-chunk", "0"], "--prefill-chunk must be at least 1, got 0")):
        assert main(base + bad) == 1, bad
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert main(["--config", FIXTURE_CONFIG, "--host-bandwidth", "40"]) == 1
    assert capsys.readouterr().err == "error: --host-bandwidth goes with --experts-on host\n"


def test_verdict_and_loader_name_the_host_memory(monkeypatch):
    """With the experts on the host the verdict line names the host memory the rank needs (the device
    placement's line is as before); the loader stops with one line when this machine has less."""
    from inference.engine import checkpoint
    from inference.engine.memory import host_expert_workspace, verdict_line
    args = ModelArgs.from_file(FIXTURE_CONFIG)
    device = plan_memory(args, 1, ranks=[0])
    host = plan_memory(args, 1, RuntimeOptions(experts_on="host"), ranks=[0])
    budget = 1 << 40
    line = verdict_line(host, "cuda:0", budget)
    r = host.worst
    need = r.routed_bytes + host_expert_workspace(args, args.max_seq_len * args.max_batch_size)
    assert line.startswith("memory plan (rank 0 of 1, Engram on device, experts on host): ")
    assert line.endswith(f"; host memory for rank 0: {gib(need)} ({gib(r.routed_bytes)} routed experts + "
                         f"{gib(need - r.routed_bytes)} expert workspace)")
    assert "host memory" not in verdict_line(device, "cuda:0", budget)
    assert "experts on host" in verdict_line(host, "cpu") and "routed experts at" in verdict_line(host, "cpu")
    lines = []
    checkpoint.check_memory(host, "cpu", lines.append, gpu_mem=budget)         # fits this machine
    monkeypatch.setattr(checkpoint, "host_memory", lambda: r.routed_bytes)      # less than it needs
    with pytest.raises(checkpoint.CheckpointError, match="routed experts do not fit in host memory: rank 0 "
                       r"needs .* GiB there .* this machine has"):
        checkpoint.check_memory(host, "cpu", lines.append, gpu_mem=budget)
    checkpoint.check_memory(device, "cpu", lines.append, gpu_mem=budget)       # no host check without it
