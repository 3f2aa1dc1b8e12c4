"""Block: one backbone layer (attention site and MoE site, each inside a hyper-connection mix, and an
optional Engram). The DSpark stages reuse it."""
from typing import Optional

import torch
import torch.nn as nn

from .attention import Attention
from .engram import Engram
from .hyper import MixConfig, MixWeights, hc_mixes, hc_post, hc_pre
from .kernels import Derived
from .layers import RMSNorm
from .moe import MoE
from .state import ForwardCall, Handoff, ModelContext


def empty_param(shape, dtype=torch.float32):
    """A weight to be filled by the loader (inference only: no gradient)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Block(nn.Module):
    """One layer: attention site and FFN site, each wrapped by a hyper-connection mix.

    Delayed (single-pass) schedule: each site collapses its input with the *previous* site's `pre`
    and returns its own for the next one (docs/architecture.md §4.3)."""

    def __init__(self, layer_id: int, ctx: ModelContext, attn: Optional[nn.Module] = None):
        """`attn`: the layer's attention, made by the model (which knows the layer's sources), or a plain one
        for a block built alone."""
        super().__init__()
        a = ctx.args
        self.layer_id, self.ctx, self.nx = layer_id, ctx, ctx.numerics
        backbone = layer_id < a.n_layers
        self.attn_norm = RMSNorm(a.dim, a.norm_eps, ctx)
        self.attn = attn if attn is not None else Attention(layer_id, ctx)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps, ctx)
        if backbone:
            self.ffn = MoE(ctx, a.n_routed_experts, a.n_activated_experts, with_bias_vl=a.vision_n_layers > 0)
        else:  # DSpark stages: their own expert count and top-k; bias_vl is stored but drafts are text
            self.ffn = MoE(ctx, a.dspark_experts, a.dspark_topk, with_bias_vl=a.vision_n_layers > 0)
        n_mix, width = (2 + a.hc_mult) * a.hc_mult, a.hc_mult * a.dim
        # Checkpoint names hc_{attn,ffn}_{fn,base,scale}.
        self.hc_attn_fn, self.hc_attn_base = empty_param((n_mix, width)), empty_param((n_mix,))
        self.hc_attn_scale = empty_param((3,))
        self.hc_ffn_fn, self.hc_ffn_base = empty_param((n_mix, width)), empty_param((n_mix,))
        self.hc_ffn_scale = empty_param((3,))
        self.mix_cfg = MixConfig(a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)
        self.derived = Derived()     # what the numerics lay out from hc_attn_fn / hc_ffn_fn
        self.engram = None
        if backbone and layer_id in a.engram_layer_ids:
            self.engram = Engram(a.engram_layer_ids.index(layer_id), ctx)

    def mixes(self, x: torch.Tensor, w: MixWeights, call: ForwardCall):
        return call.per_position(lambda u: hc_mixes(u, w, self.mix_cfg, self.nx, self.derived), x)

    def forward(self, x: torch.Tensor, call: ForwardCall, pre_mix: torch.Tensor,
                image_mask: Optional[torch.Tensor] = None, handoff: Handoff = Handoff()):
        """x [B, S, hc, D] bf16, pre_mix [B, S, hc] fp32 -> (x', this block's FFN-site pre, the handoff for
        the blocks after it)."""
        nx, residual = self.nx, x
        pre_a, post_a, comb_a = self.mixes(x, MixWeights(self.hc_attn_fn, self.hc_attn_base,
                                                         self.hc_attn_scale), call)
        y, handoff = self.attn(self.attn_norm(hc_pre(x, pre_mix, nx)), call, handoff)     # [B, S, D]
        x = hc_post(y, residual, post_a, comb_a, nx)                                      # [B, S, hc, D]
        residual = x
        pre_f, post_f, comb_f = self.mixes(x, MixWeights(self.hc_ffn_fn, self.hc_ffn_base,
                                                         self.hc_ffn_scale), call)
        y = self.ffn(self.ffn_norm(hc_pre(x, pre_a, nx)), call, image_mask)
        x = hc_post(y, residual, post_f, comb_f, nx)
        return x, pre_f, handoff
