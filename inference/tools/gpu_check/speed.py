"""The device check's `speed` phase: a decode step's cost on the GPU.

At the released widths with 2 and 4 layers (the released roles: a ratio-2 then a ratio-1 KV and index source,
then ratio-1 layers reading them, one of them an index source restricted to the candidate blocks; 384 routed
experts top-6, one Engram layer with a small table) and synthetic weights (synthetic.randomize, made on the
GPU: no checkpoint is written), per kernel route:

* decode ms/step at batch 1, 4 and 32 after a prompt of DECODE_CONTEXT tokens, eager and replayed from CUDA
  graphs, each beside the launches one eager step dispatches (counted on the device by the launch counter's
  dispatch mode, a TileLang kernel as one) and the weight bytes a step reads as a share of the HBM
  bandwidth (measured here by a device-to-device copy, and against the card's nominal figure);
* prefill tokens/s at 1K and 8K tokens (batch 1);
* the 2-layer model with --experts-on host: decode ms/step at batch 1 and 4, and the link's GB/s host to
  device and back, pinned and pageable (what the copy route's cross-over, LINK_BYTES_PER_S in
  kernels/experts.py, assumes);
* the host-expert kernel's decode GB/s at 1, 2, 4, 8 and 16 threads of the device host's cores.

Every figure is printed, none asserted: the phase fails only when something raises. The rehearsal walks the
same code on the CPU at the fixture's widths (the captured step run eagerly, no graphs, 1 and 2 threads).
"""
import dataclasses
import os
import time

from .common import note

NOMINAL_HBM_GBS = {"H200": 4800.0, "H100": 3350.0}
SPEED_LAYERS = (2, 4)
SPEED_BATCHES = (1, 4, 32)
PREFILL_TOKENS = (1024, 8192)
DECODE_CONTEXT = 1024
DECODE_STEPS = 12
HOST_THREADS = (1, 2, 4, 8, 16)
REHEARSAL = dict(layers=(2,), batches=(1, 2), prefill=(16, 32), context=16, steps=2, threads=(1, 2))


def speed_config(base: dict, layers: int) -> dict:
    """`base` (config.json keys: the released widths, or the fixture's in the rehearsal) cut to `layers`
    layers with the released roles, no DSpark or vision, one Engram layer with a 1,000-id vocabulary."""
    from ...config import ModelArgs
    from ..synthetic import engram_table_sizes
    ratios = [2, 1] + [1] * (layers - 2)
    index_sources = [0, 1] + ([2] if layers > 2 else [])
    cfg = dict(base, n_layers=layers, n_mtp_layers=0, dspark_block_size=0,
               dspark_target_layer_ids=[layers - 1],
               compress_ratios=ratios, kv_source_layers=[0, 1], index_source_layers=index_sources,
               candidate_source_layer=1, engram_layer_ids=[1], engram_vocab_size=1000, vision_n_layers=0)
    cfg["engram_num_embeddings"] = engram_table_sizes(ModelArgs(**dict(cfg, engram_num_embeddings=[])))
    return cfg


def step_bytes(model, batch: int) -> int:
    """Weight bytes one decode step reads: all but the embeddings and Engram tables (only looked-up rows are
    read), with the routed experts counted by the expected share touched at this batch (uniform routing)."""
    a = model.args
    dense = experts = 0
    for n, p in model.named_parameters():
        if n.startswith("embed.") or ".engram.embed." in n:
            continue
        if ".experts." in n:
            experts += p.numel() * p.element_size()
        else:
            dense += p.numel() * p.element_size()
    touched = 1 - (1 - a.n_activated_experts / a.n_routed_experts) ** batch
    return int(dense + experts * touched)


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _seconds(fn, device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def device_copy_gbs(device: str, gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a device-to-device copy (read + write), the best of `repeats`."""
    import torch
    src = torch.empty(int(gib * 2 ** 30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = min(_seconds(lambda: dst.copy_(src), device) for _ in range(repeats))
    return 2 * src.numel() / best / 1e9


def link_gbs(device: str, mib: int = 256, repeats: int = 5) -> dict:
    """GB/s of copies between host and device memory: {(direction, pinned or pageable): GB/s}."""
    import torch
    out = {}
    dev = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    for pinned in (True, False):
        host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())
        kind = "pinned" if pinned else "pageable"
        out[("to device", kind)] = host.numel() / min(
            _seconds(lambda: dev.copy_(host, non_blocking=pinned), device) for _ in range(repeats)) / 1e9
        out[("to host", kind)] = host.numel() / min(
            _seconds(lambda: host.copy_(dev, non_blocking=pinned), device) for _ in range(repeats)) / 1e9
    return out


def count_launches(model, ids, pos: int) -> int:
    """Launches of one eager decode step on the model's device: the launch counter's dispatch mode on the
    real tensors, each TileLang kernel call counted as one (their wrappers are wrapped for the count)."""
    import contextlib
    from ..bench.launches import DeviceOps, counting_tilelang
    counter = DeviceOps(model.ctx.device.split(":")[0])
    counter.phase = "decode"
    with contextlib.ExitStack() as stack:
        if model.nx.name == "tilelang":
            stack.enter_context(counting_tilelang(counter))
        stack.enter_context(counter)
        model.decode(ids, pos)
    return counter.total("decode")


def decode_speed(model, batch: int, context: int, steps: int, graphs: bool, gen, rehearse: bool):
    """(ms per eager step, ms per replayed step or None, launches of one eager step) at `batch` rows after
    a prefill of `context` tokens; the middle half of the steps (captures excluded)."""
    import torch
    from ...engine.cuda_graph import GraphedDecode, bucket
    from ...state import DecodeStep
    device = model.ctx.device
    ids = torch.randint(4, 999, (batch, context + 2 * steps + 2), generator=gen).to(device)
    launches = None
    times = {}
    for graphed in (False, True):
        if graphed and not graphs and not rehearse:
            break
        model.reset()
        model.prefill(ids[:, :context])
        runner = GraphedDecode(model) if graphed and not rehearse else None
        ms = []
        for i in range(steps):
            p = context + i
            step_ids = ids[:, p:p + 1]
            if runner is not None:
                ms.append(1e3 * _seconds(lambda: runner(step_ids, p), device))
            elif graphed:             # the rehearsal: the step a graph captures, run eagerly
                at = DecodeStep(torch.tensor(p, device=device), p % 2, bucket(p, model.args.max_seq_len, 32))
                ms.append(1e3 * _seconds(lambda: model.decode(step_ids, at), device))
            else:
                ms.append(1e3 * _seconds(lambda: model.decode(step_ids, p), device))
        middle = sorted(ms)[len(ms) // 4: len(ms) - len(ms) // 4] or ms
        times[graphed] = sum(middle) / len(middle)
        if not graphed:
            launches = count_launches(model, ids[:, context + steps:context + steps + 1], context + steps)
    return times[False], times.get(True), launches


def phase_speed(ctx) -> bool:
    import torch
    from encoding.tokenizer import write_v41_tokenizer, load_tokenizer
    from ...config import ModelArgs
    from ...model import Transformer
    from ..synthetic import randomize
    device, clock, r = ctx.device, ctx.clock, ctx.rehearse
    layers_list = REHEARSAL["layers"] if r else SPEED_LAYERS
    batches = REHEARSAL["batches"] if r else SPEED_BATCHES
    prefills = REHEARSAL["prefill"] if r else PREFILL_TOKENS
    context = REHEARSAL["context"] if r else DECODE_CONTEXT
    steps = REHEARSAL["steps"] if r else DECODE_STEPS
    if r:
        base, tokenizer = ctx.fixture_config(), load_tokenizer(ctx.fixture)
        note("speed: the fixture's widths on the CPU; the figures say nothing about a GPU")
    else:
        write_v41_tokenizer(ctx.tmp)
        base, tokenizer = ctx.released, load_tokenizer(ctx.tmp)
    if not r:
        name = torch.cuda.get_device_name()
        nominal = next((v for k, v in NOMINAL_HBM_GBS.items() if k in name), None)
        peak = device_copy_gbs(device)
        note(f"speed: {name}: device-to-device copy {peak:.0f} GB/s"
             + (f" (nominal HBM {nominal:.0f} GB/s)" if nominal else ""))
        link = link_gbs(device)
        note("speed: host link " + ", ".join(f"{d} {k} {v:.1f} GB/s" for (d, k), v in link.items()))
    else:
        peak, nominal = None, None
    gen = torch.Generator().manual_seed(0)
    for layers in layers_list:
        cfg = speed_config(base, layers)
        args = ModelArgs.from_dict(cfg, max_seq_len=max(max(prefills), context + 2 * steps + 2) + 64,
                                   max_batch_size=max(batches), temperature=0.0)
        for backend in ("tilelang", "torch"):
            if clock.left() < 30:
                note(f"speed: out of time, skipped {layers} layers {backend}")
                return True
            opts = dataclasses.replace(ctx.runtime(backend), deterministic_topk=True)   # as graphs run
            model = Transformer(args, opts=opts, device=device, tokenizer=tokenizer, build_dspark=False)
            randomize(model)
            for tokens in prefills:
                ids = torch.randint(4, 999, (1, tokens), generator=gen).to(device)
                model.prefill(ids[:, :8])                                  # warm-up
                t = _seconds(lambda: model.prefill(ids), device)
                note(f"speed {layers} layers {backend:8s} prefill {tokens:5d} tokens: "
                     f"{tokens / t:9.0f} tok/s")
            for batch in batches:
                if clock.left() < 20:
                    break
                eager, graphed, launches = decode_speed(model, batch, context, steps, not r, gen, r)
                read = step_bytes(model, batch)
                gbs = read / graphed / 1e6 if graphed else 0.0
                share = (f", {gbs:.0f} GB/s replayed = {100 * gbs / peak:.1f} % of the copy bandwidth"
                         if graphed and peak else "")
                replay = (f"{graphed:7.2f} ms as the captured step run eagerly" if r
                          else f"{graphed:7.2f} ms replayed" if graphed else "(no graphs)")
                note(f"speed {layers} layers {backend:8s} batch {batch:2d}: decode {eager:7.2f} ms eager, "
                     f"{replay}, {launches} launches a step, {read / 1e9:.2f} GB of weights a step{share}")
            model = None                        # freed before the next model is built
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    _host_experts_speed(ctx, base, tokenizer, context, steps, gen)
    _host_kernel_threads(REHEARSAL["threads"] if r else HOST_THREADS, 4 if r else 24)
    return True


def _host_experts_speed(ctx, base: dict, tokenizer, context: int, steps: int, gen) -> None:
    """The 2-layer model with its routed experts in host memory: decode ms/step at batch 1 and 4."""
    from ...config import ModelArgs
    from ...model import Transformer
    from ..synthetic import randomize
    if ctx.clock.left() < 30:
        note("speed: out of time, skipped the experts in host memory")
        return
    args = ModelArgs.from_dict(speed_config(base, 2), max_seq_len=context + 2 * steps + 66, max_batch_size=4,
                               temperature=0.0)
    opts = dataclasses.replace(ctx.runtime("torch"), experts_on="host", deterministic_topk=True)
    model = Transformer(args, opts=opts, device=ctx.device, tokenizer=tokenizer, build_dspark=False)
    randomize(model)
    for batch in (1, 4):
        eager, _, _ = decode_speed(model, batch, context, steps, False, gen, False)
        note(f"speed 2 layers experts on host batch {batch}: decode {eager:7.2f} ms/step (torch route, the "
             f"host-expert kernel, pinned round trips)")
    del model


def _host_kernel_threads(threads, steps: int) -> None:
    """The host-expert kernel's decode (6 random experts of the released size a step) at each thread count."""
    import torch
    from ...kernels import host_experts as he
    from ..bench.experts import decode, random_experts
    gen = torch.Generator().manual_seed(0)
    experts = random_experts(32, gen)
    buf = torch.ones(1 << 26)
    variant = he.kernel_variant()
    before = torch.get_num_threads()
    try:
        for n in threads:
            if n > (os.cpu_count() or 1):
                continue
            torch.set_num_threads(n)
            read, gbs, ms, _ = decode(experts, steps, gen, variant, buf, 2)
            note(f"speed host-expert kernel ({variant}) {n:2d} threads: decode {gbs:5.1f} GB/s of expert "
                 f"bytes, {ms:.2f} ms a step (read bandwidth {read:.1f} GB/s)")
    finally:
        torch.set_num_threads(before)
