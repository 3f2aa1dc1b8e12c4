"""Transformer: embedding, Engram hashing, the stack of Blocks, the head, the DSpark draft head and the vision
tower. Its calls: prefill (a prompt, or its next chunk), decode (one position per row) and verify
(speculative drafts), each returning the logits and what DSpark needs; rollback after a verification
(docs/architecture.md §3-5)."""
import gc
from contextlib import contextmanager
from typing import List, NamedTuple, Optional, Union

import torch
import torch.nn as nn

from .attention import Attention, KVSource
from .block import Block, empty_param
from .dspark import DSpark
from .config import ModelArgs, RuntimeOptions
from .engram import EngramHasher, build_compressed_token_map
from .hyper import hc_pre
from .kernels import drop_derived
from .layers import ParallelEmbedding, ParallelHead, RMSNorm
from .parallel import ParallelContext
from .state import DecodeStep, ForwardCall, Handoff, ModelContext, PublishedKeys
from .vision import Aligner, VisionTransformer, encode_image, image_span_embeddings


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the block (and back on after, if it was on)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, par: Optional[ParallelContext] = None,
                 opts: Optional[RuntimeOptions] = None, device: str = "cpu", tokenizer=None,
                 build_dspark: bool = True, language_model_only: bool = False, streamed: bool = False):
        """`opts` pick the numerics (made here, once: inference.kernels.numerics_for; e.g. tilelang on CPU
        is one line, early); `streamed`: the blocks' weights will stream from disk (engine/offload.py)."""
        super().__init__()
        par = par or ParallelContext.single()
        args.validate(par.world_size)
        self.args = args
        self.language_model_only = language_model_only and args.vision_n_layers > 0
        # The released model has some 64,000 modules: the collector's walks over them as they accumulate were
        # 40 % of its build time, and none of them is garbage.
        with torch.device(device), _collector_paused():
            self.ctx = ModelContext.build(args, par, opts or RuntimeOptions(), device=device,
                                          streamed=streamed)
            self.nx = self.ctx.numerics
            self.embed = ParallelEmbedding(args.vocab_size, args.dim, self.ctx)
            # the index keys published across calls (state of the model, as the caches are)
            self.published = PublishedKeys()
            self.layers = nn.ModuleList(self._blocks())
            self.norm = RMSNorm(args.dim, args.norm_eps, self.ctx)
            self.head = ParallelHead(args.vocab_size, args.dim, self.ctx)
            self.vision = self.aligner = None
            if args.vision_n_layers > 0 and not language_model_only:
                self.vision = VisionTransformer(args)
                self.aligner = Aligner(args)
                for name in ("image_start", "image_end", "image_newline"):
                    self.register_parameter(name, empty_param((args.dim,), torch.bfloat16))
            self.mtp = None
            if build_dspark and args.has_dspark:
                self.mtp = DSpark(self.ctx, self.embed, self.head)
        self.weight_stream = None          # the block streamer, when the weights stream from disk
        self.engram_hasher: Optional[EngramHasher] = None
        if tokenizer is not None and args.engram_layer_ids:
            self.set_tokenizer(tokenizer)

    def _blocks(self) -> List[Block]:
        """The backbone's blocks in order, each attention given when it is built the sources it reads: the
        last KV source at or before it (its compressed KV) and the published index keys."""
        blocks, source = [], None
        for i in range(self.args.n_layers):
            reads = source if self.args.compress_ratios[i] > 0 else None
            attn = Attention(i, self.ctx, reads, self.published)
            if attn.compressor is not None:
                source = KVSource(attn)
            blocks.append(Block(i, self.ctx, attn=attn))
        return blocks

    def set_tokenizer(self, tokenizer) -> None:
        """The Engram hashes need the compressed token map built from the tokenizer
        (docs/architecture.md §9.1)."""
        token_map, size = build_compressed_token_map(tokenizer, self.args.engram_compressed_vocab_size)
        self.engram_hasher = EngramHasher(self.args, token_map, size).to(self.ctx.device)

    def attach_stream(self, stream) -> None:
        """The block streamer (engine/offload.py) that feeds this model's blocks from disk."""
        self.weight_stream = stream

    def drop_derived(self) -> None:
        """Forget every layout the numerics derived from the weights (dequantised copies, invariant layouts):
        after the weights changed (loaded, streamed), or to give the memory back."""
        drop_derived(self)

    def reset(self) -> None:
        """Zero every cache and the shared state (interactive /clear). Hygiene only: results do not change."""
        for name, buf in self.named_buffers():
            if name.endswith("score_state"):
                buf.fill_(float("-inf"))
            elif buf.dtype in (torch.bfloat16, torch.float32, torch.uint8):     # uint8: packed caches
                buf.zero_()
        self.published.reset()
        if self.engram_hasher is not None:
            self.engram_hasher.reset()

    def rollback(self, keep_until: int) -> None:
        """After an extend call (speculative verification), forget every position > keep_until: restore the
        window rings and compressor tails. Caches beyond the committed length are never read before being
        rewritten, so they need nothing (docs/architecture.md §11.6)."""
        for layer in self.layers:
            layer.attn.rollback(keep_until)

    def merge_images(self, h: torch.Tensor, images, token_types, start_pos: int) -> None:
        """Overwrite each image span of h (the rows of positions start_pos...) with the aligner rows and the
        learned start/newline/end vectors. images: per batch row, a list of vision.ImageInput with `.start`
        set (docs/architecture.md §10.5); spans outside the call are left to their own chunk."""
        if self.vision is None:
            raise ValueError("this model was built without the vision tower (vision_n_layers = 0 or "
                             "--language-model-only): prompts with images are not supported")
        if token_types is None:
            raise ValueError("image spans need token_types")
        end = start_pos + h.shape[1]
        for b, row in enumerate(images):
            for img in row or []:
                if img.start + img.n_tokens <= start_pos or img.start >= end:
                    continue                                     # a span of another prefill chunk
                rows = encode_image(self.vision, self.aligner, img.patches.to(h.device),
                                    img.n_vit_h, img.n_vit_w)
                span = image_span_embeddings(rows, img.n_llm_h, img.n_llm_w, self.image_start,
                                             self.image_newline, self.image_end)
                first = img.start - start_pos                   # the span's first row in this chunk
                if first < 0 or first + span.shape[0] > h.shape[1]:
                    raise ValueError(f"image span at {img.start} (length {span.shape[0]}) does not fit the "
                                     f"prefill chunk of positions {start_pos}..{start_pos + h.shape[1] - 1}")
                h[b, first:first + span.shape[0]] = span

    def check_inputs(self, input_ids: torch.Tensor, start_pos: int, verify: bool = False,
                     first_row: Optional[int] = None) -> None:
        b, s = input_ids.shape
        a = self.args
        if b > a.max_batch_size:
            raise ValueError(f"batch of {b} exceeds max_batch_size={a.max_batch_size}")
        if first_row is not None and not 0 <= first_row <= a.max_batch_size - b:
            raise ValueError(f"batch rows {first_row}..{first_row + b - 1} are outside the caches' "
                             f"max_batch_size={a.max_batch_size} rows")
        if start_pos + s > a.max_seq_len:
            raise ValueError(f"positions up to {start_pos + s - 1} exceed max_seq_len={a.max_seq_len}")
        if verify and s > a.window_size:
            raise ValueError(f"a verification call (several positions at start_pos > 0, not a prefill) "
                             f"takes at most window_size={a.window_size} tokens")

    # ---- the model's calls ----

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, start: int = 0, images=None,
                token_types: Optional[torch.Tensor] = None, all_logits: bool = False,
                first_row: Optional[int] = None) -> "Output":
        """A prompt's positions [start, start + S) of input_ids [B, S]: its first call (start 0), or its next
        chunk, of any length, computing what one call over the whole prompt computes (the same bits in
        invariant numerics). Image spans (`images`, with `token_types`) may sit in any chunk, each inside
        one. `first_row`: the caches' batch row of input_ids' first row, the other rows keeping their state
        (a scheduler's batch); None: the rows are the batch, from row 0. -> Output: logits of the last
        position [B, V] (all of them [B, S, V] with all_logits)."""
        self.check_inputs(input_ids, start, first_row=first_row)
        call = ForwardCall.prefill(start, input_ids.shape[1], self.args, self.ctx.device, first_row)
        return self._run(input_ids, call, images, token_types, all_logits)

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, pos: Union[int, torch.Tensor, DecodeStep]) -> "Output":
        """One decode step of every row: input_ids [B, 1] at position `pos`, an int, or a DecodeStep (the
        position a device tensor: the step a CUDA graph captures and replays at every position of a length
        bucket, engine/cuda_graph.py); or each row at its own position: pos [B] int64 on the model's device
        (DecodeStep.rows: the caches' rows from its first_row on). -> Output: logits [B, V]."""
        if torch.is_tensor(pos):
            pos = DecodeStep.rows(pos)
        if isinstance(pos, DecodeStep):
            if pos.parity is None:                                 # positions per row: checked on the host
                self.check_inputs(input_ids, 0, first_row=pos.first_row)
                if pos.pos.shape[0] != input_ids.shape[0] or pos.length > self.args.max_seq_len:
                    raise ValueError(f"positions per row: {pos.pos.shape[0]} positions for "
                                     f"{input_ids.shape[0]} rows, a length of {pos.length} "
                                     f"(max_seq_len={self.args.max_seq_len})")
            call = ForwardCall.graph_step(pos, self.args, self.ctx.always_publish)
        else:
            self.check_inputs(input_ids, pos)
            call = ForwardCall.decode(pos, self.args, self.ctx.device, self.ctx.always_publish)
        return self._run(input_ids, call)

    @torch.inference_mode()
    def verify(self, input_ids: torch.Tensor, start: int, all_logits: bool = True) -> "Output":
        """Speculative drafts checked as decode steps: input_ids [B, S] at positions [start, start + S), S at
        most window_size, each row's logits equal to decoding it alone; rollback() then forgets the rows
        that were not accepted. -> Output: logits [B, S, V] (the last position's [B, V] without
        all_logits)."""
        self.check_inputs(input_ids, start, verify=True)
        call = ForwardCall.verify(start, input_ids.shape[1], self.args, self.ctx.device,
                                  self.nx.rows_independent, self.ctx.always_publish)
        return self._run(input_ids, call, all_logits=all_logits)

    def _run(self, input_ids: torch.Tensor, call: ForwardCall, images=None,
             token_types: Optional[torch.Tensor] = None, all_logits: bool = False) -> "Output":
        """The stack, the same for every kind of call: Engram hashing, embedding (image spans merged), the
        streams through the blocks, the final collapse, norm and head."""
        a = self.args
        b, s = input_ids.shape
        image_mask = token_types >= 0 if token_types is not None else None
        engram_mask = ~image_mask if image_mask is not None else None
        hashes = None
        if a.engram_layer_ids:
            if self.engram_hasher is None:
                raise RuntimeError("Engram layers need the tokenizer: build the model with tokenizer=...")
            at = call.positions if call.start is None else None       # a graph's step: a device position
            hashes = self.engram_hasher(input_ids, call.start or 0, engram_mask, at,
                                        call.batch_rows(b))                         # [B, S, n_e, cols]
        h = self.embed(input_ids)                                                   # [B, S, D]
        if images is not None and any(images):
            self.merge_images(h, images, token_types, call.start)
        x = h.unsqueeze(2).repeat(1, 1, a.hc_mult, 1)                               # [B, S, hc, D]
        pre = torch.zeros(b, s, a.hc_mult, dtype=torch.float32, device=h.device)
        pre[..., 0] = 1                                                              # one-hot on stream 0
        handoff = Handoff(published_at_start=self.published.cache)
        main_hiddens = []
        for i, layer in enumerate(self.layers):
            if layer.engram is not None:
                rows = hashes[:, :, a.engram_layer_ids.index(i)]
                x = call.per_position(layer.engram, x, rows, engram_mask)
            if i in a.dspark_target_layer_ids:
                main_hiddens.append(self.nx.mean(x, dim=2))                         # the block *input*
            x, pre, handoff = layer(x, call, pre, image_mask, handoff)
        x = self.norm(hc_pre(x, pre, self.nx))
        # Verification: per-position GEMVs, so every verified position's logits equal decoding it alone.
        logits = self.head(x, all_positions=all_logits, call=call)                  # [B, V] / [B, S, V]
        return Output(logits, torch.cat(main_hiddens, dim=-1) if main_hiddens else None)


class Output(NamedTuple):
    """What a call of the model gives back: fp32 logits, and the DSpark target layers' stream means
    main_hidden [B, S, n_targets * D] (None without target layers), what the draft head reads."""
    logits: torch.Tensor
    main_hidden: Optional[torch.Tensor]
