"""llama.cpp's KL-divergence files and statistics: the `.kld` base (v1), this project's compact top-K file,
and what `llama-perplexity --kl-divergence` prints (`python -m inference.tools.parity kld`, docs/kld.md).

The `.kld` layout, little-endian, as llama.cpp's tools/perplexity/perplexity.cpp writes and reads it:

    "_logits_" (8 bytes), int32 n_ctx, int32 n_vocab, int32 n_chunk,
    int32 tokens[n_chunk * n_ctx]           the corpus ids (not the BOS each chunk is evaluated with),
    per chunk, per scored position p = n_ctx/2 .. n_ctx-2 (the distribution of token p+1), one row of
    nv = 2*((n_vocab+1)/2) + 4 uint16:      float32 scale, float32 min_log_prob, then per id a 16-bit q.

With lo = max(min logit, max logit - 16): scale = (max - lo) / 65535, q = round((logit - lo) / scale) where
logit > lo, else 0, and min_log_prob = lo - logsumexp(logits); a log-probability is read back as
scale * q + min_log_prob. Everything more than 16 nats below the top is read as that floor, so a perplexity
taken from the file alone is biased low wherever the true token lies below it.

The compact file (format "kld-compact", version 1, safetensors) keeps, per scored position, what long
contexts can afford: `tokens` I32 [n_chunk, n_ctx] (as above), `target_logprob` F32 [n_chunk, R] (the exact
log-prob of the next token), `logsumexp` F32 [n_chunk, R] (of the fp32 logits), `topk_ids` I32 and
`topk_logprobs` F32 [n_chunk, R, K] (descending), R = n_ctx - 1 - n_ctx/2.
"""
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

MAGIC = b"_logits_"
CLAMP = 16.0                 # nats below the top that a row keeps
LEVELS = 65535               # 16-bit codes
HEADER = 20                  # magic and three int32
COMPACT = "kld-compact"


class KldError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------------------
# Geometry and the row codec
# ---------------------------------------------------------------------------------------------------------

def first_scored(n_ctx: int) -> int:
    return n_ctx // 2


def scored_rows(n_ctx: int) -> int:
    """Scored positions per chunk: n_ctx/2 .. n_ctx-2."""
    return n_ctx - 1 - n_ctx // 2


def row_width(n_vocab: int) -> int:
    """uint16 per row: the two float32 and the vocabulary, padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def data_offset(n_ctx: int, n_chunk: int) -> int:
    return HEADER + 4 * n_ctx * n_chunk


def chunk_bytes(n_ctx: int, n_vocab: int) -> int:
    return scored_rows(n_ctx) * row_width(n_vocab) * 2


def kld_file_bytes(n_ctx: int, n_vocab: int, n_chunk: int) -> int:
    return data_offset(n_ctx, n_chunk) + n_chunk * chunk_bytes(n_ctx, n_vocab)


def kld_header(n_ctx: int, n_vocab: int, tokens: np.ndarray) -> bytes:
    """The header and the token ids: tokens int [n_chunk, n_ctx]."""
    n_chunk = tokens.shape[0]
    return MAGIC + struct.pack("<iii", n_ctx, n_vocab, n_chunk) + tokens.astype("<i4").tobytes()


def quantise(logits: torch.Tensor, block: int = 64) -> np.ndarray:
    """logits [n, V] -> rows uint16 [n, nv] of the .kld layout. Computed in fp64 from the fp32 logits, so that
    every code is the nearest one to the exact log-prob (|read back - log_softmax| <= scale / 2)."""
    n, v = logits.shape
    out = np.zeros((n, row_width(v)), dtype="<u2")
    for r0 in range(0, n, block):                  # bounded temporaries: [block, V] fp64
        x = logits[r0:r0 + block].float()
        mx = x.amax(-1)
        lo = torch.maximum(x.amin(-1), mx - CLAMP)                      # fp32, as the reader's floor
        scale = (mx - lo) / LEVELS                                      # fp32, stored
        xd = x.double()
        lse = torch.logsumexp(xd, -1)
        q = ((xd - lo.double()[:, None]) / scale.double()[:, None]).round()
        q = torch.where(x > lo[:, None], q, 0.0).clamp_(0, LEVELS)     # scale 0: every logit equal -> 0
        head = torch.stack([scale, (lo.double() - lse).float()], -1)   # [b, 2] fp32
        rows = out[r0:r0 + x.shape[0]]
        rows[:, :4] = head.cpu().numpy().astype("<f4").view("<u2")
        rows[:, 4:4 + v] = q.to(torch.int32).cpu().numpy().astype("<u2")
    return out


def dequantise(rows: np.ndarray, n_vocab: int) -> torch.Tensor:
    """rows uint16 [n, nv] -> log-probs fp32 [n, V], as llama.cpp reads them (fp32 scale * q + min)."""
    head = torch.from_numpy(np.ascontiguousarray(rows[:, :4]).view("<f4").astype(np.float32))   # [n, 2]
    q = torch.from_numpy(rows[:, 4:4 + n_vocab].astype(np.int32)).float()
    return q * head[:, :1] + head[:, 1:]


# ---------------------------------------------------------------------------------------------------------
# Sides: what one file says about each scored position
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Rows:
    """A block of scored positions of one chunk, from one side."""
    lp: Optional[torch.Tensor] = None          # [n, V] fp64 log-probs over the whole vocabulary
    clamped: bool = False                      # lp from a .kld row: the 16-nat floor stands for lower values
    top_ids: Optional[torch.Tensor] = None     # [n, K] int64, -1 = no entry
    top_lp: Optional[torch.Tensor] = None      # [n, K] fp64, -inf = no entry
    target: Optional[torch.Tensor] = None      # [n] fp64 log-prob of the next token, NaN = unknown
    exact_target: bool = True                  # False: target read from a clamped row

    @property
    def full(self) -> bool:
        return self.lp is not None

    def best(self) -> torch.Tensor:
        """[n] each position's top-1 id (the first of equal maxima, as llama.cpp)."""
        if self.full:
            return self.lp.argmax(-1)
        return self.top_ids.gather(1, self.top_lp.argmax(-1, keepdim=True)).squeeze(1)


class Side:
    """One file: its chunks of n_ctx ids and, per chunk, the rows of its scored positions."""
    path: str
    kind: str
    n_ctx: int
    n_chunk: int
    tokens: Optional[np.ndarray]               # int [n_chunk, n_ctx] or None (unknown)
    full: bool

    def rows(self, chunk: int, r0: int, r1: int, targets: torch.Tensor) -> Rows:
        raise NotImplementedError

    def describe(self) -> str:
        what = "full vocabulary" if self.full else "top-k"
        return (f"{self.path}: {self.kind}, {self.n_chunk} chunk(s) of {self.n_ctx} tokens, "
                f"{scored_rows(self.n_ctx)} scored positions each, {what}")


def _target_from_full(lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return lp.gather(1, targets[:, None]).squeeze(1)


class KldSide(Side):
    """A `.kld` file, memory-mapped; rows are read back as llama.cpp reads them."""

    def __init__(self, path: str):
        self.path, self.kind, self.full = path, "llama.cpp KLD base (.kld v1)", True
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER)
        if len(head) < HEADER or head[:8] != MAGIC:
            raise KldError(f"{path}: not a llama.cpp KL-divergence file (no _logits_ header)")
        self.n_ctx, self.n_vocab, self.n_chunk = struct.unpack("<iii", head[8:])
        if self.n_ctx < 3 or self.n_vocab < 2 or self.n_chunk < 1:
            raise KldError(f"{path}: header says n_ctx {self.n_ctx}, n_vocab {self.n_vocab}, n_chunk "
                           f"{self.n_chunk}: not a usable KLD base")
        want = kld_file_bytes(self.n_ctx, self.n_vocab, self.n_chunk)
        if size != want:
            whole = max(0, size - data_offset(self.n_ctx, self.n_chunk))
            whole = min(self.n_chunk, whole // chunk_bytes(self.n_ctx, self.n_vocab))
            what = "truncated" if size < want else "has trailing bytes"
            raise KldError(f"{path}: {what}: {size:,} bytes where its header (n_ctx {self.n_ctx}, n_vocab "
                           f"{self.n_vocab}, {self.n_chunk} chunks) makes {want:,} ({whole} whole chunks)")
        self.tokens = np.fromfile(path, dtype="<i4", count=self.n_chunk * self.n_ctx,
                                  offset=8 + 12).reshape(self.n_chunk, self.n_ctx)
        self._rows = np.memmap(path, dtype="<u2", mode="r", offset=data_offset(self.n_ctx, self.n_chunk),
                               shape=(self.n_chunk, scored_rows(self.n_ctx), row_width(self.n_vocab)))

    def rows(self, chunk: int, r0: int, r1: int, targets: torch.Tensor) -> Rows:
        lp = dequantise(np.asarray(self._rows[chunk, r0:r1]), self.n_vocab).double()
        return Rows(lp=lp, clamped=True, target=_target_from_full(lp, targets), exact_target=False)

    def clamped_targets(self, chunk: int, targets: torch.Tensor) -> int:
        """How many of the chunk's next tokens lie below the 16-nat floor (stored as code 0)."""
        q = torch.from_numpy(self._rows[chunk, :, 4:4 + self.n_vocab][np.arange(len(targets)),
                                                                      targets.numpy()].astype(np.int32))
        return int((q == 0).sum())


class CompactSide(Side):
    """This project's compact file: exact target log-probs and the top-K of every scored position."""

    def __init__(self, path: str):
        from safetensors import safe_open
        self.path, self.kind, self.full = path, "compact top-K file (kld-compact v1)", False
        try:
            self._f = safe_open(path, framework="pt")
            meta = self._f.metadata() or {}
        except Exception as e:   # safetensors raises its own error types
            raise KldError(f"{path}: not a readable safetensors file ({e})") from None
        if meta.get("format") != COMPACT:
            raise KldError(f"{path}: not a compact KLD file (metadata format {meta.get('format')!r})")
        self.meta = meta
        self.n_ctx, self.n_vocab = int(meta["n_ctx"]), int(meta["n_vocab"])
        self.tokens = self._f.get_tensor("tokens").numpy()
        self.n_chunk = self.tokens.shape[0]
        self.k = int(meta["topk"])
        self.kind += f", K = {self.k}"

    def rows(self, chunk: int, r0: int, r1: int, targets: torch.Tensor) -> Rows:
        get = lambda name: self._f.get_slice(name)[chunk:chunk + 1, r0:r1]   # noqa: E731
        return Rows(top_ids=get("topk_ids")[0].long(), top_lp=get("topk_logprobs")[0].double(),
                    target=get("target_logprob")[0].double())


class ScoresSide(Side):
    """Sequences of a logits dump or of an engine's prompt log-probs (read by parity.read_scores): sequence i
    is chunk i. seqs: (positions, logits [n, V] or None, top-k [(ids, log-probs)] or None, input ids or None,
    target log-probs by position or None)."""

    def __init__(self, path: str, kind: str, seqs: list, full: bool):
        self.path, self.kind, self.full, self.seqs = path, kind, full, seqs
        self.n_ctx, self.n_chunk, self.tokens = 0, len(seqs), None

    def bind(self, n_ctx: int) -> "ScoresSide":
        """Take the chunking of the other file: every sequence must score positions n_ctx/2 .. n_ctx-2."""
        self.n_ctx = n_ctx
        first, rows = first_scored(n_ctx), scored_rows(n_ctx)
        self._index = []
        for i, (positions, *_rest) in enumerate(self.seqs):
            where = {p: j for j, p in enumerate(positions)}
            missing = [p for p in range(first, first + rows) if p not in where]
            if missing:
                raise KldError(f"{self.path}: sequence {i} has no scores at position {missing[0]} (a chunk "
                               f"of {n_ctx} tokens is scored at positions {first}..{n_ctx - 2}: "
                               f"{len(missing)} missing)")
            self._index.append([where[p] for p in range(first, first + rows)])
        return self

    def check_tokens(self, tokens: np.ndarray) -> None:
        """Ids the file carries must be the chunks' (position 0 excepted: the BOS an engine was fed)."""
        for i, (_, _, _, ids, _) in enumerate(self.seqs[:tokens.shape[0]]):
            if ids is None:
                continue
            n = min(len(ids), self.n_ctx)
            diff = [p for p in range(1, n) if ids[p] != int(tokens[i, p])]
            if diff:
                p = diff[0]
                raise KldError(f"{self.path}: sequence {i} has token {ids[p]} at position {p}, the corpus "
                               f"chunk {int(tokens[i, p])}: not the same text")

    def rows(self, chunk: int, r0: int, r1: int, targets: torch.Tensor) -> Rows:
        _, logits, topk, _, target_lps = self.seqs[chunk]
        idx = self._index[chunk][r0:r1]
        if logits is not None:
            lp = logits[idx].double().log_softmax(-1)
            return Rows(lp=lp, target=_target_from_full(lp, targets))
        k = max(len(topk[j][0]) for j in idx)
        ids = torch.full((len(idx), k), -1, dtype=torch.int64)
        lps = torch.full((len(idx), k), -math.inf, dtype=torch.float64)
        target = torch.full((len(idx),), math.nan, dtype=torch.float64)
        first = first_scored(self.n_ctx)
        for r, j in enumerate(idx):
            t_ids, t_lp = topk[j]
            ids[r, :len(t_ids)], lps[r, :len(t_ids)] = t_ids, t_lp
            hit = (t_ids == targets[r]).nonzero()
            if len(hit):
                target[r] = t_lp[int(hit[0])]
            elif target_lps is not None and first + r0 + r in target_lps:
                target[r] = target_lps[first + r0 + r]
        return Rows(top_ids=ids, top_lp=lps, target=target)


# ---------------------------------------------------------------------------------------------------------
# Per-position figures of a base against a test
# ---------------------------------------------------------------------------------------------------------

def _support(b: Rows, t: Rows) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(base log-probs, test log-probs, valid) [n, K] on the ids both sides give."""
    if not b.full:
        ids, lb = b.top_ids, b.top_lp
        if t.full:
            lt = t.lp.gather(1, ids.clamp(min=0))
        else:                                                   # both top-k: match ids pairwise
            match = (ids[:, :, None] == t.top_ids[:, None, :]) & (ids[:, :, None] >= 0)   # [n, Kb, Kt]
            lt = torch.where(match, t.top_lp[:, None, :], -math.inf).amax(-1)
    else:
        ids, lt = t.top_ids, t.top_lp
        lb = b.lp.gather(1, ids.clamp(min=0))
    valid = (ids >= 0) & torch.isfinite(lb) & torch.isfinite(lt)
    return lb, lt, valid


def _renormalised(lp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    lp = torch.where(valid, lp, -math.inf)
    norm = torch.logsumexp(lp, -1, keepdim=True)
    return torch.where(valid, lp - torch.where(torch.isfinite(norm), norm, 0.0), -math.inf)


def position_figures(b: Rows, t: Rows) -> Dict[str, torch.Tensor]:
    """Per position: kld = KL(base || test), same (top-1), the targets' log-probs, the support size."""
    if b.full and t.full:
        pb = b.lp.exp()
        term = pb * (b.lp - t.lp)
        # llama.cpp sums over the base's entries above -16 nats: below, a .kld row knows no value.
        keep = b.lp > -CLAMP if b.clamped else pb > 0
        kld = torch.where(keep, term, 0.0).sum(-1)
        support = keep.sum(-1)
    else:
        lb, lt, valid = _support(b, t)
        lb, lt = _renormalised(lb, valid), _renormalised(lt, valid)
        kld = torch.where(valid, lb.exp() * (lb - lt), 0.0).sum(-1)
        support = valid.sum(-1)
    return {"kld": kld, "same": b.best() == t.best(), "lp_base": b.target, "lp_test": t.target,
            "support": support}


# ---------------------------------------------------------------------------------------------------------
# Statistics, as llama-perplexity --kl-divergence reports them
# ---------------------------------------------------------------------------------------------------------

def mean_unc(x: np.ndarray) -> Tuple[float, float]:
    """Mean and its standard error (0 for fewer than 11 values, as llama.cpp)."""
    n = len(x)
    if n == 0:
        return math.nan, math.nan
    m = float(x.mean())
    var = float((x * x).mean()) - m * m
    return m, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def covariance(a: np.ndarray, b: np.ndarray) -> float:
    n = len(a)
    if n < 10:
        return 0.0
    return (float((a * b).mean()) - float(a.mean()) * float(b.mean())) / (n - 1)


def percentile(sorted_x: np.ndarray, fraction: float) -> float:
    """Linear interpolation between the two nearest ranks of the sorted values."""
    if fraction <= 0:
        return float(sorted_x[0])
    if fraction >= 1:
        return float(sorted_x[-1])
    p = fraction * (len(sorted_x) - 1)
    i = int(p)
    return float((1 - (p - i)) * sorted_x[i] + (p - i) * sorted_x[min(i + 1, len(sorted_x) - 1)])


def median(sorted_x: np.ndarray) -> float:
    n = len(sorted_x)
    return float(sorted_x[n // 2]) if n % 2 else float(0.5 * (sorted_x[n // 2] + sorted_x[n // 2 - 1]))


KLD_LEVELS = [("Maximum", 1.0), ("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9),
              ("Median", None), ("10.0%", 0.1), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001),
              ("Minimum", 0.0)]
DP_LEVELS = KLD_LEVELS[:5] + [("75.0%", 0.75), ("Median", None), ("25.0%", 0.25)] + KLD_LEVELS[6:]


@dataclass
class Figures:
    """Every scored position of the compared chunks, in order."""
    chunk: np.ndarray          # int [n]
    position: np.ndarray       # int [n]: position in the chunk
    kld: np.ndarray            # fp64 [n]
    same: np.ndarray           # bool [n]
    lp_base: np.ndarray        # fp64 [n], NaN unknown
    lp_test: np.ndarray
    support: np.ndarray        # int [n]

    def summary(self) -> Dict[str, float]:
        s: Dict[str, float] = {"n": len(self.kld)}
        s["kld"], s["kld_unc"] = mean_unc(self.kld)
        ks = np.sort(self.kld)
        for name, f in KLD_LEVELS:
            s[f"kld {name.strip()}"] = median(ks) if f is None else percentile(ks, f)
        p = float(self.same.mean())
        s["same_top"], s["same_top_unc"] = p, math.sqrt(p * (1 - p) / (len(ks) - 1)) if len(ks) > 1 else 0.0
        s["support"] = float(self.support.mean())
        nll_b, nll_t = -self.lp_base, -self.lp_test
        s["ppl_known"] = bool(np.isfinite(nll_b).all() and np.isfinite(nll_t).all())
        if not s["ppl_known"]:
            return s
        mt, ut = mean_unc(nll_t)
        mb, ub = mean_unc(nll_b)
        cov = covariance(nll_t, nll_b)
        s["ppl"], s["ppl_unc"] = math.exp(mt), math.exp(mt) * ut
        s["ppl_base"], s["ppl_base_unc"] = math.exp(mb), math.exp(mb) * ub
        s["cor"] = cov / (ut * ub) if ut > 0 and ub > 0 else math.nan
        s["ln_ratio"], s["ln_ratio_unc"] = mt - mb, math.sqrt(max(0.0, ut * ut + ub * ub - 2 * cov))
        s["ratio"], s["ratio_unc"] = math.exp(mt - mb), math.exp(mt - mb) * s["ln_ratio_unc"]
        s["diff"] = s["ppl"] - s["ppl_base"]
        s["diff_unc"] = math.sqrt(max(0.0, s["ppl_unc"] ** 2 + s["ppl_base_unc"] ** 2
                                      - 2 * s["ppl"] * s["ppl_base"] * cov))
        dp = np.exp(self.lp_test) - np.exp(self.lp_base)
        s["dp"], s["dp_unc"] = mean_unc(dp)
        ds = np.sort(dp)
        for name, f in DP_LEVELS:
            s[f"dp {name.strip()}"] = median(ds) if f is None else percentile(ds, f)
        mse, mse_unc = mean_unc(dp * dp)
        s["rms_dp"] = math.sqrt(mse)
        s["rms_dp_unc"] = 0.5 / s["rms_dp"] * mse_unc if s["rms_dp"] > 0 else 0.0
        return s


def compare_sides(base: Side, test: Side, chunks: int, tokens: np.ndarray, block: int = 32,
                  progress: bool = False) -> Figures:
    """The per-position figures of the first `chunks` chunks of `tokens` [n_chunk, n_ctx] (rows read `block`
    at a time)."""
    first, rows = first_scored(base.n_ctx), scored_rows(base.n_ctx)
    parts: Dict[str, list] = {k: [] for k in ("kld", "same", "lp_base", "lp_test", "support")}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=chunks, unit="chunk", desc="kld", file=sys.stderr, mininterval=1.0, leave=False)
    for c in range(chunks):
        targets = torch.from_numpy(tokens[c, first + 1:first + 1 + rows].astype(np.int64))
        for r0 in range(0, rows, block):
            r1 = min(rows, r0 + block)
            fig = position_figures(base.rows(c, r0, r1, targets[r0:r1]), test.rows(c, r0, r1, targets[r0:r1]))
            for k, v in fig.items():
                parts[k].append(v.cpu().numpy())
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    return Figures(np.repeat(np.arange(chunks), rows), np.tile(np.arange(first, first + rows), chunks),
                   cat["kld"].astype(np.float64), cat["same"].astype(bool), cat["lp_base"].astype(np.float64),
                   cat["lp_test"].astype(np.float64), cat["support"])


def shared_chunks(base: Side, test: Side) -> int:
    """The chunks both files hold, after checking that they hold the same text the same way."""
    if base.n_ctx != test.n_ctx:
        raise KldError(f"{test.path} has chunks of {test.n_ctx} tokens, {base.path} of {base.n_ctx}: "
                       f"score both with the same --ctx")
    n = min(base.n_chunk, test.n_chunk)
    if base.tokens is not None and test.tokens is not None:
        diff = np.argwhere(base.tokens[:n] != test.tokens[:n])
        if len(diff):
            c, p = (int(x) for x in diff[0])
            raise KldError(f"{test.path} and {base.path} differ at chunk {c}, position {p} (token "
                           f"{int(test.tokens[c, p])} vs {int(base.tokens[c, p])}): not the same token ids "
                           f"(score the test with --tokens {base.path})")
    return n


# ---------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------

@dataclass
class KldTolerances:
    max_kld: float = 1e-3          # docs/numerics.md §13.4 (the mean KL target of `parity compare`)
    max_kld_p99: float = math.inf
    min_same_top: float = 0.995    # docs/numerics.md §13.4 (top-1 agreement)
    max_floor_ratio: float = math.inf
    affected_kld: float = 1e-6     # above the 16-bit rows' own noise (about 1e-9 per position)


def _pm(v: float, u: float, width: int = 10, digits: int = 6) -> str:
    return f"{v:{width}.{digits}f} ± {u:{width}.{digits}f}"


def _lines(s: Dict[str, float]) -> List[Tuple[str, str]]:
    """(label, value) in llama.cpp's order and wording."""
    out: List[Tuple[str, str]] = []
    if s["ppl_known"]:
        out += [("====== Perplexity statistics ======", ""),
                ("Mean PPL(Q)                   :", _pm(s["ppl"], s["ppl_unc"])),
                ("Mean PPL(base)                :", _pm(s["ppl_base"], s["ppl_base_unc"])),
                ("Cor(ln(PPL(Q)), ln(PPL(base))):", f"{100 * s['cor']:6.2f}%"),
                ("Mean ln(PPL(Q)/PPL(base))     :", _pm(s["ln_ratio"], s["ln_ratio_unc"])),
                ("Mean PPL(Q)/PPL(base)         :", _pm(s["ratio"], s["ratio_unc"])),
                ("Mean PPL(Q)-PPL(base)         :", _pm(s["diff"], s["diff_unc"])), ("", "")]
    out += [("====== KL divergence statistics ======", ""), ("Mean    KLD:", _pm(s["kld"], s["kld_unc"]))]
    for name, _ in KLD_LEVELS:
        out.append((f"{name:<7} KLD:", f"{s['kld ' + name.strip()]:10.6f}"))
    out += [("", ""), ("====== Token probability statistics ======", "")]
    if s["ppl_known"]:
        out.append(("Mean    Δp:", f"{100 * s['dp']:6.3f} ± {100 * s['dp_unc']:5.3f} %"))
        for name, _ in DP_LEVELS:
            out.append((f"{name:<7} Δp:", f"{100 * s['dp ' + name.strip()]:6.3f}%"))
        out.append(("RMS Δp    :", f"{100 * s['rms_dp']:6.3f} ± {100 * s['rms_dp_unc']:5.3f} %"))
    out.append(("Same top p:", f"{100 * s['same_top']:6.3f} ± {100 * s['same_top_unc']:5.3f} %"))
    return out


def per_chunk_table(fig: Figures, p) -> None:
    """llama.cpp's running table: after each chunk, the figures over the chunks so far."""
    p("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS"
      "            Same top p")
    for c in range(int(fig.chunk.max()) + 1):
        k = fig.chunk <= c
        s = Figures(fig.chunk[k], fig.position[k], fig.kld[k], fig.same[k], fig.lp_base[k], fig.lp_test[k],
                    fig.support[k]).summary()
        ppl = (f"{s['ppl']:9.4f} ± {s['ppl_unc']:9.4f}    {s['ln_ratio']:10.5f} ± {s['ln_ratio_unc']:10.5f}"
               if s["ppl_known"] else f"{'n/a':>21}    {'n/a':>23}")
        rms = f"{100 * s['rms_dp']:6.3f} ± {100 * s['rms_dp_unc']:6.3f} %" if s["ppl_known"] else "n/a"
        p(f"{c + 1:4d}    {ppl}    {s['kld']:10.5f} ± {s['kld_unc']:10.5f}    {rms}    "
          f"{100 * s['same_top']:6.3f} ± {100 * s['same_top_unc']:6.3f} %")


def first_affected(fig: Figures, threshold: float) -> Optional[Tuple[int, int, float]]:
    """(chunk, position, KLD) of the first position whose KLD exceeds `threshold`."""
    hit = np.nonzero(fig.kld > threshold)[0]
    if not len(hit):
        return None
    j = int(hit[0])
    return int(fig.chunk[j]), int(fig.position[j]), float(fig.kld[j])


def exact_base_ppl(compact: CompactSide, base: Side, chunks: int) -> Optional[Tuple[float, float]]:
    """The base's perplexity from a compact file of the same run (exact target log-probs), or None."""
    if compact.n_ctx != base.n_ctx or compact.n_chunk < chunks or \
            not np.array_equal(compact.tokens[:chunks], base.tokens[:chunks]):
        return None
    lp = compact._f.get_slice("target_logprob")[:chunks].double().flatten().numpy()
    m, u = mean_unc(-lp)
    return math.exp(m), math.exp(m) * u


def report(base: Side, test: Side, floor: Optional[Side] = None, tol: Optional[KldTolerances] = None,
           per_chunk: bool = False, exact_base: Optional[CompactSide] = None, out=None,
           progress: bool = False) -> bool:
    """Print the statistics of test against base (and of the floor run against base beside them); True when
    every check passes."""
    tol = tol or KldTolerances()
    p = lambda *x: print(*x, file=out or sys.stdout)   # noqa: E731
    n = shared_chunks(base, test)
    p(f"base:  {base.describe()}")
    p(f"test:  {test.describe()}")
    nf = None
    if floor is not None:
        nf = shared_chunks(base, floor)
        p(f"floor: {floor.describe()}")
        n = min(n, nf)
    if n < max(base.n_chunk, test.n_chunk):
        p(f"comparing the first {n} chunks, which every file holds")
    tokens = next(s.tokens for s in (base, test, floor) if s is not None and s.tokens is not None)
    fig = compare_sides(base, test, n, tokens, progress=progress)
    figs = [fig] + ([compare_sides(base, floor, n, tokens, progress=progress)] if floor is not None else [])
    sums = [f.summary() for f in figs]
    if base.full and test.full:
        how = ("KLD over the base's log-probs above -16 nats, as llama.cpp" if isinstance(base, KldSide)
               else "KLD over the whole vocabulary")
        p(f"compared on the full vocabulary ({how}), {len(fig.kld):,} positions in {n} chunks")
    else:
        p(f"compared on the shared top-k support (each position's log-probs restricted to the ids both files "
          f"give and renormalised, {sums[0]['support']:.1f} ids on average; top-1 is each file's own best "
          f"token), {len(fig.kld):,} positions in {n} chunks")
    if per_chunk:
        per_chunk_table(fig, p)
    rows = [_lines(s) for s in sums]
    width = max(len(v) for _, v in rows[0])
    if floor is not None:                   # the floor's figures in a second column, the same rows
        p(f"{'':31} {'test':<{width}}   floor")
    floor_values = dict(rows[1]) if floor is not None else {}
    for label, value in rows[0]:
        if not value:
            p(label)
        elif floor is None:
            p(f"{label} {value}")
        else:
            p(f"{label:<31} {value:<{width}}   {floor_values.get(label, 'n/a')}")
    s = sums[0]
    if isinstance(base, KldSide) and s["ppl_known"]:
        clamped = sum(base.clamped_targets(c, torch.from_numpy(
            base.tokens[c, first_scored(base.n_ctx) + 1:base.n_ctx].astype(np.int64))) for c in range(n))
        note = (f"note: PPL(base) is read from {base.path}, whose rows keep log-probs down to 16 nats below "
                f"the top: {clamped} of {len(fig.kld):,} next tokens lie below and read as that floor")
        note += ", so PPL(base) is biased low" if clamped else " (none here: exact to the 16-bit rounding)"
        exact = exact_base_ppl(exact_base, base, n) if exact_base is not None else None
        if exact is not None:
            note += f"; exact PPL(base) from {exact_base.path}: {exact[0]:.6f} ± {exact[1]:.6f}"
        p(note)
    hit = first_affected(fig, tol.affected_kld)
    if hit is None:
        p(f"first affected: none (no position's KLD exceeds {tol.affected_kld:g})")
    else:
        c, pos, v = hit
        p(f"first affected: chunk {c} (corpus tokens {c * base.n_ctx}..{(c + 1) * base.n_ctx - 1}), position "
          f"{pos}: KLD {v:.3g} > {tol.affected_kld:g}")
    chunk_means = np.bincount(fig.chunk, weights=fig.kld) / np.bincount(fig.chunk)
    worst = int(chunk_means.argmax())
    p(f"worst chunk: {worst}, mean KLD {chunk_means[worst]:.6g}")
    checks = [(f"mean KLD {s['kld']:.4g} <= {tol.max_kld:g}", s["kld"] <= tol.max_kld),
              (f"99% KLD {s['kld 99.0%']:.4g} <= {tol.max_kld_p99:g}", s["kld 99.0%"] <= tol.max_kld_p99),
              (f"same top p {100 * s['same_top']:.3f}% >= {100 * tol.min_same_top:g}%",
               s["same_top"] >= tol.min_same_top)]
    if floor is not None:
        fl = sums[1]
        ratio = s["kld"] / fl["kld"] if fl["kld"] > 0 else (0.0 if s["kld"] == 0 else math.inf)
        where = "below" if ratio < 1 else "above"
        p(f"against the reference's own spread: mean KLD {s['kld']:.4g} is {ratio:.3g}x the floor's "
          f"{fl['kld']:.4g} ({where} it); 99% KLD {s['kld 99.0%']:.4g} vs {fl['kld 99.0%']:.4g}; same top p "
          f"{100 * s['same_top']:.3f}% vs {100 * fl['same_top']:.3f}%")
        checks.append((f"mean KLD / floor {ratio:.3g} <= {tol.max_floor_ratio:g}",
                       ratio <= tol.max_floor_ratio))
    p("checks: " + "; ".join(f"{msg} {'ok' if ok else 'FAILED'}" for msg, ok in checks))
    passed = all(ok for _, ok in checks)
    p("PASS" if passed else "FAIL")
    return passed


def read_manifest_beside(path: str) -> Optional[dict]:
    """The manifest `corpus` wrote beside a file, or None."""
    try:
        with open(path + ".manifest.json", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def companion_compact(path: str) -> Optional[str]:
    """The compact file written in the same run as the .kld `path` (its manifest names it), if present."""
    m = read_manifest_beside(path)
    name = (m or {}).get("companions", {}).get("compact")
    if not name:
        return None
    full = os.path.join(os.path.dirname(os.path.abspath(path)), name)
    return full if os.path.isfile(full) else None


def open_side(path: str) -> Optional[Side]:
    """A .kld or a compact file; None for anything else (the caller reads dumps and JSON)."""
    if not os.path.isfile(path):
        raise KldError(f"file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(8)
    if head == MAGIC:
        return KldSide(path)
    if path.endswith(".safetensors"):
        from safetensors import safe_open
        try:
            with safe_open(path, framework="pt") as f:
                fmt = (f.metadata() or {}).get("format")
        except Exception as e:   # safetensors raises its own error types
            raise KldError(f"{path}: not a readable safetensors file ({e})") from None
        if fmt == COMPACT:
            return CompactSide(path)
    return None


def sequences_from(seqs: Sequence) -> list:
    """parity.SeqScores -> the tuples ScoresSide takes."""
    return [(s.positions, s.logits, s.topk, s.input_ids, getattr(s, "target_logprobs", None)) for s in seqs]
