"""Teacher-forced scoring along the official generate loop (the interface for numeric parity checks), and
block capture: every forward's Engram hashes, index selections and block outputs, for locating where two
runs part (`inference.tools.parity compare-blocks`)."""
import json
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from .batch import prompt_buffer
from .checkpoint import save_atomically
from .errors import InputError
from .generation import Stats, _timed, next_ids_of
from .prefill import prefill
from .prompts import check_prompt_lengths


@torch.inference_mode()
def score(model, seqs: List[List[int]], prefill_len: int, all_prefill_logits: bool = False,
          stats: Optional[Stats] = None, dspark: bool = False, token_types: Optional[List[List[int]]] = None,
          images: Optional[list] = None, prefill_chunk: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Teacher-forced logits along the official generate loop: forward 0 runs [0, P) (in calls of at most
    `prefill_chunk` positions; None: one call), forward k the single position P+k-1. logits[k, b] is NaN once
    row b has no token at that position.

    images / token_types (as generate()): per row, its [ImageInput] and token types (TEXT = -1 for rows
    without images); they go to the prefill only, so every image span must end within [0, P).

    dspark: after every forward, DSpark's draft with the next teacher token (the forward's own sampled
    token where the row has none) and that forward's main_hidden, at its start_pos
    (tests/fixtures/reference-tiny/README.md §5): forward 0 seeds the rings; forward k gives dspark_*[k-1]
    (NaN / -1 where logits[k, b] is NaN)."""
    stats = stats if stats is not None else Stats()
    device = next(model.parameters()).device
    bsz, lens = len(seqs), [len(s) for s in seqs]
    total = max(lens)
    check_prompt_lengths(lens, model.args.max_seq_len)
    vision = {}
    try:
        ids, types = prompt_buffer(seqs, total, "cpu", token_types if images and any(images) else None)
    except ValueError as e:
        raise InputError(str(e)) from None
    if types is not None:
        if (types[:, prefill_len:] >= 0).any():
            raise InputError("image spans must fit in the prefill chunk [0, prefill_len)")
        vision = {"images": images, "token_types": types[:, :prefill_len].to(device)}
    # Rows that already ended are fed their last token (any valid id would do).
    fed = ids.clone()
    for b, n in enumerate(lens):
        fed[b, n:] = ids[b, n - 1]
    fed = fed.to(device)
    valid = torch.tensor([[p < n for n in lens] for p in range(prefill_len - 1, total)])   # [steps, B]

    lens_t = torch.tensor(lens, device=device)
    drafts = []

    def draft(next_ids: torch.Tensor, hidden: torch.Tensor, pos: int, start_pos: int) -> None:
        if not dspark:
            return
        nxt = fed[:, min(pos + 1, total - 1)]
        nxt = torch.where(pos + 1 < lens_t, nxt, next_ids)
        res = model.mtp.draft(nxt, hidden, start_pos)
        if res is not None:
            drafts.append([t.cpu() for t in res])

    seed = model.mtp.seed if dspark else None                           # the draft head's rings, per chunk
    next_ids, logits, hidden = _timed(stats, "prefill", bsz * prefill_len, device, prefill, model,
                                      fed[:, :prefill_len], vision.get("token_types"), vision.get("images"),
                                      all_logits=all_prefill_logits, chunk=prefill_chunk, on_chunk=seed)
    out = {}
    if all_prefill_logits:
        out["prefill_logits"] = logits.float().cpu().contiguous()
        logits = logits[:, -1]
    steps = [logits.float().cpu()]
    def decode(ids: torch.Tensor, pos: int):
        logits, hidden = model.decode(ids, pos)
        return next_ids_of(model, logits), logits, hidden

    for pos in range(prefill_len, total):
        next_ids, logits, hidden = _timed(stats, "decode", bsz, device, decode, fed[:, pos:pos + 1], pos)
        steps.append(logits.float().cpu())
        draft(next_ids, hidden, pos, pos)
    step_logits = torch.stack(steps)                                    # [L - P + 1, B, V]
    step_logits[~valid] = float("nan")
    out["logits"] = step_logits.contiguous()
    out["input_ids"] = ids
    if dspark and drafts:
        gone = ~valid[1:]                                               # [L - P, B]
        draft_ids, draft_logits, confidence = (torch.stack(t) for t in zip(*drafts))
        draft_ids[gone] = -1
        draft_logits[gone] = float("nan")
        confidence[gone] = float("nan")
        out["dspark_draft_ids"] = draft_ids.contiguous()                # [L - P, B, blk + 1]
        out["dspark_logits"] = draft_logits.float().contiguous()        # [L - P, B, blk, V]
        out["dspark_confidence"] = confidence.float().contiguous()      # [L - P, B, blk]
    return out


# ---------------------------------------------------------------------------------------------------------
# Block capture along the scoring protocol
# ---------------------------------------------------------------------------------------------------------

class BlockCapture:
    """While its `with` block runs, records every call of the model (a step: prefill or decode) through
    forward hooks on the model's own modules: the Engram hashes (the hasher), each Engram layer's output,
    each block's output streams and FFN-site pre mix, the index sources' selections and the candidate blocks
    (what each block hands on), the final norm. Rank 0 records (every rank holds the same streams); the
    tensors go to the CPU as they come."""

    def __init__(self, model):
        self.model = model
        self.steps: List[Dict[str, torch.Tensor]] = []
        self.handles = []
        self.pending: Dict[str, torch.Tensor] = {}      # a call's ids and hashes, until its first block

    def __enter__(self) -> "BlockCapture":
        m = self.model
        if m.ctx.par.rank != 0:
            return self
        hook = lambda module, fn: self.handles.append(module.register_forward_hook(fn))   # noqa: E731
        # (the embedding also runs for DSpark's drafts: a step begins at the first block)
        hook(m.embed, lambda mod, inp, out: self.pending.update(input_ids=inp[0].to("cpu", copy=True)))
        if m.engram_hasher is not None:
            hook(m.engram_hasher, lambda mod, inp, out: self.pending.update(engram_hashes=out.to("cpu",
                                                                                                copy=True)))

        for i, layer in enumerate(m.layers):
            if layer.engram is not None:
                hook(layer.engram, lambda mod, inp, out: self._add("engram_out", out))
            hook(layer, lambda mod, inp, out, i=i: self._block(i, inp[1], out))
        hook(m.norm, lambda mod, inp, out: self._put("final_norm", out))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _step(self) -> Dict[str, torch.Tensor]:
        """The current step: a new one when a call's ids are pending (its first layer is running)."""
        if self.pending:
            self.steps.append(self.pending)
            self.pending = {}
        return self.steps[-1]

    def _put(self, name: str, t: torch.Tensor) -> None:
        t = t.to(torch.uint8) if t.dtype == torch.bool else t         # U8 masks, as in the fixture
        self._step()[name] = t.to("cpu", copy=True).contiguous()

    def _add(self, name: str, t: torch.Tensor) -> None:
        self._step().setdefault(name, []).append(t.to("cpu", copy=True))

    def _block(self, i: int, call, out) -> None:
        x, pre, handoff = out
        a = self.model.args
        if i == 0:
            self._put("start_pos", torch.tensor([call.start]))
        self._add("block_out", x)
        self._add("block_pre_mix", pre)
        if i in a.index_source_layers:
            self._put(f"indexer_idxs.layer{i}", call.offset_rows(handoff.topk))
        if i == a.candidate_source_layer and handoff.candidates is not None:
            self._put("candidates", handoff.candidates)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """{stepKK.name: tensor}, the per-layer lists stacked on a new dim 0."""
        out = {}
        for k, step in enumerate(self.steps):
            for name, t in step.items():
                out[f"step{k:02d}.{name}"] = torch.stack(t).contiguous() if isinstance(t, list) else t
        return out

    def metadata(self) -> Dict[str, str]:
        a, opts = self.model.args, self.model.ctx.opts
        numerics = ("golden" if opts.golden else "fixed" if opts.fix_index_k_publish
                    else "fast" if opts.order == "fast" else "reference")
        return {"format": "parity-capture", "steps": str(len(self.steps)), "numerics": numerics,
                "world_size": str(self.model.ctx.par.world_size), "n_layers": str(a.n_layers),
                "engram_layer_ids": json.dumps(list(a.engram_layer_ids)),
                "candidate_source_layer": str(a.candidate_source_layer)}


def score_with_capture(model, seqs: List[List[int]], prefill_len: int, capture_path: str,
                       score_fn: Optional[Callable] = None, **score_kw) -> Dict[str, torch.Tensor]:
    """Run the scoring protocol of score() (forward 0 = prefill [0, P) at start_pos 0, forward k =
    position P+k-1) and write every forward's block capture to `capture_path` (safetensors, rank 0, atomic).
    Returns what score() returns, the --dump-logits tensors. score_fn defaults to score(); score_kw
    are its other arguments (all_prefill_logits, stats, ...)."""
    score_fn = score if score_fn is None else score_fn
    with BlockCapture(model) as recorder:
        out = score_fn(model, seqs, prefill_len, **score_kw)
    if model.ctx.par.rank == 0:
        save_atomically(recorder.tensors(), capture_path,
                        dict(recorder.metadata(), prefill_len=str(prefill_len)))
    return out


@dataclass(frozen=True)
class ScoreJob:
    """What to score (generate.py --score: prompts.read_score_file): the sequences, the prefill length P,
    and per row its token types and images (None without images)."""
    seqs: List[List[int]]
    prefill_len: int
    token_types: Optional[List[List[int]]] = None
    images: Optional[list] = None


@dataclass(frozen=True)
class ScoreOutputs:
    """What a scoring run writes: the logits dump (`dump`), and optionally every block's capture, every
    prefill position's logits, the DSpark draft head's answers."""
    dump: str
    capture: Optional[str] = None
    all_prefill_logits: bool = False
    dspark: bool = False


def score_to_file(model, job: ScoreJob, out: ScoreOutputs, metadata: Dict[str, str],
                  stats: Optional[Stats] = None,
                  prefill_chunk: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """score() (with block capture when out.capture is given), the dump written by rank 0, atomically."""
    kw = dict(all_prefill_logits=out.all_prefill_logits, stats=stats, dspark=out.dspark,
              token_types=job.token_types, images=job.images, prefill_chunk=prefill_chunk)
    if out.capture:
        tensors = score_with_capture(model, job.seqs, job.prefill_len, out.capture, **kw)
    else:
        tensors = score(model, job.seqs, job.prefill_len, **kw)
    if model.ctx.par.rank == 0:
        save_atomically(tensors, out.dump, dict(metadata, prefill_len=str(job.prefill_len),
                                                world_size=str(model.ctx.par.world_size)))
    return tensors

