"""--experts-on host (inference/kernels/experts.py HostExperts): the routed experts kept in host memory at
their stored precision and computed there by the host-expert kernel. Against the reference's logits on the
fixture (inside the fast order's floor), against the expert loop they replace (the torch path: the same
matmuls, bit for bit; the native kernels: the same products, within the summation bound), with no dequantised
copy kept, at W = 1 and 2 through the CLI, at W = 4 with the Engram tables off the device and a chunked
prefill, with experts converted to FP8, on 2 MB pages, and the placements that exclude it refused in one
line."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURE, fixture_config, fixture_file, fixture_model, fixture_tensors, tiny_model
from test_generate import assert_close_to_reference, run_cli

from inference.config import ConfigError, ModelArgs, RuntimeOptions
from inference.kernels import host_experts as he
from inference.kernels.experts import HostExperts, looped_experts, prefers_copy
from inference.moe import MoE

U = 2.0 ** -24
NATIVE = ["avx512", "avx2", "scalar"][["avx512", "avx2", "scalar"].index(he.auto_variant()):]


def first_moe(model) -> MoE:
    return next(m for m in model.modules() if isinstance(m, MoE))


@pytest.mark.parametrize("numerics, cpu_linears", [("fast", "fp32"), ("fast", "stored"), ("exact", "stored")])
def test_fixture_logits_inside_the_fast_floor(numerics, cpu_linears):
    """Teacher-forced on the fixture with the experts on the host: max |d| <= 0.25, mean <= 0.03 against the
    reference's logits, its argmax wherever the reference's top-1/top-2 margin exceeds 0.5; the DSpark head's
    too. With --cpu-linears stored the other FP8/FP4 Linears come from their stored bytes as well, and no
    fp32 copy of any is made. (The default rounding points: the CLI's scoring below.)"""
    from test_model_fixture import run_teacher_forced
    from inference.layers import Linear
    model = fixture_model(RuntimeOptions.from_profile(numerics, experts_on="host", cpu_linears=cpu_linears))
    assert isinstance(first_moe(model).routed, HostExperts)
    ref = fixture_tensors("reference_logits")
    logits, drafts = run_teacher_forced(model, ref)
    want = ref["step_logits"]
    d = (logits - want).abs()
    print(f"{numerics}, --cpu-linears {cpu_linears}, experts on the host ({he.kernel_variant()}): max |d| "
          f"{d.max():.4f} mean {d.mean():.5f}")
    copies = sum(len(m.derived) for m in model.modules() if isinstance(m, Linear) and m.kind in he.FORMATS)
    assert (copies == 0) == (cpu_linears == "stored")
    assert d.max() <= 0.25 and d.mean() <= 0.03
    top2 = want.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 0.5
    assert clear.any() and torch.equal(logits.argmax(-1)[clear], want.argmax(-1)[clear])
    assert (torch.stack([x[1] for x in drafts]) - ref["dspark_logits"]).abs().max() <= 0.25


@pytest.fixture(scope="module")
def host_model():
    return fixture_model(RuntimeOptions.from_profile("fast", experts_on="host"))


def routed_inputs(moe: MoE, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, moe.gate.weight.shape[1], generator=g) * 4).bfloat16()
    weights, idx = moe.gate(x)
    return x, weights, idx


def test_the_torch_path_is_the_expert_loop_bit_for_bit(host_model, monkeypatch):
    """The host kernel's torch path multiplies the same fp32 operands as the fast order's expert loop
    (act_quant of the rows, each expert dequantised exactly): the same bits, at 1 token and at 300."""
    monkeypatch.setenv(he.ENV, "torch")
    moe = first_moe(host_model)
    for n in (1, 300):
        x, weights, idx = routed_inputs(moe, n, n)
        got = HostExperts().apply(moe, x, weights, idx, n == 1)
        assert torch.equal(got, looped_experts(moe, x, weights, idx))


@pytest.mark.parametrize("variant", NATIVE)
def test_the_native_kernel_against_the_expert_loop(host_model, monkeypatch, variant):
    """The native kernels sum the same products in another order: each selection's output within the bf16
    rounding of a bound on the second projection's sums (its inputs are the same bf16 values unless the first
    projections' sums rounded apart, which the bound on those allows: checked on the counts)."""
    monkeypatch.setenv(he.ENV, variant)
    moe = first_moe(host_model)
    x, weights, idx = routed_inputs(moe, 200, 7)
    got, want = HostExperts().apply(moe, x, weights, idx, False), looped_experts(moe, x, weights, idx)
    d = (got.float() - want.float()).abs()
    scale = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)       # per selection
    print(f"{variant}: {int((d > 0).sum())} of {d.numel()} outputs apart, "
          f"max relative {(d / scale).max():.2e}")
    assert (d <= scale * 2.0 ** -6).all()                   # a few bf16 ulps of the row's largest output


def test_no_dequantised_copy_is_kept(host_model):
    """The routed experts stay in their stored dtypes on the CPU and keep nothing derived after a forward;
    only the other layers keep their layouts."""
    host_model.reset()
    host_model.prefill(torch.tensor([[0, 5, 9, 14]]))
    for moe in (m for m in host_model.modules() if isinstance(m, MoE)):
        for w, s in moe.stacked.values():
            assert w.device.type == "cpu" and w.element_size() == 1 and s.dtype == torch.float8_e8m0fnu
        experts = [e for e in moe.experts if e is not None]
        assert all(len(lin.derived) == 0 for e in experts for lin in (e.w1, e.w2, e.w3))
    assert sum(len(m.derived) for m in host_model.modules() if hasattr(m, "derived")) > 0


def mapping_flags(address: int) -> str:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only (madvise, /proc)")
def test_the_experts_memory_asks_for_huge_pages(monkeypatch):
    """A host placement advises each stacked expert weight before it is read (kernels/experts.py
    HostExperts.hold), and the advice reaches the kernel: the mapping that holds an advised tensor carries the
    'hg' flag (MADV_HUGEPAGE)."""
    from inference.model import Transformer
    advised = []
    monkeypatch.setattr(he, "advise_huge_pages", lambda t: advised.append(t.data_ptr()) or True)
    model = Transformer(ModelArgs.from_file(os.path.join(FIXTURE, "config.json")),
                        opts=RuntimeOptions.from_profile("fast", experts_on="host"))
    weights = [w.data_ptr() for moe in model.modules() if isinstance(moe, MoE)
               for w, _ in moe.stacked.values()]
    assert weights and sorted(advised) == sorted(weights)
    monkeypatch.undo()
    t = torch.empty(8 << 20, dtype=torch.uint8)
    assert he.advise_huge_pages(t) and " hg" in mapping_flags(t.data_ptr() + (4 << 20))
    assert not he.advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))      # under one huge page


@pytest.mark.parametrize("variant", ["avx512", "avx2", "scalar", "torch"])
def test_the_copy_estimate_of_a_gpu_call(variant, monkeypatch):
    """prefers_copy on the released geometry (meta weights): 18.8 MB and 3 x 5120 x 2304 multiply-adds per
    expert; with every expert active the copy wins once the selections' work on the host, at the rate of the
    kernel variant that runs, outweighs the bytes over the link: at 2 threads about 170 tokens of top-6 with
    avx512, 106 with avx2 (a variant beyond this CPU is only named here, never run)."""
    from inference.kernels.experts import HOST_MACS_PER_THREAD, LINK_BYTES_PER_S
    from inference.state import ModelContext
    args = ModelArgs.from_file(os.path.join(os.path.dirname(FIXTURE), "..", "..", "config.json"),
                               n_routed_experts=384)
    ctx = ModelContext.build(args, opts=RuntimeOptions(experts_on="host"), device="meta")
    with torch.device("meta"):
        moe = MoE(ctx, 384, 6, False)
    per_expert = 3 * (5120 * 2304 // 2 + 5120 * 2304 // 32)
    assert sum(w[0].nbytes + s[0].nbytes for w, s in moe.stacked.values()) == per_expert
    threads = torch.get_num_threads()
    rate = HOST_MACS_PER_THREAD[variant]
    tokens = per_expert * 384 / LINK_BYTES_PER_S * rate * threads / (3 * 5120 * 2304) / 6
    everything = list(range(384))
    monkeypatch.setattr(he, "kernel_variant", lambda v=None: variant)     # the estimate only reads the name
    assert not prefers_copy(moe, everything, math.floor(tokens * 6 * 0.9))
    assert prefers_copy(moe, everything, math.ceil(tokens * 6 * 1.1))          # a few selections at 1 thread
    assert not prefers_copy(moe, [], 10 ** 6)
    print(f"{variant}: copy from {tokens:.0f} tokens at {threads} threads")


def test_placements_that_exclude_it_are_refused():
    for words in ("golden", "invariant"):
        with pytest.raises(ConfigError, match=f"--experts-on host .* not with --numerics {words}"):
            RuntimeOptions.from_profile(words, experts_on="host")
    with pytest.raises(ConfigError, match="unknown expert placement 'gpu'"):
        RuntimeOptions.from_profile("reference", experts_on="gpu")
    with pytest.raises(ConfigError, match="--cpu-linears stored computes the other Linears as --experts-on "
                                          "host computes the routed experts, and goes with it"):
        RuntimeOptions.from_profile("fast", cpu_linears="stored")
    with pytest.raises(ConfigError, match="unknown CPU Linear form 'fp16'"):
        RuntimeOptions.from_profile("fast", experts_on="host", cpu_linears="fp16")
    from inference.kernels import numerics_for
    with pytest.raises(ConfigError, match="--cpu-linears stored computes the Linears held on the CPU: not "
                                          "with --device cuda"):
        numerics_for(RuntimeOptions.from_profile("fast", experts_on="host", cpu_linears="stored"), "cuda")


def fixture_args():
    fixture = fixture_file(FIXTURE)
    return ["--ckpt-path", fixture, "--config", os.path.join(fixture, "config.json"), "--device", "cpu"]


@pytest.mark.parametrize("extra, line", [
    (["--offload", "disk"], "--offload disk streams the experts from disk: not with --experts-on host"),
    (["--numerics", "golden"], "not with --numerics golden"),
    (["--cpu-linears", "stored", "--device", "cuda:0"], "--cpu-linears stored computes the Linears held on "
                                                        "the CPU: not with --device cuda:0")])
def test_the_cli_names_a_clash_in_one_line(extra, line, tmp_path):
    (tmp_path / "p.txt").write_text("hello\n")
    proc = run_cli(fixture_args() + ["--experts-on", "host", "--input-file", str(tmp_path / "p.txt")] + extra)
    assert proc.returncode != 0 and line in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_scoring_through_the_cli_at_one_and_two_ranks(tmp_path):
    """generate.py --score --experts-on host, at W = 1 and at W = 2 (each rank's experts on its host; there
    with --cpu-linears stored, every FP8/FP4 Linear from its stored bytes): inside the bounds the device
    placement is held to (W = 2 reduces bf16 partials in another order)."""
    ref = load_file(os.path.join(FIXTURE, "reference_logits.safetensors"))
    tensors = load_file(os.path.join(fixture_file(FIXTURE), "model0-mp1.safetensors"))
    from test_tensor_parallel import reshard
    for rank in range(2):
        save_file(reshard(tensors, 2, rank), str(tmp_path / f"model{rank}-mp2.safetensors"))
    shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), tmp_path / "tokenizer.json")
    outs = {}
    for w, ckpt in ((1, fixture_file(FIXTURE)), (2, str(tmp_path))):
        outs[w] = tmp_path / f"logits{w}.safetensors"
        proc = run_cli(["--ckpt-path", ckpt, "--config", os.path.join(FIXTURE, "config.json"),
                        "--device", "cpu", "--score", os.path.join(FIXTURE, "score.json"),
                        "--experts-on", "host", "--dump-logits", str(outs[w])]
                       + (["--cpu-linears", "stored"] if w == 2 else []), nproc=w)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_close_to_reference(load_file(str(outs[1]))["logits"], ref["step_logits"], 0.25, 0.03)
    assert_close_to_reference(load_file(str(outs[2]))["logits"], ref["step_logits"], 0.35, 0.05)


def test_four_ranks_with_engram_off_the_device_and_chunked_prefill(tiny_mp4, tmp_path, monkeypatch):
    """W = 4 (a random model converted at MP 4), the Engram tables on the host or on disk, the prefill in
    chunks of 7: with the kernel's torch path the host placement gives the device placement's logits bit for
    bit (the same matmuls); with the native kernel, inside the fast order's floor."""
    with open(os.path.join(FIXTURE, "score.json")) as f:
        tokens = json.load(f)["sequences"][0][:48]
    (tmp_path / "score.json").write_text(json.dumps({"sequences": [tokens], "prefill_len": 40}))
    base = ["--ckpt-path", tiny_mp4["ckpt"], "--config", tiny_mp4["config"], "--device", "cpu", "--numerics",
            "fast", "--score", str(tmp_path / "score.json"), "--prefill-chunk", "7"]

    def logits(name, *extra, kernel="auto"):
        monkeypatch.setenv(he.ENV, kernel)                          # the ranks fork with this environment
        proc = run_cli(base + ["--dump-logits", str(tmp_path / name), *extra], nproc=4)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return load_file(str(tmp_path / name))["logits"]

    device = logits("device.safetensors", "--experts-on", "device", "--engram-on", "host")
    torch_path = logits("torch.safetensors", "--experts-on", "host", "--engram-on", "host", kernel="torch")
    native = logits("native.safetensors", "--experts-on", "host", "--engram-on", "disk")
    assert device.shape[0] == 9 and torch.equal(torch_path, device)
    assert_close_to_reference(native, device, 0.25, 0.03)


@pytest.fixture(scope="module")
def fp8_experts(tmp_path_factory):
    """A tiny random model whose routed experts convert.py wrote as FP8 (--expert-dtype fp8) at MP 1."""
    model = tiny_model(tmp_path_factory.mktemp("fp8_experts"), fixture_config(), seed=5, expert_dtype="fp8")
    return {"ckpt": model["dirs"][1], "config": model["config"]}


def test_fp8_experts_stay_fp8_on_the_host_and_score_as_on_the_device(fp8_experts, tmp_path, monkeypatch):
    """Experts converted to FP8: kept as E4M3 bytes with their block scales in host memory, nothing derived
    after a forward; through the CLI, the kernel's torch path gives the device placement's logits bit for
    bit, the native kernel (its FP8 decode) inside the fast order's floor."""
    from encoding.tokenizer import load_tokenizer
    from inference.engine.checkpoint import load_checkpoint
    from inference.model import Transformer
    model = Transformer(ModelArgs.from_file(fp8_experts["config"]),
                        opts=RuntimeOptions.from_profile("fast", experts_on="host"),
                        tokenizer=load_tokenizer(fp8_experts["ckpt"]))
    load_checkpoint(model, fp8_experts["ckpt"])
    model.prefill(torch.tensor([[0, 5, 9, 14]]))
    moe = first_moe(model)
    assert all(w.device.type == "cpu" and w.dtype == torch.float8_e4m3fn for w, _ in moe.stacked.values())
    assert all(len(lin.derived) == 0 for e in moe.experts if e is not None for lin in (e.w1, e.w2, e.w3))

    with open(os.path.join(FIXTURE, "score.json")) as f:
        tokens = json.load(f)["sequences"][0][:48]
    (tmp_path / "score.json").write_text(json.dumps({"sequences": [tokens], "prefill_len": 40}))

    def logits(name, where, kernel="auto"):
        monkeypatch.setenv(he.ENV, kernel)
        proc = run_cli(["--ckpt-path", fp8_experts["ckpt"], "--config", fp8_experts["config"],
                        "--device", "cpu", "--numerics", "fast", "--score", str(tmp_path / "score.json"),
                        "--experts-on", where, "--dump-logits", str(tmp_path / name)])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return load_file(str(tmp_path / name))["logits"]

    device = logits("device.safetensors", "device")
    assert torch.equal(logits("torch.safetensors", "host", kernel="torch"), device)
    assert_close_to_reference(logits("native.safetensors", "host"), device, 0.25, 0.03)


GENERATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "generate.py")


def test_a_host_experts_run_starts_torch_with_passive_openmp_workers(monkeypatch, capsys):
    """generate.py --experts-on host sets OMP_WAIT_POLICY=PASSIVE before torch loads (torch's idle OpenMP
    workers would spin on the cores the kernel's threads need), unless set; other runs leave it."""
    spy = ("import os, runpy, sys\n"
           "seen = []\n"
           "class Spy:\n"
           "    def find_spec(self, name, path=None, target=None):\n"
           "        if name == 'torch':\n"
           "            seen.append(os.environ.get('OMP_WAIT_POLICY'))\n"
           "sys.meta_path.insert(0, Spy())\n"
           f"sys.argv = [{GENERATE!r}, '--experts-on', 'host', '--help']\n"
           "try:\n"
           "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
           "except SystemExit:\n"
           "    pass\n"
           "print('torch loaded with', seen[0])\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, "-c", spy], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "torch loaded with PASSIVE", proc.stdout + proc.stderr
    import runpy                                                    # the other cases: torch is loaded here
    for argv, preset, want in ((["--experts-on=host"], None, "PASSIVE"), (["--experts-on", "host"], "ACTIVE",
                               "ACTIVE"), (["--experts-on", "device"], None, None), ([], None, None)):
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        if preset:
            monkeypatch.setenv("OMP_WAIT_POLICY", preset)
        monkeypatch.setattr(sys, "argv", [GENERATE, *argv, "--help"])
        with pytest.raises(SystemExit):
            runpy.run_path(GENERATE, run_name="__main__")
        assert os.environ.get("OMP_WAIT_POLICY") == want, argv
    capsys.readouterr()


def test_the_loader_reads_cpu_parameters_straight_from_the_file(monkeypatch):
    """load_checkpoint reads a CPU parameter's bytes from the file into it (no mapped pages kept beside the
    copy: the experts of a CPU run are most of the shard): the same bits as the safetensors path, for all but
    the widened tensors."""
    from inference.engine import checkpoint
    direct = []
    read_into = checkpoint.read_into
    monkeypatch.setattr(checkpoint, "read_into", lambda *a: direct.append(read_into(*a)) or direct[-1])
    ours = dict(fixture_model().named_parameters())
    monkeypatch.setattr(checkpoint, "read_into", lambda *a: False)
    theirs = dict(fixture_model().named_parameters())
    assert sum(direct) > 0.9 * len(direct) and ours.keys() == theirs.keys()
    for name, p in ours.items():
        q = theirs[name]
        assert p.dtype == q.dtype and torch.equal(p.view(torch.uint8), q.view(torch.uint8)), name
