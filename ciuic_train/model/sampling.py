"""Sampling from a trained model, for a look at what it learnt."""

from __future__ import annotations

import torch

from ciuic_train.model.transformer import Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample max_new_tokens after prompt_ids [1, T]; returns prompt and sample, [1, T + new].

    No KV cache: each step re-runs the model on the last max_seq_len tokens, which is
    plenty for a look at what a small model learnt. top_k None or 0 keeps every token.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive")
    was_training = model.training
    model.eval()
    try:
        ids = prompt_ids
        for _ in range(max_new_tokens):
            logits = model(ids[:, -model.config.max_seq_len :])[:, -1, :].float() / temperature
            if top_k:
                kth_largest = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            next_id = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            ids = torch.cat([ids, next_id], dim=1)
    finally:
        model.train(was_training)
    return ids
