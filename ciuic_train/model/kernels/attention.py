"""Causal attention: spelled out in query blocks on CPU, fused SDPA with padded heads elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ciuic_train.model.common import compute_dtype
from ciuic_train.model.kernels.softmax import softmax_fp32

# Queries per block of `blocked_attention`; 64 measured fastest at model=bench.
BLOCK_ROWS = 64


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`model.attention.causal_attention` by the faster route of each device.

    On CPU the blocked version beats the fused kernel in fp32 and bf16 alike: the fused
    CPU kernel scores the masked half of the matrix too.
    """
    if q.device.type == "cpu":
        return blocked_attention(q, k, v, scale)
    return padded_sdpa(q, k, v, scale)


def padded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Fused SDPA, which wants one head dim for q, k and v.

    MLA's unequal dims (48 vs 32 at model=bench) would send it to its unfused math path.
    Zero padding is exact: zero q/k columns add nothing to a score, zero v columns give
    zero output columns, cut off after.
    """
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim < qk_dim:
        v = F.pad(v, (0, qk_dim - v_dim))
    elif qk_dim < v_dim:
        q, k = F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[..., :v_dim]


def blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_rows: int = BLOCK_ROWS
) -> torch.Tensor:
    """Causal attention spelled out, `block_rows` queries at a time (see `BlockedCausalAttention`).

    Under autocast the matmuls run in autocast's dtype around an fp32 softmax, autocast's
    usual numerics for attention.
    """
    batch, heads = q.shape[:2]
    dtype = compute_dtype(q)
    q, k, v = (t.to(dtype).flatten(0, 1).contiguous() for t in (q, k, v))
    with torch.autocast(q.device.type, enabled=False):
        out = BlockedCausalAttention.apply(q, k, v, scale, block_rows)
    return out.unflatten(0, (batch, heads))


class BlockedCausalAttention(torch.autograd.Function):
    """softmax(q k^T * scale, causal) v for q, k [N, S, d_qk] and v [N, S, d_v], by query blocks.

    Block i scores only the keys up to its own last query, so the fully masked part of the
    score matrix (3/8 of it for four blocks) is never computed. The backward is written
    out so that each block's gradients add straight into whole q, k, v gradients, instead
    of autograd's zero-filled copy per slice and a sum over blocks. It keeps what autograd
    would: the inputs and each block's fp32 probabilities.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, size: int) -> torch.Tensor:
        seq = q.shape[1]
        out, probs = [], []
        empty = q.new_empty(())
        # Row r of a block is query start + r, which may see keys 0 .. start + r: only the
        # block's diagonal square of keys start .. end needs a mask, the same for every block
        # (a short last block takes its top-left corner).
        mask = torch.full((size, size), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        for start in range(0, seq, size):
            end = min(start + size, seq)
            scores = torch.baddbmm(empty, q[:, start:end], k[:, :end].transpose(1, 2), beta=0, alpha=scale)
            scores[:, :, start:].add_(mask[: end - start, : end - start])
            p = softmax_fp32(scores, dim=-1)
            out.append(torch.bmm(p.to(v.dtype), v[:, :end]))
            probs.append(p)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.scale, ctx.size = scale, size
        return torch.cat(out, dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, *probs = ctx.saved_tensors
        scale, size = ctx.scale, ctx.size
        grad_q, grad_k, grad_v = [], None, None
        # Last block first: it spans every key, so its products are whole grad_k and grad_v,
        # and the earlier, shorter blocks add into their prefixes.
        for i in reversed(range(len(probs))):
            start, p = i * size, probs[i]
            end = start + p.shape[1]
            d_out, p_low = grad_out[:, start:end], p.to(v.dtype)
            # The score gradients overwrite the probability gradients' buffer.
            d_probs = torch.bmm(d_out, v[:, :end].transpose(1, 2)).to(p.dtype)
            d_scores = torch.ops.aten._softmax_backward_data.out(d_probs, p, -1, p.dtype, grad_input=d_probs)
            d_scores = d_scores.to(q.dtype)
            grad_q.append(torch.bmm(d_scores, k[:, :end]).mul_(scale))
            if grad_k is None:
                grad_v = torch.bmm(p_low.transpose(1, 2), d_out)
                grad_k = torch.bmm(d_scores.transpose(1, 2), q[:, start:end]).mul_(scale)
            else:
                grad_v[:, :end] += torch.bmm(p_low.transpose(1, 2), d_out)
                grad_k[:, :end] += torch.bmm(d_scores.transpose(1, 2), q[:, start:end]).mul_(scale)
        return torch.cat(grad_q[::-1], dim=1), grad_k, grad_v, None, None
