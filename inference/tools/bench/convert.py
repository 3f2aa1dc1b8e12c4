"""Benchmark convert.py against plain `cp` on the same disk (not a test).

    python -m inference.tools.bench convert --size-gb 3 [--work-dir DIR] [--mp 1 4] [--max-buffer 1GB]
                                            [--cold]

Generates a synthetic HF checkpoint of about --size-gb (a scaled-up config with the released proportions:
mostly MXFP4 experts and FP8, Engram tables about a third), copies its shards with `cp` (then fsync, as
convert.py fsyncs its output), converts it at each --mp, and prints throughput and the converter's peak RSS.
Targets: convert throughput >= 50% of cp, peak RSS <= 1.5 GB with a 1 GB buffer.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

from inference.config import ModelArgs
from inference.safetensors_io import tensor_nbytes
from inference.tools.synthetic import hf_tensor_specs, write_synthetic_checkpoint

from .common import ROOT, drop_cache


def layer_roles(n_layers: int, n_mtp_layers: int) -> dict:
    """Config keys that give n_layers blocks the released roles: two uncompressed blocks, ratio-2 blocks up to
    the middle, ratio-1 after; KV written by block 2 and the middle one; index sources from the middle on."""
    half = max(3, n_layers // 2)
    kv = [2, half] if n_layers > half else [2]
    return dict(n_layers=n_layers, n_mtp_layers=n_mtp_layers,
                compress_ratios=[0, 0] + [2] * (half - 2) + [1] * (n_layers - half) + [0] * n_mtp_layers,
                kv_source_layers=kv, index_source_layers=sorted(set(kv + list(range(half, n_layers, 4)))),
                candidate_source_layer=kv[-1])


def scaled_config(size_gb: float) -> ModelArgs:
    """A config with the released structure whose HF checkpoint is about size_gb (10^9 bytes)."""
    base = dict(vocab_size=32768, dim=2048, moe_inter_dim=1024, n_heads=16, head_dim=256, rope_head_dim=64,
                q_lora_rank=512, o_groups=8, o_lora_rank=256, n_routed_experts=64, n_activated_experts=6,
                index_n_heads=16, index_head_dim=128, engram_n_heads=8, engram_head_dim=256,
                engram_vocab_size=16000000, engram_compressed_vocab_size=0, dspark_markov_rank=128,
                dspark_n_routed_experts=32, dspark_n_activated_experts=3, vision_n_layers=0, window_size=128)

    def build(n_layers: int, rows: int) -> ModelArgs:
        return ModelArgs.from_dict(dict(
            base, **layer_roles(n_layers, n_mtp_layers=1), engram_layer_ids=[1, min(3, n_layers - 1)],
            engram_num_embeddings=[rows, rows + 1], dspark_target_layer_ids=[n_layers - 1]))

    def nbytes(args: ModelArgs) -> int:
        return sum(tensor_nbytes(d, s) for _, d, s in hf_tensor_specs(args))

    target = size_gb * 1e9
    rows = int(target * 0.37 / 2 / 264)  # Engram: 256 E4M3 + 8 UE8M0 bytes per row, two tables
    n_layers = 4
    while nbytes(build(n_layers + 1, rows)) <= target:
        n_layers += 1
    return build(n_layers, rows)


def timed(cmd) -> tuple:
    """Run a command; return (seconds, peak RSS bytes)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}")
    return seconds, usage.ru_maxrss * 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m inference.tools.bench convert",
                                 description="Benchmark convert.py against cp on a synthetic checkpoint.")
    ap.add_argument("--size-gb", type=float, default=3.0,
                    help="approximate checkpoint size in GB (default 3)")
    ap.add_argument("--work-dir", default=None,
                    help="directory for the checkpoint and outputs (default: a new folder under /tmp)")
    ap.add_argument("--mp", type=int, nargs="+", default=[1, 4],
                    help="model-parallel sizes to convert (default 1 4)")
    ap.add_argument("--max-buffer", default="1GB", help="convert.py --max-buffer (default 1GB)")
    ap.add_argument("--expert-dtype", choices=["fp4", "fp8"], default=None, help="convert.py --expert-dtype")
    ap.add_argument("--cold", action="store_true",
                    help="evict the source files from the page cache before each run")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement, best kept (default 2)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and outputs")
    a = ap.parse_args(argv)

    work = a.work_dir or os.path.join("/tmp", f"bench_convert_{os.getpid()}")
    hf, out = os.path.join(work, "hf"), os.path.join(work, "out")
    args = scaled_config(a.size_gb)
    index_path = os.path.join(hf, "model.safetensors.index.json")
    config_path = os.path.join(hf, "inference", "config.json")
    if os.path.exists(index_path) and ModelArgs.from_file(config_path) == args:
        print(f"reusing {hf}")
    else:
        probe = os.path.abspath(work)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        free = shutil.disk_usage(probe).free
        need = a.size_gb * 1e9 * (2 + len(a.mp))
        if need > free:
            raise SystemExit(f"not enough disk space: about {need / 1e9:.1f} GB needed, "
                             f"{free / 1e9:.1f} GB free")
        t = time.perf_counter()
        shards = max(4, int(a.size_gb * 2))
        write_synthetic_checkpoint(args, hf, seed=0, shards=shards, workers=os.cpu_count() or 1)
        print(f"generated {hf} ({args.n_layers} layers) in {time.perf_counter() - t:.1f} s")
    shards = sorted(glob.glob(os.path.join(hf, "*.safetensors")))
    total = sum(os.path.getsize(p) for p in shards)
    tensor_bytes = json.load(open(index_path))["metadata"]["total_size"]
    print(f"checkpoint: {len(shards)} shards, {total / 1e9:.2f} GB on disk "
          f"({tensor_bytes / 1e9:.2f} GB tensors)")

    cp_dir = os.path.join(work, "cp")
    best_cp = None
    for _ in range(a.repeat):
        shutil.rmtree(cp_dir, ignore_errors=True)
        os.makedirs(cp_dir)
        if a.cold:
            drop_cache(shards)
        t_cp, _ = timed(["cp", *shards, cp_dir])
        t = time.perf_counter()
        drop_cache(os.path.join(cp_dir, os.path.basename(p)) for p in shards)  # fsync (and evict) the copies
        t_sync = time.perf_counter() - t
        shutil.rmtree(cp_dir)
        if best_cp is None or t_cp + t_sync < sum(best_cp):
            best_cp = (t_cp, t_sync)
    t_cp, t_sync = best_cp
    cp_rate = total / (t_cp + t_sync)
    print(f"cp (best of {a.repeat}): {t_cp:.2f} s + fsync {t_sync:.2f} s -> {cp_rate / 1e6:.0f} MB/s "
          f"(without fsync {total / t_cp / 1e6:.0f} MB/s)")
    # Interpreter + torch import: a fixed cost per run, negligible for a real checkpoint.
    startup = min(timed([sys.executable, os.path.join(ROOT, "convert.py"), "--help"])[0] for _ in range(3))
    print(f"convert.py start-up (python + torch import): {startup:.2f} s")

    results = []
    for mp in a.mp:
        best = None
        for _ in range(a.repeat):
            shutil.rmtree(out, ignore_errors=True)
            if a.cold:
                drop_cache(shards)
            cmd = [sys.executable, os.path.join(ROOT, "convert.py"), "--hf-ckpt-path", hf, "--save-path", out,
                   "--model-parallel", str(mp), "--max-buffer", a.max_buffer]
            if a.expert_dtype:
                cmd += ["--expert-dtype", a.expert_dtype]
            seconds, rss = timed(cmd)
            if best is None or seconds < best[0]:
                best = (seconds, max(rss, best[1]) if best else rss)
        seconds, rss = best
        written = sum(os.path.getsize(p) for p in glob.glob(os.path.join(out, f"model*-mp{mp}.safetensors")))
        rate, steady = written / seconds, written / max(seconds - startup, 1e-9)
        results.append((mp, seconds, written, rate, steady, rss))
        print(f"convert mp{mp}: {seconds:.2f} s, wrote {written / 1e9:.2f} GB -> {rate / 1e6:.0f} MB/s "
              f"({rate / cp_rate:.0%} of cp+fsync; {steady / cp_rate:.0%} without start-up), "
              f"peak RSS {rss / 2**30:.2f} GiB")
    shutil.rmtree(out, ignore_errors=True)
    if not a.keep and not a.work_dir:
        shutil.rmtree(work, ignore_errors=True)

    print("\nsummary (target: >= 50% of cp throughput, peak RSS <= 1.5 GB at a 1 GB buffer)")
    print(f"cp + fsync: {cp_rate / 1e6:.0f} MB/s; convert start-up {startup:.2f} s")
    print(f"{'mp':>3} {'seconds':>8} {'GB out':>7} {'MB/s':>6} {'vs cp':>6} {'vs cp, no start-up':>19} "
          f"{'peak RSS':>9}")
    for mp, seconds, written, rate, steady, rss in results:
        print(f"{mp:>3} {seconds:>8.2f} {written / 1e9:>7.2f} {rate / 1e6:>6.0f} {rate / cp_rate:>6.0%} "
              f"{steady / cp_rate:>19.0%} {rss / 2**30:>7.2f} G")
    return 0

