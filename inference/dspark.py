"""DSpark draft head (checkpoint `mtp.0..K`): window-only stages seeded with the main model's KV, a Markov
head that chains the drafts and a confidence head (docs/architecture.md §11.1-11.4)."""
from typing import Optional, Tuple

import torch
import torch.nn as nn

from .attention import Attention
from .hyper import hc_pre
from .layers import Linear, ParallelEmbedding, ParallelHead, RMSNorm
from .block import Block
from .sampling import sample
from .state import ForwardCall, Handoff, ModelContext


class DSparkAttention(Attention):
    """Window-only attention whose ring holds main-model KV; the draft block attends to the ring (slot
    order) and to all of its own rows (not causal inside the block)."""

    def write_main_kv(self, main_x: torch.Tensor, start_pos: int) -> None:
        b, m, _ = main_x.shape
        positions = torch.arange(start_pos, start_pos + m, device=main_x.device)
        kv = self.project_kv(self.wkv(main_x), self.freqs()[positions])         # [B, m, hd]
        keep = min(m, self.window)
        self.kv_cache[:b, positions[m - keep:] % self.window] = kv[:, m - keep:]

    def forward(self, x: torch.Tensor, call: ForwardCall, handoff: Handoff) -> Tuple[torch.Tensor, Handoff]:
        """x [B, blk, D]: the draft block at call.positions, right after the main model's positions (whose KV
        write_main_kv has put into the ring) -> (y [B, blk, D], the handoff, unchanged)."""
        b, blk, _ = x.shape
        rope = call.rope(self.freqs())
        q, _, kv = self.project(x, rope)
        kv_all = torch.cat([self.kv_cache[:b], kv], dim=1)                      # [B, W + blk, hd]
        n_ring = min(self.window, call.start)
        idx = torch.cat([torch.arange(n_ring), self.window + torch.arange(blk)]).to(torch.int32)
        idx = idx.to(x.device).expand(b, blk, -1)
        o = self.nx.sparse_attn(q, kv_all, self.attn_sink, idx, self.softmax_scale)    # [B, blk, H_l, hd]
        return self.output(o, rope), handoff


class MarkovHead(nn.Module):
    """Rank-r token-to-token bigram bias on the draft logits."""

    def __init__(self, ctx: ModelContext):
        super().__init__()
        a = ctx.args
        self.embed = ParallelEmbedding(a.vocab_size, a.dspark_markov_rank, ctx)
        self.head = ParallelHead(a.vocab_size, a.dspark_markov_rank, ctx)


class ConfidenceHead(nn.Module):
    def __init__(self, ctx: ModelContext):
        super().__init__()
        self.proj = Linear(ctx.args.dim + ctx.args.dspark_markov_rank, 1, "fp32", ctx)


class DSparkStage(Block):
    def __init__(self, stage: int, ctx: ModelContext):
        a = ctx.args
        layer_id = a.n_layers + stage
        super().__init__(layer_id, ctx, attn=DSparkAttention(layer_id, ctx))
        if stage == 0:
            self.main_proj = Linear(len(a.dspark_target_layer_ids) * a.dim, a.dim, a.dtype, ctx)
            self.main_norm = RMSNorm(a.dim, a.norm_eps, ctx)
        if stage == a.n_mtp_layers - 1:
            self.norm = RMSNorm(a.dim, a.norm_eps, ctx)
            self.markov_head = MarkovHead(ctx)
            self.confidence_head = ConfidenceHead(ctx)


class DSpark(nn.ModuleList):
    """The stages, stored as `mtp.{k}`. The token embedding and output head are the backbone's (shared,
    not registered here, so the checkpoint has no `mtp.*.embed/head`)."""

    def __init__(self, ctx: ModelContext, embed: ParallelEmbedding, head: ParallelHead):
        super().__init__([DSparkStage(k, ctx) for k in range(ctx.args.n_mtp_layers)])
        self.ctx = ctx
        self._shared = (embed, head)

    @torch.inference_mode()
    def draft(self, input_ids: torch.Tensor, main_hidden: torch.Tensor, start_pos: int,
                     temperature: Optional[float] = None):
        """input_ids [B] (the token at position start_pos + m), main_hidden [B, m, n_targets*D]; the drafts
        are sampled at `temperature` (None: the config's).

        start_pos = 0 only seeds the rings and returns None; otherwise returns
        (draft ids [B, blk+1], draft logits [B, blk, V] fp32 with the Markov bias, confidence [B, blk])."""
        a = self.ctx.args
        if start_pos == 0:
            return self.seed(main_hidden, 0)
        main_x = self.main_x(main_hidden)                                        # [B, m, D]
        embed, _ = self._shared
        b, blk = input_ids.shape[0], a.dspark_block_size
        ids = torch.full((b, blk), a.dspark_noise_token_id, dtype=torch.long, device=input_ids.device)
        ids[:, 0] = input_ids
        x = embed(ids).unsqueeze(2).repeat(1, 1, a.hc_mult, 1)                 # [B, blk, hc, D]
        pre = torch.zeros(b, blk, a.hc_mult, dtype=torch.float32, device=x.device)
        pre[..., 0] = 1
        for stage in self:                                   # the main rows' KV first, then the draft block
            stage.attn.write_main_kv(main_x, start_pos)
        call = ForwardCall.draft(start_pos + main_x.shape[1], blk, x.device)
        for stage in self:
            x, pre, _ = stage(x, call, pre)
        return self.forward_head(x, pre, input_ids, temperature)

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        first = self[0]
        return first.main_norm(first.main_proj(main_hidden))

    @torch.inference_mode()
    def seed(self, main_hidden: torch.Tensor, start_pos: int) -> None:
        """Write the main model's KV of positions start_pos.. (main_hidden [B, m, n_targets*D], one prefill
        call's) into every stage's ring, drafting nothing: a prompt prefilled in chunks seeds chunk by
        chunk."""
        main_x = self.main_x(main_hidden)                                        # [B, m, D]
        for stage in self:
            stage.attn.write_main_kv(main_x, start_pos)

    def forward_head(self, x: torch.Tensor, pre: torch.Tensor, input_ids: torch.Tensor,
                     temperature: Optional[float] = None):
        a = self.ctx.args
        temperature = a.temperature if temperature is None else temperature
        last = self[-1]
        _, head = self._shared
        hidden = hc_pre(x, pre, self.ctx.numerics)                              # [B, blk, D]
        logits = head(last.norm(hidden), all_positions=True)                    # [B, blk, V]
        b, blk = hidden.shape[:2]
        out = torch.zeros(b, blk + 1, dtype=torch.long, device=x.device)
        out[:, 0] = input_ids
        embs = []
        for i in range(blk):
            e = last.markov_head.embed(out[:, i])                                # [B, rank] bf16
            logits[:, i] += last.markov_head.head(e, all_positions=True)
            out[:, i + 1] = sample(logits[:, i], temperature, self.ctx.numerics)
            embs.append(e)
        feats = torch.cat([hidden, torch.stack(embs, dim=1)], dim=-1).float()    # [B, blk, D + rank]
        confidence = last.confidence_head.proj(feats).squeeze(-1)               # [B, blk]
        return out, logits, confidence
