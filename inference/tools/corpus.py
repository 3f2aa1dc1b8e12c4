"""Corpus scoring: perplexity and a llama.cpp KL-divergence base from this reference (docs/kld.md).

    [torchrun --nproc-per-node W -m] python -m inference.tools.parity corpus --ckpt-path D --config C \
        --text wiki.test.raw --ctx 512 --kld-base base.kld [--topk-out base.safetensors --topk 32] [--batch B]

The text is tokenized (a BOS first, --bos yes) and cut into n_chunk = len // ctx chunks of --ctx tokens, as
llama.cpp's perplexity tool cuts it. Each chunk runs from an empty cache with its first token replaced by BOS
(--bos yes), --batch chunks per forward (chunked prefill: --prefill-chunk); the distributions of positions
ctx/2 .. ctx-2 are kept: the .kld rows of llama.cpp (inference/tools/kld.py) and/or the compact top-K file.

Files are written as the run goes, under `<name>.partial`, with a journal `<first output>.partial.json`: the
run's identity (corpus, tokenizer, checkpoint, config, numerics, world size, batch, code) and the number of
chunks committed (their bytes flushed to disk before the journal says so). A run stopped at any point and
started again with the same arguments truncates what followed the last committed batch and continues there;
the finished files are those of an uninterrupted run, byte for byte. Done, each is renamed to its name and
gets a manifest `<name>.manifest.json`. Rank 0 writes; an error there (a full disk) stops every rank with the
same line.
"""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from encoding.tokenizer import TokenizerError
from ..config import ConfigError, ModelArgs, RuntimeOptions
from ..engine.checkpoint import CheckpointError, check_writable, shard_path
from ..engine.errors import InputError
from ..engine.prefill import chunk_bounds
from ..engine.session import Session, add_checkpoint_flags, add_model_flags, model_args, runtime_options
from ..engram import EngramError
from ..parallel import ParallelContext, RankLog, run_and_shut_down
from ..safetensors_io import build_header, manifest_path
from .kld import (COMPACT, KldError, KldSide, chunk_bytes, data_offset, first_scored, kld_file_bytes,
                  kld_header, quantise, row_width, scored_rows)

KNOWN_ERRORS = (InputError, ConfigError, CheckpointError, TokenizerError, EngramError, KldError)
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_arguments(c) -> None:
    """The `corpus` subcommand's options (parity.py builds the parser)."""
    add = c.add_argument
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="UTF-8 text file (e.g. wikitext-2's wiki.test.raw), tokenized here")
    src.add_argument("--tokens", help="token ids instead: a JSON list, or a .kld file (its ids, e.g. a base "
                     "made by llama.cpp, so that both tokenize alike)")
    add("--ctx", type=int, required=True, help="tokens per chunk (llama.cpp's -c; 512 is the custom)")
    add("--kld-base", default=None, metavar="OUT.kld", help="write llama.cpp's KL-divergence base (v1)")
    add("--topk-out", default=None, metavar="OUT.safetensors",
        help="write the compact file: per scored position the next token's log-prob, the log-sum-exp, the "
             "top-K")
    add("--topk", type=int, default=32, help="K of --topk-out (default 32)")
    add("--chunks", type=int, default=None, help="score only the first M chunks (llama.cpp's --chunks)")
    add("--batch", type=int, default=1, help="chunks per forward (default 1); with --offload disk every "
        "forward reads all the weights, so B chunks a pass cost little more than one")
    add("--bos", choices=["yes", "no"], default="yes", help="a BOS before the text and in place of each "
        "chunk's first token (llama.cpp's rule when the vocabulary adds one; default yes, as DeepSeek's "
        "encoding)")
    add("--no-progress", action="store_true", help="no progress bar (a line per batch instead)")
    add_checkpoint_flags(c)         # the loading flags of every command (engine/session.py)
    add_model_flags(c)


# ---------------------------------------------------------------------------------------------------------
# The corpus and the run's identity
# ---------------------------------------------------------------------------------------------------------

def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def bos_id_of(ckpt_path: str, tokenizer) -> int:
    """The BOS id: tokenizer_config.json's bos_token when the file is there, else DeepSeek's BOS string."""
    token = BOS_TOKEN
    path = os.path.join(ckpt_path, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            token = json.load(f).get("bos_token") or token
        token = token.get("content", BOS_TOKEN) if isinstance(token, dict) else token
    found = tokenizer.token_to_id(token)
    if found is None:
        raise TokenizerError(f"the tokenizer has no BOS token {token!r} (use --bos no)")
    return found


def read_corpus(o, tokenizer, bos: Optional[int], vocab: int) -> Tuple[np.ndarray, dict]:
    """-> (ids int32 [N], the corpus' identity). Text gets a BOS first (with --bos yes), as llama.cpp's
    tokenization of the whole file; given ids are taken as they are."""
    path = o.text or o.tokens
    if not os.path.isfile(path):
        raise InputError(f"corpus file not found: {path}")
    if o.text:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        ids = ([bos] if bos is not None else []) + tokenizer.encode(text, add_special_tokens=False).ids
        ids = np.asarray(ids, dtype=np.int64)
        kind = "text"
    else:
        with open(path, "rb") as f:
            is_kld = f.read(8) == b"_logits_"
        if is_kld:
            ids, kind = KldSide(path).tokens.reshape(-1).astype(np.int64), "tokens of a .kld file"
        else:
            try:
                with open(path, encoding="utf-8") as f:
                    obj = json.load(f)
            except (OSError, ValueError) as e:
                raise InputError(f"{path}: neither a .kld file nor JSON ({e})") from None
            obj = obj.get("tokens") if isinstance(obj, dict) else obj
            if not isinstance(obj, list) or not all(isinstance(t, int) for t in obj):
                raise InputError(f"{path}: expected a JSON list of token ids (or {{\"tokens\": [...]}})")
            ids, kind = np.asarray(obj, dtype=np.int64), "token ids (JSON)"
    bad = np.nonzero((ids < 0) | (ids >= vocab))[0]
    if len(bad):
        raise InputError(f"{path}: token {int(ids[bad[0]])} at index {int(bad[0])} is outside the vocabulary "
                         f"(0..{vocab - 1})")
    source = {"path": path, "kind": kind, "bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    return ids.astype(np.int32), source


def checkpoint_identity(ckpt: str, world: int) -> dict:
    """Cheap and exact enough: each shard's size and the SHA-256 of its header (names, dtypes, shapes,
    offsets), and of convert.py's record of per-tensor checksums when it is there."""
    shards = []
    for rank in range(world):
        path = shard_path(ckpt, rank, world)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = f.read(n)
        shards.append({"file": os.path.basename(path), "bytes": os.path.getsize(path),
                       "header_sha256": hashlib.sha256(header).hexdigest()})
    record = manifest_path(ckpt, world)                          # convert.py's per-tensor checksums
    return {"path": ckpt, "world_size": world, "shards": shards,
            "convert_record_sha256": sha256_file(record) if os.path.isfile(record) else None}


def sources_sha256() -> str:
    """The SHA-256 of the sources that compute the numbers (inference/, encoding/)."""
    h = hashlib.sha256()
    for folder in ("inference", "encoding"):
        for base, _, files in sorted(os.walk(os.path.join(ROOT, folder))):     # a fixed order
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(base, name)
                h.update(os.path.relpath(path, ROOT).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def git_commit() -> Optional[str]:
    """The checkout's commit, for the manifest (not the resume check: the sources' hash is what counts)."""
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------------------------------------
# The output files: partial files, their journal, resumption
# ---------------------------------------------------------------------------------------------------------

def _write_json_atomically(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _pwrite(fd: int, data, pos: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


@dataclass
class Geometry:
    n_ctx: int
    n_vocab: int
    n_chunk: int
    topk: int

    @property
    def first(self) -> int:
        return first_scored(self.n_ctx)

    @property
    def rows(self) -> int:
        return scored_rows(self.n_ctx)


class CompactLayout:
    """The compact file's header and where each tensor's bytes lie."""

    def __init__(self, g: Geometry, identity: dict):
        r, k = g.rows, g.topk
        entries = [("tokens", "I32", [g.n_chunk, g.n_ctx]), ("target_logprob", "F32", [g.n_chunk, r]),
                   ("logsumexp", "F32", [g.n_chunk, r]), ("topk_ids", "I32", [g.n_chunk, r, k]),
                   ("topk_logprobs", "F32", [g.n_chunk, r, k])]
        meta = {"format": COMPACT, "version": "1", "n_ctx": str(g.n_ctx), "n_vocab": str(g.n_vocab),
                "first": str(g.first), "topk": str(k), "identity": json.dumps(identity, sort_keys=True)}
        self.header, layout = build_header(entries, meta)
        self.offset, pos = {}, len(self.header)
        for name, nbytes in layout:
            self.offset[name] = pos
            pos += nbytes
        self.size = pos
        self.per_row = {"target_logprob": 4, "logsumexp": 4, "topk_ids": 4 * k, "topk_logprobs": 4 * k}


class Outputs:
    """Rank 0's files. Each output is written as `<name>.partial`; `<first output>.partial.json` is the
    journal: {"identity", "chunks_done", "chunk_nll": [[sum, sum of squares, count], ...]}. A partial run
    is recognised by its journal; data beyond chunks_done (a batch cut short) is dropped when it goes on."""

    def __init__(self, kld_path: Optional[str], compact_path: Optional[str], g: Geometry, identity: dict):
        self.kld_path, self.compact_path, self.g, self.identity = kld_path, compact_path, g, identity
        self.paths = [p for p in (kld_path, compact_path) if p]
        self.journal = (self.paths[0] + ".partial.json") if self.paths else None
        self.compact = CompactLayout(g, identity) if compact_path else None
        self.fds: Dict[str, int] = {}
        self.done, self.chunk_nll = 0, []

    def bytes_total(self) -> Dict[str, int]:
        out = {}
        if self.kld_path:
            out[self.kld_path] = kld_file_bytes(self.g.n_ctx, self.g.n_vocab, self.g.n_chunk)
        if self.compact_path:
            out[self.compact_path] = self.compact.size
        return out

    def _kld_committed(self, chunks: int) -> int:
        return data_offset(self.g.n_ctx, self.g.n_chunk) + chunks * chunk_bytes(self.g.n_ctx, self.g.n_vocab)

    def open(self, tokens: np.ndarray) -> int:
        """Start or continue: -> the first chunk left to score. tokens int32 [n_chunk, n_ctx]."""
        if not self.paths:
            return 0
        for p in self.paths:
            check_writable(p)
        state = None
        if os.path.isfile(self.journal):
            try:
                with open(self.journal, encoding="utf-8") as f:
                    state = json.load(f)
            except (OSError, ValueError) as e:
                raise KldError(f"{self.journal}: unreadable journal of a partial run ({e}): delete it and "
                               f"the .partial files to start over") from None
            old = state.get("identity", {})
            if old != self.identity:
                key = next(k for k in sorted(set(old) | set(self.identity))
                           if old.get(k) != self.identity.get(k))
                raise KldError(f"{self.journal}: a partial run with other settings ({key}: {old.get(key)!r} "
                               f"then, {self.identity.get(key)!r} now): rerun it as it was started, or "
                               f"delete {self.journal} and the .partial files to start over")
            missing = [p + ".partial" for p in self.paths if not os.path.isfile(p + ".partial")]
            if missing and state["chunks_done"] < self.g.n_chunk:
                raise KldError(f"{self.journal}: its partial file {missing[0]} is gone: delete the journal "
                               f"to start over")
        self._check_space(state)
        if state is None:
            self._start(tokens)
        else:
            self.done, self.chunk_nll = state["chunks_done"], state["chunk_nll"]
            self._reopen()
        return self.done

    def _check_space(self, state: Optional[dict]) -> None:
        """Stop before any work when a disk cannot hold what is left to write."""
        done = state["chunks_done"] if state is not None else 0
        need: Dict[str, int] = {}                    # folder -> bytes, folders on one disk counted together
        for path, total in self.bytes_total().items():
            if state is None:
                left = total
            elif path == self.kld_path:
                left = total - self._kld_committed(done)
            else:                                    # sized at the start, filled chunk by chunk
                left = (self.g.n_chunk - done) * self.g.rows * sum(self.compact.per_row.values())
            folder = os.path.dirname(os.path.abspath(path))
            same = next((f for f in need if os.stat(f).st_dev == os.stat(folder).st_dev), folder)
            need[same] = need.get(same, 0) + left
        for folder, n in need.items():
            free = shutil.disk_usage(folder).free
            if free < n:
                raise KldError(f"{folder}: {n / 1e9:.2f} GB left to write, {free / 1e9:.2f} GB free on its "
                               f"disk: free space or write elsewhere")

    def _start(self, tokens: np.ndarray) -> None:
        """New partial files: headers and ids written, the compact file at its final size (sparse until
        filled), then the journal."""
        if self.kld_path:
            fd = self.fds["kld"] = os.open(self.kld_path + ".partial",
                                           os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            _pwrite(fd, kld_header(self.g.n_ctx, self.g.n_vocab, tokens), 0)
            os.fsync(fd)
        if self.compact_path:
            fd = self.fds["compact"] = os.open(self.compact_path + ".partial",
                                               os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            _pwrite(fd, self.compact.header, 0)
            _pwrite(fd, tokens.astype("<i4").tobytes(), self.compact.offset["tokens"])
            os.ftruncate(fd, self.compact.size)
            os.fsync(fd)
        self.done, self.chunk_nll = 0, []
        self._journal()

    def _reopen(self) -> None:
        if self.kld_path and os.path.isfile(self.kld_path + ".partial"):
            fd = self.fds["kld"] = os.open(self.kld_path + ".partial", os.O_RDWR)
            committed = self._kld_committed(self.done)
            if os.fstat(fd).st_size < committed:
                raise KldError(f"{self.kld_path}.partial is shorter than its journal says ({self.done} "
                               f"chunks): delete it and {self.journal} to start over")
            os.ftruncate(fd, committed)                 # what a batch cut short had written
        if self.compact_path and os.path.isfile(self.compact_path + ".partial"):
            fd = self.fds["compact"] = os.open(self.compact_path + ".partial", os.O_RDWR)
            if os.fstat(fd).st_size != self.compact.size:
                raise KldError(f"{self.compact_path}.partial has {os.fstat(fd).st_size:,} bytes, not "
                               f"{self.compact.size:,}: delete it and {self.journal} to start over")

    def _journal(self) -> None:
        _write_json_atomically(self.journal, {"identity": self.identity, "chunks_done": self.done,
                                              "chunk_nll": self.chunk_nll})

    def write(self, chunk: int, row0: int, kld_rows: Optional[np.ndarray], compact: Optional[dict]) -> None:
        """Rows row0.. of one chunk (a call may hold part of a chunk)."""
        g = self.g
        if kld_rows is not None and "kld" in self.fds:
            pos = self._kld_committed(chunk) + row0 * row_width(g.n_vocab) * 2
            _pwrite(self.fds["kld"], np.ascontiguousarray(kld_rows), pos)
        if compact is not None and "compact" in self.fds:
            for name, per_row in self.compact.per_row.items():
                pos = self.compact.offset[name] + (chunk * g.rows + row0) * per_row
                _pwrite(self.fds["compact"], np.ascontiguousarray(compact[name]), pos)

    def commit(self, done: int, nll: List[List[float]]) -> None:
        """The chunks up to `done` are in: flush them, then say so in the journal."""
        for fd in self.fds.values():
            os.fsync(fd)
        self.done = done
        self.chunk_nll = self.chunk_nll + nll
        if self.journal:
            self._journal()

    def finish(self, manifest: dict) -> None:
        """Rename each partial file to its name, write the manifests, drop the journal (each step may be
        repeated: a run stopped between them finishes them when started again)."""
        for fd in self.fds.values():
            os.fsync(fd)
            os.close(fd)
        self.fds = {}
        companions = {"kld": os.path.basename(self.kld_path) if self.kld_path else None,
                      "compact": os.path.basename(self.compact_path) if self.compact_path else None}
        for path, fmt in ((self.kld_path, "llama.cpp KL-divergence base, v1 (_logits_)"),
                          (self.compact_path, f"{COMPACT} v1 (safetensors)")):
            if not path:
                continue
            if os.path.isfile(path + ".partial"):
                os.replace(path + ".partial", path)
            _write_json_atomically(path + ".manifest.json", dict(manifest, file=os.path.basename(path),
                                                                 format=fmt, bytes=os.path.getsize(path),
                                                                 companions=companions))
        if self.journal and os.path.isfile(self.journal):
            os.remove(self.journal)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


# ---------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------

def position_rows(logits: torch.Tensor, targets: torch.Tensor, topk: int, want_kld: bool, want_compact: bool):
    """logits [n, V] of n scored positions, targets [n] (the next ids) -> (nll fp64 [n], .kld rows uint16
    [n, nv] or None, the compact file's tensors or None)."""
    x = logits.float()
    lse = torch.logsumexp(x.double(), -1)                                       # [n]
    lp_target = x.double().gather(1, targets[:, None].to(x.device)).squeeze(1) - lse
    nll = (-lp_target).cpu()
    rows = quantise(x) if want_kld else None
    compact = None
    if want_compact:
        vals, ids = x.topk(topk, dim=-1)                                          # [n, K], descending
        compact = {"target_logprob": lp_target.float().cpu().numpy().astype("<f4"),
                   "logsumexp": lse.float().cpu().numpy().astype("<f4"),
                   "topk_ids": ids.to(torch.int32).cpu().numpy().astype("<i4"),
                   "topk_logprobs": (vals.double() - lse[:, None]).float().cpu().numpy().astype("<f4")}
    return nll, rows, compact


@torch.inference_mode()
def score_batch(model, ids: torch.Tensor, g: Geometry, prefill_chunk: Optional[int], rank0: bool,
                emit) -> List[torch.Tensor]:
    """ids [B, ctx] (BOS already in place) from an empty cache; the scored positions' rows go to
    emit(j, row0, rows, compact) per chunk j of the batch. -> per chunk, nll fp64 [R]."""
    model.reset()
    bsz, first, last = ids.shape[0], g.first, g.n_ctx - 1         # positions first .. last-1 are scored
    nll: List[List[torch.Tensor]] = [[] for _ in range(bsz)]
    for start, end in chunk_bounds(g.n_ctx, prefill_chunk):
        need = end > first and start < last          # alike on every rank: the head gathers across ranks
        logits = model.prefill(ids[:, start:end], start, all_logits=need).logits        # [B, s, V]
        if not (need and rank0):
            continue
        a, b = max(start, first), min(end, last)
        for j in range(bsz):
            targets = ids[j, a + 1:b + 1].cpu()
            n, rows, compact = position_rows(logits[j, a - start:b - start], targets, g.topk,
                                             emit.kld, emit.compact)
            nll[j].append(n)
            emit(j, a - first, rows, compact)
    return [torch.cat(parts) for parts in nll] if rank0 else []


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _ppl(chunk_nll: List[List[float]]) -> Tuple[float, float, int]:
    """Perplexity and its uncertainty over the per-chunk [sum, sum of squares, count] (llama.cpp's)."""
    s = sum(c[0] for c in chunk_nll)
    s2 = sum(c[1] for c in chunk_nll)
    n = sum(c[2] for c in chunk_nll)
    if not n:
        return math.nan, math.nan, 0
    m = s / n
    var = s2 / n - m * m
    unc = math.sqrt(var / (n - 1)) if var > 0 and n > 1 else 0.0
    return math.exp(m), math.exp(m) * unc, n


def check_options(o) -> RuntimeOptions:
    """The corpus flags' checks, then every command's loading checks -> the runtime options."""
    checks = [(o.ctx < 3, f"--ctx must be at least 3 (one scored position), got {o.ctx}"),
              (o.batch < 1, f"--batch must be >= 1, got {o.batch}"),
              (o.chunks is not None and o.chunks < 1, f"--chunks must be >= 1, got {o.chunks}"),
              (o.topk < 1, f"--topk must be >= 1, got {o.topk}"),
              (o.kld_base and o.topk_out and os.path.abspath(o.kld_base) == os.path.abspath(o.topk_out),
               "--kld-base and --topk-out name the same file"),
              (o.topk_out and not o.topk_out.endswith(".safetensors"),
               f"--topk-out {o.topk_out}: the compact file is safetensors: name it *.safetensors")]
    for failed, message in checks:
        if failed:
            raise InputError(message)
    return runtime_options(o)


def prepare(o, par: ParallelContext, tokenizer, margs: ModelArgs, log: RankLog):
    """Rank 0: the corpus, the chunks, the outputs (started or continued). -> (chunks int32 [n_chunk, ctx],
    first chunk to score, Outputs, manifest)."""
    bos = bos_id_of(o.ckpt_path, tokenizer) if o.bos == "yes" else None
    ids, source = read_corpus(o, tokenizer, bos, margs.vocab_size)
    n_chunk = len(ids) // o.ctx
    if n_chunk == 0:
        raise InputError(f"{source['path']} gives {len(ids):,} tokens: fewer than one chunk of --ctx {o.ctx}")
    if o.chunks is not None:
        n_chunk = min(n_chunk, o.chunks)
    chunks = ids[:n_chunk * o.ctx].reshape(n_chunk, o.ctx)
    g = Geometry(o.ctx, margs.vocab_size, n_chunk, min(o.topk, margs.vocab_size))
    tok_files = [os.path.join(o.ckpt_path, n) for n in ("tokenizer.json", "tokenizer_config.json")]
    identity = {
        "corpus": source, "tokens": {"count": int(chunks.size), "sha256": hashlib.sha256(
            chunks.astype("<i4").tobytes()).hexdigest()},
        "bos": {"rule": o.bos, "id": bos}, "n_ctx": o.ctx, "n_chunk": n_chunk, "n_vocab": margs.vocab_size,
        "scored_positions": [g.first, o.ctx - 2], "topk": g.topk if o.topk_out else None,
        "tokenizer": {os.path.basename(p): sha256_file(p) for p in tok_files if os.path.isfile(p)},
        "checkpoint": checkpoint_identity(o.ckpt_path, par.world_size),
        "config_sha256": sha256_file(o.config),
        "numerics": o.numerics, "kernel_backend": o.kernel_backend, "kernel_build": o.kernel_build,
        "fix_index_k": o.fix_index_k, "deterministic_topk": o.deterministic_topk, "engram_on": o.engram_on,
        "experts_on": o.experts_on, "cpu_linears": o.cpu_linears, "offload": o.offload,
        "device": o.device, "world_size": par.world_size, "threads": torch.get_num_threads(),
        "batch": o.batch, "prefill_chunk": o.prefill_chunk, "code_sha256": sources_sha256(),
        "torch": torch.__version__,
    }
    outputs = Outputs(o.kld_base, o.topk_out, g, identity)
    start = outputs.open(chunks)
    log.info(f"corpus {source['path']}: {len(ids):,} tokens ({source['kind']}), {n_chunk} chunks of {o.ctx} "
             f"(scored positions {g.first}..{o.ctx - 2}: {g.rows} per chunk, {g.rows * n_chunk:,} in all), "
             f"BOS {'id ' + str(bos) if bos is not None else 'none'}")
    for path, size in outputs.bytes_total().items():
        log.info(f"will write {path}: {size:,} bytes ({size / 1e9:.2f} GB)")
    if start:
        log.info(f"continuing the partial run of {outputs.journal}: {start} of {n_chunk} chunks done")
    forwards = -(-(n_chunk - start) // o.batch)
    log.info(f"{n_chunk - start} chunks to score in {forwards} forward(s) of up to {o.batch} chunk(s) "
             f"({o.batch * o.ctx:,} tokens); the time is estimated after the first")
    return chunks, start, outputs, identity


class Emitter:
    """Hands a batch's rows to the writer, at the chunk's place. A write that fails (a full disk) is kept, not
    raised: rank 0 runs the batch's remaining forward calls with the other ranks, then all stop together."""

    def __init__(self, outputs: Optional[Outputs], c0: int):
        self.outputs, self.c0 = outputs, c0
        self.kld = bool(outputs and outputs.kld_path)
        self.compact = bool(outputs and outputs.compact_path)
        self.error: Optional[OSError] = None

    def __call__(self, j: int, row0: int, rows, compact) -> None:
        if self.outputs is None or self.error is not None:
            return
        try:
            self.outputs.write(self.c0 + j, row0, rows, compact)
        except OSError as e:
            self.error = e

    def commit(self, done: int, sums: List[List[float]]) -> None:
        if self.outputs is not None and self.error is None:
            try:
                self.outputs.commit(done, sums)
            except OSError as e:
                self.error = e

    def message(self) -> Optional[str]:
        if self.error is None:
            return None
        e = self.error
        return (f"writing {e.filename or 'the outputs'}: {e.strerror or e}; the chunks committed so far "
                f"({self.outputs.done} of {self.outputs.g.n_chunk}) are kept: free space and rerun the same "
                f"command to continue")


def run(o, log: RankLog) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    opts = check_options(o)
    margs = model_args(o, world, need_eos=False, max_seq_len=o.ctx, max_batch_size=o.batch, temperature=0.0)
    session = Session.start(o, log, margs, opts, language_model_only=True)
    par, tokenizer = session.par, session.tokenizer
    rank0 = par.rank == 0

    box = []
    ready, error = par.from_rank0(lambda: box.append(prepare(o, par, tokenizer, margs, log)) or
                                  (box[0][0], box[0][1]), KNOWN_ERRORS + (OSError,))
    if error is not None:
        raise KldError(error)
    chunks, start = ready
    outputs, identity = (box[0][2], box[0][3]) if rank0 else (None, None)
    n_chunk = chunks.shape[0]
    g = Geometry(o.ctx, margs.vocab_size, n_chunk, min(o.topk, margs.vocab_size))
    manifest = None
    try:
        if start < n_chunk:
            _score(o, session, chunks, start, g, outputs, log)
        if rank0:
            ppl, unc, n = _ppl(outputs.chunk_nll)
            manifest = dict(identity, perplexity={"ppl": ppl, "uncertainty": unc, "positions": n},
                            git_commit=git_commit())
        status = par.from_rank0(lambda: outputs.finish(manifest), (OSError,))[1]     # runs on rank 0
        if status is not None:
            raise KldError(f"finishing the outputs: {status} (rerun the same command to finish)")
        if rank0:
            log.info(f"Final estimate: PPL = {ppl:.4f} +/- {unc:.5f} over {n:,} positions of {n_chunk} "
                     f"chunks")
            for path in outputs.bytes_total():
                log.info(f"wrote {path} ({os.path.getsize(path):,} bytes) and {path}.manifest.json")
    finally:
        if outputs is not None:
            outputs.close()


def _score(o, session: Session, chunks, start, g: Geometry, outputs: Optional[Outputs], log) -> None:
    par, rank0 = session.par, session.par.rank == 0
    loaded = session.load()
    model, prefill_chunk = loaded.model, loaded.prefill_chunk
    bos = None if o.bos == "no" else bos_id_of(o.ckpt_path, session.tokenizer)
    n_chunk, done_nll = chunks.shape[0], list(outputs.chunk_nll) if rank0 else []
    bar = None
    if rank0 and not o.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=n_chunk, initial=start, unit="chunk", desc="corpus", file=sys.stderr,
                   mininterval=1.0, dynamic_ncols=True)
    t0, scored_tokens = time.perf_counter(), 0
    try:
        for c0 in range(start, n_chunk, o.batch):
            c1 = min(n_chunk, c0 + o.batch)
            ids = torch.from_numpy(chunks[c0:c1].astype(np.int64))
            if bos is not None:
                ids[:, 0] = bos                                  # evaluated with BOS; the files keep the ids
            tb = time.perf_counter()
            emit = Emitter(outputs, c0)
            nll = score_batch(model, ids.to(o.device), g, prefill_chunk, rank0, emit)
            sums = [[float(np.sum(v)), float(np.sum(v * v)), int(v.size)] for v in (n.numpy() for n in nll)]
            emit.commit(c1, sums)
            write_error = par.broadcast_object(emit.message())
            if write_error is not None:
                raise KldError(write_error)
            done_nll += sums
            dt = time.perf_counter() - tb
            scored_tokens += (c1 - c0) * o.ctx
            if not rank0:
                continue
            ppl, _, _ = _ppl(done_nll)
            rate = scored_tokens / (time.perf_counter() - t0)
            if c0 == start and c1 < n_chunk:
                left = (n_chunk - c1) / (c1 - c0) * dt
                msg = (f"first batch: {dt:.2f} s for {c1 - c0} chunk(s) ({(c1 - c0) * o.ctx / dt:,.0f} "
                       f"tokens/s): about {_eta(left)} for the {n_chunk - c1} chunks left")
                bar.write(msg) if bar is not None else log.info(msg)
            if bar is not None:
                bar.set_postfix_str(f"PPL {ppl:.4f}, {rate:,.0f} tok/s", refresh=False)
                bar.update(c1 - c0)
            else:
                log.info(f"[{c1}/{n_chunk}] PPL {ppl:.4f}, {rate:,.0f} tokens/s")
    finally:
        if bar is not None:
            bar.close()
    if rank0:
        total = time.perf_counter() - t0
        log.info(f"scored {n_chunk - start} chunks ({scored_tokens:,} tokens) in {total:.1f} s: "
                 f"{scored_tokens / total:,.1f} tokens/s")
    if model.weight_stream is not None:
        line = model.weight_stream.close()
        log.info(line)


def main(o) -> int:
    """`parity corpus`: 0 done, 2 bad input or a file that cannot be written (one line), 130 interrupted."""
    log = RankLog.from_env()
    return run_and_shut_down(lambda: run(o, log), log, KNOWN_ERRORS, error_code=2,
                             interrupted="interrupted: rerun the same command to continue after the last "
                                         "committed batch")
