"""YaRN's scalar math: the attention temperature (mscale) and the ramp of rotation speeds.

No torch here: `ciuic_train/checkpoint/hf_config.py` writes and checks the mscale pair of a
config.json while the CLI composes a config, where torch must not load. The tensors
YaRN changes, the rope tables, are built in `rope.py` from these numbers.
"""

from __future__ import annotations

import math

from ciuic_train.model.config import ModelConfig


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature sqrt(1/t) = 0.1 ln(factor) + 1, with DeepSeek's weight on the log."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_rope_magnitude(cfg: ModelConfig) -> float:
    """What YaRN multiplies the rotated channels (cos and sin) by.

    The paper scales q and k, here only their rope parts, by yarn_mscale(factor). DeepSeek
    moved that scaling to the softmax scale, where it reaches every channel
    (`yarn_softmax_correction`), and left here only the ratio of the two weights: 1 in
    their configs, where rope_mscale equals rope_mscale_all_dim. (Where one weight is 0,
    transformers takes yarn_mscale(factor) instead of the ratio; DeepSeek's code takes the ratio.)
    """
    factor = cfg.rope_factor
    return yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)


def yarn_softmax_correction(cfg: ModelConfig) -> float:
    """The factor on the attention softmax scale: yarn_mscale(factor, mscale_all_dim)^2 under yarn, else 1."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    return yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


def yarn_ramp(head_dim: int, theta: float, cfg: ModelConfig) -> tuple[float, float]:
    """The pair indices (low, high) between which YaRN's rotation speeds ramp (`rope.yarn_frequencies`).

    Pair i turns original_max_seq_len * inv_freq[i] / 2pi times over the pre-training
    length. A pair that turns many times (more than beta_fast) has seen every angle in
    pre-training and keeps its speed; one that turns few times (fewer than beta_slow) would
    meet unseen angles at longer positions, so it is slowed by `factor` (interpolated).
    Solving for the index at which a pair turns r times gives
    head_dim * ln(L / (2pi r)) / (2 ln theta); the ramp's ends are those indices rounded
    outwards and clamped to [0, head_dim - 1] (head_dim, not head_dim / 2: the bound of
    DeepSeek's and transformers' code, kept for the same tables).
    """

    def index_turning(rotations: float) -> float:
        # The index i whose speed theta^(-2i/d) is rotations * 2pi / L radians per position.
        log_inverse_speed = math.log(cfg.rope_original_max_seq_len / (rotations * 2 * math.pi))
        return head_dim * log_inverse_speed / (2 * math.log(theta))

    low = max(math.floor(index_turning(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(index_turning(cfg.rope_beta_slow)), head_dim - 1)
    if high == low:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    return low, high
