"""Benchmark `--offload disk`: a prefill streamed from a checkpoint several times larger than the memory the
run may use, and streamed vs in-memory prefill on a model that fits. Figures are printed, never asserted.

    python -m inference.tools.bench offload                      # both parts, defaults below
    python -m inference.tools.bench offload --part big --mem-limit-gb 2 --tokens 2048

big: `models`' "large" model (dim 1024, released head geometry) deepened to --layers blocks of --experts
routed experts of width --moe-inter-dim, written once under --workdir (7.3 GiB with the defaults). The
prefill runs in a child process inside a memory cgroup limited to --mem-limit-gb (cgroup v2 memory.max or
v1 memory.limit_in_bytes; page cache counts against it too); without a usable cgroup the run says so and is
not enforced. The shard is evicted from the page cache before each run (posix_fadvise), so the reads come
from the disk, whose cold sequential bandwidth is measured first.
fit: the "large" model (32 experts) prefilled in memory and streamed, same tokens, same numerics.

Per run (--repeat prefills of the same tokens, the page cache emptied before each; figures of the last, the
first call's time beside them): tokens/s, seconds per streamed unit (a block or the head), the share of that
time spent waiting for the disk, bytes read and the reading thread's GB/s, and peak RSS (and the cgroup's
peak usage).
"""
import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from .common import ROOT, drop_cache, make_args, synthetic_checkpoint


def big_args(n_layers: int, experts: int, inter: int, max_seq_len: int):
    """The models subcommand's "large" model with n_layers blocks (the layer roles of the convert
    subcommand's scaled configs) of `experts` routed experts of width `inter`."""
    from .convert import layer_roles
    from ...config import ModelArgs
    base = {k: v for k, v in vars(make_args("large", max_seq_len)).items() if not k.startswith("_")}
    return ModelArgs.from_dict(dict(
        base, **layer_roles(n_layers, base["n_mtp_layers"]), n_routed_experts=experts, moe_inter_dim=inter,
        dspark_target_layer_ids=[n_layers - 3, n_layers - 2, n_layers - 1]))


def ensure_checkpoint(name: str, args, workdir: str) -> str:
    """Synthetic HF checkpoint -> convert.py at MP 1 (cached); returns the converted directory, with the
    config beside it (bench_config.json): the child process rebuilds the model from it."""
    ckpt = synthetic_checkpoint(name, args, workdir, shards=4, log=lambda m: print(m, flush=True))
    config = os.path.join(ckpt, "bench_config.json")
    if not os.path.exists(config):
        with open(config, "w") as f:
            json.dump({k: v for k, v in vars(args).items() if not k.startswith("_")}, f)
    return ckpt


def evict(path: str) -> None:
    drop_cache([path])


def disk_bandwidth(path: str, limit: int = 2 << 30) -> float:
    """Cold sequential read of the file's first `limit` bytes in 16 MiB reads -> GB/s."""
    evict(path)
    buf = bytearray(16 << 20)
    done, t = 0, time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while done < limit:
            n = f.readinto(buf)
            if not n:
                break
            done += n
    seconds = time.perf_counter() - t
    evict(path)
    return done / seconds / 1e9


def make_cgroup(limit_bytes: int):
    """A fresh memory cgroup limited to limit_bytes -> (its folder, cgroup.procs, peak-usage file) or None."""
    name = f"dsv41-bench-{os.getpid()}-{time.monotonic_ns()}"
    for base, limit_file, peak_file in (("/sys/fs/cgroup", "memory.max", "memory.peak"),
                                        ("/sys/fs/cgroup/unified", "memory.max", "memory.peak"),
                                        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes",
                                         "memory.max_usage_in_bytes")):
        if not os.path.exists(os.path.join(base, "cgroup.procs")):
            continue
        if base != "/sys/fs/cgroup/memory":
            try:
                with open(os.path.join(base, "cgroup.controllers")) as f:
                    if "memory" not in f.read().split():
                        continue
            except OSError:
                continue
        path = os.path.join(base, name)
        try:
            os.mkdir(path)
            with open(os.path.join(path, limit_file), "w") as f:
                f.write(str(limit_bytes))
            swap = os.path.join(path, "memory.memsw.limit_in_bytes")   # v1: no escape into swap
            if os.path.exists(swap):
                with open(swap, "w") as f:
                    f.write(str(limit_bytes))
            return path, os.path.join(path, "cgroup.procs"), os.path.join(path, peak_file)
        except OSError:
            continue
    return None


def child(opts) -> None:
    """Runs inside the limit: load (streamed or in memory), prefill once, print one JSON line."""
    import torch
    from encoding.tokenizer import load_tokenizer
    from ...config import ModelArgs, RuntimeOptions
    from ...engine.checkpoint import load_model
    from ...parallel import ParallelContext
    if opts.threads:
        torch.set_num_threads(opts.threads)
    with open(os.path.join(opts.ckpt, "bench_config.json")) as f:
        args = ModelArgs.from_dict(json.load(f), max_seq_len=opts.tokens + 8, max_batch_size=1)
    runtime = RuntimeOptions.from_profile(opts.numerics,
                                          engram_on="disk" if opts.offload == "disk" else "device")
    t = time.perf_counter()
    model = load_model(opts.ckpt, args, ParallelContext.single(), runtime, "cpu", load_tokenizer(opts.ckpt),
                       log=lambda *a: None, offload=opts.offload)
    load_s = time.perf_counter() - t
    ids = torch.randint(3, args.vocab_size, (1, opts.tokens), generator=torch.Generator().manual_seed(0))
    shard = os.path.join(opts.ckpt, "model0-mp1.safetensors")
    stream = model.weight_stream
    times, first = [], None
    for _ in range(opts.repeat):   # the first call also builds what the kernels cache (in memory: kept)
        model.reset()
        evict(shard)     # streamed: every call reads from the disk, not from the page cache
        if stream is not None:
            first = dataclasses.replace(stream.stats, per_block=[])
        t = time.perf_counter()
        model.prefill(ids)
        times.append(time.perf_counter() - t)
    out = {"load_s": load_s, "first_s": times[0], "prefill_s": times[-1], "tok_s": opts.tokens / times[-1],
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if stream is not None:     # the last call's figures
        st = stream.stats
        stream.close()
        units, block_s = st.blocks_run - first.blocks_run, st.block_s - first.block_s
        read_b, read_s = st.bytes_read - first.bytes_read, st.read_s - first.read_s
        out.update(units=units, s_per_unit=block_s / units, wait_share=(st.wait_s - first.wait_s) / block_s,
                   bytes_read=read_b, read_gbps=read_b / read_s / 1e9)
    print("RESULT " + json.dumps(out), flush=True)


def run_child(ckpt: str, offload: str, opts, limit_gb: float = 0.0) -> dict:
    shard = os.path.join(ckpt, "model0-mp1.safetensors")
    evict(shard)
    cmd = [sys.executable, "-m", "inference.tools.bench", "offload", "--child", "--ckpt", ckpt, "--offload",
           offload, "--tokens", str(opts.tokens), "--numerics", opts.numerics, "--threads", str(opts.threads),
           "--repeat", str(opts.repeat)]
    group, preexec = None, None
    if limit_gb:
        group = make_cgroup(int(limit_gb * 2 ** 30))
        if group is None:
            print(f"  (no writable memory cgroup here: the {limit_gb} GiB limit is NOT enforced)")
        else:
            procs = group[1]

            def join_group():     # in the child, before it runs Python: its whole life is inside the limit
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            preexec = join_group
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, preexec_fn=preexec)
    result = {"enforced": group is not None, "returncode": proc.returncode}
    if group is not None:
        try:
            with open(group[2]) as f:
                result["cgroup_peak"] = int(f.read())
        except OSError:
            pass
        try:
            os.rmdir(group[0])
        except OSError:
            pass
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        result["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        if proc.returncode in (-9, 137):
            result["error"] = "killed (out of memory inside the limit)"
        return result
    result.update(json.loads(lines[-1][len("RESULT "):]))
    return result


def describe(tag: str, r: dict) -> str:
    if "error" in r:
        return f"  {tag}: FAILED ({r['error']})"
    gib = 2 ** 30
    text = (f"  {tag}: prefill {r['tok_s']:.1f} tok/s ({r['prefill_s']:.1f} s; first call "
            f"{r['first_s']:.1f} s; load {r['load_s']:.1f} s), peak RSS {r['peak_rss'] / gib:.2f} GiB")
    if "cgroup_peak" in r:
        text += f", cgroup peak {r['cgroup_peak'] / gib:.2f} GiB (page cache included)"
    if "units" in r:
        text += (f"\n      {r['units']} units streamed, {r['s_per_unit']:.2f} s per unit, waiting on disk "
                 f"{100 * r['wait_share']:.0f}% of it, {r['bytes_read'] / 1e9:.2f} GB read at "
                 f"{r['read_gbps']:.2f} GB/s")
    return text


def meta_model(args):
    """The MP 1 model on the meta device, as streamed (Engram on disk, no DSpark head): shapes only."""
    from ...config import RuntimeOptions
    from ...engine.memory import build_meta_model
    return build_meta_model(args, 1, 0, RuntimeOptions(engram_on="disk"), build_dspark=False)


def weight_macs_per_token(args, model=None) -> float:
    """Multiply-adds per token in the weight GEMMs of one forward (every block, the head; routed experts at
    their activated share). Attention scores and the indexer are left out: a lower bound on the work."""
    from ...layers import Linear
    model = model or meta_model(args)
    share = args.n_activated_experts / args.n_routed_experts
    macs = float(args.vocab_size * args.dim)                                         # the head
    for name, m in model.layers.named_modules():
        if isinstance(m, Linear) and ".engram." not in f".{name}.":
            macs += m.in_features * m.out_features * (share if ".ffn.experts." in f".{name}." else 1.0)
    return macs


def released_estimate(config_path: str, tokens: int, gmacs: float, disk_gbps: float) -> str:
    """What a prefill of `tokens` through the released model (config.json) takes streamed at MP 1, at a
    machine's measured weight-GEMM rate and disk bandwidth: per block, the read overlaps the compute."""
    from ...config import ModelArgs
    args = ModelArgs.from_file(config_path)
    model = meta_model(args)
    block = max(sum(p.nbytes for n, p in layer.named_parameters() if not n.startswith("engram."))
                for layer in model.layers)
    per_block_macs = (weight_macs_per_token(args, model) - args.vocab_size * args.dim) / args.n_layers
    read_s, compute_s = block / disk_gbps / 1e9, tokens * per_block_macs / gmacs / 1e9
    total = args.n_layers * max(read_s, compute_s)
    return (f"released model ({args.n_layers} blocks of {block / 1e9:.2f} GB), {tokens}-token prefill at "
            f"{gmacs:.0f} GMAC/s and {disk_gbps:.2f} GB/s: per block {read_s:.1f} s reading, "
            f"{compute_s:.1f} s computing -> about {total / 60:.1f} min "
            f"({'disk' if read_s > compute_s else 'compute'}-bound)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m inference.tools.bench offload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["big", "fit", "both"], default="both")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "dsv41-bench"))
    ap.add_argument("--tokens", type=int, default=2048, help="prefill length (default 2048)")
    ap.add_argument("--mem-limit-gb", type=float, default=2.0, help="the big run's memory limit, GiB")
    ap.add_argument("--layers", type=int, default=16, help="big model: blocks")
    ap.add_argument("--experts", type=int, default=256, help="big model: routed experts per block")
    ap.add_argument("--moe-inter-dim", type=int, default=1024, help="big model: expert width")
    ap.add_argument("--numerics", default="fast", help="generate.py's --numerics words (default fast)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--repeat", type=int, default=2, help="prefills per run; figures of the last (default 2)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--offload", default="disk", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.child:
        return child(opts)
    os.makedirs(opts.workdir, exist_ok=True)
    print(f"{os.cpu_count()} CPUs, numerics {opts.numerics}, prefill of {opts.tokens} tokens")
    if opts.part in ("big", "both"):
        args = big_args(opts.layers, opts.experts, opts.moe_inter_dim, opts.tokens + 8)
        name = f"big-l{opts.layers}-e{opts.experts}-i{opts.moe_inter_dim}"
        ckpt = ensure_checkpoint(name, args, opts.workdir)
        shard = os.path.join(ckpt, "model0-mp1.safetensors")
        size = os.path.getsize(shard)
        disk_gbps = disk_bandwidth(shard)
        print(f"[big] {args.n_layers} blocks of {opts.experts} experts x {opts.moe_inter_dim}: shard "
              f"{size / 2 ** 30:.2f} GiB = {size / 2 ** 30 / opts.mem_limit_gb:.1f} x the "
              f"{opts.mem_limit_gb} GiB limit; disk: {disk_gbps:.2f} GB/s cold sequential read")
        big = run_child(ckpt, "disk", opts, opts.mem_limit_gb)
        print(describe("streamed, limited", big))
        if "error" not in big:
            busy = big["prefill_s"] * (1 - big["wait_share"])          # time not spent waiting on the disk
            gmacs = opts.tokens * weight_macs_per_token(args) / busy / 1e9
            print(f"  weight GEMMs: {gmacs:.1f} GMAC/s on this machine (a lower bound: attention not "
                  f"counted)")
            released = os.path.join(ROOT, "config.json")
            print("  " + released_estimate(released, opts.tokens, gmacs, disk_gbps))
            cores = os.cpu_count() or 1
            for scale, gbps in ((16, 3.0), (32, 6.0)):    # a bigger machine of the same kind of core
                print(f"  with {scale * cores} such cores and a {gbps:.0f} GB/s disk: "
                      + released_estimate(released, opts.tokens, scale * gmacs, gbps))
    if opts.part in ("fit", "both"):
        args = make_args("large", opts.tokens + 8)
        ckpt = ensure_checkpoint("offload-large", args, opts.workdir)
        shard = os.path.join(ckpt, "model0-mp1.safetensors")
        print(f"[fit] the large model, shard {os.path.getsize(shard) / 2 ** 30:.2f} GiB; disk: "
              f"{disk_bandwidth(shard):.2f} GB/s cold sequential read")
        memory = run_child(ckpt, "none", opts)
        print(describe("in memory", memory))
        disk = run_child(ckpt, "disk", opts)
        print(describe("streamed (cold page cache)", disk))
        if "error" not in memory and "error" not in disk:
            print(f"  streamed / in-memory prefill speed: {disk['tok_s'] / memory['tok_s']:.2f}")

