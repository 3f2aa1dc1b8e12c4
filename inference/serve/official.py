"""`--batch-loop official` for the endpoint: DeepSeek's batch loop, as generate.py's batch files and scoring
run it. A batch is the waiting jobs with the same Sampling
(one sampler and RNG stream), at most --max-batch-size; a job with images runs alone. Prompts are right-padded
in one buffer as the generate loop does (inference/engine/generation.py): the prefill runs to the shortest
prompt, longer rows are teacher-forced, and the batch ends when its last row does (a request that arrives
meanwhile waits for the next batch). Its decode steps share one position, so on a GPU they replay from CUDA
graphs. Each row ends on its own (EOS, its max_tokens, a stop string, its client gone); the batch ends when
every row has, decided on rank 0 and made every rank's after each step (chat.StopFlag).
"""
import time
from typing import List, Optional

import torch

from ..engine.batch import prompt_buffer
from ..engine.chat import StopFlag
from ..engine.prefill import prefill
from ..sampling import sample
from .engine import HEARTBEAT_S, Event, Queue, Row, top_entry
from .protocol import Request


@torch.inference_mode()
def run_batch(runner, requests: List[Request], rows: Optional[List[Row]], stop: StopFlag) -> None:
    """One batch on every rank. `rows`: rank 0's bookkeeping (None elsewhere). The calls are those of the
    generate loop (prefill to the shortest prompt, then decode steps, replayed from CUDA graphs when the run
    has them); the next token is sampled here from the step's fp32 logits with the batch's Sampling."""
    model, graphs, chunk = runner.model, runner.graphs, runner.budget.prefill_chunk
    device = next(model.parameters()).device
    lens = [len(r.ids) for r in requests]
    total = max(n + r.max_tokens for n, r in zip(lens, requests))
    shortest = min(lens)
    first = requests[0]
    types = [r.token_types for r in requests] if first.images else None
    tokens, token_types = prompt_buffer([r.ids for r in requests], total, device, types)
    in_prompt = tokens != -1
    s = first.sampling
    gen = None if s.seed is None else torch.Generator(device=device).manual_seed(s.seed)
    echo = any(r.echo_logprobs for r in requests)
    want = max((r.logprobs or 0 for r in requests), default=0)
    want_any = echo or any(r.logprobs is not None for r in requests)
    decode = runner.tokenizer.decode if rows is not None else None

    def text_of(t):
        return decode([t], skip_special_tokens=False)

    started = time.perf_counter()
    _, logits, _ = prefill(model, tokens[:, :shortest], token_types[:, :shortest] if first.images else None,
                           [first.images] if first.images else None, all_logits=echo, chunk=chunk,
                           temperature=0.0)
    runner.stats.add("prefill", len(requests) * shortest, time.perf_counter() - started)
    started = time.perf_counter()
    if echo:                                         # [B, P, V]: position i predicts token i + 1
        if rows is not None:
            logp = torch.log_softmax(logits[:, :-1].float(), -1)
            for b, row in enumerate(rows):
                if row.req.echo_logprobs:
                    row.prompt_logprobs += [top_entry(logp[b, i], int(tokens[b, i + 1]), want, text_of)
                                            for i in range(shortest - 1)]
        logits = logits[:, -1]
    pos = shortest
    while pos < total:
        chosen = sample(logits, s.temperature, model.nx, gen, s.top_p)         # [B]
        ids = torch.where(in_prompt[:, pos], tokens[:, pos], chosen)
        tokens[:, pos] = ids
        if rows is not None:
            _account(rows, pos, lens, ids.tolist(), logits if want_any else None, want, text_of)
        if pos + 1 >= total or stop():
            break
        step = ids[:, None]
        logits = graphs(step, pos)[1] if graphs is not None else model.decode(step, pos).logits
        pos += 1
    runner.stats.add("decode", len(requests) * (pos - shortest), time.perf_counter() - started)
    for row in rows or []:
        row.end("length")


def _account(rows: List[Row], pos: int, lens: List[int], ids: List[int], logits, want: int, text_of):
    """Rank 0, after the token at `pos` was chosen: a prompt row records its prompt token's log-prob (echo),
    a generating row its new token."""
    logp = torch.log_softmax(logits.float(), -1) if logits is not None else None
    for b, row in enumerate(rows):
        if pos < lens[b]:                           # still in its prompt (teacher-forced)
            if row.req.echo_logprobs:
                row.prompt_logprobs.append(top_entry(logp[b], ids[b], want, text_of))
        elif row.finish:
            continue
        elif row.job.cancelled.is_set():
            row.finish = "abort"
        elif row.req.max_tokens == 0:
            row.finish = "length"
        else:
            row.add(ids[b], top_entry(logp[b], ids[b], row.req.logprobs, text_of)
                    if row.req.logprobs is not None else None)


def serve_batches(runner, par, queue_: Optional[Queue], eos_id: int, log) -> None:
    """Every rank: batches until rank 0's queue is closed and empty. Rank 0 takes each batch from `queue_`
    and broadcasts its requests; every rank runs it. Rank 0 keeps the rows and hands their events to the jobs;
    a step's end of the batch (every row done) is rank 0's decision, made every rank's (StopFlag)."""
    while True:
        batch = queue_.next_batch(HEARTBEAT_S) if par.rank == 0 else None
        requests = par.broadcast_object(None if batch is None else [j.request for j in batch])
        if requests is None:
            return
        if not requests:                             # a heartbeat
            continue
        rows = [Row(j, runner.tokenizer, eos_id) for j in batch] if par.rank == 0 else None
        stop = StopFlag(par, (lambda: all(r.finish or r.job.cancelled.is_set() for r in rows))
                        if rows is not None else None, next(runner.model.parameters()).device)
        try:
            run_batch(runner, requests, rows, stop)
        except Exception as e:                       # the rows learn why; the error ends the server
            for row in rows or []:
                row.job.sink(Event("done", finish_reason="error", text=f"{type(e).__name__}: {e}"))
            raise
