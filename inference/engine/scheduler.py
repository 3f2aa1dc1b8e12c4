"""Continuous batching: every row of the caches at its own position, requests joining and leaving a running
batch (the endpoint's loop, inference/serve/engine.py).

    submit(seq) ----> waiting ----> a free cache row: its prompt prefilled into the row, a chunk per step
                                     (--prefill-chunk), the rows running meanwhile
    step():  admit into free rows, one prefill chunk for each row still in its prompt (neighbouring rows
             with prompts of one length in one call), then one decode step of every generating row at its
             own position (model.decode with positions [B]); each row sampled with its own temperature,
             top_p and generator
    a row that ends (EOS, its max_new tokens, released by the caller: a stop string, its client gone) frees
    its row at once; a request with max_new 0 (a log-likelihood) is a prefill only

Under `--numerics invariant` a sequence's tokens and logits are the same bits whatever runs beside it (rows
never mix in that order); in the other orders a batch moves the numbers as the official loop's batches do.
The official loop (generation.py: prefill to the shortest prompt, the rest teacher-forced) stays for
`--batch-loop official` and scoring, whose numbers are the parity contract.

Every rank runs the same scheduler on the same inputs (the caller broadcasts what joins and what leaves), so
its decisions are every rank's without a collective of its own.
"""
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch

from ..sampling import sample
from ..state import DecodeStep
from .generation import Stats
from .prefill import chunk_bounds, image_spans


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler runs it.

    ids          the prompt's token ids
    max_new      tokens to generate at most (0: the prompt's logits only)
    temperature, top_p, seed    its sampling (seed None: the process's RNG stream, alike on every rank)
    all_logits   keep every prompt position's logits (log-likelihoods, echo)
    token_types, images         a prompt with images (vision.ImageInput spans; never cut by a chunk)
    tag          the caller's (the endpoint's bookkeeping of the request)

    Set while it runs, by the scheduler alone: `row` (its cache row), `done` (prompt positions prefilled),
    `tokens` (generated), `finish` ("eos", "length", or the caller's reason), its generator. Sequences compare
    by identity."""
    ids: List[int]
    max_new: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    all_logits: bool = False
    token_types: Optional[List[int]] = None
    images: Optional[list] = None
    tag: Any = None
    row: int = -1
    done: int = 0
    tokens: List[int] = field(default_factory=list)
    finish: Optional[str] = None
    generator: Optional[torch.Generator] = field(default=None, repr=False)
    prompt_logits: List[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def position(self) -> int:
        """The position of the next token fed to the model (the prompt's length plus those generated)."""
        return len(self.ids) + len(self.tokens) - 1


# What a step hands the caller: a sequence's new token with the logits it was sampled from [V] fp32; once a
# prompt is prefilled, its logits [P, V] (all_logits) before its first token.
TokenHook = Callable[[Sequence, int, torch.Tensor], None]
PromptHook = Callable[[Sequence, torch.Tensor], None]


class Scheduler:
    """The running set of at most `rows` sequences (the model's first `rows` cache rows) and those waiting
    for a row. `chunk`: prompt positions prefilled per step and row (None: a whole prompt in one call);
    `stats`: where the prefill and decode calls' tokens and seconds are counted (the samples' reads of the
    logits wait for the device)."""

    def __init__(self, model, rows: int, eos_id: int, chunk: Optional[int] = None,
                 stats: Optional[Stats] = None):
        if rows > model.args.max_batch_size:
            raise ValueError(f"{rows} rows: the model's caches hold max_batch_size="
                             f"{model.args.max_batch_size}")
        self.model, self.eos_id, self.chunk = model, eos_id, chunk
        self.stats = stats if stats is not None else Stats()
        self.device = next(model.parameters()).device
        self.slots: List[Optional[Sequence]] = [None] * rows
        self.waiting: List[Sequence] = []

    # ---- what the caller sees ----

    @property
    def running(self) -> List[Sequence]:
        return [s for s in self.slots if s is not None]

    def free_rows(self) -> int:
        return self.slots.count(None) - len(self.waiting)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence (it runs from the next step on, once a row is free)."""
        if seq.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.seed)
        self.waiting.append(seq)

    def release(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (a stop string, its client gone, its own error): its row is free at once."""
        seq.finish = seq.finish or reason
        if seq in self.waiting:
            self.waiting.remove(seq)
        if 0 <= seq.row < len(self.slots) and self.slots[seq.row] is seq:
            self.slots[seq.row] = None

    # ---- one step ----

    @torch.inference_mode()
    def step(self, on_token: TokenHook, on_prompt: Optional[PromptHook] = None,
             on_error: Optional[Callable[[Sequence, Exception], None]] = None) -> None:
        """Admit waiting sequences into free rows, one prefill chunk for each row still in its prompt, then
        one decode step of every row generating. A prefill that fails on its own (a ValueError: its prompt,
        its images; memory for its prefill) ends that sequence through on_error (raised without one);
        anything else, and any failure of the decode step, propagates."""
        while self.waiting and None in self.slots:
            seq = self.waiting.pop(0)
            seq.row = self.slots.index(None)
            self.slots[seq.row] = seq
        for group in self._prefill_groups():
            started, before = time.perf_counter(), group[0].done
            try:
                self._prefill_chunk(group, on_token, on_prompt)
            except (ValueError, torch.OutOfMemoryError, MemoryError) as e:
                if on_error is None:
                    raise
                for seq in group:
                    self.release(seq, "error")
                    on_error(seq, e)
            self.stats.add("prefill", len(group) * (group[0].done - before), time.perf_counter() - started)
        generating = [s for s in self.slots if s is not None and s.done == len(s.ids) and s.finish is None]
        if generating:
            self._decode(generating, on_token)

    def _prefill_groups(self) -> List[List[Sequence]]:
        """The rows still in their prompts, in groups that one prefill call serves: neighbouring rows at the
        same point of prompts of the same length (requests sent together), each with images alone."""
        groups: List[List[Sequence]] = []
        for seq in self.slots:
            if seq is None or seq.done >= len(seq.ids):
                continue
            last = groups[-1][-1] if groups else None
            if (last is not None and last.row + 1 == seq.row and len(last.ids) == len(seq.ids)
                    and last.done == seq.done and last.all_logits == seq.all_logits
                    and not last.images and not seq.images):
                groups[-1].append(seq)
            else:
                groups.append([seq])
        return groups

    def _prefill_chunk(self, group: List[Sequence], on_token: TokenHook,
                       on_prompt: Optional[PromptHook]) -> None:
        """The next chunk of the group's prompts into their rows (one call); after the last one each one's
        first token (or its end)."""
        first = group[0]
        spans = image_spans([first.images]) if first.images else ()
        start = first.done
        end = next(e for s, e in chunk_bounds(len(first.ids), self.chunk, spans) if s == start)
        ids = torch.tensor([seq.ids[start:end] for seq in group], dtype=torch.long, device=self.device)
        types = None if first.token_types is None else torch.tensor(
            [first.token_types[start:end]], dtype=torch.long, device=self.device)
        out = self.model.prefill(ids, start, images=[first.images] if first.images else None,
                                 token_types=types, all_logits=first.all_logits, first_row=first.row)
        for i, seq in enumerate(group):
            seq.done = end
            if seq.all_logits:
                seq.prompt_logits.append(out.logits[i])                # [s, V]
            if end < len(seq.ids):
                continue
            last = out.logits[i, -1] if seq.all_logits else out.logits[i]   # [V]
            if on_prompt is not None and seq.all_logits:
                on_prompt(seq, torch.cat(seq.prompt_logits))
            seq.prompt_logits = []
            if seq.max_new == 0:
                self.release(seq, "length")
                continue
            self._take(seq, self._sample(seq, last[None])[0], last, on_token)

    def _decode(self, seqs: List[Sequence], on_token: TokenHook) -> None:
        """One decode step of the generating rows, each feeding its last token at its own position: a call
        per run of rows that no prompt being prefilled interrupts (such a row keeps its state); a free row
        inside a run computes a throw-away token 0 at position 0 in its own cache row, rewritten by the
        prefill of whatever joins there before it is read."""
        started = time.perf_counter()
        by_row = {s.row: s for s in seqs}
        runs, run = [], []
        for r in range(max(by_row) + 1):
            busy = self.slots[r] is not None and r not in by_row        # in its prompt
            if busy and run:
                runs.append(run)
                run = []
            elif not busy and (run or r in by_row):
                run.append(r)
        runs.append(run)
        logits = {}
        for rows in runs:
            while rows[-1] not in by_row:                                  # free rows after the last one
                rows.pop()
            ids = [by_row[r].tokens[-1] if r in by_row else 0 for r in rows]
            pos = [by_row[r].position if r in by_row else 0 for r in rows]
            length = max(pos) + 1
            step = DecodeStep.rows(torch.tensor(pos, device=self.device), length + length % 2, rows[0])
            out = self.model.decode(torch.tensor(ids, device=self.device).view(-1, 1), step).logits  # [b, V]
            logits.update({r: out[i] for i, r in enumerate(rows)})
        chosen = self._sample_rows(seqs, logits)
        self.stats.add("decode", len(seqs), time.perf_counter() - started)
        for s, t in zip(seqs, chosen):
            self._take(s, t, logits[s.row], on_token)

    def _take(self, seq: Sequence, token: int, logits: torch.Tensor, on_token: TokenHook) -> None:
        seq.tokens.append(token)
        if token == self.eos_id:
            seq.finish = "eos"
        elif len(seq.tokens) >= seq.max_new:
            seq.finish = "length"
        on_token(seq, token, logits)
        if seq.finish is not None:
            self.release(seq, seq.finish)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> List[int]:
        return sample(logits, seq.temperature, self.model.nx, seq.generator, seq.top_p).tolist()

    def _sample_rows(self, seqs: List[Sequence], logits) -> List[int]:
        """Each row with its own sampling (logits: row -> [V]): a greedy row by argmax, another alone with
        its own generator (the draws it would get running alone)."""
        return [int(self._sample(s, logits[s.row][None])[0]) for s in seqs]
