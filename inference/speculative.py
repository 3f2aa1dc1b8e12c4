"""Speculative decoding with the DSpark draft head (spec modules §11.5), batch size 1.

Each step drafts a block with `model.mtp.forward_spec`, lets the main model verify the first k drafts, keeps
the longest valid prefix plus one token of the main model's own, and forgets what the rejected drafts
wrote (`model.rollback`). Greedy: a draft is valid if it is the main model's argmax, so the output is plain
greedy decoding's. Sampling: standard speculative rejection sampling, so the output is distributed as plain
sampling (but is not the same random draw as the Gumbel-max decoder).

Every rank runs this loop on identical all-gathered logits and draws from the same seeded RNG in the same
order, so every rank takes the same decisions without communicating (numerics §13).
"""
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

VERIFY_MODES = ("chunked", "sequential")


# ---------------------------------------------------------------------------------------------------------
# Acceptance rules
# ---------------------------------------------------------------------------------------------------------

def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The distribution `sample` draws from (numerics §13): softmax(logits / max(T, 1e-5)) in fp32."""
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
    steps: int = 0            # draft + verify steps
    drafted: int = 0          # drafts verified
    accepted: int = 0         # drafts accepted
    step_tokens: int = 0      # tokens committed by the steps (accepted drafts + 1 each)
    step_forwards: int = 0    # main-model forwards spent verifying
    plain_steps: int = 0      # ordinary decode steps (prompt of one token; the end near max_seq_len)
    prefill_tokens: int = 0
    new_tokens: int = 0       # completion tokens, EOS included
    prefill_s: float = 0.0
    decode_s: float = 0.0
    reason: str = "length"    # of the last sequence: "eos" or "length"
    decisions: List[Tuple[int, int]] = field(default_factory=list)   # (accepted, next token) per step

    def add(self, other: "SpecStats") -> None:
        for name in ("steps", "drafted", "accepted", "step_tokens", "step_forwards", "plain_steps",
                     "prefill_tokens", "new_tokens", "prefill_s", "decode_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.decisions += other.decisions
        self.reason = other.reason

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.step_tokens / self.step_forwards if self.step_forwards else 0.0

    def summary(self, verify: str, k: int) -> str:
        rate = f" ({self.accepted / self.drafted:.1%} of drafts)" if self.drafted else ""
        return (f"speculative (dspark, {verify} verification, k={k}): {self.steps} steps, "
                f"mean accepted length {self.mean_accepted:.2f}{rate}, "
                f"{self.tokens_per_forward:.2f} tokens per main-model forward "
                f"({self.step_tokens} tokens / {self.step_forwards} forwards; "
                f"{self.plain_steps} plain decode steps)")


# ---------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DraftHook = Callable[[int, torch.Tensor], torch.Tensor]


@torch.inference_mode()
def speculative_generate(model, prompt_ids: List[int], max_new_tokens: int, eos_id: int,
                         temperature: Optional[float] = None, k: Optional[int] = None,
                         verify: str = "chunked",
                         min_confidence: Optional[float] = None, draft_hook: Optional[DraftHook] = None,
                         token_types: Optional[List[int]] = None, images=None) -> Tuple[List[int], SpecStats]:
    """One prompt -> (completion ids, EOS excluded, at most max_new_tokens; statistics).

    temperature: None = model.args.temperature (the drafts and the main model sample at args.temperature,
    so another value is written there). k: drafts verified per step, 1..dspark_block_size (default: all).
    draft_hook(position of the first draft, drafts [k]) -> drafts [k]: a test hook replacing the drafts;
    when sampling, its drafts count as deterministic proposals (q = one-hot), which keeps the rule exact.
    token_types [S], images (one list per batch row): as the model's prefill takes them."""
    a = model.args
    if model.mtp is None:
        raise ValueError("speculative decoding needs the DSpark head "
                         "(n_mtp_layers > 0, dspark_block_size > 0)")
    blk = a.dspark_block_size
    k = blk if k is None else k
    if not 1 <= k <= blk:
        raise ValueError(f"k must be in 1..{blk} (dspark_block_size), got {k}")
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if temperature is not None:
        a.temperature = temperature
    judge = Judge(a.temperature)
    stats = SpecStats()
    device = next(model.parameters()).device
    n_prompt, max_len = len(prompt_ids), a.max_seq_len
    if n_prompt > max_len:
        raise ValueError(f"Prompt length exceeds model maximum sequence length (max_seq_len={max_len})")
    if n_prompt == max_len:                      # no room for a token (the official loop makes no call)
        return [], stats

    def forward(ids: List[int], pos: int, all_logits: bool = False):
        t = torch.tensor([ids], dtype=torch.long, device=device)
        return model(t, pos, all_logits=all_logits)

    start = time.perf_counter()
    types = None if token_types is None else torch.tensor([token_types], dtype=torch.long, device=device)
    x, _, hidden = model(torch.tensor([prompt_ids], dtype=torch.long, device=device), 0,
                         images=images, token_types=types)
    model.mtp.forward_spec(x, hidden, 0)         # seeds the DSpark rings with positions 0..S-1
    _sync(device)
    stats.prefill_s, stats.prefill_tokens = time.perf_counter() - start, n_prompt
    start = time.perf_counter()

    out = [int(x)]                               # emitted tokens; out[-1] is x, at position c + 1
    c = n_prompt - 1                             # last position the main model has processed
    # main_hidden rows not yet given to DSpark, from position p0 to c. Row S-1 is given again (it rewrites
    # its ring slot with the same value), because start_pos 0 means "seed only".
    pending, p0 = (hidden[:, -1:], c) if n_prompt > 1 else (None, None)

    def done() -> bool:
        return len(out) >= max_new_tokens or eos_id in out[-k - 1:] or c + 2 >= max_len

    while not done():
        # Drafts to verify: no more than the budget can use; positions c+1..c+1+k and the next draft block
        # (c'+1..c'+blk, c' <= c+1+k) must stay below max_seq_len.
        kk = min(k, max_new_tokens - len(out) - 1, max_len - 2 - blk - c)
        if pending is None or kk < 1:            # plain decode step
            y, _, h = forward([out[-1]], c + 1)
            stats.plain_steps += 1
            if pending is None:
                pending, p0 = h, c + 1
            else:
                pending = torch.cat([pending, h], dim=1)
            c += 1
            out.append(int(y))
            continue

        ids, dlogits, conf = model.mtp.forward_spec(torch.tensor([out[-1]], device=device), pending, p0)
        drafts = ids[0, 1:1 + kk]
        if min_confidence is not None:          # verify only the leading confident drafts
            sure = (torch.sigmoid(conf[0, :kk]) >= min_confidence).long().cumprod(0)
            drafts = drafts[:int(sure.sum())]
        q = probs(dlogits[0, :len(drafts)], a.temperature) if a.temperature > 0 else None
        if draft_hook is not None:
            drafts = draft_hook(c + 2, drafts.clone()).to(device)
            if q is not None:
                q = torch.nn.functional.one_hot(drafts, q.shape[-1]).float()
        n = len(drafts)
        chain = [out[-1]] + drafts.tolist()      # positions c+1 .. c+1+n

        if verify == "chunked":                 # one extend call, then forget the rejected rows
            _, logits, h = forward(chain, c + 1, all_logits=True)
            acc, y = judge.block(logits[0], drafts, q)
            model.rollback(c + 1 + acc)
            forwards = 1
        else:                                   # one decode step per token, stop at the first rejection
            rows = []
            for i in range(n + 1):
                _, logits, h_i = forward([chain[i]], c + 1 + i)
                rows.append(h_i)
                y = judge.bonus(logits[0]) if i == n else judge.check(logits[0], chain[i + 1],
                                                                      None if q is None else q[i])
                if y is not None:
                    acc = i
                    break
            h = torch.cat(rows, dim=1)
            forwards = acc + 1

        stats.steps += 1
        stats.drafted += n
        stats.accepted += acc
        stats.step_tokens += acc + 1
        stats.step_forwards += forwards
        stats.decisions.append((acc, y))
        pending, p0 = h[:, :acc + 1], c + 1      # main_hidden of the committed positions c+1..c+1+acc
        c += acc + 1
        out += chain[1:acc + 1] + [y]

    _sync(device)
    stats.decode_s = time.perf_counter() - start
    out = out[:max_new_tokens]
    if eos_id in out:
        out = out[:out.index(eos_id) + 1]
        stats.reason = "eos"
    stats.new_tokens = len(out)
    return (out[:-1] if stats.reason == "eos" else out), stats
