"""The lm head and cross-entropy in chunks of tokens, gradients taken in forward."""

from __future__ import annotations

import torch

from ciuic_train.model.common import IGNORE_INDEX, compute_dtype
from ciuic_train.model.kernels.softmax import softmax_fp32

# Most bytes of fp32 logits per chunk on CPU: so many tokens' logits exist at once, and
# none are kept for backward. 4 MiB (256 tokens at vocab 4096) measured fastest at
# model=bench: the chunk's logits stay in cache while the softmax walks them.
LOSS_CHUNK_BYTES = 4 * 2**20
# On a GPU each chunk re-reads the whole head weight, so a chunk of a few tokens (4 MiB is
# 8 at DeepSeek-V3's vocabulary) leaves the matmul starved for data; from about a
# thousand tokens it is compute-bound. Up to 256 MiB of logits, at least 1024 tokens
# (V3: 1024 tokens, 0.5 GB of logits): reasoned from the H200's FLOPs per byte, not yet
# measured on one.
GPU_LOSS_CHUNK_BYTES = 256 * 2**20
GPU_LOSS_CHUNK_MIN_TOKENS = 1024


def loss_chunk_tokens(vocab_size: int, device_type: str = "cpu") -> int:
    """Tokens per loss chunk on `device_type`: as many as keep its fp32 logits within
    `LOSS_CHUNK_BYTES` on CPU; within `GPU_LOSS_CHUNK_BYTES`, but no fewer than
    `GPU_LOSS_CHUNK_MIN_TOKENS`, elsewhere."""
    if device_type == "cpu":
        return max(1, LOSS_CHUNK_BYTES // (4 * vocab_size))
    return max(GPU_LOSS_CHUNK_MIN_TOKENS, GPU_LOSS_CHUNK_BYTES // (4 * vocab_size))


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """`model.transformer.lm_cross_entropy` without ever building the whole logits tensor."""
    total = LinearCrossEntropy.apply(h, weight, targets, loss_chunk_tokens(len(weight), h.device.type))
    return total / (targets != IGNORE_INDEX).sum() if reduction == "mean" else total


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `h @ weight.T` against targets, its gradients taken in forward.

    The loss is a scalar, so its gradients with respect to h and the weight are known as
    soon as the forward has seen a chunk: softmax minus one-hot, times the other operand.
    Taking them there, chunk by chunk, means no logits or log-probabilities are kept for
    backward (they are the largest activation of a step at large vocabularies) and the
    probabilities are walked once, by one softmax. Backward only scales the gradients by
    the incoming one, which is exact for any function of the loss. Matmuls run in
    autocast's dtype, the softmax in fp32, and the weight's gradient accumulates in fp32.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        dtype = compute_dtype(h)
        weight_c = weight.to(dtype)
        with_grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if with_grads else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grads else None
        # Ignored targets point at row 0 for the gathers, and their losses and gradients are
        # zeroed by `kept`. Done for every batch, not only one with ignored targets: asking
        # whether there are any would wait for the device, and make what runs depend on
        # values (a simulation on fake tensors has none). Zeroing costs O(tokens x dim).
        ignored = targets == IGNORE_INDEX
        targets = targets.masked_fill(ignored, 0)
        kept = (~ignored).to(dtype).unsqueeze(-1)  # [N, 1]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        # One logits buffer serves every chunk: a fresh one per chunk would be handed back
        # to the OS and faulted in again each time.
        vocab = len(weight)
        logits_buffer = torch.empty(vocab * min(chunk, len(h)), dtype=torch.float32, device=h.device)
        for start in range(0, len(h), chunk):
            h_c, t_c = h[start : start + chunk].to(dtype), targets[start : start + chunk]
            cols = torch.arange(len(t_c), device=h.device)
            # Logits transposed, [vocab, chunk]: weight @ h^T runs faster than h @ weight^T on
            # CPU, and the gradient matmuls take them as they lie.
            logits = logits_buffer[: vocab * len(t_c)].view(vocab, len(t_c))
            if dtype == torch.float32:
                torch.mm(weight_c, h_c.T, out=logits)
            else:
                logits.copy_(weight_c @ h_c.T)
            # -log softmax at the target is logsumexp - target logit, and
            # logsumexp = max logit - log(max probability): that probability is at least
            # 1/vocab, so unlike the target's it cannot underflow.
            losses = logits.amax(dim=0) - logits[t_c, cols]
            probs = softmax_fp32(logits, dim=0)
            losses -= probs.amax(dim=0).log()
            losses.masked_fill_(ignored[start : start + chunk], 0)
            total += losses.sum()
            if not with_grads:
                continue
            probs[t_c, cols] -= 1
            grad_logits = probs.to(dtype)
            # An ignored token's column of grad_logits meets only its own row of h and of
            # grad_h: zeroing those rows drops its gradient, without touching the logits.
            kept_c = kept[start : start + chunk]
            grad_h[start : start + chunk] = (grad_logits.T @ weight_c).mul_(kept_c)
            h_kept = h_c * kept_c
            if dtype == torch.float32:
                grad_weight.addmm_(grad_logits, h_kept)
            else:
                grad_weight += grad_logits @ h_kept
        if with_grads:
            ctx.save_for_backward(grad_h, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_weight = ctx.saved_tensors
        return grad_h * grad_loss, grad_weight * grad_loss, None, None
