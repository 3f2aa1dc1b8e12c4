"""The device check's `cudagraph` phase: greedy decode steps of the fixture's model replayed from CUDA
graphs (inference/engine/cuda_graph.py) against the same steps run eagerly, logits compared bit for bit.
"""
import json
import os
import time

from .common import Ctx, note

CUDAGRAPH_RUN = (200, 60)        # prompt past the window, then steps across the 256 bucket and both parities
REHEARSAL_CUDAGRAPH = (60, 6)    # the rehearsal's, on CPU (bucket minimum 32: the 64 bucket is crossed)


def phase_cudagraph(ctx: Ctx) -> bool:
    """The fixture's model on the GPU (fast order, deterministic top-k, as --cuda-graph sets it), batch 1 and
    4: greedy decode steps eager and replayed from CUDA graphs (engine/cuda_graph.py), logits compared bit for
    bit, ms/step both ways (captures excluded). Rehearsal: no graph on a CPU, so the step a graph captures
    (a tensor position over a length bucket) runs eagerly against the plain eager step."""
    import torch
    from encoding.tokenizer import load_tokenizer
    from ...config import ModelArgs, RuntimeOptions
    from ...engine.checkpoint import load_checkpoint
    from ...engine.cuda_graph import GraphedDecode, bucket
    from ...model import Transformer
    from ...state import DecodeStep
    prompt, steps = REHEARSAL_CUDAGRAPH if ctx.rehearse else CUDAGRAPH_RUN
    args = ModelArgs.from_file(os.path.join(ctx.fixture, "config.json"), max_batch_size=4,
                               max_seq_len=prompt + steps + 8, temperature=0.0)
    opts = RuntimeOptions.from_profile("reference", kernel_backend="torch", deterministic_topk=True)
    model = Transformer(args, opts=opts, device=ctx.device, tokenizer=load_tokenizer(ctx.fixture))
    load_checkpoint(model, ctx.fixture)
    with open(os.path.join(ctx.fixture, "score.json"), encoding="utf-8") as f:
        seq = json.load(f)["sequences"][0]
    ok = True
    for batch in (1, 4):
        if ctx.clock.left() < 10:
            note(f"cudagraph: out of time, skipped batch {batch}")
            break
        ids = torch.tensor([seq[b:b + prompt + steps] for b in range(batch)], device=ctx.device)
        runs, times = [], []
        for graphed in (False, True):
            model.reset()
            model.prefill(ids[:, :prompt])
            graphs = GraphedDecode(model) if graphed and not ctx.rehearse else None
            logits, ms = [], []
            for p in range(prompt, prompt + steps):
                t = time.perf_counter()
                if graphs is not None:
                    out = graphs(ids[:, p:p + 1], p)[1]
                elif graphed:                                 # the rehearsal: the captured step, eagerly
                    length = bucket(p, args.max_seq_len, minimum=32)
                    pos = torch.tensor(p, device=ctx.device)
                    out = model.decode(ids[:, p:p + 1], DecodeStep(pos, p % 2, length)).logits
                else:
                    out = model.decode(ids[:, p:p + 1], p).logits
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                ms.append(1e3 * (time.perf_counter() - t))
                logits.append(out.float().cpu())
            runs.append(torch.stack(logits))
            times.append(sorted(ms)[len(ms) // 4: len(ms) - len(ms) // 4] or ms)   # middle half: no capture
        same = torch.equal(runs[0], runs[1])
        eager, replayed = (sum(t) / len(t) for t in times)
        what = "the captured step run eagerly" if ctx.rehearse else "replayed"
        note(f"cudagraph batch {batch}: {steps} steps from position {prompt}, {what} vs eager: "
             f"{'identical logits' if same else 'logits DIFFER'} (max |d| "
             f"{(runs[0] - runs[1]).abs().max().item():.3g}); {eager:.2f} ms/step eager, {replayed:.2f} "
             f"ms/step {what} (middle half of the steps)")
        ok &= same
    del model
    return ok

