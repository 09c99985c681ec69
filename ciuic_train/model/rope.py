"""Rotary position embeddings: the cos/sin tables (plain or YaRN-scaled) and their rotation."""

from __future__ import annotations

import torch

from ciuic_train.model.config import ModelConfig
from ciuic_train.model.yarn import yarn_ramp, yarn_rope_magnitude


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None, cfg: ModelConfig | None = None):
    """cos/sin of shape [max_seq_len, head_dim // 2], one angle per rotated pair.

    Plain RoPE, unless `cfg` is given with rope_scaling yarn: then YaRN's frequencies
    (`yarn_frequencies`), and both tables scaled by its magnitude (`yarn_rope_magnitude`).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)  # [d/2]
    yarn = cfg is not None and cfg.rope_scaling == "yarn"
    if yarn:
        inv_freq = yarn_frequencies(inv_freq, head_dim, theta, cfg)
    angles = torch.outer(torch.arange(max_seq_len, device=device).float(), inv_freq)
    if not yarn:
        return angles.cos(), angles.sin()
    magnitude = yarn_rope_magnitude(cfg)
    return angles.cos() * magnitude, angles.sin() * magnitude


def yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, cfg: ModelConfig) -> torch.Tensor:
    """YaRN's rotation speeds: slow pairs interpolated (divided by `rope_factor`), fast pairs
    kept, and between the ends of `yarn_ramp` the two speeds mixed linearly in the pair index."""
    low, high = yarn_ramp(head_dim, theta, cfg)
    pair = torch.arange(head_dim // 2, device=inv_freq.device, dtype=torch.float32)
    interpolate = ((pair - low) / (high - low)).clamp(0, 1)  # [d/2]: 0 keeps a pair's speed, 1 slows it
    return inv_freq / cfg.rope_factor * interpolate + inv_freq * (1 - interpolate)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x[..., T, d] by position, pairing adjacent channels (2i, 2i+1).

    Interleaved pairs are the convention of DeepSeek's released inference code, so weights
    from their checkpoints load without permuting the rope channels. Each pair (a, b) is
    the complex number a + ib, turned by multiplying with cos + i sin.
    """
    # contiguous: a complex view needs even offsets and strides, which slices at odd widths lack.
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))  # [..., T, d/2]
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).type_as(x)
