"""Where two runs part: the first forward and block at which two block captures differ (`python -m
inference.tools.parity compare-blocks`).

    python -m inference.tools.parity compare-blocks A_CAPS B_CAPS [--rtol 1e-3] [--pre-mix-atol 1e-4]

Block captures come from engine/scoring.py's score_with_capture() (generate.py --capture-blocks FILE) or are
the fixture's intermediates.safetensors; both use one naming, per forward k of the scoring protocol (the
forwards whose logits the dump holds): `stepKK.engram_hashes` [B, s, n_engram, cols], `stepKK.engram_out`
[n_engram, B, s, hc, D], `stepKK.indexer_idxs.layerL` [B, s, k] for each index source L (the selected
compressed rows, offset by the window rows), `stepKK.candidates` [B, s, T] U8, `stepKK.block_out` [n_layers,
B, s, hc, D], `stepKK.block_pre_mix` [n_layers, B, s, hc], `stepKK.final_norm` [B, s, D]; our captures add
`stepKK.input_ids` [B, s] and `stepKK.start_pos` [1]. Streams are compared by relative Frobenius error |A - B|
/ |B| (<= --rtol, tests/fixtures/reference-tiny/README.md §8.2), the collapse weights by max |Δ| (<=
--pre-mix-atol), ids, hashes, selections and candidate masks exactly. The checks run in execution order
(forward by forward; inside one: ids, hashes, then per block its Engram, its index selection, its candidate
mask, its output and collapse weights; last the final norm) and the first one that fails is named. Later
forwards inherit a divergence through the caches, so only the first locates it. Runs of two different
implementations also differ by rounding noise that compounds along the depth (ours against the fixture end to
end: 2e-5 after block 0, 1e-3 after block 1, 2e-2 after block 7), so across implementations look for a jump
above that floor, or raise --rtol; a bug shows up as a jump.
"""
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch


class CaptureError(ValueError):
    """A file that is not a readable block capture (reported as one line)."""


EXACT_KINDS = ("input_ids", "engram_hashes", "indexer_idxs", "candidates")


@dataclass
class BlockLayout:
    n_layers: int
    engram_layer_ids: List[int]
    candidate_source_layer: Optional[int]    # None: unknown, the mask is checked at the end of the forward


def _layout(metas: Sequence[Dict[str, str]], caps: Dict[str, torch.Tensor]) -> BlockLayout:
    """From our captures' metadata. The fixture's intermediates have none: Engram sits on the first layers."""
    for meta in metas:
        if meta.get("format") == "parity-capture":
            cand = int(meta["candidate_source_layer"])
            return BlockLayout(int(meta["n_layers"]), json.loads(meta["engram_layer_ids"]),
                               cand if cand >= 0 else None)
    n_engram = caps["step00.engram_out"].shape[0] if "step00.engram_out" in caps else 0
    return BlockLayout(caps["step00.block_out"].shape[0], list(range(n_engram)), None)


def _load_capture(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    from safetensors import safe_open
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        raise CaptureError(f"file not found: {path}")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        caps = load_file(path)
    except Exception as e:   # safetensors raises its own error types
        raise CaptureError(f"{path}: not a readable safetensors file ({e})") from None
    caps = {k: v for k, v in caps.items() if re.match(r"step\d+\.", k)}
    if "step00.block_out" not in caps:
        raise CaptureError(f"{path}: no step00.block_out (not a block capture)")
    return caps, meta


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    num, den = (a.double() - b.double()).norm().item(), b.double().norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _step_checks(k: int, ca, cb, lay: BlockLayout, rtol: float, pre_mix_atol: float):
    """[(block or None, kind, value, ok, message)] for forward k, in execution order."""
    pre = f"step{k:02d}."
    out = []

    def exact(name: str, block: Optional[int]) -> None:
        a, b = ca.get(pre + name), cb.get(pre + name)
        if a is None or b is None:
            return
        if a.shape != b.shape:
            out.append((block, name, 1.0, False, f"{name} shape {list(a.shape)} vs {list(b.shape)}"))
            return
        n_diff = int((a.long() != b.long()).sum())
        out.append((block, name, float(n_diff > 0), n_diff == 0,
                    f"{name} differs ({n_diff} of {a.numel()} entries)"))

    def close(name: str, index: Optional[int], block: Optional[int], tol: float, relative=True) -> None:
        a, b = ca.get(pre + name), cb.get(pre + name)
        if a is None or b is None or (index is not None and index >= min(a.shape[0], b.shape[0])):
            return
        if index is not None:
            a, b = a[index], b[index]
        if a.shape != b.shape:
            out.append((block, name, math.inf, False, f"{name} shape {list(a.shape)} vs {list(b.shape)}"))
            return
        value = _rel(a, b) if relative else (a.double() - b.double()).abs().max().item()
        what = "relative error" if relative else "max|Δ|"
        out.append((block, name, value, value <= tol, f"{name} {what} {value:.2e} > {tol:g}"))

    exact("input_ids", None)
    exact("engram_hashes", None)
    for layer in range(lay.n_layers):
        if layer in lay.engram_layer_ids:
            close("engram_out", lay.engram_layer_ids.index(layer), layer, rtol)
        exact(f"indexer_idxs.layer{layer}", layer)
        if layer == lay.candidate_source_layer:
            exact("candidates", layer)
        close("block_out", layer, layer, rtol)
        close("block_pre_mix", layer, layer, pre_mix_atol, relative=False)
    if lay.candidate_source_layer is None:
        exact("candidates", None)
    close("final_norm", None, None, rtol)
    return out


def run_compare_blocks(path_a: str, path_b: str, rtol: float = 1e-3, pre_mix_atol: float = 1e-4,
                       out=None) -> Optional[Tuple[int, Optional[int], str]]:
    """Prints one line per forward and the first divergence; returns it as (step, block or None, message),
    None when every check passes."""
    ca, meta_a = _load_capture(path_a)
    cb, meta_b = _load_capture(path_b)
    p = lambda *x: print(*x, file=out or sys.stdout)   # noqa: E731
    steps_a = {int(k[4:k.index(".")]) for k in ca}
    steps_b = {int(k[4:k.index(".")]) for k in cb}
    steps = sorted(steps_a & steps_b)
    lay = _layout([meta_a, meta_b], ca)
    p(f"A: {path_a} ({len(steps_a)} forwards, numerics {meta_a.get('numerics', 'not recorded')})")
    p(f"B: {path_b} ({len(steps_b)} forwards, numerics {meta_b.get('numerics', 'not recorded')})")
    if len(steps) < max(len(steps_a), len(steps_b)):
        p(f"comparing the {len(steps)} forwards captured in both")
    only = sorted({k.split(".", 1)[1] for k in ca} ^ {k.split(".", 1)[1] for k in cb})
    if only:
        p(f"in one file only, not compared: {', '.join(only)}")
    p(f"tolerances: streams relative Frobenius error <= {rtol:g}, block_pre_mix max|Δ| <= {pre_mix_atol:g}, "
      f"ids / hashes / selections / candidates exact")
    first = None
    for k in steps:
        worst: Dict[str, Tuple[float, Optional[int]]] = {}
        for block, name, value, ok, msg in _step_checks(k, ca, cb, lay, rtol, pre_mix_atol):
            kind = name.split(".")[0]                          # indexer_idxs.layerL -> indexer_idxs
            if kind not in worst or value > worst[kind][0]:
                worst[kind] = (value, block)
            if not ok and first is None:
                first = (k, block, msg)
        parts = []
        for kind, (value, block) in worst.items():
            shown = ("DIFFER" if value else "exact") if kind in EXACT_KINDS else f"{value:.2e}"
            parts.append(f"{kind} {shown}" + (f" (block {block})" if block is not None and value > 0 else ""))
        p(f"step {k:02d}: " + ", ".join(parts))
    if first is None:
        p("no divergence beyond tolerance")
    else:
        step, block, msg = first
        p(f"first divergence: step {step:02d}, {'model input' if block is None else f'block {block}'}: {msg}")
    return first
