"""Sparse attention with an attention sink: the reference semantics of the official kernel (numerics §11)."""
import torch

CHUNK = 64  # the kernel walks each index list in blocks of 64 entries


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                q_block: int = 64) -> torch.Tensor:
    """q [B, M, H, D] bf16, kv [B, N, D] bf16 (K = V), sink [H] fp32, idx [B, M, T] int32 (-1 = none).

    Online softmax over 64-entry chunks in list order; probabilities are rounded to bf16 (relative to the
    running max) before P.V; the sink logit enters only the denominator. Returns [B, M, H, D] bf16.
    """
    b, m, h, d = q.shape
    out = torch.empty_like(q)
    for m0 in range(0, m, q_block):  # bound the gathered KV memory
        out[:, m0:m0 + q_block] = _attend(q[:, m0:m0 + q_block], kv, sink, idx[:, m0:m0 + q_block], scale)
    return out


def _attend(q, kv, sink, idx, scale):
    b, m, h, d = q.shape
    t = idx.shape[-1]
    mx = torch.full((b, m, h), -1e30, dtype=torch.float32, device=q.device)
    den = torch.zeros(b, m, h, dtype=torch.float32, device=q.device)
    acc = torch.zeros(b, m, h, d, dtype=torch.float32, device=q.device)
    qf = q.float()
    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    for c0 in range(0, t, CHUNK):
        ic = idx[:, :, c0:c0 + CHUNK].long()                        # [B, M, C]
        valid = ic >= 0
        rows = kv[batch, ic.clamp_min(0)].float()                   # [B, M, C, D]
        s = torch.einsum("bmhd,bmcd->bmhc", qf, rows) * scale       # [B, M, H, C] fp32
        s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
        new_mx = torch.maximum(mx, s.amax(-1))
        alpha = torch.exp(mx - new_mx)
        p = torch.exp(s - new_mx.unsqueeze(-1))
        den = den * alpha + p.sum(-1)
        pv = torch.einsum("bmhc,bmcd->bmhd", p.to(torch.bfloat16).float(), rows)
        acc = acc * alpha.unsqueeze(-1) + pv
        mx = new_mx
    den = den + torch.exp(sink.float().view(1, 1, h) - mx)
    return (acc / den.unsqueeze(-1)).to(torch.bfloat16)
