"""The server's model side: requests queued by the HTTP thread, taken as batches by rank 0 and run on every
rank, each generated token handed back to its request while the batch runs.

    HTTP thread (rank 0)           Queue                 serve_loop (every rank)
    Job(request, sink) ---------> submit() ----------> next_batch() on rank 0, broadcast to the others
                                                         run_batch(): prefill, decode steps, sampling
    sink(event) <------------------------------------- rank 0: each row's tokens, text, log-probs, end

A batch is the waiting jobs with the same Sampling (one sampler and RNG stream), at most --max-batch-size;
a job with images runs alone (as generate.py runs them). Prompts are right-padded in one buffer as the
generate loop does (inference/engine/generation.py): the prefill runs to the shortest prompt, longer rows are
teacher-forced. Each row ends on its own (EOS, its max_tokens, a stop string, its client gone); the batch ends
when every row has, decided on rank 0 and made every rank's after each step (chat.StopFlag).
"""
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from ..engine.batch import prompt_buffer
from ..engine.chat import Detokenizer, StopFlag
from ..engine.prefill import prefill
from ..sampling import sample
from .protocol import APIError, Request

GATHER_S = 0.02       # a batch waits this long for the requests sent with its first in any case
HEARTBEAT_S = 30.0     # an idle rank 0 still broadcasts this often: the others' collectives never time out


@dataclass
class Event:
    """What the model side hands a request: a generated token ("token": its id, the text it adds once stop
    strings are ruled out, its log-probs), or the end ("done": finish_reason, the whole text, the number of
    generated tokens, the prompt's log-probs when asked)."""
    kind: str
    token: Optional[int] = None
    text: str = ""
    logprob: Optional[Dict[str, Any]] = None
    finish_reason: Optional[str] = None
    completion_tokens: int = 0
    prompt_logprobs: Optional[List[Optional[Dict[str, Any]]]] = None


@dataclass
class Job:
    """One request in the queue: what to run and where its events go (sink: called on the model thread;
    it must only hand the event over). `cancelled` is set by the HTTP side when the client goes."""
    request: Request
    sink: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class Queue:
    """Rank 0's bounded queue of jobs. submit() refuses past `capacity` waiting jobs (the server answers 503
    with Retry-After); next_batch() takes the oldest job and those that can share its batch, once the requests
    sent with it are queued too (GATHER_S, then those `arriving()`: being read and tokenized) for at most
    `gather_s`."""

    def __init__(self, capacity: int, max_batch: int, gather_s: float = 0.1):
        self.capacity, self.max_batch, self.gather_s = capacity, max_batch, gather_s
        self.jobs: List[Job] = []
        self.cond = threading.Condition()
        self.closed = False
        self.preparing = 0               # requests received, not yet queued

    @contextlib.contextmanager
    def arriving(self):
        """Around a request's reading, checking and tokenizing: the next batch may wait for it."""
        with self.cond:
            self.preparing += 1
        try:
            yield
        finally:
            with self.cond:
                self.preparing -= 1
                self.cond.notify()

    def submit(self, jobs: List[Job]) -> None:
        with self.cond:
            if self.closed:
                raise APIError(503, "the server is shutting down")
            if len(self.jobs) + len(jobs) > self.capacity:
                raise APIError(503, f"the server is busy: {len(self.jobs)} requests wait (--max-queue "
                                    f"{self.capacity}); retry later", code="queue_full")
            self.jobs.extend(jobs)
            self.cond.notify()

    def close(self) -> None:
        """No more jobs; those still waiting are dropped (their clients are gone: the server has stopped)."""
        with self.cond:
            self.closed = True
            self.jobs.clear()
            self.cond.notify()

    def waiting(self) -> int:
        with self.cond:
            return len(self.jobs)

    def next_batch(self, timeout: float) -> Optional[List[Job]]:
        """The next batch ([] after `timeout` seconds idle: a heartbeat), or None once closed and empty."""
        with self.cond:
            if not self.jobs and not self.closed:
                self.cond.wait(timeout)
            if not self.jobs:
                return None if self.closed else []
        with self.cond:                             # requests sent together arrive some ms apart
            start = time.monotonic()
            settle, deadline = start + min(GATHER_S, self.gather_s), start + self.gather_s
            while not self.closed and len(self.jobs) < self.max_batch and (
                    time.monotonic() < settle or self.preparing and time.monotonic() < deadline):
                until = settle if time.monotonic() < settle else deadline
                self.cond.wait(max(0.0, until - time.monotonic()))
            self.jobs = [j for j in self.jobs if not j.cancelled.is_set()]     # their clients went away
            if not self.jobs:
                return []
            first = self.jobs[0]
            if first.request.images:
                batch = [first]
            else:
                batch = [j for j in self.jobs if j.request.sampling == first.request.sampling
                         and not j.request.images][:self.max_batch]
            self.jobs = [j for j in self.jobs if j not in batch]
            return batch


def _top(logp: torch.Tensor, token: int, k: int, decode) -> Dict[str, Any]:
    """A token's log-prob and the k most likely alternatives, from the row's log-softmax [V]."""
    entry = {"token": token, "text": decode(token), "logprob": float(logp[token])}
    if k:
        values, ids = logp.topk(k)
        entry["top"] = [(int(i), decode(int(i)), float(v)) for v, i in zip(values.tolist(), ids.tolist())]
    return entry


class Row:
    """Rank 0's bookkeeping of one running row: its text so far (stop strings cut it), what was sent, its
    log-probs, why it ended."""

    def __init__(self, job: Job, tokenizer, eos_id: int):
        self.job, self.req, self.eos_id = job, job.request, eos_id
        self.text_of = Detokenizer(tokenizer)
        self.text, self.sent, self.generated = "", 0, 0
        self.finish: Optional[str] = None
        self.prompt_logprobs: List[Optional[Dict[str, Any]]] = [None]      # the first token has none

    def _held(self) -> int:
        """How many characters at the end of the text may still start a stop string."""
        return max((n for s in self.req.stop for n in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:n])), default=0)

    def add(self, token: int, logprob: Optional[Dict[str, Any]]) -> None:
        self.generated += 1
        if token == self.eos_id:                    # not part of the text; its log-prob is not listed
            self.text += self.text_of.flush()
            self.finish, logprob = "stop", None
        else:
            self.text += self.text_of.add(token)
            cut = min((i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.req.stop)
                       if i >= 0), default=-1)
            if cut >= 0:
                self.text, self.finish = self.text[:cut], "stop"
            elif self.generated >= self.req.max_tokens:
                self.text += self.text_of.flush()
                self.finish = "length"
        end = len(self.text) if self.finish else len(self.text) - self._held()
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        self.job.sink(Event("token", token, piece, logprob))

    def end(self, reason: Optional[str] = None) -> None:
        self.finish = self.finish or reason
        if not self.job.cancelled.is_set():
            self.job.sink(Event("done", text=self.text, finish_reason=self.finish,
                                completion_tokens=self.generated,
                                prompt_logprobs=self.prompt_logprobs if self.req.echo_logprobs else None))


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
                           first.images, all_logits=echo, chunk=chunk, temperature=0.0)
    runner.stats.add("prefill", len(requests) * shortest, time.perf_counter() - started)
    started = time.perf_counter()
    if echo:                                         # [B, P, V]: position i predicts token i + 1
        if rows is not None:
            logp = torch.log_softmax(logits[:, :-1].float(), -1)
            for b, row in enumerate(rows):
                if row.req.echo_logprobs:
                    row.prompt_logprobs += [_top(logp[b, i], int(tokens[b, i + 1]), want, text_of)
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
                row.prompt_logprobs.append(_top(logp[b], ids[b], want, text_of))
        elif row.finish:
            continue
        elif row.job.cancelled.is_set():
            row.finish = "abort"
        elif row.req.max_tokens == 0:
            row.finish = "length"
        else:
            row.add(ids[b], _top(logp[b], ids[b], row.req.logprobs, text_of)
                    if row.req.logprobs is not None else None)


def serve_loop(runner, par, queue_: Optional[Queue], eos_id: int, log) -> None:
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
