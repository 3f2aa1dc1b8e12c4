"""Convert the Hugging Face checkpoint of DeepSeek-V4.1-Flash into `model{rank}-mp{W}.safetensors` files.

    python convert.py --hf-ckpt-path HF --save-path OUT --model-parallel W [--expert-dtype fp4|fp8]
    python convert.py --verify OUT          # every converted file against the checksums recorded

Rules: the names, the split table and the recasts are the table below (RULES, with DROP_PREFIX, SKIP and
RENAMES); docs/checkpoint.md §2-3 and docs/cli.md §3 explain them. The output bytes equal those of the
official converter, which builds each rank's tensors in memory and calls `safetensors.torch.save_file`
without metadata.

Unlike the official tool this one streams: it plans every output tensor from the shard headers alone,
checks that the checkpoint is complete before writing anything, then writes each rank's file tensor by
tensor (raw byte ranges are copied in pieces, hashed on the way; tensors that need arithmetic are processed
in row chunks), so memory stays within --max-buffer whatever the checkpoint size. Each file is written under
`<name>.partial`, fsynced and renamed; a small manifest (`.convert-mp{W}.json`) records finished ranks
with the sha256 of every tensor's bytes, hashed as they are written, so that a rerun after an interruption
skips them once their data is verified (a damaged file is named and rewritten), and `--verify` can check the
output at any time.
"""
import argparse
import hashlib
import json
import math
import os
import re
import resource
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import numpy as np

from inference.safetensors_io import (CHECKSUM, CHECKSUM_KEY, CopyRange, SafetensorsError, StreamWriter,
                                      build_header, check_recorded, find_damaged, manifest_path, read_header,
                                      read_manifest, tensor_nbytes)

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
MAX_OFFSET_BITS = 6  # FP4 -> FP8 recast: 6 * 2^6 = 384 <= 448 < 6 * 2^7
MIN_OFFSET = -24     # 6 * 2^-24 is below half the smallest E4M3 subnormal: smaller offsets all give zeros
COPY_PIECE = 256 << 20  # progress granularity of plain copies


class ConvertError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------------------
# The conversion rules (docs/checkpoint.md §2-3). The planner takes them from here and nowhere else; the rest
# of the file moves bytes (planning from headers, streaming, resuming, verification).

# HF name -> converted name: drop a leading `model.`, skip the tied copies, then rename substrings in order.
# The V4.1 release already uses the converted names; the renames are kept for older exports.
DROP_PREFIX = "model."
SKIP = re.compile(r"mtp\.\d+\.(?:embed|head)\.weight")  # the stages share the backbone's embed and head
RENAMES = [  # (old, new, names starting with this keep `old`)
    ("self_attn", "attn", None),
    ("mlp", "ffn", "vision."),  # the vision tower's blocks keep their own `mlp`
    ("weight_scale_inv", "scale", None),
    ("e_score_correction_bias", "bias", None),
]


class Rule(NamedTuple):
    regex: "re.Pattern"  # fullmatch on the converted name; the first row that matches decides
    split: str    # rank r's part: expert (whole experts), engram (padded rows), dim0, dim1, replicate (all)
    divides: str  # the config quantity W must divide, named in the error ("": nothing has to)
    recast: str   # "" (the bytes unchanged), bf16, drop or expert, as below


# Recasts. bf16: an FP8 weight becomes fp32(w) * fp32(its block scale) rounded to bf16, exactly. drop: not
# written. expert: MXFP4 (I8) weights keep their bytes as F4 (float4_e2m1fn_x2) or, with --expert-dtype fp8,
# become E4M3 with a UE8M0 scale per 32x32 block (exact unless a block's row scales span over 2^14,
# docs/checkpoint.md §3.5).
# Other dtypes are copied unchanged by both; no tensor is widened here (the loader widens some in memory,
# docs/checkpoint.md §5).
_B = r"(?:layers|mtp)\.\d+"  # a backbone layer or a DSpark stage
_ATTN = _B + r"\.attn\."
RULES = [Rule(re.compile(pattern, re.S), *rest) for pattern, *rest in [  # re.S: `.` spans any character
    # converted name                                              split        W must divide       recast
    # experts stay whole: rank r holds experts [r*E/W, (r+1)*E/W), their global indices kept in the names
    (r"(?:.*?\.)?(?:mlp|ffn)\.experts\.(\d+)\..*",                "expert",    "n_routed_experts", "expert"),
    # Engram rows need not divide by W: ceil(rows/W) rows per rank, padded (weights 0, scales 1.0)
    (r".*\.engram\.embed\.(?:weight|scale)",                      "engram",    "",                 ""),
    # vocabulary-parallel embeddings and output heads: the backbone's and the DSpark Markov heads'
    (r"(?:mtp\.\d+\.markov_head\.)?(?:embed|head)\.weight",       "dim0",      "vocab_size",       ""),
    # column-parallel query heads, each rank with its heads' attention sinks
    (_ATTN + r"(?:wq_b\.(?:weight|scale)|attn_sink)",             "dim0",      "n_heads",          ""),
    # grouped output projection, by groups; the model runs it in bf16
    (_ATTN + r"wo_a\.weight",                                     "dim0",      "o_groups",         "bf16"),
    # folded into the bf16 wo_a (written only where the weight is missing)
    (_ATTN + r"wo_a\.scale",                                      "dim0",      "o_groups",         "drop"),
    # the indexer's query heads and their head weights
    (_ATTN + r"indexer\.(?:wq_b|weights_proj)\.(?:weight|scale)", "dim0",      "index_n_heads",    ""),
    # row-parallel output projection: split along its input, the ranks' partial outputs are summed
    (_ATTN + r"wo_b\.(?:weight|scale)",                           "dim1",      "o_groups",         ""),
    # the rest (norms, wq_a, wkv, compressor, gates, shared experts, hc_*, Engram q/k/wkv, vision...): whole
    (r".*",                                                       "replicate", "",                 ""),
]]


def normalize_name(name: str) -> Optional[str]:
    """Converted name of an HF tensor name, or None for the tied `mtp.K.embed/head` copies (skipped)."""
    if name.startswith(DROP_PREFIX):
        name = name[len(DROP_PREFIX):]
    if SKIP.fullmatch(name):
        return None
    for old, new, keep_under in RENAMES:
        if not (keep_under and name.startswith(keep_under)):
            name = name.replace(old, new)
    return name


def match_rule(name: str) -> Tuple[Rule, "re.Match"]:
    """The first row of RULES that matches a converted name, and the match (group 1: the expert index)."""
    for rule in RULES:
        m = rule.regex.fullmatch(name)
        if m:
            return rule, m
    raise AssertionError(name)  # unreachable: the last row matches every name


def split_rule(name: str) -> Tuple[str, str]:
    """(split, what must be divisible by W): split is expert | engram | dim0 | dim1 | replicate."""
    rule, _ = match_rule(name)
    return rule.split, rule.divides


# ----------------------------------------------------------------------------------------------------------
# Plan

# The names the model knows: anything else stops the conversion before a byte is written.
_KNOWN = re.compile("|".join(f"(?:{p})" for p in [
    r"(?:embed|head|norm)\.weight", r"image_(?:start|end|newline)",
    _B + r"\.(?:attn_norm|ffn_norm)\.weight", _B + r"\.hc_(?:attn|ffn)_(?:fn|base|scale)",
    _B + r"\.attn\.attn_sink", _B + r"\.attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)\.(?:weight|scale)",
    _B + r"\.attn\.(?:q_norm|kv_norm|compressor\.norm|indexer\.k_norm)\.weight",
    _B + r"\.attn\.compressor\.(?:wkv|wgate)\.(?:weight|scale)",
    _B + r"\.attn\.indexer\.(?:wq_b|weights_proj|wk)\.(?:weight|scale)",
    _B + r"\.ffn\.gate\.(?:weight|bias|bias_vl)",
    _B + r"\.ffn\.(?:experts\.\d+|shared_experts)\.w[123]\.(?:weight|scale)",
    r"layers\.\d+\.engram\.(?:embed|wkv)\.(?:weight|scale)", r"layers\.\d+\.engram\.(?:q_weight|k_weight)",
    r"mtp\.\d+\.main_proj\.(?:weight|scale)", r"mtp\.\d+\.(?:main_norm|norm)\.weight",
    r"mtp\.\d+\.markov_head\.(?:embed|head)\.weight", r"mtp\.\d+\.confidence_head\.proj\.weight",
    r"vision\.patch_embed\.proj\.(?:weight|bias)", r"vision\.blocks\.\d+\.norm[12]\.weight",
    r"vision\.blocks\.\d+\.attn\.(?:wqkv|wo)\.(?:weight|bias)", r"vision\.blocks\.\d+\.mlp\.w[12]\.weight",
    r"vision\.norm\.weight", r"aligner\.w[12]\.(?:weight|bias)",
]))


@dataclass
class Src:
    file: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int   # absolute data offset in the file
    nbytes: int

    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


@dataclass
class Out:
    name: str
    dtype: str
    shape: List[int]   # header shape
    op: str            # copy | cols | engram | wo_a | fp8_weight | fp8_scale
    src: Src
    rows: Tuple[int, int] = (0, 0)      # source rows (copy, engram, wo_a)
    cols: Tuple[int, int] = (0, 0)      # source columns (cols)
    pad_rows: int = 0                  # engram padding
    aux: Optional[Src] = None          # scale of wo_a / FP4 experts

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


@dataclass
class Plan:
    hf_dir: str
    world: int
    expert_dtype: str
    files: List[str]
    sources: Dict[str, Src]
    n_read: int
    experts: Tuple[int, int]
    ranks: List[List[Out]] = field(default_factory=list)
    headers: List[bytes] = field(default_factory=list)

    def rank_file(self, rank: int) -> str:
        return f"model{rank}-mp{self.world}.safetensors"

    def header(self, rank: int) -> bytes:
        return self.headers[rank]

    def rank_bytes(self, rank: int) -> int:
        return len(self.header(rank)) + sum(o.nbytes for o in self.ranks[rank])


def load_sources(hf_dir: str) -> Tuple[List[str], Dict[str, Src]]:
    """Read and validate every shard header; check the names against the index (before any writing)."""
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"--hf-ckpt-path {hf_dir} is not a directory")
    index_path = os.path.join(hf_dir, INDEX_FILE)
    expected = None
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConvertError(f"{index_path}: cannot read weight_map ({e})") from None
        expected = set(weight_map)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ConvertError(f"shard {missing[0]}{more} named in {INDEX_FILE} is missing from {hf_dir}")
    else:
        files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
        if not files:
            raise ConvertError(f"no {INDEX_FILE} and no *.safetensors files in {hf_dir}")
    sources: Dict[str, Src] = {}
    for f in files:
        try:
            tensors, _ = read_header(os.path.join(hf_dir, f))
        except SafetensorsError as e:
            raise ConvertError(str(e)) from None
        for name, t in tensors.items():
            if name in sources:
                raise ConvertError(f"tensor {name} appears in both {sources[name].file} and {f}")
            sources[name] = Src(f, t.dtype, t.shape, t.offset, t.nbytes)
    if expected is not None and set(sources) != expected:
        missing, unexpected = sorted(expected - set(sources)), sorted(set(sources) - expected)
        example = (missing or unexpected)[0]
        raise ConvertError(f"checkpoint shards incomplete: {len(missing)} tensor(s) of {INDEX_FILE} missing, "
                           f"{len(unexpected)} unexpected (e.g. {example}); the source may be mid-upload")
    return files, sources


def infer_experts(names) -> Tuple[int, int]:
    backbone, mtp = -1, -1
    for name in names:
        name = name[len(DROP_PREFIX):] if name.startswith(DROP_PREFIX) else name
        rule, m = match_rule(name)
        if rule.split == "expert":
            if name.startswith("mtp."):
                mtp = max(mtp, int(m.group(1)))
            else:
                backbone = max(backbone, int(m.group(1)))
    backbone += 1
    return backbone, (mtp + 1 if mtp >= 0 else backbone)


def make_plan(hf_dir: str, world: int, expert_dtype: Optional[str] = None) -> Plan:
    if world < 1:
        raise ConvertError(f"--model-parallel must be >= 1, got {world}")
    expert_dtype = expert_dtype or "fp4"
    if expert_dtype not in ("fp4", "fp8"):
        raise ConvertError(f"--expert-dtype must be fp4 or fp8, got {expert_dtype!r}")
    files, raw = load_sources(hf_dir)
    sources: Dict[str, Src] = {}
    for name, src in raw.items():
        ref = normalize_name(name)
        if ref is None:
            continue
        if ref in sources:
            raise ConvertError(f"two tensors normalize to the same name {ref}")
        sources[ref] = src
    unknown = sorted(n for n in sources if not _KNOWN.fullmatch(n))
    if unknown:
        shown = ", ".join(unknown[:8]) + (f", ... ({len(unknown)} in all)" if len(unknown) > 8 else "")
        raise ConvertError(f"unknown tensor name(s) in the checkpoint: {shown}")
    experts = infer_experts(raw)
    plan = Plan(hf_dir, world, expert_dtype, files, sources, len(raw), experts)
    _check_divisibility(plan)
    plan.ranks = [_rank_tensors(plan, rank) for rank in range(world)]
    plan.headers = [build_header([(o.name, o.dtype, o.shape) for o in outs])[0] for outs in plan.ranks]
    return plan


def _check_divisibility(plan: Plan) -> None:
    w, (e_main, e_mtp) = plan.world, plan.experts
    if e_main % w or e_mtp % w:
        raise ConvertError(f"--model-parallel {w} does not divide the routed expert counts "
                           f"(backbone {e_main}, DSpark {e_mtp})")
    # Report the config-level quantity: vocabulary first, then attention heads, then anything else.
    order = {"vocab_size": 0, "n_heads": 1, "o_groups": 2, "index_n_heads": 3}
    splits = []
    for name, src in plan.sources.items():
        rule, what = split_rule(name)
        if rule in ("dim0", "dim1"):
            dim = 0 if rule == "dim0" else 1
            size = src.shape[dim] if len(src.shape) > dim else 0
            if size % w:
                splits.append((order.get(what, 9), name, what, dim, size))
    if splits:
        _, name, what, dim, size = min(splits)
        raise ConvertError(f"--model-parallel {w} does not divide {what}: "
                           f"dim {dim} of {name} has size {size}")


def _rank_tensors(plan: Plan, rank: int) -> List[Out]:
    out = []
    for name, src in sorted(plan.sources.items()):
        rule, m = match_rule(name)
        o = _split(plan, rank, rule.split, name, src, m)
        if o is not None:
            o = _recast(plan, rule.recast, o)
        if o is not None:
            out.append(o)
    return out


def _split(plan: Plan, rank: int, split: str, name: str, src: Src, m: "re.Match") -> Optional[Out]:
    """This rank's part of one tensor under a RULES split (None: the rank holds none of it)."""
    w, shape = plan.world, list(src.shape)
    whole = (0, shape[0]) if shape else (0, 1)
    if split == "expert":
        per = (plan.experts[1] if name.startswith("mtp.") else plan.experts[0]) // w
        if not rank * per <= int(m.group(1)) < (rank + 1) * per:
            return None
        return Out(name, src.dtype, shape, "copy", src, rows=whole)
    if split == "engram":
        rows = shape[0]
        chunk = -(-rows // w)
        r0, r1 = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
        return Out(name, src.dtype, [chunk] + shape[1:], "engram", src, rows=(r0, r1),
                   pad_rows=chunk - (r1 - r0))
    if split == "dim0":
        n = shape[0] // w
        return Out(name, src.dtype, [n] + shape[1:], "copy", src, rows=(rank * n, (rank + 1) * n))
    if split == "dim1":
        k = shape[1] // w
        return Out(name, src.dtype, [shape[0], k] + shape[2:], "cols", src, cols=(rank * k, (rank + 1) * k))
    return Out(name, src.dtype, shape, "copy", src, rows=whole)


def _recast(plan: Plan, recast: str, o: Out) -> Optional[Out]:
    """A rank's part after a RULES recast (None: not written)."""
    if recast == "bf16":
        return _wo_a_tensor(plan, o.name, o.src, o.rows) if o.src.dtype == "F8_E4M3" else o
    if recast == "drop":
        return None if o.name[:-len("scale")] + "weight" in plan.sources else o
    if recast == "expert":
        return _expert_tensor(plan, o.name, o.src)
    return o


def _wo_a_tensor(plan: Plan, name: str, src: Src, rows: Tuple[int, int]) -> Out:
    scale = plan.sources.get(name[:-len("weight")] + "scale")
    if scale is None:
        raise ConvertError(f"{name} is FP8 but has no scale tensor")
    n, k = src.shape
    bn, bk = n // max(scale.shape[0], 1), k // max(scale.shape[1], 1)
    if (bn, bk) not in ((32, 32), (128, 128)) or scale.shape != (n // bn, k // bk):
        raise ConvertError(f"{name}: cannot infer the block size from weight {list(src.shape)} and scale "
                           f"{list(scale.shape)} (expected 32x32 or 128x128 blocks)")
    if (rows[1] - rows[0]) % bn:
        raise ConvertError(f"--model-parallel {plan.world} splits {name} inside a {bn}-row scale block")
    return Out(name, "BF16", [rows[1] - rows[0], k], "wo_a", src, rows=rows, aux=scale)


def _expert_tensor(plan: Plan, name: str, src: Src) -> Out:
    shape = list(src.shape)
    full = (0, shape[0]) if shape else (0, 1)
    is_scale = name.endswith(".scale")
    weight = plan.sources.get(name[:-len("scale")] + "weight") if is_scale else src
    if weight is None or weight.dtype != "I8":  # not MXFP4: copied as is
        return Out(name, src.dtype, shape, "copy", src, rows=full)
    n, k = weight.shape[0], weight.shape[1] * 2
    if plan.expert_dtype == "fp4":
        if is_scale:
            return Out(name, src.dtype, shape, "copy", src, rows=full)
        return Out(name, "F4", [n, k], "copy", src, rows=full)  # same bytes, viewed as float4_e2m1fn_x2
    if n % 32 or k % 32:
        raise ConvertError(f"{name}: FP8 recast needs dimensions divisible by 32, got [{n}, {k}]")
    if is_scale:
        return Out(name, "F8_E8M0", [n // 32, k // 32], "fp8_scale", src)
    scale = plan.sources.get(name[:-len("weight")] + "scale")
    if scale is None or scale.shape != (n, k // 32):
        raise ConvertError(f"{name}: FP4 weight [{n}, {k}] needs a scale of shape [{n}, {k // 32}]")
    return Out(name, "F8_E4M3", [n, k], "fp8_weight", src, aux=scale)


# ----------------------------------------------------------------------------------------------------------
# Producers: the bytes of one output tensor, in chunks of bounded size

class Reader:
    """Positional reads from the source shards (file descriptors shared by all threads)."""

    def __init__(self, hf_dir: str, files: List[str]):
        self.fds = {f: os.open(os.path.join(hf_dir, f), os.O_RDONLY) for f in files}

    def read(self, src: Src, start: int, length: int) -> np.ndarray:
        buf = np.empty(length, dtype=np.uint8)
        view, pos = memoryview(buf), src.offset + start
        while view:
            n = os.preadv(self.fds[src.file], [view], pos)
            if n == 0:
                raise ConvertError(f"{src.file} ended early (truncated while converting?)")
            view, pos = view[n:], pos + n
        return buf

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _row_steps(total: int, row_bytes: int, budget: int, align: int) -> Iterator[Tuple[int, int]]:
    step = max(align, budget // max(row_bytes, 1) // align * align)
    for r0 in range(0, total, step):
        yield r0, min(total, r0 + step)


def produce(o: Out, reader: Reader, budget: int) -> Iterator:
    """The chunks of one output tensor, each within `budget` bytes of memory (kernel copies need none)."""
    src = o.src
    if o.op in ("copy", "engram"):
        rb = src.row_bytes()
        start, end = o.rows[0] * rb, o.rows[1] * rb
        for pos in range(start, end, COPY_PIECE):
            yield CopyRange(reader.fds[src.file], src.offset + pos, min(COPY_PIECE, end - pos))
    if o.op == "engram":
        # Padding rows: zero weights, scales of 1.0 (UE8M0 byte 127), so padded rows dequantize to 0.
        one = b"\x00" if o.name.endswith(".weight") else _ONE.get(src.dtype)
        if one is None:
            raise ConvertError(f"{o.name}: cannot pad a scale of dtype {src.dtype}")
        left = o.pad_rows * rb
        while left:
            n = min(left, max(len(one), budget // len(one) * len(one)))
            yield one * (n // len(one))
            left -= n
    elif o.op == "cols":
        rb, item = src.row_bytes(), src.nbytes // max(math.prod(src.shape), 1)
        c0, c1 = o.cols[0] * item * math.prod(src.shape[2:]), o.cols[1] * item * math.prod(src.shape[2:])
        for r0, r1 in _row_steps(src.shape[0], rb, budget // 2, 1):
            rows = reader.read(src, r0 * rb, (r1 - r0) * rb).reshape(r1 - r0, rb)
            yield np.ascontiguousarray(rows[:, c0:c1])
    elif o.op == "wo_a":
        yield from _dequant_wo_a(o, reader, budget)
    elif o.op == "fp8_scale":
        n, kb = src.shape
        e = reader.read(src, 0, src.nbytes).reshape(n // 32, 32, kb)
        yield np.maximum(e.max(axis=1).astype(np.int32) - MAX_OFFSET_BITS, 0).astype(np.uint8)
    elif o.op == "fp8_weight":
        yield from _recast_fp4_weight(o, reader, budget)
    elif o.op != "copy":
        raise AssertionError(o.op)


def _e4m3_values() -> np.ndarray:
    """fp32 value of every E4M3 byte (bias 7, subnormals m * 2^-9, 0x7F / 0xFF = NaN)."""
    b = np.arange(256)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))
    mag[(e == 15) & (m == 7)] = np.nan
    return (np.where(b & 0x80, -1.0, 1.0) * mag).astype(np.float32)


E4M3_VALUES = _e4m3_values()
# The value 1.0 in each dtype a scale may have (Engram padding).
_ONE = {"F8_E8M0": b"\x7f", "F8_E4M3": b"\x38", "F8_E5M2": b"\x3c", "BF16": b"\x80\x3f",
        "F16": np.float16(1).tobytes(), "F32": np.float32(1).tobytes(), "F64": np.float64(1).tobytes()}


def _ue8m0_values(b: np.ndarray) -> np.ndarray:
    v = np.ldexp(np.float32(1), b.astype(np.int32) - 127).astype(np.float32)
    v[b == 255] = np.nan
    return v


def _bf16_bits(v: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, round to nearest even (torch's rule; NaN -> 0x7FC0)."""
    bits = v.view(np.uint32)
    out = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    out[np.isnan(v)] = 0x7FC0
    return out


def _dequant_wo_a(o: Out, reader: Reader, budget: int) -> Iterator[np.ndarray]:
    """FP8 -> bf16: fp32(w) * fp32(block scale), rounded to bf16 (exact for E4M3 times a power of two)."""
    w, s = o.src, o.aux
    n, k = w.shape
    sn, sk = s.shape
    bn, bk = n // sn, k // sk
    for r0, r1 in _row_steps(o.rows[1] - o.rows[0], k, budget // 12, bn):
        r0, r1 = r0 + o.rows[0], r1 + o.rows[0]
        q = E4M3_VALUES[reader.read(w, r0 * k, (r1 - r0) * k)].reshape((r1 - r0) // bn, bn, sk, bk)
        sc = _ue8m0_values(reader.read(s, (r0 // bn) * sk, (r1 - r0) // bn * sk)).reshape(-1, 1, sk, 1)
        yield _bf16_bits((q * sc).reshape(-1))


def _encode_e4m3(x: np.ndarray) -> np.ndarray:
    """E4M3 bytes of exact values within ±448: the nearest E4M3 value, ties to the even mantissa (RNE)."""
    x = np.asarray(x, dtype=np.float64)
    codes = np.arange(128)[~np.isnan(E4M3_VALUES[:128])]
    dist = np.abs(np.abs(x)[..., None] - E4M3_VALUES[codes].astype(np.float64))
    nearest = dist == dist.min(-1, keepdims=True)
    best = codes[np.where(nearest, codes % 2, 2).argmin(-1)].astype(np.uint8)  # even byte = even mantissa
    return np.where(np.signbit(x), best | 0x80, best).astype(np.uint8)


_RECAST_TABLE = None


def _recast_table() -> np.ndarray:
    """[offset - MIN_OFFSET, packed byte] -> the two E4M3 bytes (as '<u2', even column first) of
    e4m3(E2M1(code) * 2^offset) for both nibbles. Offsets below MIN_OFFSET give zeros as well (signed)."""
    global _RECAST_TABLE
    if _RECAST_TABLE is None:
        offsets = np.arange(MIN_OFFSET, MAX_OFFSET_BITS + 1)
        # The E2M1 code 0x8 (-0) becomes +0 (byte 0x00), as the official converter writes it: equal values,
        # and the bytes too. A negative value that underflows keeps its sign (0x80), as a float cast does.
        values = np.array(E2M1_VALUES)
        values[8] = 0.0
        per_code = _encode_e4m3(values[None, :] * np.exp2(offsets)[:, None])
        b = np.arange(256)
        _RECAST_TABLE = (per_code[:, b & 0xF].astype("<u2") | (per_code[:, b >> 4].astype("<u2") << 8))
    return _RECAST_TABLE


def _recast_fp4_weight(o: Out, reader: Reader, budget: int) -> Iterator[np.ndarray]:
    """MXFP4 -> FP8 (docs/checkpoint.md §3.5): each row's E2M1 values times its power-of-two offset s/S,
    where the block scale S is the largest row scale of the 32x32 block over 2^6, rounded to E4M3 (by
    table)."""
    w, s = o.src, o.aux
    n, half = w.shape
    kb = s.shape[1]
    table = _recast_table()
    for r0, r1 in _row_steps(n, half, budget // 16, 32):
        rows = r1 - r0
        packed = reader.read(w, r0 * half, rows * half).reshape(rows, kb, 16)
        e = reader.read(s, r0 * kb, rows * kb).reshape(rows // 32, 32, kb).astype(np.int32)
        block = np.maximum(e.max(axis=1) - MAX_OFFSET_BITS, 0)
        offset = np.maximum(e - block[:, None, :], MIN_OFFSET).reshape(rows, kb) - MIN_OFFSET
        yield table[offset[:, :, None], packed].reshape(-1)


# ----------------------------------------------------------------------------------------------------------
# Writing, resuming

def _fingerprint(plan: Plan) -> str:
    h = hashlib.sha256()
    for f in plan.files:
        st = os.stat(os.path.join(plan.hf_dir, f))
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(f"W={plan.world};experts={plan.expert_dtype}".encode())
    return h.hexdigest()


class Manifest:
    """`.convert-mp{W}.json`: source fingerprint and the ranks finished from it, each with its size, header
    hash and the CHECKSUM of every tensor (safetensors_io.manifest_path describes the entries)."""

    def __init__(self, save_path: str, plan: Plan):
        self.path = manifest_path(save_path, plan.world)
        self.fingerprint = _fingerprint(plan)
        self.lock = threading.Lock()
        self.ranks: Dict[str, dict] = {}
        try:
            with open(self.path) as f:
                data = json.load(f)
            if data.get("source") == self.fingerprint:
                self.ranks = data.get("ranks", {})
        except (OSError, ValueError):
            pass

    def is_done(self, plan: Plan, save_path: str, rank: int) -> bool:
        path = os.path.join(save_path, plan.rank_file(rank))
        header, size = plan.header(rank), plan.rank_bytes(rank)
        entry = self.ranks.get(str(rank))
        if not isinstance(entry, dict) or (entry.get("size"), entry.get("header_sha256")) != \
                (size, hashlib.sha256(header).hexdigest()):
            return False
        try:
            if os.path.getsize(path) != size:
                return False
            with open(path, "rb") as f:
                return f.read(len(header)) == header
        except OSError:
            return False

    def checksums(self, rank: int) -> Optional[Dict[str, str]]:
        """The tensor checksums recorded for a finished rank (None: finished before they were recorded)."""
        return self.ranks[str(rank)].get(CHECKSUM_KEY)

    def mark_done(self, plan: Plan, rank: int, digests: Dict[str, str]) -> None:
        with self.lock:
            self.ranks[str(rank)] = {"size": plan.rank_bytes(rank),
                                     "header_sha256": hashlib.sha256(plan.header(rank)).hexdigest(),
                                     CHECKSUM_KEY: digests}
            self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"source": self.fingerprint, "ranks": self.ranks}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _byte_bar(total: int, desc: str, progress: Optional[bool]):
    """A progress bar over bytes (progress None: shown on a terminal) and a thread-safe advance(n) for it."""
    from tqdm import tqdm
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
               disable=(not progress) if progress is not None else None, smoothing=0.1)
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            bar.update(n)

    return bar, advance


def _verify_done(plan: Plan, save_path: str, manifest: Optional[Manifest], ranks: List[int], workers: int,
                 progress: Optional[bool], log: Callable[[str], None]) -> List[int]:
    """Hash the data of the finished files a rerun would skip (a progress bar over their bytes). -> the ranks
    whose data no longer matches the checksums recorded as it was written: each is named in the log, and
    rewritten, since the manifest shows the file is this conversion's and the source is at hand."""
    ranks = [r for r in ranks if manifest.checksums(r) is not None]
    if not ranks:
        return []
    bar, advance = _byte_bar(sum(plan.rank_bytes(r) - len(plan.header(r)) for r in ranks),
                             f"verify mp{plan.world}", progress)
    damaged = []
    try:
        for r in ranks:
            path = os.path.join(save_path, plan.rank_file(r))
            name = find_damaged(path, manifest.checksums(r), workers, advance)
            if name is not None:
                log(f"rank {r}: tensor {name} in {path} does not match the {CHECKSUM} recorded when it was "
                    f"written (damaged on disk): rewriting the file")
                damaged.append(r)
    except SafetensorsError as e:
        raise ConvertError(str(e)) from None
    finally:
        bar.close()
    return damaged


def verify(ckpt_dir: str, workers: Optional[int] = None, progress: Optional[bool] = None,
           log: Callable[[str], None] = print) -> int:
    """Check every converted file in ckpt_dir (of each world size there) against the checksums recorded
    when it was written, with a progress bar. Raises ConvertError naming the first damaged tensor and its
    file (or why nothing can be checked). -> the number of tensors checked."""
    if not os.path.isdir(ckpt_dir):
        raise ConvertError(f"checkpoint directory not found: {ckpt_dir}")
    found: Dict[int, set] = {}
    for f in os.listdir(ckpt_dir):
        m = re.fullmatch(r"model(\d+)-mp(\d+)\.safetensors", f)
        if m:
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if not found:
        raise ConvertError(f"no model{{rank}}-mp{{W}}.safetensors files in {ckpt_dir}")
    workers = max(1, workers or os.cpu_count() or 1)
    try:
        jobs = []
        for world in sorted(found):
            missing = [r for r in range(world) if r not in found[world]]
            if missing:
                raise ConvertError(f"{os.path.join(ckpt_dir, f'model{missing[0]}-mp{world}.safetensors')} is "
                                   f"missing (an interrupted conversion? rerun convert.py)")
            ranks = read_manifest(ckpt_dir, world)
            jobs += [(world, r, ranks) for r in range(world)]
        paths = [os.path.join(ckpt_dir, f"model{r}-mp{w}.safetensors") for w, r, _ in jobs]
        total = sum(os.path.getsize(p) for p in paths)
        data = sum(i.nbytes for p in paths for i in read_header(p)[0].values())
        bar, advance = _byte_bar(data, f"verify {ckpt_dir}", progress)
        n = 0
        try:
            for world, r, ranks in jobs:
                n += check_recorded(ckpt_dir, world, r, ranks, workers, advance)
        finally:
            bar.close()
    except SafetensorsError as e:
        raise ConvertError(str(e)) from None
    except OSError as e:
        raise ConvertError(f"{e.filename or ckpt_dir}: cannot read: {e.strerror or e}") from None
    log(f"verified {ckpt_dir}: {len(jobs)} file(s), {n} tensors, {_fmt(total)}: every tensor matches the "
        f"{CHECKSUM} recorded when it was written")
    return n


def _write_rank(plan: Plan, rank: int, save_path: str, reader: Reader, budget: int,
                progress: Callable[[int], None], pool: Optional[ThreadPoolExecutor]) -> StreamWriter:
    """Write every tensor of one rank; returns the writer, still to be closed (fsync + rename)."""
    w = StreamWriter(os.path.join(save_path, plan.rank_file(rank)),
                     [(o.name, o.dtype, o.shape) for o in plan.ranks[rank]], checksums=True)
    # Source order keeps the reads sequential; positional writes make the output order irrelevant.
    outs = sorted(plan.ranks[rank], key=lambda o: (o.src.file, o.src.offset))

    def one(o: Out) -> None:
        w.write_tensor(o.name, _counted(produce(o, reader, budget), progress))

    futures = []
    try:
        progress(len(w.header))
        if pool is None:
            for o in outs:
                one(o)
        else:
            futures = [pool.submit(one, o) for o in outs]
            for f in futures:
                f.result()
        return w
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)  # no thread may still write to the file when it is removed
        w.abort()
        raise


def _counted(chunks, progress):
    for c in chunks:
        yield c
        progress(c.length if isinstance(c, CopyRange) else memoryview(c).nbytes)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", str(text).lower())
    if not m:
        raise ConvertError(f"cannot parse byte size {text!r} (examples: 2GB, 512MiB, 1e9)")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " kmgt".index(m.group(2) or " "))


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def _prepare_output(save_path: str) -> None:
    try:
        os.makedirs(save_path, exist_ok=True)
    except FileExistsError:
        raise ConvertError(f"--save-path {save_path} exists and is not a directory") from None
    except OSError as e:
        raise ConvertError(f"cannot create output directory {save_path}: {e.strerror or e}") from None
    probe = os.path.join(save_path, f".convert-write-test-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise ConvertError(f"output directory {save_path} is not writable: {e.strerror or e}") from None


def _copy_tokenizer(src_dir: str, save_path: str, log) -> None:
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            dst = os.path.join(save_path, name)
            if os.path.abspath(src) != os.path.abspath(dst):
                shutil.copyfile(src, dst + ".partial")
                os.replace(dst + ".partial", dst)
            copied.append(name)
    if copied:
        log(f"copied {', '.join(copied)} from {src_dir}")
    else:
        log(f"warning: no tokenizer files in {src_dir}; generate.py needs tokenizer.json in {save_path}")


def convert(hf_ckpt_path: str, save_path: str, model_parallel: int, expert_dtype: Optional[str] = None,
            tokenizer_path: Optional[str] = None, max_buffer: int = 2 * 10 ** 9, dry_run: bool = False,
            force: bool = False, workers: Optional[int] = None, progress: Optional[bool] = None,
            log: Callable[[str], None] = print) -> Plan:
    """Convert (or, with dry_run, only plan) a checkpoint. Raises ConvertError on bad input."""
    plan = make_plan(hf_ckpt_path, model_parallel, expert_dtype)
    world = plan.world
    log(f"source {hf_ckpt_path}: {len(plan.files)} shard(s), {plan.n_read} tensors")
    log(f"routed experts: backbone {plan.experts[0]}, DSpark {plan.experts[1]} "
        f"({plan.experts[0] // world} / {plan.experts[1] // world} per rank at model parallel {world})")
    workers = max(1, workers or os.cpu_count() or 1)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sizes = [plan.rank_bytes(r) for r in range(world)]

    # Resume: a rank file recorded in the manifest for this source and these options, with the expected
    # size and header, is finished once its data matches the checksums recorded; one that does not is ours
    # and is rewritten. Any other existing rank file is not ours to overwrite without --force.
    manifest = Manifest(save_path, plan) if os.path.isdir(save_path) else None
    done, clash = [], []
    for r in range(world):
        path = os.path.join(save_path, plan.rank_file(r))
        if manifest and not force and manifest.is_done(plan, save_path, r):
            done.append(r)
        elif os.path.exists(path) and not force:
            clash.append(r)
    damaged = [] if dry_run else _verify_done(plan, save_path, manifest, done, workers, progress, log)
    done = [r for r in done if r not in damaged]
    unverified = [r for r in done if manifest.checksums(r) is None]
    todo = [r for r in range(world) if r not in done]

    def state(r: int) -> str:
        if r in unverified:
            return f"done before {CHECKSUM}s were recorded: not verified, will skip"
        if r in done:
            return "done, will verify and skip" if dry_run else "done and verified, will skip"
        if r in damaged:
            return "damaged, will rewrite"
        return "exists, needs --force" if r in clash else "to write"

    for r in range(world):
        log(f"rank {r}: {plan.rank_file(r)}  {len(plan.ranks[r])} tensors  {_fmt(sizes[r])}  ({state(r)})")
    log(f"total {_fmt(sum(sizes))} in {world} file(s); {workers} worker(s); peak memory at most about "
        f"{_fmt(baseline + max_buffer)} (process {_fmt(baseline)} + buffer {_fmt(max_buffer)})")
    if dry_run:
        return plan
    if clash:
        path = os.path.join(save_path, plan.rank_file(clash[0]))
        raise ConvertError(f"{path} exists and is not a finished conversion of this source with these "
                           f"options; pass --force to overwrite")
    if unverified:
        log(f"note: {len(unverified)} file(s) were converted before {CHECKSUM}s were recorded and cannot be "
            f"verified (--force rewrites them with checksums)")
    if not todo:
        log(f"all {world} rank file(s) already converted in {save_path}; nothing to do (--force rewrites)")
        _copy_tokenizer(tokenizer_path or hf_ckpt_path, save_path, log)
        return plan

    _prepare_output(save_path)
    manifest = Manifest(save_path, plan)
    if force:
        manifest.ranks = {}
    manifest.save()
    need = sum(sizes[r] for r in todo)
    free = shutil.disk_usage(save_path).free
    if need > free:
        log(f"warning: {_fmt(need)} to write but only {_fmt(free)} free in {save_path}")

    bar, advance = _byte_bar(need, f"convert mp{world}", progress)
    reader = Reader(hf_ckpt_path, plan.files)
    budget = max(max_buffer // workers, 1 << 20)  # per tensor in flight
    pool = ThreadPoolExecutor(workers) if workers > 1 else None
    closer, closing = ThreadPoolExecutor(1), []

    def finish(writer: StreamWriter, r: int) -> None:
        try:
            writer.close()
        except BaseException:
            writer.abort()
            raise
        manifest.mark_done(plan, r, writer.digests())

    try:
        # One rank at a time, so that an interruption loses at most the ranks in flight; the fsync of a
        # finished rank overlaps the writing of the next one.
        for r in todo:
            writer = _write_rank(plan, r, save_path, reader, budget, advance, pool)
            closing.append(closer.submit(finish, writer, r))
            if len(closing) > 2:
                closing.pop(0).result()
        for f in closing:
            f.result()
    except SafetensorsError as e:
        raise ConvertError(str(e)) from None
    except OSError as e:  # e.g. the disk filled up
        raise ConvertError(f"writing to {save_path} failed: {e}") from None
    finally:
        wait(closing)
        closer.shutdown()
        if pool is not None:
            pool.shutdown()
        reader.close()
        bar.close()
    _copy_tokenizer(tokenizer_path or hf_ckpt_path, save_path, log)
    log(f"wrote {len(todo)} file(s) to {save_path}" + (f" (skipped {len(done)} finished)" if done else ""))
    if plan.expert_dtype == "fp8":
        log('experts are FP8 now: set "expert_dtype": null in the inference config.json')
    return plan


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Convert the DeepSeek-V4.1-Flash HF checkpoint into "
                                             "model{rank}-mp{W}.safetensors files for W-way model "
                                             "parallelism.")
    ap.add_argument("--hf-ckpt-path", help="HF checkpoint directory (*.safetensors + index)")
    ap.add_argument("--save-path", help="output directory (created)")
    ap.add_argument("--model-parallel", type=int, help="W, the number of output files (ranks)")
    ap.add_argument("--expert-dtype", choices=["fp4", "fp8"], default=None,
                    help="routed experts: fp4 (default) keeps MXFP4; fp8 recasts them losslessly to FP8 "
                         '(then set "expert_dtype": null in the inference config)')
    ap.add_argument("--tokenizer-path", default=None,
                    help="where to copy tokenizer.json / tokenizer_config.json from "
                         "(default: the HF directory)")
    ap.add_argument("--max-buffer", default="2GB",
                    help="memory for tensor data in flight, e.g. 2GB, 512MiB (default 2GB)")
    ap.add_argument("--workers", type=int, default=None,
                    help="threads converting tensors in parallel (default: CPU count)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (tensors, bytes, memory) and exit")
    ap.add_argument("--force", action="store_true", help="overwrite existing output files")
    ap.add_argument("--verify", metavar="CKPT", default=None,
                    help="instead of converting: check every converted file in CKPT against the "
                         f"{CHECKSUM}s recorded when it was written; names the first damaged tensor (exit 1)")
    a = ap.parse_args(argv)
    if a.verify is not None:
        try:
            verify(a.verify, workers=a.workers)
        except ConvertError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    missing = [flag for flag, v in (("--hf-ckpt-path", a.hf_ckpt_path), ("--save-path", a.save_path),
                                    ("--model-parallel", a.model_parallel)) if v is None]
    if missing:
        ap.error(f"the following arguments are required: {', '.join(missing)} (or --verify CKPT)")
    try:
        convert(a.hf_ckpt_path, a.save_path, a.model_parallel, expert_dtype=a.expert_dtype,
                tokenizer_path=a.tokenizer_path, max_buffer=parse_bytes(a.max_buffer), dry_run=a.dry_run,
                force=a.force, workers=a.workers)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
