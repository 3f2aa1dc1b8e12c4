"""Sparse attention with an attention sink: the reference semantics of the official kernel (numerics §11)."""
import torch

CHUNK = 64  # the kernel walks each index list in blocks of 64 entries


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                q_block: int = 64) -> torch.Tensor:
    """q [B, M, H, D] bf16, kv [B, N, D] bf16 (K = V), sink [H] fp32, idx [B, M, T] int32 (-1 = none).

    Online softmax over 64-entry chunks in list order; probabilities are rounded to V's dtype, bf16 (relative
    to the running max), before P.V; the sink logit enters only the denominator. Returns [B, M, H, D] bf16.
    With fp32 q and kv (golden numerics) nothing is rounded and the output is fp32.
    """
    b, m, h, d = q.shape
    out = torch.empty_like(q)
    for m0 in range(0, m, q_block):  # bound the gathered KV memory
        out[:, m0:m0 + q_block] = _attend(q[:, m0:m0 + q_block], kv, sink, idx[:, m0:m0 + q_block], scale)
    return out


def _dot_in_order(qf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Scores q.k [B, M, H, C]: the exact bf16 products summed in fp32 one at a time, in d order. That order
    reproduces the reference's near-tie bf16 roundings of p; a blocked GEMM (einsum) flips some of them
    (layer-isolated block_pre_mix max diff 4.3e-4 instead of 1.2e-4 at layer 4, 1.4e-4 vs 2.3e-5 at 0)."""
    s = torch.zeros(*qf.shape[:-1], rows.shape[-2], dtype=torch.float32, device=qf.device)
    for k in range(qf.shape[-1]):
        s += qf[..., k:k + 1] * rows[..., k].unsqueeze(-2)
    return s


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
        s = _dot_in_order(qf, rows) * scale                         # [B, M, H, C] fp32
        s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
        new_mx = torch.maximum(mx, s.amax(-1))
        alpha = torch.exp(mx - new_mx)
        p = torch.exp(s - new_mx.unsqueeze(-1))
        den = den * alpha + p.sum(-1)
        pv = torch.einsum("bmhc,bmcd->bmhd", p.to(kv.dtype).float(), rows)      # the kernel's P cast
        acc = acc * alpha.unsqueeze(-1) + pv
        mx = new_mx
    den = den + torch.exp(sink.float().view(1, 1, h) - mx)
    return (acc / den.unsqueeze(-1)).to(q.dtype)
