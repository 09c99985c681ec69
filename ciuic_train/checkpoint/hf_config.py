"""Hugging Face's config.json for DeepSeek-V3, out and in.

transformers' DeepseekV3ForCausalLM computes what `ciuic_train.model.Transformer` computes
(logits agree to ~1e-6 on the same weights) once its config.json says what our ModelConfig
says. This module is the one place that knows both sides of that file: `config_json` (our
ModelConfig -> config.json, for `ciuic-train-export --format hf`) and `model_fields`
(config.json -> ModelConfig fields, for `init_from=DIR`), refusing in one line what the
other side cannot express. The tensors are `hf_weights.py`'s.

The CLI reads config.json while it composes a config, where torch must not be imported
(`--cfg` and `--help` never import it): nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ciuic_train.errors import UserError
from ciuic_train.model.config import ModelConfig
from ciuic_train.model.yarn import yarn_mscale, yarn_rope_magnitude

CONFIG_FILE = "config.json"
MODEL_TYPES = ("deepseek_v3", "deepseek_v2")


def unsupported(field: str, value: Any, why: str) -> UserError:
    return UserError(f"model.{field}={value!r} cannot be exported to Hugging Face DeepseekV3: {why}")


def transformers_yarn_magnitude(rope: dict[str, Any]) -> float:
    """The factor transformers' YaRN puts on cos/sin: attention_factor if given, else the
    ratio of the two mscale weights when both are non-zero, else yarn_mscale(factor, 1)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, weight, weight_all = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    if weight and weight_all:
        return yarn_mscale(factor, weight) / yarn_mscale(factor, weight_all)
    return yarn_mscale(factor, 1.0)


def config_json(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of a model transformers loads as DeepseekV3ForCausalLM computing what ours does.

    RoPE is written as DeepSeek released it (`rope_theta`, `rope_scaling`), which older
    readers understand too; transformers turns it into its `rope_parameters`.
    """
    if cfg.score_func != "sigmoid":
        raise unsupported("score_func", cfg.score_func, "its router scores experts with sigmoid only")
    rope_scaling = None
    if cfg.rope_scaling == "yarn":
        rope_scaling = {
            "type": "yarn", "rope_type": "yarn", "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
            "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
            "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim,
        }
        if not math.isclose(transformers_yarn_magnitude(rope_scaling), yarn_rope_magnitude(cfg), rel_tol=1e-9):
            # transformers' rule differs from DeepSeek's where a weight is 0; stated, both agree.
            rope_scaling["attention_factor"] = yarn_rope_magnitude(cfg)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "first_k_dense_replace": cfg.n_dense_layers,
        "moe_layer_freq": 1,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "intermediate_size": cfg.dense_ffn_dim,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.n_activated_experts,
        "n_group": cfg.n_expert_groups,
        "topk_group": cfg.n_limited_groups,
        "topk_method": "noaux_tc",
        "scoring_func": cfg.score_func,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.route_scale,
        "aux_loss_alpha": cfg.seq_aux_loss_alpha or cfg.aux_loss_alpha,
        "seq_aux": bool(cfg.seq_aux_loss_alpha),
        "num_nextn_predict_layers": cfg.n_mtp_layers,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_interleave": True,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "float32",
    }


def read_config_json(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"init_from={folder}: no {CONFIG_FILE} there (expected a Hugging Face model folder)") from None
    except (OSError, ValueError) as err:
        raise UserError(f"init_from={folder}: unreadable {CONFIG_FILE} ({err})") from None
    if config.get("model_type") not in MODEL_TYPES:
        raise UserError(
            f"init_from={folder}: {CONFIG_FILE} has model_type={config.get('model_type')!r}; "
            f"allowed: {', '.join(MODEL_TYPES)}"
        )
    return config


def topk_method(config: dict[str, Any]) -> str:
    """How a config.json's router picks experts; where it does not say, its model type's way."""
    return config.get("topk_method", "noaux_tc" if config["model_type"] == "deepseek_v3" else "greedy")


def model_fields(folder: Path) -> dict[str, Any]:
    """The ModelConfig fields a DeepSeek-V3/V2 config.json sets (every one that changes the
    forward, plus the balance losses it declares); one line naming any key this model cannot follow."""
    c = read_config_json(folder)

    def need(key: str) -> Any:
        if key not in c:
            raise UserError(f"init_from={folder}: {CONFIG_FILE} lacks {key!r}")
        return c[key]

    def refuse(key: str, why: str) -> UserError:
        return UserError(f"init_from={folder}: {CONFIG_FILE} {key}={c.get(key)!r} is not supported: {why}")

    if c.get("quantization_config"):
        raise refuse("quantization_config", "dequantize the weights (e.g. to bf16) first")
    if c.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "the FFNs are SwiGLU")
    if c.get("attention_bias"):
        raise refuse("attention_bias", "the projections have no bias")
    if not c.get("rope_interleave", True):
        raise refuse("rope_interleave", "RoPE pairs adjacent channels, as DeepSeek's weights expect")
    if c.get("moe_layer_freq", 1) != 1:
        raise refuse("moe_layer_freq", "every layer after first_k_dense_replace is MoE")
    n_groups = c.get("n_group") or 1
    method = topk_method(c)
    if method not in ("noaux_tc", "greedy") and not (method == "group_limited_greedy" and n_groups == 1):
        raise refuse("topk_method", "groups are ranked by their top-2 score sum (noaux_tc), or not used (greedy)")
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    fields_ = dict(
        name=folder.name,
        vocab_size=need("vocab_size"),
        dim=need("hidden_size"),
        n_layers=need("num_hidden_layers"),
        n_dense_layers=c.get("first_k_dense_replace") or 0,
        n_heads=need("num_attention_heads"),
        q_lora_rank=c.get("q_lora_rank") or 0,
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"),
        dense_ffn_dim=need("intermediate_size"),
        moe_ffn_dim=need("moe_intermediate_size"),
        n_routed_experts=need("n_routed_experts"),
        n_shared_experts=c.get("n_shared_experts") or 0,
        n_activated_experts=need("num_experts_per_tok"),
        n_expert_groups=n_groups,
        n_limited_groups=c.get("topk_group") or 1,
        score_func=c.get("scoring_func", "sigmoid" if c["model_type"] == "deepseek_v3" else "softmax"),
        norm_topk_prob=bool(need("norm_topk_prob")),
        route_scale=float(c.get("routed_scaling_factor", 1.0)),
        max_seq_len=need("max_position_embeddings"),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        norm_eps=float(need("rms_norm_eps")),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )
    if "initializer_range" in c:
        fields_["init_std"] = float(c["initializer_range"])
    fields_["n_mtp_layers"] = c.get("num_nextn_predict_layers") or 0
    alpha = float(c.get("aux_loss_alpha", 0.0))
    fields_["seq_aux_loss_alpha"], fields_["aux_loss_alpha"] = (alpha, 0.0) if c.get("seq_aux") else (0.0, alpha)
    if method != "noaux_tc":  # no e_score_correction_bias to steer: V2 balances by its losses only
        fields_["bias_update_rate"] = 0.0
    if rope_type == "yarn":
        fields_ |= dict(
            rope_scaling="yarn", rope_factor=float(rope["factor"]),
            rope_original_max_seq_len=int(rope.get("original_max_position_embeddings") or fields_["max_seq_len"]),
            rope_beta_fast=float(rope.get("beta_fast", 32.0)), rope_beta_slow=float(rope.get("beta_slow", 1.0)),
            # Absent weights: transformers' defaults (cos/sin by m(1), no softmax correction).
            rope_mscale=float(1.0 if rope.get("mscale") is None else rope["mscale"]),
            rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        )
        factor = fields_["rope_factor"]
        ours = yarn_mscale(factor, fields_["rope_mscale"]) / yarn_mscale(factor, fields_["rope_mscale_all_dim"])
        if not math.isclose(ours, transformers_yarn_magnitude(rope), rel_tol=1e-9):
            key = "rope_scaling.attention_factor" if rope.get("attention_factor") is not None else "rope_scaling.mscale"
            raise UserError(
                f"init_from={folder}: {CONFIG_FILE} {key} gives cos/sin a magnitude of "
                f"{transformers_yarn_magnitude(rope):.6g}; this model's YaRN gives mscale/mscale_all_dim = {ours:.6g}"
            )
    elif rope_type != "default":
        raise UserError(f"init_from={folder}: {CONFIG_FILE} rope type {rope_type!r} is not supported: default or yarn")
    return fields_


def explicit_model_keys(overrides: list[str]) -> set[str]:
    """The model fields a command line sets itself (`model.FIELD=...`, with or without + or ++)."""
    keys = (override.split("=", 1)[0].lstrip("+~") for override in overrides)
    return {key.removeprefix("model.") for key in keys if key.startswith("model.")}


def model_with_init_from(model: dict[str, Any], folder: str, overrides: list[str]) -> dict[str, Any]:
    """The composed model section (a preset's) with config.json's fields over it and the
    command line's own model.FIELD=... over those; fields config.json does not hold
    (bias_update_rate, kernels, ...) stay the preset's."""
    explicit = explicit_model_keys(overrides)
    from_json = model_fields(Path(folder).expanduser())
    return {**model, **{k: v for k, v in from_json.items() if k not in explicit}}

