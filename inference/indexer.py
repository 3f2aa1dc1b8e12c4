"""Indexer: scores compressed positions per query and keeps the top-k (docs/architecture.md §6.6-6.7)."""
from typing import Optional, Tuple

import torch
import torch.nn as nn

from .config import ModelArgs
from .kv_cache import register_cache
from .layers import ColumnParallelLinear, Linear, RMSNorm
from .rope import apply_rotary_
from .state import ForwardCall, Handoff, Kind, ModelContext, PublishedKeys


def topk_indices(x: torch.Tensor, k: int, deterministic: bool, sorted: bool = True) -> torch.Tensor:
    """Indices of the k largest values; `deterministic` keeps the lowest index among exact ties and returns
    them in the order of a stable descending sort (of a NaN-free x) without sorting the whole row."""
    if not deterministic:
        return x.topk(k, dim=-1, sorted=sorted).indices
    t = x.shape[-1]
    kth = x.topk(k, dim=-1).values[..., -1:]                          # [..., 1] the k-th largest value
    # One int32 key per entry, distinct where it matters: t above the k-th value (fewer than k entries),
    # t - 1 - index at it (the lowest index first), -1 below it. Its top k is the set a stable sort keeps.
    key = torch.arange(t - 1, -1, -1, dtype=torch.int32, device=x.device).expand(x.shape).clone()
    key.masked_fill_(x > kth, t).masked_fill_(x < kth, -1)
    pos = key.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values   # [..., k] ascending
    order = torch.sort(x.gather(-1, pos), dim=-1, descending=True, stable=True).indices
    return pos.gather(-1, order)


def select_candidate_blocks(score: torch.Tensor, compress_lens: torch.Tensor, n_blocks: int, block: int,
                            deterministic: bool = False) -> torch.Tensor:
    """Level 1: keep the n_blocks best blocks of `block` positions (block score = max), always keeping the
    block of the newest visible position. score [B, S, T] -> bool mask [B, S, T]."""
    b, s, t = score.shape
    nb = -(-t // block)
    padded = torch.nn.functional.pad(score, (0, nb * block - t), value=float("-inf"))
    bscore = padded.unflatten(-1, (nb, block)).amax(-1)             # [B, S, nb]
    newest = (compress_lens.unsqueeze(-1) - 1) // block              # [S, 1], or [B, S, 1] per row
    forced = torch.arange(nb, device=score.device) == newest
    bscore = bscore.masked_fill(forced, float("inf"))
    k = min(n_blocks, nb)
    top = topk_indices(bscore, k, deterministic)
    keep = bscore.gather(-1, top) > float("-inf")                    # drop unreachable blocks
    mask = torch.zeros_like(bscore, dtype=torch.bool).scatter_(-1, top, keep)
    return mask.repeat_interleave(block, dim=-1)[..., :t]


class Indexer(nn.Module):
    def __init__(self, layer_id: int, ctx: ModelContext, published: Optional[PublishedKeys] = None):
        """`published`: the model's published index keys (what this layer scores against; an index-key
        owner publishes its own cache there)."""
        super().__init__()
        args: ModelArgs = ctx.args
        self.ctx, self.nx, self.layer_id = ctx, ctx.numerics, layer_id
        self.ratio = args.compress_ratios[layer_id]
        self.n_heads, self.head_dim, self.rope_dim = (args.index_n_heads, args.index_head_dim,
                                                      args.rope_head_dim)
        self.n_local_heads = args.index_n_heads // ctx.par.world_size
        self.topk = args.index_topk
        self.published = published if published is not None else PublishedKeys()
        self.owns_keys = layer_id in args.kv_source_layers
        self.is_candidate_source = layer_id == args.candidate_source_layer
        self.uses_candidates = 0 <= args.candidate_source_layer < layer_id
        self.wq_b = ColumnParallelLinear(args.q_lora_rank, args.index_n_heads * args.index_head_dim,
                                         args.dtype, ctx)
        self.weights_proj = ColumnParallelLinear(args.dim, args.index_n_heads, "bf16", ctx)
        # Global head count, even under TP: 1/sqrt(head_dim) * 1/sqrt(n_heads) (= 1/64 released, exact).
        self.weight_scale = args.index_head_dim ** -0.5 * args.index_n_heads ** -0.5
        if self.owns_keys:
            self.wk = Linear(args.head_dim, args.index_head_dim, "bf16", ctx)
            self.k_norm = RMSNorm(args.index_head_dim, args.norm_eps, ctx)
            register_cache(self, "k_cache", (args.max_batch_size, args.max_seq_len // self.ratio,
                                             args.index_head_dim), "fp4_ue8m0", ctx)

    def publish(self, call: ForwardCall, b: int, complete: Optional[torch.Tensor] = None) -> None:
        """This layer's keys published: for every row (a call of the official batch layout, first_row None),
        or for the call's rows of the caches only (rows a scheduler named), of them those whose group
        `complete` [b] does when given."""
        if call.first_row is None and complete is None:
            self.published.publish(self.k_cache)
        else:
            self.published.publish(self.k_cache, call.batch_rows(b), complete)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, latent: Optional[torch.Tensor], call: ForwardCall,
                handoff: Handoff) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """-> (the selection [B, S, k] int32 compressed rows, ascending, -1 = none; the candidate source's
        blocks [B, S, T] bool, None in the other layers)."""
        b, s, _ = x.shape
        nx, plan, opts = self.nx, call.ratios[self.ratio], self.ctx.opts
        freqs = self.ctx.compress_freqs
        batch = call.batch_rows(b)
        if self.owns_keys and latent is not None:
            k = self.k_norm(self.wk(latent))                         # [B, n, ihd]
            apply_rotary_(k[..., -self.rope_dim:], freqs[plan.rope_pos], nx)
            nx.fp4_qdq_e8m0_(k)                                      # the cache's rounding
            self.k_cache[call.compressed_key(self.ratio, b)] = k
            self.publish(call, b, None if call.policy.publish else plan.complete)
        elif self.owns_keys and call.policy.publish:
            self.publish(call, b)                  # a prefill chunk publishes what the whole prefill would
        q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.head_dim))   # [B, S, H_l, ihd]
        apply_rotary_(q[..., -self.rope_dim:], call.rope(freqs), nx)
        nx.fp4_qdq_e8m0_(q)
        t = plan.keys
        keys = self.published.keys(batch, t)                         # [B, T, ihd]
        w = self.weights_proj(x) * self.weight_scale                 # [B, S, H_l] bf16
        # [S] groups visible to each query (all t rows at a decode step's int position; a graph's step masks
        # its bucket's rows past its own); [B, 1] for rows at their own positions
        lens = plan.visible
        score = nx.index_scores(q, keys, w, self.ctx.par, None if call.per_row else lens)   # [B, S, T] bf16
        stale = handoff.published_at_start
        if (call.kind == Kind.VERIFY and self.owns_keys and not call.policy.publish and stale is not None
                and self.ratio > 1):
            # Verification in reference numerics: a row whose group is still incomplete would, decoded alone,
            # not have published its keys and would score against the stale published cache
            # (docs/numerics.md §14.1).
            stale_score = nx.index_scores(q, stale[:b, :t], w, self.ctx.par, lens)
            incomplete = (call.positions + 1) % self.ratio != 0
            score = torch.where(incomplete.view(1, -1, 1), stale_score, score)
        score = score.masked_fill(torch.arange(t, device=x.device) >= lens.unsqueeze(-1), float("-inf"))
        candidates = None
        if self.is_candidate_source:
            a = self.ctx.args
            candidates = select_candidate_blocks(score, lens, a.candidate_topk_blocks, a.candidate_block_size,
                                                 opts.deterministic_topk)
        elif self.uses_candidates:
            score = score.masked_fill(~handoff.candidates, float("-inf"))
        top = topk_indices(score, min(self.topk, t), opts.deterministic_topk, sorted=False)
        top = top.sort(dim=-1).values
        top = torch.where(top < lens.unsqueeze(-1), top, -1)
        return top.to(torch.int32), candidates                       # [B, S, k]
