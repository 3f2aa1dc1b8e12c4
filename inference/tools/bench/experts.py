"""Benchmark the CPU routed-expert kernel (inference/kernels/host_experts.py) on one MoE layer of the released
geometry.

    python -m inference.tools.bench experts [--json] [--experts 128] [--threads 2]

Prints: the machine's memory read bandwidth (a streaming sum over a large buffer); routed decode at batch 1
(dim 5120, experts of moe_inter_dim 2304 in MXFP4, top-6, 6 random experts per step out of --experts held in
memory, far beyond the caches) in GB/s of expert bytes and as a share of the read bandwidth. The two are
sampled in turns (--rounds: one sum, then a share of the decode steps), each figure the best over the run:
on a shared host the bandwidth left to a process moves by a quarter within seconds, and a share formed from
figures taken at different moments would move with it. Then a 512-token prefill (top-6 over the held
experts) in tokens/s and GMAC/s, and the kernel against "dequantise each active expert once into bf16,
torch's GEMM" on a subset of the active experts; the kernel's build time and peak RSS. With --linear, then:
one FP8 Linear of 8,192 x 5,120 computed from its stored bytes by the same kernel (--cpu-linears stored)
against its exact fp32 copy and torch's GEMM (the fast order's way), at the given token counts.

The per-core ceiling (--no-ceiling skips it): the kernel's rate on one thread with its weights in the last-
level cache (about 8 MB of each format a decode step reads: MXFP4 expert rows, FP8 Linear rows, bf16 rows),
a decode step's one token, in GB/s of weight bytes: what one core computes when memory is not the limit. A
decode with T threads can read at most min(the read bandwidth, T x that ceiling); the routed decode is printed
against both. Figures are printed, never asserted.
"""
import argparse
import functools
import json
import resource
import tempfile
import time

import torch

from ...kernels import host_experts as he
from ...kernels.fast import dequant_weight, gemm

DIM, INTER, TOPK, LIMIT = 5120, 2304, 6, 10.0


def stream_sum(buf: torch.Tensor) -> float:
    """GB/s of one streaming read of buf (torch's sum)."""
    t = time.perf_counter()
    buf.sum()
    return buf.numel() * buf.element_size() / (time.perf_counter() - t) / 1e9


def read_bandwidth(gib: float = 2.0, repeats: int = 4) -> float:
    """GB/s of a streaming read: torch's sum over a `gib` GiB fp32 buffer, best of `repeats`."""
    buf = torch.ones(int(gib * 2 ** 30) // 4)
    return max(stream_sum(buf) for _ in range(repeats))


def random_experts(n: int, gen: torch.Generator):
    """{projection: (weight [n, out, in/2] uint8, scale [n, out, in/32] uint8)} of n random MXFP4 experts."""
    shapes = {"w1": (INTER, DIM), "w3": (INTER, DIM), "w2": (DIM, INTER)}
    out = {}
    for p, (o, i) in shapes.items():
        w = torch.empty(n, o, i // 2, dtype=torch.uint8)
        he.advise_huge_pages(w)                                  # as the model's host experts (moe.py)
        out[p] = (torch.randint(0, 256, w.shape, dtype=torch.uint8, generator=gen, out=w),
                  torch.randint(118, 126, (n, o, i // 32), dtype=torch.uint8, generator=gen))
    return out


def expert_bytes(experts) -> int:
    """Stored bytes (weights and scales) of one expert."""
    return sum(w[0].numel() + s[0].numel() for w, s in experts.values())


def decode(experts, steps: int, gen: torch.Generator, variant: str, buf: torch.Tensor, rounds: int):
    """-> (best read GB/s, best GB/s of expert bytes, median ms per step, each round's best step / its read
    GB/s): `rounds` turns of one streaming sum over buf and steps / rounds decode steps of one token with 6
    random experts."""
    n = experts["w1"][0].shape[0]
    act = functools.partial(he.swiglu, limit=LIMIT)
    times, reads, shares = [], [], []
    for step in range(steps):
        if step % -(-steps // rounds) == 0:                                      # a new round
            reads.append(stream_sum(buf))
            shares.append([])
        x = torch.randn(1, DIM, generator=gen).bfloat16()                          # the token, as the model
        sel = torch.randperm(n, generator=gen)[:TOPK].tolist()                       # gives it (moe.py)
        rw = torch.rand(TOPK, generator=gen)
        t = time.perf_counter()
        he.expert_swiglu(x, [1] * TOPK, sel, rw, experts["w1"], experts["w3"], experts["w2"], "fp4", act,
                         variant, tokens=torch.zeros(TOPK, dtype=torch.int64))
        times.append(time.perf_counter() - t)
        shares[-1].append(times[-1])
    per_step = TOPK * expert_bytes(experts)
    fractions = [per_step / min(ts) / 1e9 / bw for ts, bw in zip(shares, reads)]
    return max(reads), per_step / min(times) / 1e9, 1e3 * sorted(times)[len(times) // 2], fractions


def routed(tokens: int, n: int, gen: torch.Generator):
    """A prefill's selections: (counts, expert ids) over the active experts in increasing id, and the token
    of each row, rows grouped by expert."""
    idx = torch.rand(tokens, n, generator=gen).topk(TOPK, dim=1).indices      # [T, k] distinct per token
    order = idx.flatten().argsort(stable=True)
    counts = torch.bincount(idx.flatten(), minlength=n)
    active = [e for e in range(n) if counts[e]]
    return [int(counts[e]) for e in active], active, order // TOPK


def dequant_gemm(x, counts, sel, experts):
    """The comparison: each active expert's three projections dequantised once into bf16, torch's GEMM.
    -> seconds spent dequantising, seconds in the GEMMs and the SwiGLU."""
    act = functools.partial(he.swiglu, limit=LIMIT)
    t_deq = t_gemm = 0.0
    start = 0
    for e, c in zip(sel, counts):
        t = time.perf_counter()
        w = {p: dequant_weight(wt[e], sc[e], "fp4", torch.bfloat16) for p, (wt, sc) in experts.items()}
        t_deq += time.perf_counter() - t
        t = time.perf_counter()
        xe = x[start:start + c]
        h = act(xe @ w["w1"].t(), xe @ w["w3"].t(), None).to(torch.bfloat16)
        h @ w["w2"].t()
        t_gemm += time.perf_counter() - t
        start += c
    return t_deq, t_gemm


def prefill(experts, tokens: int, subset: int, gen: torch.Generator, variant: str) -> dict:
    n = experts["w1"][0].shape[0]
    counts, sel, tok = routed(tokens, n, gen)
    x = torch.randn(tokens, DIM, generator=gen).bfloat16()                     # [T, D], each row's token: tok
    rw = torch.rand(len(tok), generator=gen)
    act = functools.partial(he.swiglu, limit=LIMIT)
    run = lambda c, s, rows: he.expert_swiglu(x, c, s, rw[:len(rows)], experts["w1"], experts["w3"],
                                              experts["w2"], "fp4", act, variant, tokens=rows)
    t = time.perf_counter()
    run(counts, sel, tok)
    t_all = time.perf_counter() - t
    macs = 3 * DIM * INTER * len(tok)
    # the comparison on the first `subset` active experts (dequantising all of them takes long)
    c_sub, s_sub = counts[:subset], sel[:subset]
    tok_sub = tok[:sum(c_sub)]
    x_sub = x[tok_sub]                                                          # [M, D] grouped by expert
    t = time.perf_counter()
    run(c_sub, s_sub, tok_sub)
    t_kernel = time.perf_counter() - t
    t_deq, t_gemm = dequant_gemm(x_sub, c_sub, s_sub, experts)
    t_base = t_deq + t_gemm
    macs_sub = 3 * DIM * INTER * x_sub.shape[0]
    return {"prefill_tokens": tokens, "prefill_active_experts": len(sel),
            "prefill_tokens_per_s": tokens / t_all, "prefill_gmacs": macs / t_all / 1e9,
            "prefill_subset_experts": len(s_sub), "prefill_subset_kernel_gmacs": macs_sub / t_kernel / 1e9,
            "prefill_subset_dequant_gemm_gmacs": macs_sub / t_base / 1e9,
            "prefill_subset_dequant_share": t_deq / t_base,
            "prefill_subset_bf16_gemm_gmacs": macs_sub / t_gemm / 1e9,
            "prefill_dequant_gemm_tokens_per_s_est": tokens / (t_all * t_base / t_kernel)}


def fp8_linear(tokens: list, gen: torch.Generator, n: int = 8192, k: int = 5120, copies: int = 8) -> dict:
    """One FP8 Linear [n, k] from its stored bytes (host_experts.stored_linear) and from its fp32 copy
    (fast.gemm), `copies` such Linears taken in turn so that each read comes from DRAM; their E4M3 codes
    those of Gaussian weights, as a checkpoint's (uniformly random bytes would make 1 in 16 an E4M3
    subnormal, which some cores multiply slowly). -> {tokens: (stored ms, fp32 copy ms)}, best of the
    calls."""
    scale = torch.full((n // 32, k // 32), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    stored = [(torch.randn(n, k, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
              for _ in range(copies)]
    fp32 = [dequant_weight(w, scale, "fp8", torch.float32) for w in stored]
    out = {}
    for t in tokens:
        x = torch.randn(t, k, generator=gen).bfloat16()
        best = []
        for run in (lambda w, f: he.stored_linear(x, w, scale, "fp8"), lambda w, f: gemm(x, f)):
            times = []
            for i in range(max(3, 2 * copies // max(1, t // 8))):            # fewer calls for long ones
                w, f = stored[i % copies], fp32[i % copies]
                start = time.perf_counter()
                run(w, f)
                times.append(time.perf_counter() - start)
            best.append(1e3 * min(times[1:]))                                # the first call warms up
        out[t] = tuple(best)
    return out


CEILING_BYTES = 8 << 20          # weights read per call of the ceiling: in the last-level cache, past L2


def ceiling(variant: str, gen: torch.Generator, repeats: int = 40) -> dict:
    """GB/s of weight bytes one thread computes a decode step's token at, its weights in the last-level cache
    (the first call brings them there), best of `repeats` calls, per format: {fp4, fp8, bf16: GB/s}."""
    k = DIM
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(1, k, generator=gen).bfloat16()
        n4 = CEILING_BYTES // (k // 2 + k // 32)
        w4 = torch.randint(0, 256, (1, n4, k // 2), dtype=torch.uint8, generator=gen)
        s4 = torch.randint(118, 126, (1, n4, k // 32), dtype=torch.uint8, generator=gen)
        n8 = CEILING_BYTES // k // 32 * 32
        w8 = (torch.randn(n8, k, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        s8 = torch.full((n8 // 32, k // 32), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        w16 = torch.randn(CEILING_BYTES // (2 * k), k, generator=gen).bfloat16()
        calls = {"fp4": (lambda: he.expert_linears_fp32(x, [1], [0], [(w4, s4)], "fp4", variant),
                         w4.nbytes + s4.nbytes),
                 "fp8": (lambda: he.stored_linear(x, w8, s8, "fp8", variant), w8.nbytes + s8.nbytes),
                 "bf16": (lambda: he.bf16_linear(x, [w16], variant), w16.nbytes)}
        for name, (call, nbytes) in calls.items():
            call()
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                call()
                best = min(best, time.perf_counter() - t)
            out[name] = nbytes / best / 1e9
    finally:
        torch.set_num_threads(threads)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m inference.tools.bench experts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128, help="routed experts held in memory (18.8 MB each)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps")
    ap.add_argument("--rounds", type=int, default=6,
                    help="turns of one bandwidth sum and steps / rounds decode steps")
    ap.add_argument("--tokens", type=int, default=512, help="prefill tokens")
    ap.add_argument("--subset", type=int, default=8, help="active experts in the dequant + GEMM comparison")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--bandwidth-gib", type=float, default=2.0, help="buffer of the read-bandwidth sum")
    ap.add_argument("--variant", default=None, help="auto, torch, avx512, avx2, scalar (default: "
                    f"${he.ENV} or auto)")
    ap.add_argument("--linear", default=None, metavar="TOKENS", help="also an FP8 Linear from its stored "
                    "bytes against its fp32 copy at these token counts, e.g. 1,4,64 (after the peak RSS)")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the per-core ceiling (weights in cache)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    opts = ap.parse_args(argv)
    if opts.steps < 1 or not 1 <= opts.rounds <= opts.steps:
        raise SystemExit(f"bench experts: need 1 <= --rounds ({opts.rounds}) <= --steps ({opts.steps})")
    if int(opts.bandwidth_gib * 2 ** 30) < 4:
        raise SystemExit(f"bench experts: --bandwidth-gib must be a positive size, "
                         f"got {opts.bandwidth_gib:g}")
    try:
        linear_tokens = [int(t) for t in opts.linear.split(",")] if opts.linear else []
    except ValueError:
        linear_tokens = [0]
    if any(t < 1 for t in linear_tokens):
        raise SystemExit(f"bench experts: --linear takes token counts >= 1 joined by commas, got "
                         f"{opts.linear}")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    gen = torch.Generator().manual_seed(0)
    say = (lambda *_: None) if opts.json else print
    variant = he.resolve(opts.variant)
    r = {"kernel_variant": variant, "threads": torch.get_num_threads()}
    if variant != "torch":
        with tempfile.TemporaryDirectory() as d:                     # a build from scratch, timed
            t = time.perf_counter()
            he.build(variant, cache_dir=d)
            r["build_s"] = time.perf_counter() - t
    say(f"kernel {variant}, {r['threads']} threads, torch {torch.__version__}"
        + (f", build {r['build_s']:.2f} s (uncached)" if "build_s" in r else ""))
    buf = torch.ones(int(opts.bandwidth_gib * 2 ** 30) // 4)                  # read in turns with the decode
    stream_sum(buf)                                                              # pages in, off the record
    experts = random_experts(opts.experts, gen)
    per = expert_bytes(experts)
    say(f"{opts.experts} MXFP4 experts of {DIM} x {INTER}: {per / 1e6:.1f} MB each, "
        f"{opts.experts * per / 1e9:.2f} GB held")
    he.expert_swiglu(torch.zeros(1, DIM, dtype=torch.bfloat16), [1], [0], torch.ones(1), experts["w1"],
                     experts["w3"], experts["w2"], "fp4", functools.partial(he.swiglu, limit=LIMIT), variant)
    r["read_bandwidth_gbs"], r["routed_decode_gbs"], r["routed_decode_ms"], rounds = decode(
        experts, opts.steps, gen, variant, buf, opts.rounds)
    r["routed_decode_fraction"] = r["routed_decode_gbs"] / r["read_bandwidth_gbs"]
    r["routed_decode_fraction_rounds"] = rounds
    say(f"read bandwidth: {r['read_bandwidth_gbs']:.1f} GB/s (a sum over {opts.bandwidth_gib:g} GiB, best of "
        f"{len(rounds)}, in turns with the decode steps)")
    say(f"decode, batch 1, top-{TOPK}: {r['routed_decode_gbs']:.1f} GB/s of expert bytes (best step), "
        f"{100 * r['routed_decode_fraction']:.0f} % of the read bandwidth (round by round "
        f"{100 * min(rounds):.0f}-{100 * max(rounds):.0f} %); median {r['routed_decode_ms']:.2f} ms per "
        f"layer ({TOPK * per / 1e6:.0f} MB)")
    if not opts.no_ceiling and variant != "torch":
        r["ceiling_gbs"] = ceiling(variant, gen)
        bound = min(r["read_bandwidth_gbs"], r["threads"] * r["ceiling_gbs"]["fp4"])
        r["routed_decode_fraction_of_bound"] = r["routed_decode_gbs"] / bound
        say("per-core ceiling (1 thread, weights in the last-level cache, one token): " + ", ".join(
            f"{k} {v:.1f} GB/s" for k, v in r["ceiling_gbs"].items()))
        say(f"decode against min(read bandwidth, {r['threads']} x the MXFP4 ceiling) = {bound:.1f} GB/s: "
            f"{100 * r['routed_decode_fraction_of_bound']:.0f} %")
    r.update(prefill(experts, opts.tokens, opts.subset, gen, variant))
    faster = "kernel" if r["prefill_subset_kernel_gmacs"] > r["prefill_subset_dequant_gemm_gmacs"] else \
        "dequant + GEMM"
    r["prefill_faster"] = faster
    say(f"prefill, {opts.tokens} tokens over {r['prefill_active_experts']} active experts: "
        f"{r['prefill_tokens_per_s']:.1f} tokens/s, {r['prefill_gmacs']:.1f} GMAC/s")
    say(f"  on {r['prefill_subset_experts']} of them: kernel {r['prefill_subset_kernel_gmacs']:.1f} GMAC/s, "
        f"dequantise to bf16 + torch GEMM {r['prefill_subset_dequant_gemm_gmacs']:.1f} GMAC/s "
        f"({100 * r['prefill_subset_dequant_share']:.0f} % of it dequantising; the GEMMs alone "
        f"{r['prefill_subset_bf16_gemm_gmacs']:.1f} GMAC/s) "
        f"(~{r['prefill_dequant_gemm_tokens_per_s_est']:.1f} tokens/s for the whole prefill): "
        f"{faster} faster")
    # the bandwidth buffer is resident from before the experts to the end: the peak less it is the rest's peak
    r["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - buf.numel() * 4
    say(f"peak RSS {r['peak_rss_bytes'] / 2 ** 30:.2f} GiB (the {opts.bandwidth_gib:g} GiB bandwidth buffer "
        "not counted)")
    if linear_tokens:
        r["linear_fp8"] = {}
        for t, (stored_ms, copy_ms) in fp8_linear(linear_tokens, gen).items():
            r["linear_fp8"][t] = {"stored_ms": stored_ms, "fp32_copy_ms": copy_ms}
            rate = f"{8192 * 5120 / stored_ms / 1e6:.1f} GB/s of them" if t == 1 else \
                f"{t * 8192 * 5120 / stored_ms / 1e6:.1f} GMAC/s"
            say(f"FP8 Linear 8,192 x 5,120, {t} token{'s' * (t > 1)}: from its stored bytes "
                f"{stored_ms:.2f} ms ({rate}), from its fp32 copy {copy_ms:.2f} ms")
    if opts.json:
        print(json.dumps(r))
    return r

