"""The server's model side: requests queued by the HTTP thread, run on every rank by the scheduler
(inference/engine/scheduler.py: continuous batching), each generated token handed back to its request as it
is made.

    HTTP thread (rank 0)           Queue                 serve_loop (every rank)
    Job(request, sink) ---------> submit() ----------> take() on rank 0: the jobs for the free rows;
                                                         what joins and what leaves broadcast to the others
                                                         Scheduler.step(): prefill chunks, one decode step
    sink(event) <------------------------------------- rank 0: each row's tokens, text, log-probs, end

Every request has a cache row of its own from its prefill to its end: it joins the running batch at the next
step and leaves it when it ends (EOS, its max_tokens, a stop string, its client gone), its row free at once.
Requests with different sampling settings share a step (each row sampled with its own). A log-likelihood
request (max_tokens 0) is a prefill only. A request that fails on its own (its prompt, its images, memory for
its prefill) gets an error and the others go on; a failure of the step itself ends the server.
"""
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..engine.chat import Detokenizer
from ..engine.scheduler import Scheduler, Sequence
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
    status: int = 500                   # an error's HTTP status: 400 a request's own input, 500 the model


@dataclass
class Job:
    """One request in the queue: what to run and where its events go (sink: called on the model thread;
    it must only hand the event over). `cancelled` is set by the HTTP side when the client goes."""
    request: Request
    sink: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class Queue:
    """Rank 0's bounded queue of jobs. submit() refuses past `capacity` waiting jobs (the server answers 503
    with Retry-After); take() hands the serve loop the oldest jobs, as many as it has free rows, waiting for
    them only while nothing runs."""

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

    def take(self, n: int, timeout: float) -> Optional[List[Job]]:
        """At most n waiting jobs, oldest first, without waiting when `timeout` is 0 (a batch is running);
        else once one arrives (and those sent with it: GATHER_S, then those `arriving()`, for at most
        gather_s) or [] after `timeout` seconds idle (a heartbeat). None once closed and empty."""
        with self.cond:
            if not self.jobs and not self.closed and timeout > 0:
                self.cond.wait(timeout)
                if self.jobs:
                    self._gather(min(n, self.max_batch))
            if not self.jobs:
                return None if self.closed else []
            self.jobs = [j for j in self.jobs if not j.cancelled.is_set()]     # their clients went away
            taken, self.jobs = self.jobs[:n], self.jobs[n:]
            return taken

    def next_batch(self, timeout: float) -> Optional[List[Job]]:
        """The official loop's next batch (serve/official.py): the oldest job and those with its Sampling, at
        most max_batch, a job with images alone ([] after `timeout` seconds idle: a heartbeat), or None once
        closed and empty."""
        with self.cond:
            if not self.jobs and not self.closed:
                self.cond.wait(timeout)
            if not self.jobs:
                return None if self.closed else []
        with self.cond:
            self._gather(self.max_batch)
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

    def _gather(self, limit: int) -> None:
        """With the lock held and a job waiting: let the requests sent with it arrive (they come some ms
        apart), up to `limit` jobs: GATHER_S in any case, then while requests are being read and tokenized
        (`arriving()`), gather_s in all."""
        start = time.monotonic()
        settle, deadline = start + min(GATHER_S, self.gather_s), start + self.gather_s
        while not self.closed and len(self.jobs) < limit and (
                time.monotonic() < settle or self.preparing and time.monotonic() < deadline):
            until = settle if time.monotonic() < settle else deadline
            self.cond.wait(max(0.0, until - time.monotonic()))


def top_entry(logp: torch.Tensor, token: int, k: int, decode) -> Dict[str, Any]:
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
        self.ended = False                          # its "done" event sent
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
        self.ended = True
        if not self.job.cancelled.is_set():
            self.job.sink(Event("done", text=self.text, finish_reason=self.finish,
                                completion_tokens=self.generated,
                                prompt_logprobs=self.prompt_logprobs if self.req.echo_logprobs else None))


def _plan(queue_: Queue, sched: Scheduler, ending: List[Tuple[int, str]]):
    """Rank 0: what changes before the next step: ([(sequence number, reason)] ending, [Request] joining),
    or None once the queue is closed and nothing runs (the loop's end)."""
    busy = not sched.idle()
    jobs = queue_.take(sched.free_rows(), 0.0 if busy else HEARTBEAT_S)
    if jobs is None and not busy:
        return None
    return ending, jobs or []


def serve_loop(runner, par, queue_: Optional[Queue], eos_id: int, log) -> None:
    """Every rank until rank 0's queue is closed and nothing runs. Each turn rank 0 says what leaves (rows it
    ended: a stop string, a client gone) and what joins (queued requests, as many as there are free rows),
    broadcast to every rank; every rank applies it to its scheduler and runs one step. Rank 0 keeps the rows'
    bookkeeping and hands their events to the jobs. Every rank's scheduler sees the same inputs, so every
    decision it makes (admissions, ends by EOS or length) is every rank's."""
    model = runner.model
    sched = Scheduler(model, model.args.max_batch_size, eos_id, runner.budget.prefill_chunk, runner.stats)
    decode = runner.tokenizer.decode if par.rank == 0 else None
    running: Dict[int, Tuple[Sequence, Optional[Row]]] = {}        # sequence number -> (sequence, row)
    ending: List[Tuple[int, str]] = []
    count = 0

    def text_of(t):
        return decode([t], skip_special_tokens=False)

    def on_token(seq: Sequence, token: int, logits: torch.Tensor) -> None:
        row = seq.tag
        if row is None or row.finish:
            return
        if row.job.cancelled.is_set():
            row.finish = "abort"
            return
        want = row.req.logprobs
        row.add(token, None if want is None else
                top_entry(torch.log_softmax(logits.float(), -1), token, want, text_of))

    def on_prompt(seq: Sequence, logits: torch.Tensor) -> None:       # [P, V]: position i predicts i + 1
        row = seq.tag
        if row is None or not row.req.echo_logprobs:
            return
        logp = torch.log_softmax(logits[:-1].float(), -1)
        row.prompt_logprobs += [top_entry(logp[i], seq.ids[i + 1], row.req.logprobs or 0, text_of)
                                for i in range(len(seq.ids) - 1)]

    def on_error(seq: Sequence, e: Exception) -> None:
        if seq.tag is not None:
            status = 400 if isinstance(e, ValueError) else 503
            seq.tag.finish = "error"
            seq.tag.job.sink(Event("done", finish_reason="error", text=f"{type(e).__name__}: {e}",
                                   status=status))

    while True:
        jobs: List[Optional[Job]] = []
        message = None
        if par.rank == 0:
            plan = _plan(queue_, sched, ending)
            if plan is not None:
                jobs = plan[1]
                message = (plan[0], [j.request for j in jobs])
        message = par.broadcast_object(message)
        if message is None:
            return
        ends, requests = message
        jobs = jobs if par.rank == 0 else [None] * len(requests)
        ending = []
        for number, reason in ends:
            if number in running:
                sched.release(running[number][0], reason)
        for req, job in zip(requests, jobs):
            row = Row(job, runner.tokenizer, eos_id) if job is not None else None
            seq = Sequence(req.ids, req.max_tokens, req.sampling.temperature, req.sampling.top_p,
                           req.sampling.seed, req.echo_logprobs, req.token_types, req.images, tag=row)
            running[count] = (seq, row)
            count += 1
            sched.submit(seq)
        if sched.idle():
            continue
        try:
            sched.step(on_token, on_prompt, on_error)
        except Exception as e:               # a failure of the step: every row learns why; the server ends
            for seq, row in running.values():
                if row is not None and seq.finish is None:
                    row.job.sink(Event("done", finish_reason="error", text=f"{type(e).__name__}: {e}"))
            raise
        for number, (seq, row) in list(running.items()):
            if seq.finish is not None:               # ended by the scheduler (EOS, length) or an error
                del running[number]
                if row is not None and seq.finish != "error" and not row.ended:
                    row.end("stop" if seq.finish == "eos" else seq.finish)
            elif row is not None and (row.finish or row.job.cancelled.is_set()):
                ending.append((number, row.finish or "abort"))        # a stop string, a client gone
                if not row.finish:
                    row.finish = "abort"
                row.end()
