"""The shape of a DeepSeek-style transformer, one flat dataclass.

It doubles as the Hydra structured-config schema for `conf/model/*.yaml`, which is why
it holds only plain scalar fields with defaults (the defaults are the `tiny` preset).
"""

from __future__ import annotations

from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")
ROPE_SCALINGS = ("none", "yarn")
KERNEL_CHOICES = ("auto", "reference")
# Fields that choose how the model is computed, not what it computes: presets leave them
# at their defaults, and a checkpoint resumes under any value of them.
IMPLEMENTATION_FIELDS = ("kernels",)


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    # The first n_dense_layers blocks use a dense SwiGLU FFN, the rest a MoE.
    n_dense_layers: int = 1
    n_heads: int = 4
    # Multi-head latent attention. q_lora_rank=0 projects queries directly from dim.
    q_lora_rank: int = 0
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    dense_ffn_dim: int = 128
    # Hidden size of each routed expert and of each shared-expert slice.
    moe_ffn_dim: int = 32
    n_routed_experts: int = 4
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    # Group-limited routing (DeepSeek-V2 device-limited, V3 node-limited): experts form
    # n_expert_groups equal groups and each token picks its top-k only from its
    # n_limited_groups best groups, bounding how many devices/nodes it is sent to. 1/1 = off.
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    score_func: str = "softmax"
    norm_topk_prob: bool = False
    route_scale: float = 1.0
    # Step of the auxiliary-loss-free balancing bias (gamma in DeepSeek-V3).
    bias_update_rate: float = 1e-3
    # Balance losses (0 = off, and nothing is computed): sum over experts of f_i * P_i, the
    # load share of expert i (its chosen count x E / (k x tokens)) times its mean normalized
    # affinity, per MoE layer. aux_loss_alpha weighs it over all tokens of a micro-batch
    # (DeepSeek-V2's expert-level loss), seq_aux_loss_alpha per sequence, averaged
    # (DeepSeek-V3's complementary sequence-wise loss). They reach the weights through their
    # gradient only: the loss the model returns and the trainer logs stays the LM loss.
    aux_loss_alpha: float = 0.0
    seq_aux_loss_alpha: float = 0.0
    # Multi-token prediction (DeepSeek-V3): this many extra depths, depth k predicting the
    # token k + 1 ahead through one more block and the shared head, in training only; their
    # mean loss joins the gradient weighted by train.mtp_loss_weight. 0: off.
    n_mtp_layers: int = 0
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    # RoPE context extension. none: plain RoPE. yarn: YaRN (arXiv 2309.00071) as the Hugging
    # Face code of DeepSeek-V2/V3 applies it, whatever max_seq_len: rotated pairs that turn fewer than
    # rope_beta_slow times over the pre-training length rope_original_max_seq_len are slowed
    # by rope_factor, those turning more than rope_beta_fast times keep their speed, a linear
    # ramp between; the softmax scale is multiplied by m(rope_mscale_all_dim)^2 and cos/sin by
    # m(rope_mscale) / m(rope_mscale_all_dim), where m(w) = 0.1 * w * ln(rope_factor) + 1.
    # The defaults are DeepSeek-V3's (its config.json); they are read only under yarn.
    rope_scaling: str = "none"
    rope_factor: float = 40.0
    rope_original_max_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = False
    # auto: the fast paths of ciuic_train/model/kernels/ where they serve the device;
    # reference: the plain formulas of the model's own files everywhere (same results).
    kernels: str = "auto"

    def __post_init__(self) -> None:
        positive = (
            "vocab_size dim n_layers n_heads kv_lora_rank qk_nope_head_dim qk_rope_head_dim"
            " v_head_dim dense_ffn_dim moe_ffn_dim n_routed_experts n_activated_experts"
            " max_seq_len route_scale rope_theta norm_eps init_std"
            " n_expert_groups n_limited_groups rope_original_max_seq_len rope_beta_slow"
        ).split()
        for field in positive:
            if getattr(self, field) <= 0:
                raise ValueError(f"model.{field}={getattr(self, field)} must be positive")
        zero_or_more = (
            "n_dense_layers q_lora_rank n_shared_experts bias_update_rate rope_mscale rope_mscale_all_dim"
            " aux_loss_alpha seq_aux_loss_alpha n_mtp_layers"
        ).split()
        for field in zero_or_more:
            if getattr(self, field) < 0:
                raise ValueError(f"model.{field}={getattr(self, field)} must be 0 or more")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)"
            )
        if self.n_dense_layers > self.n_layers:
            raise ValueError(
                f"model.n_dense_layers={self.n_dense_layers} must be at most "
                f"n_layers={self.n_layers}"
            )
        if self.n_activated_experts > self.n_routed_experts:
            raise ValueError(
                f"model.n_activated_experts={self.n_activated_experts} must be at most "
                f"n_routed_experts={self.n_routed_experts}"
            )
        if self.n_routed_experts % self.n_expert_groups:
            raise ValueError(
                f"model.n_expert_groups={self.n_expert_groups} must divide "
                f"n_routed_experts={self.n_routed_experts}"
            )
        if self.n_limited_groups > self.n_expert_groups:
            raise ValueError(
                f"model.n_limited_groups={self.n_limited_groups} must be at most "
                f"n_expert_groups={self.n_expert_groups}"
            )
        experts_per_group = self.n_routed_experts // self.n_expert_groups
        if self.n_limited_groups * experts_per_group < self.n_activated_experts:
            raise ValueError(
                f"model.n_limited_groups={self.n_limited_groups} groups must hold at least "
                f"n_activated_experts={self.n_activated_experts} experts (each holds {experts_per_group})"
            )
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(
                f"model.kernels={self.kernels!r} is not one of: {', '.join(KERNEL_CHOICES)}"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f"model.score_func={self.score_func!r} is not one of: {', '.join(SCORE_FUNCS)}"
            )
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(
                f"model.rope_scaling={self.rope_scaling!r} is not one of: {', '.join(ROPE_SCALINGS)}"
            )
        if self.rope_factor < 1:
            raise ValueError(
                f"model.rope_factor={self.rope_factor} must be at least 1 (YaRN only stretches the context)"
            )
        if self.rope_beta_fast <= self.rope_beta_slow:
            raise ValueError(
                f"model.rope_beta_fast={self.rope_beta_fast} must be greater than "
                f"rope_beta_slow={self.rope_beta_slow}"
            )
