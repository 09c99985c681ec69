"""Causal attention: spelled out in query blocks on CPU, fused SDPA with padded heads elsewhere.

Both take the documents of `data.doc_mask` (`docs` [B, T], `model/documents.py`): the
blocked version adds their mask to each block's scores and skips the keys before the
block's earliest document start, the fused one takes the mask as `attn_mask`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ciuic_train.model.common import compute_dtype
from ciuic_train.model.documents import document_causal_mask, document_first_positions
from ciuic_train.model.kernels.softmax import softmax_fp32

# Queries per block of `blocked_attention`; 64 measured fastest at model=bench.
BLOCK_ROWS = 64


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, docs: torch.Tensor | None = None
) -> torch.Tensor:
    """`model.attention.causal_attention` by the faster route of each device.

    On CPU the blocked version beats the fused kernel in fp32 and bf16 alike: the fused
    CPU kernel scores the masked half of the matrix too.
    """
    if q.device.type == "cpu":
        return blocked_attention(q, k, v, scale, docs=docs)
    return padded_sdpa(q, k, v, scale, docs)


def padded_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, docs: torch.Tensor | None = None
) -> torch.Tensor:
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
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[..., :v_dim]
    mask = document_causal_mask(docs)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[..., :v_dim]


def blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_rows: int = BLOCK_ROWS,
    docs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention spelled out, `block_rows` queries at a time (see `BlockedCausalAttention`).

    Under autocast the matmuls run in autocast's dtype around an fp32 softmax, autocast's
    usual numerics for attention.
    """
    batch, heads = q.shape[:2]
    dtype = compute_dtype(q)
    q, k, v = (t.to(dtype).flatten(0, 1).contiguous() for t in (q, k, v))
    with torch.autocast(q.device.type, enabled=False):
        out = BlockedCausalAttention.apply(q, k, v, scale, block_rows, docs, heads)
    return out.unflatten(0, (batch, heads))


def block_document_masks(docs: torch.Tensor, size: int, dtype: torch.dtype) -> list[tuple[int, torch.Tensor]]:
    """For each query block of `BlockedCausalAttention`: the first key any of its queries
    may see (the earliest document start among the block's first rows) and the additive
    mask [B, rows, keys] from there to the block's end (0 or -inf: causal and same
    document), broadcast over the heads."""
    seq = docs.shape[1]
    first = document_first_positions(docs)  # [B, T]
    blocks = []
    for start in range(0, seq, size):
        end = min(start + size, seq)
        low = int(first[:, start].min())
        rows, keys = docs[:, start:end, None], docs[:, None, low:end]
        allowed = (rows == keys) & (
            torch.arange(start, end, device=docs.device)[:, None] >= torch.arange(low, end, device=docs.device)
        )
        mask = torch.zeros(allowed.shape, dtype=dtype, device=docs.device).masked_fill_(~allowed, float("-inf"))
        blocks.append((low, mask))
    return blocks


class BlockedCausalAttention(torch.autograd.Function):
    """softmax(q k^T * scale, causal) v for q, k [N, S, d_qk] and v [N, S, d_v], by query blocks.

    Block i scores only the keys up to its own last query, so the fully masked part of the
    score matrix (3/8 of it for four blocks) is never computed. The backward is written
    out so that each block's gradients add straight into whole q, k, v gradients, instead
    of autograd's zero-filled copy per slice and a sum over blocks. It keeps what autograd
    would: the inputs and each block's fp32 probabilities.

    With `docs` (and the `heads` each of its rows stands for in q's first dim) a block
    scores the keys from its earliest document start only, under `block_document_masks`:
    with documents shorter than the window most of the matrix is never computed either.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, size: int,
                docs: torch.Tensor | None = None, heads: int = 1) -> torch.Tensor:
        seq = q.shape[1]
        out, probs, lows = [], [], []
        empty = q.new_empty(())
        if docs is not None:
            blocks = block_document_masks(docs, size, q.dtype)
        else:
            # Row r of a block is query start + r, which may see keys 0 .. start + r: only the
            # block's diagonal square of keys start .. end needs a mask, the same for every
            # block (a short last block takes its top-left corner).
            mask = torch.full((size, size), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        for i, start in enumerate(range(0, seq, size)):
            end = min(start + size, seq)
            low = blocks[i][0] if docs is not None else 0
            scores = torch.baddbmm(empty, q[:, start:end], k[:, low:end].transpose(1, 2), beta=0, alpha=scale)
            if docs is not None:
                scores.unflatten(0, (-1, heads)).add_(blocks[i][1][:, None])
            else:
                scores[:, :, start:].add_(mask[: end - start, : end - start])
            p = softmax_fp32(scores, dim=-1)
            out.append(torch.bmm(p.to(v.dtype), v[:, low:end]))
            probs.append(p)
            lows.append(low)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.scale, ctx.size, ctx.lows = scale, size, lows
        return torch.cat(out, dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, *probs = ctx.saved_tensors
        scale, size = ctx.scale, ctx.size
        grad_q, grad_k, grad_v = [], None, None
        # Last block first: without documents it spans every key, so its products are whole
        # grad_k and grad_v, and the earlier, shorter blocks add into their keys' rows.
        for i in reversed(range(len(probs))):
            start, low, p = i * size, ctx.lows[i], probs[i]
            end = start + p.shape[1]
            d_out, p_low = grad_out[:, start:end], p.to(v.dtype)
            # The score gradients overwrite the probability gradients' buffer.
            d_probs = torch.bmm(d_out, v[:, low:end].transpose(1, 2)).to(p.dtype)
            d_scores = torch.ops.aten._softmax_backward_data.out(d_probs, p, -1, p.dtype, grad_input=d_probs)
            d_scores = d_scores.to(q.dtype)
            grad_q.append(torch.bmm(d_scores, k[:, low:end]).mul_(scale))
            if grad_k is None and low == 0:
                grad_v = torch.bmm(p_low.transpose(1, 2), d_out)
                grad_k = torch.bmm(d_scores.transpose(1, 2), q[:, start:end]).mul_(scale)
                continue
            if grad_k is None:  # the last block starts past key 0: the keys before it have no gradient yet
                grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
            grad_v[:, low:end] += torch.bmm(p_low.transpose(1, 2), d_out)
            grad_k[:, low:end] += torch.bmm(d_scores.transpose(1, 2), q[:, start:end]).mul_(scale)
        return torch.cat(grad_q[::-1], dim=1), grad_k, grad_v, None, None, None, None
