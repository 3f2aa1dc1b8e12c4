"""Speculative decoding with the DSpark draft head (docs/architecture.md §11.5), for a batch of prompts.

Each step drafts a block with `model.mtp.draft`, lets the main model verify the first k drafts, keeps
the longest valid prefix plus one token of the main model's own, and forgets what the rejected drafts
wrote (`model.rollback`).

A batch shares one position (the model takes one start_pos), so its rows advance together: each step
commits m + 1 tokens per row, m = the fewest drafts any unfinished row accepted. A row that accepted more
keeps its first m + 1 accepted drafts and drafts the rest again. That stays exact: for greedy the kept
tokens are argmaxes; for sampling, the row's own accepted tokens form a correctly distributed sequence, and
cutting it at the other row's accepted length, which is independent of it, leaves a correctly distributed
prefix (tests/test_speculative.py checks this on a toy model).

Greedy: a draft is valid if it is the main model's argmax, so the output is plain greedy decoding's.
Sampling: standard speculative rejection sampling, so the output is distributed as plain sampling (but is
not the same random draw as the Gumbel-max decoder).

Every rank runs this loop on identical all-gathered logits and draws from the same seeded RNG in the same
order, so every rank takes the same decisions without communicating (docs/numerics.md §11).
"""
import time
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Tuple

import torch

from ..sampling import sample
from .batch import Budget, PromptBatch, prompt_buffer, read_completions
from .prefill import prefill

VERIFY_MODES = ("chunked", "sequential")


# ---------------------------------------------------------------------------------------------------------
# Acceptance rules
# ---------------------------------------------------------------------------------------------------------

def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The distribution `sample` draws from (docs/numerics.md §11): softmax(logits / max(T, 1e-5)), fp32."""
    return torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)


def draw(p: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def accept_draft(p: torch.Tensor, q: torch.Tensor, d: int,
                 generator: Optional[torch.Generator] = None) -> bool:
    """Accept draft d (drawn from q) with probability min(1, p(d) / q(d)). p, q [V]."""
    u = torch.rand((), generator=generator, device=p.device)
    return bool(u * q[d] <= p[d])          # u <= p/q without dividing by a zero q(d)


def residual_token(p: torch.Tensor, q: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """The replacement after a rejection: a draw from normalize(max(p - q, 0)), or from p if that is all 0."""
    r = (p - q).clamp_min(0)
    return draw(r if r.sum() > 0 else p, generator)


def sampled_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                   generator: Optional[torch.Generator] = None) -> Tuple[int, int]:
    """p [k+1, V] target distributions (row i for the position of draft i+1, row k for the one after),
    q [k, V] the distributions the drafts were drawn from, drafts [k]
    -> (number of accepted drafts a, the token that follows them)."""
    k = drafts.shape[0]
    for i in range(k):
        if not accept_draft(p[i], q[i], int(drafts[i]), generator):
            return i, residual_token(p[i], q[i], generator)
    return k, draw(p[k], generator)


def greedy_accept(logits: torch.Tensor, drafts: torch.Tensor) -> Tuple[int, int]:
    """logits [k+1, V] of the main model, drafts [k] -> (a, y): a leading drafts equal the argmax, y = the
    argmax after them."""
    best = logits.argmax(dim=-1)
    a = int((drafts == best[:-1]).long().cumprod(0).sum())
    return a, int(best[a])


class Judge:
    """Draft-by-draft form of the rules above (sequential verification decides before feeding the next
    draft). check() returns None to accept, else the replacement token."""

    def __init__(self, temperature: float, generator: Optional[torch.Generator] = None):
        self.t, self.gen = temperature, generator

    def check(self, logits: torch.Tensor, d: int, q: Optional[torch.Tensor]) -> Optional[int]:
        if self.t <= 0:
            best = int(logits.argmax())
            return None if best == d else best
        p = probs(logits, self.t)
        return None if accept_draft(p, q, d, self.gen) else residual_token(p, q, self.gen)

    def bonus(self, logits: torch.Tensor) -> int:
        return int(logits.argmax()) if self.t <= 0 else draw(probs(logits, self.t), self.gen)

    def block(self, logits: torch.Tensor, drafts: torch.Tensor, q: Optional[torch.Tensor]) -> Tuple[int, int]:
        """logits [k+1, V], drafts [k], q [k, V] -> (a, y)."""
        if self.t <= 0:
            return greedy_accept(logits, drafts)
        return sampled_accept(probs(logits, self.t), q, drafts, self.gen)


# ---------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------

@dataclass
class SpecStats:
    """Per-sequence counts: a batch step over 2 unfinished rows counts 2 row-steps."""
    steps: int = 0            # draft + verify row-steps
    drafted: int = 0          # drafts verified
    accepted: int = 0         # drafts committed
    discarded: int = 0        # drafts accepted by the rule but dropped because another row accepted fewer
    step_tokens: int = 0      # tokens committed by the steps (committed drafts + 1 each)
    step_forwards: int = 0    # main-model forwards spent verifying, times the rows they advanced
    plain_steps: int = 0      # ordinary decode steps (prompt of one token; rows inside their prompt; the end)
    prefill_tokens: int = 0
    new_tokens: int = 0       # completion tokens, EOS included
    prefill_s: float = 0.0
    decode_s: float = 0.0
    reason: str = "length"    # of the last sequence: "eos" or "length"
    # Per step, per row: (drafts accepted by the rule, the token that follows them); (-1, -1) for a row
    # that was finished, or (sequential verification) was still accepting when another row stopped.
    decisions: List[Tuple[Tuple[int, int], ...]] = field(default_factory=list)

    def add(self, other: "SpecStats") -> None:
        for name in ("steps", "drafted", "accepted", "discarded", "step_tokens", "step_forwards",
                     "plain_steps", "prefill_tokens", "new_tokens", "prefill_s", "decode_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.decisions += other.decisions
        self.reason = other.reason

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a main-model forward adds to each sequence (1 for plain decoding)."""
        return self.step_tokens / self.step_forwards if self.step_forwards else 0.0

    def summary(self, verify: str, k: int) -> str:
        rate = f" ({self.accepted / self.drafted:.1%} of drafts)" if self.drafted else ""
        lost = (f"; {self.discarded} accepted drafts re-drafted to keep the batch rows in step"
                if self.discarded else "")
        return (f"speculative (dspark, {verify} verification, k={k}): {self.steps} steps, "
                f"mean accepted length {self.mean_accepted:.2f}{rate}, "
                f"{self.tokens_per_forward:.2f} tokens per main-model forward per sequence "
                f"({self.step_tokens} tokens / {self.step_forwards} forwards; "
                f"{self.plain_steps} plain decode steps{lost})")


# ---------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# draft_hook(position of the first draft, drafts [B, k]) -> drafts [B, k]
DraftHook = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SpecOptions:
    """Speculative decoding with the DSpark draft head. temperature: None = model.args.temperature; the
    drafts and the main model sample at it, passed with every call (the model's config is never changed).
    k: drafts verified per step, 1..dspark_block_size (None: all). verify: chunked (one extend call, the
    rejected rows rolled back) or sequential (a decode step per token). min_confidence: verify only the
    leading drafts whose sigmoid(confidence) reaches it (None: all)."""
    temperature: Optional[float] = None
    k: Optional[int] = None
    verify: str = "chunked"
    min_confidence: Optional[float] = None


@torch.inference_mode()
def speculative_generate_batch(model, batch: PromptBatch, budget: Budget, spec: SpecOptions = SpecOptions(),
                               draft_hook: Optional[DraftHook] = None,
                               on_step: Optional[Callable[[torch.Tensor], bool]] = None
                               ) -> Tuple[List[List[int]], List[str], SpecStats]:
    """Prompts -> (completion ids per prompt, EOS excluded, at most budget.max_new_tokens; finish reasons
    "eos" / "length"; statistics). The buffer and the prompt handling are generation.generate()'s: prompts
    right-padded, prefill up to the shortest, rows inside their prompt teacher-forced (by plain decode steps:
    speculation starts once every row is past its prompt).

    draft_hook(position of the first draft, drafts [B, k]) -> drafts [B, k]: a test hook replacing the
    drafts; when sampling, its drafts count as deterministic proposals (q = one-hot), which keeps the rule
    exact. on_step(ids [B]): called on every rank with each committed position's ids, in order (a step
    commits one to k+1 of them); when one call returns True the loop ends after the current step and the rows
    not yet ended get the finish reason "interrupted" (generate()'s hook, as a chat uses it)."""
    a = model.args
    prompts, max_new_tokens, eos_id = batch.ids, budget.max_new_tokens, budget.eos_id
    temperature, k, verify, min_confidence = spec.temperature, spec.k, spec.verify, spec.min_confidence
    token_types, images, prefill_chunk = batch.token_types, batch.images, budget.prefill_chunk
    if model.mtp is None:
        raise ValueError("speculative decoding needs the DSpark head "
                         "(n_mtp_layers > 0, dspark_block_size > 0)")
    blk = a.dspark_block_size
    k = blk if k is None else k
    if not 1 <= k <= blk:
        raise ValueError(f"k must be in 1..{blk} (dspark_block_size), got {k}")
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    t = a.temperature if temperature is None else temperature
    judge = Judge(t)
    stats = SpecStats()
    device = next(model.parameters()).device
    bsz, lens, max_len = len(prompts), [len(p) for p in prompts], a.max_seq_len
    for i, n in enumerate(lens):
        if n > max_len:
            raise ValueError(f"Prompt length exceeds model maximum sequence length (max_seq_len={max_len}): "
                             f"prompt {i + 1} has {n} tokens")
    total_len = min(max_len, max_new_tokens + max(lens))
    shortest, longest = min(lens), max(lens)
    if shortest == total_len:                    # no room for a token (the official loop makes no call)
        return [[] for _ in prompts], ["length"] * bsz, stats

    tokens, types = prompt_buffer(prompts, total_len, device, token_types)
    in_prompt = tokens != -1
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)
    stop = []                                    # set when on_step asks the loop to end

    def commit(pos: int, ids: torch.Tensor) -> None:
        """Write the chosen ids [B] at position pos (prompt tokens win), note who emitted EOS, and show them
        to on_step."""
        ids = torch.where(in_prompt[:, pos], tokens[:, pos], ids)
        tokens[:, pos] = ids
        finished.logical_or_(~in_prompt[:, pos] & (ids == eos_id))
        if on_step is not None and on_step(ids):   # every rank, every committed position (a collective)
            stop.append(pos)

    start = time.perf_counter()
    x, _, hidden = prefill(model, tokens[:, :shortest], None if types is None else types[:, :shortest],
                           images, chunk=prefill_chunk, on_chunk=model.mtp.seed,   # seeds the DSpark rings
                           temperature=t)
    commit(shortest, x)
    _sync(device)
    stats.prefill_s, stats.prefill_tokens = time.perf_counter() - start, bsz * shortest
    start = time.perf_counter()

    c = shortest - 1                             # last position the main model has processed
    # main_hidden rows not yet given to DSpark, from position p0 to c. Row S-1 is given again (it rewrites
    # its ring slot with the same value), because start_pos 0 means "seed only".
    pending, p0 = (hidden[:, -1:], c) if shortest > 1 else (None, None)

    while c + 2 < total_len and not bool(finished.all()) and not stop:
        # Drafts to verify: positions c+2..c+1+kk must fit in the buffer, and positions c+1..c+1+kk and the
        # next draft block (c'+1..c'+blk, c' <= c+1+kk) below max_seq_len.
        kk = min(k, total_len - 3 - c, max_len - 2 - blk - c)
        if pending is None or kk < 1 or c + 2 < longest:       # plain decode step
            logits, h = model.decode(tokens[:, c + 1:c + 2], c + 1)
            y = sample(logits, t, model.nx)
            stats.plain_steps += 1
            pending, p0 = (h, c + 1) if pending is None else (torch.cat([pending, h], dim=1), p0)
            c += 1
            commit(c + 1, y)
            continue

        ids, dlogits, conf = model.mtp.draft(tokens[:, c + 1], pending, p0, temperature=t)
        drafts = ids[:, 1:1 + kk]                                               # [B, kk]
        n_row = [kk] * bsz                       # drafts verified per row
        if min_confidence is not None:          # verify only the leading confident drafts
            sure = (torch.sigmoid(conf[:, :kk]) >= min_confidence).long().cumprod(1).sum(1)   # [B]
            n_row = sure.tolist()
        q = probs(dlogits[:, :kk], t) if t > 0 else None                                   # [B, kk, V]
        if draft_hook is not None:
            drafts = draft_hook(c + 2, drafts.clone()).to(device)
            if q is not None:
                q = torch.nn.functional.one_hot(drafts, q.shape[-1]).float()
        live = [b for b in range(bsz) if not finished[b]]
        n = max(n_row[b] for b in live)
        drafts = drafts[:, :n]
        chain = torch.cat([tokens[:, c + 1:c + 2], drafts], dim=1)             # [B, n+1], positions c+1..
        verdict = {}                             # row -> (accepted a_b, the token after them y_b)

        if verify == "chunked":                 # one extend call, then forget the rejected rows
            logits, h = model.verify(chain, c + 1)                              # [B, n+1, V]
            for b in live:
                nb = n_row[b]
                verdict[b] = judge.block(logits[b, :nb + 1], drafts[b, :nb], None if q is None else q[b, :nb])
            m = min(acc for acc, _ in verdict.values())
            model.rollback(c + 1 + m)
            forwards = 1
        else:                                   # one decode step per token, stop at the first rejection
            rows = []
            for i in range(n + 1):
                logits, h_i = model.decode(chain[:, i:i + 1], c + 1 + i)              # [B, V]
                rows.append(h_i)
                for b in live:
                    if i == n_row[b]:
                        verdict[b] = (i, judge.bonus(logits[b]))
                    else:
                        y = judge.check(logits[b], int(chain[b, i + 1]), None if q is None else q[b, i])
                        if y is not None:
                            verdict[b] = (i, y)
                if verdict:
                    break
            m = i
            h = torch.cat(rows, dim=1)
            forwards = m + 1

        # Row b commits chain[b, 1..m] and then its own verdict if it stopped at m, else its next accepted
        # draft. Finished rows take the drafts (their tokens are cut at EOS anyway).
        nxt = chain[:, min(m + 1, n)].clone()
        for b, (acc, y) in verdict.items():
            if acc == m:
                nxt[b] = y
        for i in range(1, m + 1):
            commit(c + 1 + i, chain[:, i])
        commit(c + 2 + m, nxt)
        # A row with no verdict, or one beyond m, also commits its draft m+1 and drops the rest it accepted.
        beyond = [b for b in live if verdict.get(b, (n + 1, -1))[0] > m]
        stats.steps += len(live)
        stats.drafted += sum(n_row[b] for b in live)
        stats.accepted += m * len(live) + len(beyond)
        stats.discarded += sum(verdict[b][0] - m - 1 for b in beyond if b in verdict)
        stats.step_tokens += (m + 1) * len(live)
        stats.step_forwards += forwards * len(live)
        stats.decisions.append(tuple(verdict.get(b, (-1, -1)) for b in range(bsz)))
        pending, p0 = h[:, :m + 1], c + 1        # main_hidden of the committed positions c+1..c+1+m
        c += m + 1

    _sync(device)
    stats.decode_s = time.perf_counter() - start
    stopped = bool(stop) and not bool(finished.all()) and c + 2 < total_len
    completions, reasons = read_completions(tokens, lens, max_new_tokens, eos_id, stopped)
    stats.new_tokens = sum(len(t) + (r == "eos") for t, r in zip(completions, reasons))
    stats.reason = reasons[-1]
    return completions, reasons, stats


def speculative_generate(model, prompt_ids: List[int], budget: Budget, spec: SpecOptions = SpecOptions(),
                         draft_hook: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None
                         ) -> Tuple[List[int], SpecStats]:
    """One prompt -> (completion ids, statistics): speculative_generate_batch for a batch of 1, with a
    draft_hook taking and returning drafts [k], and decisions (accepted, next token) per step."""
    hook = None if draft_hook is None else (lambda pos, d: draft_hook(pos, d[0]).view(1, -1))
    out, _, stats = speculative_generate_batch(model, PromptBatch([prompt_ids]), budget, spec, hook)
    return out[0], replace(stats, decisions=[d[0] for d in stats.decisions])
