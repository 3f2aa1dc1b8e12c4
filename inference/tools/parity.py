"""Numeric parity toolkit: compare this reference with any engine, and find where two runs part.

compare: do two runs predict the same next-token distributions?

    python -m inference.tools.parity compare A B [--atol-max 0.25] [--atol-mean 0.03] [--max-kl 1e-3]
                                           [--min-cos 0.999] [--min-top1 0.995]

A and B are each one of
  - a logits dump of `generate.py --score S.json --dump-logits X.safetensors`: `logits` [N, B, V] fp32,
    forward k scoring position P-1+k (NaN once a sequence has ended), `input_ids` [B, L] (-1 = padding),
    optionally `prefill_logits` [B, P, V] (--all-prefill-logits: positions 0..P-1);
  - the reference-tiny fixture's reference_logits.safetensors (`step_logits` is read as `logits`,
    `prefill_all_logits` as `prefill_logits`; the ids are prompt_ids followed by generated_ids[:-1]);
  - an engine's prompt log-probabilities as JSON. Entry t of a sequence holds the top-k of the distribution
    of token t, i.e. of the logits at position t-1; entry 0 is null. Accepted shapes:
      vLLM    {"prompt_logprobs": SEQ, "prompt_token_ids": [ids]}   (the ids are optional)
              SEQ = [null, {"<id>": {"logprob": x, "rank": r, "decoded_token": s} or x, ...}, ...]
              or an OpenAI-style response {"choices": [{"prompt_logprobs": SEQ, ...}, ...]};
      SGLang  {"meta_info": {"input_top_logprobs": SEQ, "input_token_logprobs": [[x, id, text], ...]}}
              (the meta_info level and input_token_logprobs, which gives the ids, are optional)
              SEQ = [null, [[logprob, token_id, text], ...], ...]   (text may be absent);
      "prompt_logprobs" / "input_top_logprobs" may also hold a list of SEQs (and the ids a list of lists),
      and a JSON list of request objects is a batch: one sequence each, in order.

Sequences are matched by index, positions by number; only the positions both files score are compared, and
where both files carry token ids they must agree. B is the baseline: KL(B || A), B's top-1/top-2 margin.
Printed per sequence and overall: KL (mean, max), cosine (mean, min), top-1 agreement, max and mean |Δ|, and
the first diverging position (the top-1 differs there, or max |Δ| > --atol-max). Two full dumps are
compared on the whole vocabulary, cosine and |Δ| on the raw logits. A top-k file on either side makes it a
comparison on the shared top-k support, and the report says so: at each position, full logits are
log-softmaxed over the vocabulary, restricted to the ids both sides give and renormalised, top-k log-probs
are renormalised on the same ids, and KL, cosine and |Δ| are taken on these renormalised log-probs. Top-1
is always each side's own best token. The default tolerances are the parity targets of
docs/numerics.md §13.3 (max / mean |Δ|: tiny model, same world size and device) and docs/numerics.md §13.4
(KL, cosine, top-1: released weights); `inf` or 0 switches a check off. Exit status: 0 when every check
passes, 1 when one fails, 2 on bad input.

compare-blocks: at which forward and block do two runs part? (inference/tools/blocks.py)

    python -m inference.tools.parity compare-blocks A_CAPS B_CAPS [--rtol 1e-3] [--pre-mix-atol 1e-4]

Worked example on the reference-tiny fixture (FIX = tests/fixtures/reference-tiny), under the CPU code
paths the fixture was made with (README, bit-level note; without them the official top-1/top-2 margin of
0.015 at the fixture's step 18 flips, and the top-1 check fails at 20/21):

    $ export MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2
    $ python generate.py --ckpt-path FIX --config FIX/config.json --score FIX/score.json --dump-logits ours.st
    $ python -m inference.tools.parity compare ours.st FIX/reference_logits.safetensors
    A: ours.st: logits dump, 1 sequence(s), 21 scored positions, full vocabulary (1024)
    B: FIX/reference_logits.safetensors: fixture reference logits, 1 sequence(s), 321 scored positions, ...
    compared on the full vocabulary (KL, cosine and |Δ| on the raw fp32 logits), 21 shared positions
     seq   pos     KL mean      KL max  cos mean   cos min          top-1    max|Δ|   mean|Δ|  first ...
       0    21   2.370e-04   1.070e-03  0.999775  0.999035    21/21  100.0%  1.56e-01  1.64e-02  -
    checks: max|Δ| 0.1561 <= 0.25 ok; mean|Δ| 0.01635 <= 0.03 ok; mean KL 0.000237 <= 0.001 ok; mean cos
    0.999775 >= 0.999 ok; top-1 100.00% >= 99.5% ok
    PASS

A model with one expert's weights scaled (expert 0's w2 x8 in block 4) fails the same check (max |Δ| 0.94,
mean KL 3.9e-3; exit status 1), and the block captures of the two runs (score_with_capture, or the
--capture-blocks flag of generate.py's scoring mode) name the block:

    $ python -m inference.tools.parity compare-blocks bad_caps.st ours_caps.st
    ...
    step 00: input_ids exact, engram_hashes exact, engram_out 0.00e+00, block_out 1.00e-01 (block 4), ...
    ...
    first divergence: step 00, block 4: block_out relative error 1.00e-01 > 0.001

corpus: perplexity over a text, and llama.cpp's KL-divergence base (docs/kld.md, inference/tools/corpus.py)

    [torchrun --nproc-per-node W -m] python -m inference.tools.parity corpus --ckpt-path D --config C
        --text FILE | --tokens FILE  --ctx N  [--kld-base OUT.kld] [--topk-out OUT.safetensors --topk K]
        [--chunks M] [--batch B] [--bos yes|no] [--numerics ...] [--offload disk] [--prefill-chunk N]

The text cut into chunks of N tokens as llama.cpp's perplexity tool cuts it (each from an empty cache, BOS in
place of its first token); the distributions of positions N/2 .. N-2 of every chunk written as the .kld rows
llama-perplexity --kl-divergence reads and/or the compact top-K file, with a manifest beside each. Resumable:
a run stopped at any point and started again with the same arguments gives the same bytes.

kld: what llama-perplexity --kl-divergence prints, for a test run against a base (docs/kld.md §4)

    python -m inference.tools.parity kld BASE TEST [--floor OTHER] [--max-kld 1e-3] [--max-kld-p99 X]
        [--min-same-top 0.995] [--max-floor-ratio R] [--per-chunk]

BASE and TEST: .kld files, compact files, dumps or engines' prompt log-probs (top-K: on the shared support, as
compare). --floor: a second run of this reference (another summation order or world size), its figures
printed beside the test's. Exit status: 0 when every check passes, 1 when one fails, 2 on bad input.
"""
import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import blocks, kld


class ParityError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------------------
# Reading score files: logits dumps and engines' top-k prompt log-probabilities
# ---------------------------------------------------------------------------------------------------------

TopK = Tuple[torch.Tensor, torch.Tensor]    # ids int64 [k], log-probs fp64 [k]


@dataclass
class SeqScores:
    """One sequence of a file: the positions it scores (position p: the distribution of token p+1) and, per
    position, full logits or a top-k."""
    positions: List[int]
    logits: Optional[torch.Tensor] = None        # [n, V] fp32
    topk: Optional[List[TopK]] = None
    input_ids: Optional[List[int]] = None
    target_logprobs: Optional[Dict[int, float]] = None    # position p: log-prob of token p+1 (SGLang's)


@dataclass
class ScoreFile:
    path: str
    kind: str
    seqs: List[SeqScores] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return self.seqs[0].logits is not None

    def describe(self) -> str:
        n = sum(len(s.positions) for s in self.seqs)
        if self.full:
            what = f"full vocabulary ({self.seqs[0].logits.shape[-1]})"
        else:
            ks = [len(ids) for s in self.seqs for ids, _ in s.topk]
            what = f"top-k, {min(ks)} to {max(ks)} ids per position"
        return f"{self.path}: {self.kind}, {len(self.seqs)} sequence(s), {n} scored positions, {what}"


def read_scores(path: str) -> ScoreFile:
    if not os.path.isfile(path):
        raise ParityError(f"file not found: {path}")
    return _read_json(path) if path.endswith(".json") else _read_dump(path)


def _read_dump(path: str) -> ScoreFile:
    from safetensors.torch import load_file
    try:
        t = load_file(path)
    except Exception as e:   # safetensors raises its own error types
        raise ParityError(f"{path}: not a readable safetensors file ({e})") from None
    if "logits" in t and "input_ids" in t:
        kind, logits, ids, prefill = "logits dump", t["logits"], t["input_ids"], t.get("prefill_logits")
    elif "step_logits" in t and "prompt_ids" in t:
        kind, logits, prefill = "fixture reference logits", t["step_logits"], t.get("prefill_all_logits")
        ids = torch.cat([t["prompt_ids"], t["generated_ids"][:, :-1]], dim=1)
    elif any(k.endswith(".block_out") for k in t):
        raise ParityError(f"{path} is a block capture: use `python -m inference.tools.parity compare-blocks`")
    else:
        found = ", ".join(sorted(t)[:6])
        raise ParityError(f"{path}: expected `logits` and `input_ids` (a --dump-logits file) or "
                          f"`step_logits` and `prompt_ids` (reference_logits.safetensors), found {found}")
    n_steps, bsz, _ = logits.shape
    prefill_len = ids.shape[1] - n_steps + 1                  # forward k scores position P-1+k
    out = ScoreFile(path, kind)
    for b in range(bsz):
        row = ids[b].tolist()
        pos = [prefill_len - 1 + k for k in range(n_steps) if not logits[k, b].isnan().any()]
        rows = [logits[p - prefill_len + 1, b] for p in pos]
        if prefill is not None:                               # positions 0..P-2 (P-1 is forward 0's)
            pos = list(range(prefill_len - 1)) + pos
            rows = list(prefill[b, :prefill_len - 1]) + rows
        if not pos:
            raise ParityError(f"{path}: sequence {b} has no scored position")
        out.seqs.append(SeqScores(pos, logits=torch.stack(rows).float(),
                                  input_ids=row[:row.index(-1)] if -1 in row else row))
    return out


def _read_json(path: str) -> ScoreFile:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise ParityError(f"{path}: not valid JSON ({e})") from None
    requests = obj["choices"] if isinstance(obj, dict) and "choices" in obj else obj
    out, kinds = ScoreFile(path, ""), set()
    for i, req in enumerate(requests if isinstance(requests, list) else [requests]):
        if not isinstance(req, dict):
            raise ParityError(f"{path}: request {i} is not a JSON object "
                              f"(`python -m inference.tools.parity -h`)")
        req = req.get("meta_info", req)
        if "prompt_logprobs" in req:
            kinds.add("vLLM prompt_logprobs")
            seqs, parse, ids = req["prompt_logprobs"], _vllm_entry, req.get("prompt_token_ids")
        elif "input_top_logprobs" in req:
            kinds.add("SGLang input_top_logprobs")
            seqs, parse, ids = req["input_top_logprobs"], _sglang_entry, req.get("input_token_logprobs")
        else:
            raise ParityError(f"{path}: request {i} has neither prompt_logprobs (vLLM) nor "
                              f"input_top_logprobs (SGLang)")
        if not isinstance(seqs, list):
            raise ParityError(f"{path}: request {i}: expected a list of per-position entries")
        if not _is_list_of_sequences(seqs, parse):
            seqs, ids = [seqs], [ids]
        ids = ids or [None] * len(seqs)
        targets = [None] * len(seqs)
        if parse is _sglang_entry:                            # [logprob, id, text] per token: keep the ids
            targets = [_sglang_targets(seq_ids) for seq_ids in ids]
            ids = [[e[1] for e in seq_ids] if seq_ids else None for seq_ids in ids]
        for seq, seq_ids, seq_targets in zip(seqs, ids, targets):
            try:
                entries = [(t - 1, parse(e)) for t, e in enumerate(seq) if t > 0 and e]
            except (TypeError, ValueError, KeyError, IndexError) as e:
                raise ParityError(f"{path}: request {i}: unreadable entry ({e!r})") from None
            if not entries:
                raise ParityError(f"{path}: request {i}: no position has log-probabilities")
            out.seqs.append(SeqScores([p for p, _ in entries], topk=[e for _, e in entries],
                                      input_ids=list(seq_ids) if seq_ids else None,
                                      target_logprobs=seq_targets))
    out.kind = " + ".join(sorted(kinds))
    return out


def _is_list_of_sequences(seqs: list, parse) -> bool:
    """A position is a dict (vLLM) or a list of [logprob, id, ...] (SGLang); a list of sequences nests one
    level deeper."""
    first = next((e for e in seqs if e), None)
    if parse is _vllm_entry:
        return isinstance(first, list)
    inner = next((e for e in first if e), None) if isinstance(first, list) else None
    return isinstance(inner, list) and any(isinstance(x, list) for x in inner)


def _sglang_targets(entries: Optional[list]) -> Optional[Dict[int, float]]:
    """input_token_logprobs [[logprob, id, text], ...] -> {position t-1: logprob of token t}."""
    if not entries:
        return None
    return {t - 1: float(e[0]) for t, e in enumerate(entries)
            if t > 0 and isinstance(e[0], (int, float)) and math.isfinite(e[0])}


def _vllm_entry(e: dict) -> TopK:
    items = [(int(k), v["logprob"] if isinstance(v, dict) else v) for k, v in e.items()]
    return _topk([i for i, _ in items], [lp for _, lp in items])


def _sglang_entry(e: list) -> TopK:
    return _topk([int(x[1]) for x in e], [x[0] for x in e])


def _topk(ids: List[int], logprobs: List[Optional[float]]) -> TopK:
    keep = [j for j, lp in enumerate(logprobs) if lp is not None and math.isfinite(lp)]
    return (torch.tensor([ids[j] for j in keep], dtype=torch.int64),
            torch.tensor([logprobs[j] for j in keep], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------
# Comparing two score files
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Tolerances:
    atol_max: float = 0.25     # docs/numerics.md §13.3: tiny random-weight model against the official logits
    atol_mean: float = 0.03
    max_kl: float = 1e-3       # docs/numerics.md §13.4, released weights: mean KL(official || ours),
                               # mean cosine, top-1
    min_cos: float = 0.999
    min_top1: float = 0.995
    # A top-1 flip where B's top-1/top-2 margin is below this is a near tie that rounding alone can flip:
    # two runs whose logits differ by at most d can swap two tokens whose margin is below 2 d. DeepSeek's own
    # code, run on two x86 CPUs (tests/fixtures/reference-tiny vs reference-tiny-cpu2), differs by up to
    # d = 0.160, hence 0.32. Such flips are listed and count as agreement; a flip at a wider margin counts
    # against --min-top1.
    tie_margin: float = 0.32


@dataclass
class PositionStats:
    """Per shared position, for one sequence (or several, concatenated)."""
    positions: torch.Tensor    # int64 [n]
    kl: torch.Tensor           # fp64 [n]: KL(B || A)
    cos: torch.Tensor
    agree: torch.Tensor        # bool [n]: the same top-1
    top1: torch.Tensor         # int64 [n, 2]: A's and B's top-1
    margin: torch.Tensor       # B's top-1 minus top-2 (NaN if B gives one id)
    dmax: torch.Tensor         # max |Δ| at the position
    dsum: torch.Tensor         # sum |Δ| and the number of values compared, for the mean over all values
    dcount: torch.Tensor

    @staticmethod
    def cat(parts: Sequence["PositionStats"]) -> "PositionStats":
        return PositionStats(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(PositionStats)))


def compare_scores(a: ScoreFile, b: ScoreFile, chunk: int = 64) -> List[PositionStats]:
    if len(a.seqs) != len(b.seqs):
        raise ParityError(f"{a.path} has {len(a.seqs)} sequence(s), {b.path} has {len(b.seqs)}")
    stats = []
    for i, (sa, sb) in enumerate(zip(a.seqs, b.seqs)):
        if sa.input_ids and sb.input_ids:
            n = min(len(sa.input_ids), len(sb.input_ids))
            diff = [j for j in range(n) if sa.input_ids[j] != sb.input_ids[j]]
            if diff:
                j = diff[0]
                raise ParityError(f"sequence {i}: the files score different tokens (first at position {j}: "
                                  f"{sa.input_ids[j]} vs {sb.input_ids[j]})")
        shared = sorted(set(sa.positions) & set(sb.positions))
        if not shared:
            span = lambda s: f"{min(s.positions)}..{max(s.positions)}"   # noqa: E731
            raise ParityError(f"sequence {i}: no position is scored by both files (positions {span(sa)} vs "
                              f"{span(sb)})")
        where_a = {p: j for j, p in enumerate(sa.positions)}
        where_b = {p: j for j, p in enumerate(sb.positions)}
        ia, ib = [where_a[p] for p in shared], [where_b[p] for p in shared]
        if sa.logits is not None and sb.logits is not None:   # chunks bound the fp64 [n, V] temporaries
            st = PositionStats.cat([_full_stats(sa.logits[ia[j:j + chunk]], sb.logits[ib[j:j + chunk]])
                                    for j in range(0, len(shared), chunk)])
        else:
            st = PositionStats.cat([_support_stats(_entry(sa, x), _entry(sb, y)) for x, y in zip(ia, ib)])
        st.positions = torch.tensor(shared)
        stats.append(st)
    return stats


def _entry(s: SeqScores, i: int):
    return s.logits[i] if s.logits is not None else s.topk[i]


def _full_stats(a: torch.Tensor, b: torch.Tensor) -> PositionStats:
    """Logits a, b [n, V] on the whole vocabulary."""
    a, b = a.double(), b.double()
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    d = (a - b).abs()
    n = a.shape[0]
    top2 = b.topk(min(2, b.shape[-1]), dim=-1).values
    margin = top2[:, 0] - top2[:, 1] if top2.shape[-1] == 2 else torch.full((n,), math.nan)
    return PositionStats(torch.zeros(n, dtype=torch.int64), (lb.exp() * (lb - la)).sum(-1),
                         F.cosine_similarity(a, b, dim=-1), a.argmax(-1) == b.argmax(-1),
                         torch.stack([a.argmax(-1), b.argmax(-1)], dim=-1), margin, d.amax(-1), d.sum(-1),
                         torch.full((n,), float(a.shape[-1]), dtype=torch.float64))


def _support_stats(a, b) -> PositionStats:
    """One position; each side full logits [V] or a top-k. Compared on the ids both sides give."""
    support = None
    for side in (a, b):
        if isinstance(side, tuple):
            support = side[0] if support is None else support[torch.isin(support, side[0])]
    if support.numel() == 0:
        raise ParityError("at some position the two top-k lists share no token id")
    va, vb = _restrict(a, support), _restrict(b, support)
    va, vb = va - va.logsumexp(0), vb - vb.logsumexp(0)     # renormalised on the shared support
    d = (va - vb).abs()
    best_a, best_b = _best(a), _best(b)
    one = lambda v: torch.tensor([v], dtype=torch.float64)   # noqa: E731
    return PositionStats(torch.zeros(1, dtype=torch.int64), one((vb.exp() * (vb - va)).sum().item()),
                         one(F.cosine_similarity(va, vb, dim=0).item()), torch.tensor([best_a == best_b]),
                         torch.tensor([[best_a, best_b]]), one(_margin(b)), one(d.max().item()),
                         one(d.sum().item()), one(float(d.numel())))


def _restrict(side, support: torch.Tensor) -> torch.Tensor:
    if isinstance(side, tuple):
        ids, lp = side
        where = {int(t): j for j, t in enumerate(ids)}
        return lp[[where[int(t)] for t in support]]
    return side.double().log_softmax(-1)[support]


def _best(side) -> int:
    return int(side[0][side[1].argmax()]) if isinstance(side, tuple) else int(side.argmax())


def _margin(side) -> float:
    v = side[1] if isinstance(side, tuple) else side.double()
    if v.numel() < 2:
        return math.nan
    top2 = v.topk(2).values
    return float(top2[0] - top2[1])


def first_divergence(st: PositionStats, tol: Tolerances) -> Optional[Tuple[int, str]]:
    """(position, why) of the first position whose top-1 differs or whose max |Δ| exceeds --atol-max (the
    KL, cosine and mean bounds are bounds on means, not on single positions)."""
    bad = ~st.agree | (st.dmax > tol.atol_max)
    if not bad.any():
        return None
    j = int(bad.nonzero()[0])
    why = []
    if not st.agree[j]:
        why.append(f"top-1 {int(st.top1[j, 0])} vs {int(st.top1[j, 1])}, B margin {float(st.margin[j]):.3g}")
    if st.dmax[j] > tol.atol_max:
        why.append(f"max|Δ| {float(st.dmax[j]):.3g}")
    return int(st.positions[j]), "; ".join(why + [f"KL {float(st.kl[j]):.3g}"])


def near_ties(st: PositionStats, tol: "Tolerances") -> torch.Tensor:
    """bool [n]: top-1 flips at a B margin below tol.tie_margin (a NaN margin is not a near tie)."""
    return ~st.agree & (st.margin < tol.tie_margin)


def summarize(st: PositionStats, tol: Optional["Tolerances"] = None) -> Dict[str, float]:
    tol = tol or Tolerances()
    flips = st.margin[~st.agree]
    ties = near_ties(st, tol)
    return {"n": st.kl.numel(), "kl_mean": st.kl.mean().item(), "kl_max": st.kl.max().item(),
            "cos_mean": st.cos.mean().item(), "cos_min": st.cos.min().item(),
            "top1": st.agree.double().mean().item(), "agree": int(st.agree.sum()),
            "near_ties": int(ties.sum()), "top1_beyond_ties": (st.agree | ties).double().mean().item(),
            "flip_margin": flips.max().item() if flips.numel() else 0.0,
            "dmax": st.dmax.max().item(), "dmean": (st.dsum.sum() / st.dcount.sum()).item()}


def check(s: Dict[str, float], tol: Tolerances) -> List[Tuple[str, bool]]:
    flips, ties = s["n"] - s["agree"], s["near_ties"]
    top1 = f"top-1 {100 * s['top1_beyond_ties']:.2f}% >= {100 * tol.min_top1:g}%"
    if flips:
        top1 += (f" ({flips} flip(s), B margin there <= {s['flip_margin']:.3g}; {ties} of them near ties "
                 f"below {tol.tie_margin:g}, counted as agreement)")
    return [(f"max|Δ| {s['dmax']:.4g} <= {tol.atol_max:g}", s["dmax"] <= tol.atol_max),
            (f"mean|Δ| {s['dmean']:.4g} <= {tol.atol_mean:g}", s["dmean"] <= tol.atol_mean),
            (f"mean KL {s['kl_mean']:.4g} <= {tol.max_kl:g}", s["kl_mean"] <= tol.max_kl),
            (f"mean cos {s['cos_mean']:.6f} >= {tol.min_cos:g}", s["cos_mean"] >= tol.min_cos),
            (top1, s["top1_beyond_ties"] >= tol.min_top1)]


def run_compare(path_a: str, path_b: str, tol: Optional[Tolerances] = None, out=None) -> bool:
    """Prints the report; True when every check passes."""
    tol = tol or Tolerances()
    a, b = read_scores(path_a), read_scores(path_b)
    stats = compare_scores(a, b)
    p = lambda *x: print(*x, file=out or sys.stdout)   # noqa: E731
    p(f"A: {a.describe()}")
    p(f"B: {b.describe()}")
    n = sum(s.kl.numel() for s in stats)
    if a.full and b.full:
        p(f"compared on the full vocabulary (KL, cosine and |Δ| on the raw fp32 logits), {n} shared "
          f"positions")
    else:
        p("compared on the shared top-k support: full logits log-softmaxed, restricted to the token ids both "
          "sides give at each position and renormalised, top-k log-probs renormalised on the same ids; KL, "
          f"cosine and |Δ| on these renormalised log-probs; top-1 is each side's own best token; {n} shared "
          f"positions")
    p(f"{'seq':>4} {'pos':>5} {'KL mean':>11} {'KL max':>11} {'cos mean':>9} {'cos min':>9} {'top-1':>14} "
      f"{'max|Δ|':>9} {'mean|Δ|':>9}  first divergence")

    def row(label: str, s: Dict[str, float], where: str) -> None:
        p(f"{label:>4} {s['n']:>5} {s['kl_mean']:>11.3e} {s['kl_max']:>11.3e} {s['cos_mean']:>9.6f} "
          f"{s['cos_min']:>9.6f} {s['agree']:>5}/{s['n']:<4}{100 * s['top1']:>5.1f}% {s['dmax']:>9.2e} "
          f"{s['dmean']:>9.2e}  {where}")

    firsts = [first_divergence(st, tol) for st in stats]
    for i, (st, div) in enumerate(zip(stats, firsts)):
        row(str(i), summarize(st, tol), "-" if div is None else f"position {div[0]}: {div[1]}")
    for i, st in enumerate(stats):
        for j in near_ties(st, tol).nonzero().flatten().tolist():
            p(f"near-tie flip: sequence {i}, position {int(st.positions[j])}: top-1 {int(st.top1[j, 0])} vs "
              f"{int(st.top1[j, 1])} where B's top-1/top-2 margin is {float(st.margin[j]):.3g} < "
              f"{tol.tie_margin:g} (--tie-margin): rounding can flip it")
    overall = summarize(PositionStats.cat(stats), tol)
    if len(stats) > 1:
        seq = next((i for i, div in enumerate(firsts) if div is not None), None)
        row("all", overall, "-" if seq is None else f"sequence {seq}, position {firsts[seq][0]}")
    results = check(overall, tol)
    p("checks: " + "; ".join(f"{msg} {'ok' if ok else 'FAILED'}" for msg, ok in results))
    passed = all(ok for _, ok in results)
    p("PASS" if passed else "FAIL")
    return passed


# ---------------------------------------------------------------------------------------------------------
# KL-divergence statistics over a corpus (inference/tools/kld.py)
# ---------------------------------------------------------------------------------------------------------

def open_kld_side(path: str) -> "kld.Side":
    """A .kld, a compact file, or anything `compare` reads (a logits dump, an engine's prompt log-probs)."""
    side = kld.open_side(path)
    if side is not None:
        return side
    f = read_scores(path)
    return kld.ScoresSide(path, f.kind, kld.sequences_from(f.seqs), f.full)


def run_kld(base: str, test: str, floor: Optional[str] = None, tol: Optional["kld.KldTolerances"] = None,
            per_chunk: bool = False, base_exact: Optional[str] = None, out=None,
            progress: bool = False) -> bool:
    """Prints llama.cpp's KL-divergence statistics of `test` against `base` (and of `floor` against `base`
    beside them); True when every check passes."""
    sides = [open_kld_side(p) for p in (base, test, floor) if p]
    anchor = next((s for s in sides if not isinstance(s, kld.ScoresSide)), None)
    if anchor is None:
        raise ParityError("kld needs a .kld or a compact file (python -m inference.tools.parity corpus) on "
                          "one side: two dumps or prompt log-prob files are compared with `parity compare`")
    for s in sides:
        if isinstance(s, kld.ScoresSide):
            s.bind(anchor.n_ctx).check_tokens(anchor.tokens)
    exact = base_exact or (kld.companion_compact(base) if isinstance(sides[0], kld.KldSide) else None)
    exact_side = kld.CompactSide(exact) if exact else None
    return kld.report(sides[0], sides[1], sides[2] if floor else None, tol, per_chunk, exact_side, out,
                      progress)


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from . import corpus     # the model's code: loaded for the options, not by `compare` users at import
    p = argparse.ArgumentParser(prog="python -m inference.tools.parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="compare two logits dumps / prompt-logprobs files (B = the baseline)")
    c.add_argument("a", help="logits dump (.safetensors) or prompt log-probabilities (.json)")
    c.add_argument("b", help="the baseline, of the same kinds")
    t = Tolerances()
    c.add_argument("--atol-max", type=float, default=t.atol_max, help=f"max |Δ| (default {t.atol_max})")
    c.add_argument("--atol-mean", type=float, default=t.atol_mean, help=f"mean |Δ| (default {t.atol_mean})")
    c.add_argument("--max-kl", type=float, default=t.max_kl, help=f"mean KL(B || A) (default {t.max_kl})")
    c.add_argument("--min-cos", type=float, default=t.min_cos, help=f"mean cosine (default {t.min_cos})")
    c.add_argument("--min-top1", type=float, default=t.min_top1,
                   help=f"top-1 agreement, a fraction (default {t.min_top1})")
    c.add_argument("--tie-margin", type=float, default=t.tie_margin,
                   help=f"top-1 flips where B's top-1/top-2 margin is below this are near ties: listed, "
                        f"counted as agreement (default {t.tie_margin}: twice the reference's own spread "
                        f"between two CPUs)")
    cb = sub.add_parser("compare-blocks", help="name the first forward and block where two captures differ")
    cb.add_argument("a", help="block capture (score_with_capture, --capture-blocks) or intermediates file")
    cb.add_argument("b", help="the baseline, of the same kinds")
    cb.add_argument("--rtol", type=float, default=1e-3,
                    help="relative Frobenius error of the streams (default 1e-3, "
                    "tests/fixtures/reference-tiny/README.md §8.2)")
    cb.add_argument("--pre-mix-atol", type=float, default=1e-4,
                    help="max |Δ| of the collapse weights block_pre_mix (default 1e-4)")
    sc = sub.add_parser("corpus", help="score a text in chunks: perplexity, a llama.cpp .kld base, a compact "
                        "top-K file (docs/kld.md)")
    corpus.add_arguments(sc)
    k = sub.add_parser("kld", help="llama.cpp's KL-divergence statistics of a test run against a base, "
                       "beside the reference's own floor")
    k.add_argument("base", help=".kld base, compact file (.safetensors), logits dump or prompt log-probs "
                   "(.json)")
    k.add_argument("test", help="the run to judge, of the same kinds")
    k.add_argument("--floor", default=None, metavar="OTHER",
                   help="a second run of this reference that should agree with the base (e.g. --numerics "
                        "fast, or W = 2): its figures are printed beside the test's")
    kt = kld.KldTolerances()
    k.add_argument("--max-kld", type=float, default=kt.max_kld, help=f"mean KLD (default {kt.max_kld:g})")
    k.add_argument("--max-kld-p99", type=float, default=kt.max_kld_p99,
                   help="99th percentile KLD (default off)")
    k.add_argument("--min-same-top", type=float, default=kt.min_same_top,
                   help=f"same top p, a fraction (default {kt.min_same_top:g})")
    k.add_argument("--max-floor-ratio", type=float, default=kt.max_floor_ratio,
                   help="mean KLD at most this many times the floor's (with --floor; default off)")
    k.add_argument("--affected-kld", type=float, default=kt.affected_kld,
                   help=f"a position whose KLD exceeds this counts as affected (default {kt.affected_kld:g})")
    k.add_argument("--per-chunk", action="store_true", help="also llama.cpp's running table, chunk by chunk")
    k.add_argument("--base-exact", default=None, metavar="COMPACT",
                   help="the compact file of the base's run, for the exact PPL(base) (default: the one the "
                        "base's manifest names, when present)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    o = build_parser().parse_args(argv)
    if o.command == "corpus":
        from . import corpus
        return corpus.main(o)
    try:
        if o.command == "compare":
            tol = Tolerances(o.atol_max, o.atol_mean, o.max_kl, o.min_cos, o.min_top1, o.tie_margin)
            return 0 if run_compare(o.a, o.b, tol) else 1
        if o.command == "kld":
            tol = kld.KldTolerances(o.max_kld, o.max_kld_p99, o.min_same_top, o.max_floor_ratio,
                                    o.affected_kld)
            return 0 if run_kld(o.base, o.test, o.floor, tol, o.per_chunk, o.base_exact,
                                progress=sys.stderr.isatty()) else 1
        return 0 if blocks.run_compare_blocks(o.a, o.b, o.rtol, o.pre_mix_atol) is None else 1
    except (ParityError, blocks.CaptureError, kld.KldError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
