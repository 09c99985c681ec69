"""Hugging Face checkpoints: DeepSeek-V3's tensor names and config.json, out and in.

transformers' DeepseekV3ForCausalLM computes what `ciuic_train.model.Transformer` computes
(logits agree to ~1e-6 on the same weights), so moving weights between the two is renaming,
plus stacking for published checkpoints that store each routed expert apart. This module is
the one place that knows both sides: `hf_name` (our parameter -> theirs), `config_json`
(our ModelConfig -> config.json) and `model_fields` (config.json -> ModelConfig fields).

- `write_hf_folder` writes the folder of `ciuic-train-export RUN --format hf`: config.json,
  generation_config.json and model.safetensors (or shards plus model.safetensors.index.json).
- `load_hf_weights` reads `init_from=DIR` into a freshly built model; `check_init_from`
  checks names and shapes first (the CLI calls it before a run folder exists).

Multi-token-prediction depths are written as DeepSeek released them: depth j is decoder
layer n_layers + j with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the block's own
names, and copies of the shared embedding and head. transformers drops them when loading.

The CLI reads config.json while it composes a config, where torch must not be imported
(`--cfg` and `--help` never import it), so torch and safetensors are imported where
tensors move.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ciuic_train.errors import UserError
from ciuic_train.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from ciuic_train.model import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers' save_pretrained default, "5GB"
MODEL_TYPES = ("deepseek_v3", "deepseek_v2")

# Our name inside a block -> transformers' inside a decoder layer (dense FFN and MoE alike;
# the MoE's stacked experts `ffn.w2` differ from the dense `ffn.w2.weight` by the suffix).
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.expert_bias": "mlp.gate.e_score_correction_bias",
    "ffn.w13": "mlp.experts.gate_up_proj",  # [E, 2 * hidden, dim]: each expert's gate rows, then its up rows
    "ffn.w2": "mlp.experts.down_proj",  # [E, dim, hidden]
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# An MTP depth's own modules besides its block, under DeepSeek's names.
MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
# DeepSeek's checkpoints give each MTP layer copies of the shared embedding and head.
MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "lm_head.weight"}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_name(name: str, n_layers: int) -> str:
    """transformers' (DeepSeek's) name of our state_dict entry `name`."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    found = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if found:
        return f"model.layers.{found[1]}.{BLOCK_NAMES[found[2]]}"
    found = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
    if found:
        layer, rest = n_layers + int(found[1]), found[2]
        inner = BLOCK_NAMES[rest.removeprefix("block.")] if rest.startswith("block.") else MTP_NAMES[rest]
        return f"model.layers.{layer}.{inner}"
    raise KeyError(f"no Hugging Face name for {name}")


def exported_names(model: Transformer) -> dict[str, str]:
    """transformers' name -> ours, for every tensor an export writes (a tied head once)."""
    cfg = model.config
    names = {hf_name(name, cfg.n_layers): name for name in model.state_dict()}
    if cfg.tie_embeddings:
        del names["lm_head.weight"]
    for j in range(len(model.mtp)):
        for copy, ours in MTP_COPIES.items():
            names[f"model.layers.{cfg.n_layers + j}.{copy}"] = ours
    return names


# --- config.json ------------------------------------------------------------------------


def unsupported(field: str, value: Any, why: str) -> UserError:
    return UserError(f"model.{field}={value!r} cannot be exported to Hugging Face DeepseekV3: {why}")


def mscale(factor: float, weight: float) -> float:
    """model.deepseek.yarn_mscale's formula, here without importing torch (see the module docstring)."""
    return 0.1 * weight * math.log(factor) + 1.0 if factor > 1 else 1.0


def transformers_yarn_magnitude(rope: dict[str, Any]) -> float:
    """The factor transformers' YaRN puts on cos/sin: attention_factor if given, else the
    ratio of the two mscale weights when both are non-zero, else mscale(factor, 1)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, weight, weight_all = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    return mscale(factor, weight) / mscale(factor, weight_all) if weight and weight_all else mscale(factor, 1.0)


def config_json(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of a model transformers loads as DeepseekV3ForCausalLM computing what ours does.

    RoPE is written as DeepSeek released it (`rope_theta`, `rope_scaling`), which older
    readers understand too; transformers turns it into its `rope_parameters`.
    """
    from ciuic_train.model.deepseek import yarn_rope_magnitude

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
    topk_method = c.get("topk_method", "noaux_tc" if c["model_type"] == "deepseek_v3" else "greedy")
    if topk_method not in ("noaux_tc", "greedy") and not (topk_method == "group_limited_greedy" and n_groups == 1):
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
    if topk_method != "noaux_tc":  # no e_score_correction_bias to steer: V2 balances by its losses only
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
        ours = mscale(factor, fields_["rope_mscale"]) / mscale(factor, fields_["rope_mscale_all_dim"])
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


# --- Tensors in -------------------------------------------------------------------------


def tensor_files(folder: Path) -> dict[str, Path]:
    """Each tensor's file: from model.safetensors.index.json when there is one, else model.safetensors."""
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise UserError(f"init_from={folder}: unreadable {INDEX_FILE} ({err})") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        raise UserError(f"init_from={folder}: neither {WEIGHTS_FILE} nor {INDEX_FILE} is there")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _shapes(files: dict[str, Path]) -> dict[str, list[int]]:
    """Every tensor's shape, from the files' headers (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for path in sorted(set(files.values())):
        if not path.is_file():
            raise UserError(f"init_from={path.parent}: {path.name}, listed in {INDEX_FILE}, is missing")
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if files.get(name) == path:
                    shapes[name] = list(f.get_slice(name).get_shape())
    return shapes


def plan_load(model: Transformer, folder: Path) -> tuple[dict[str, Path], dict[str, list[str]]]:
    """Check the folder's tensor names and shapes against `model`, reading no tensor.

    Returns each tensor's file and, for each of our state_dict entries, the tensors that
    make it: one, or one per expert where a published checkpoint stores experts apart.
    Tensors of MTP layers the model has no depth for are ignored, as are the copies of the
    embedding and head in MTP layers. The first bad tensor is one UserError.
    """
    from ciuic_train.model.deepseek import MoE

    files = tensor_files(folder)
    shapes = _shapes(files)
    cfg = model.config
    where = f"init_from={folder}"
    quantized = next((name for name in shapes if name.endswith("_scale_inv")), None)
    if quantized:
        raise UserError(f"{where}: {quantized} is an FP8 scale: dequantize the weights (e.g. to bf16) first")
    hf_config = read_config_json(folder)
    topk_method = hf_config.get("topk_method", "noaux_tc" if hf_config["model_type"] == "deepseek_v3" else "greedy")
    moes = {name: module for name, module in model.named_modules() if isinstance(module, MoE)}
    sources: dict[str, list[str]] = {}
    for ours, tensor in model.state_dict().items():
        if ours == "lm_head.weight" and cfg.tie_embeddings:
            continue
        theirs, want = hf_name(ours, cfg.n_layers), list(tensor.shape)
        owner, _, leaf = ours.rpartition(".")
        per_expert = _per_expert_names(theirs, leaf, moes.get(owner))
        if theirs in shapes:
            if shapes[theirs] != want:
                raise UserError(f"{where}: {theirs} has shape {shapes[theirs]}, model {ours} needs {want}")
            sources[ours] = [theirs]
        elif per_expert and any(name in shapes for name in per_expert):
            each = want[1:] if leaf == "w2" else [want[1] // 2, want[2]]
            for name in per_expert:
                if name not in shapes:
                    raise UserError(f"{where}: no tensor {name} there (model {ours}, expert weights of shape {each})")
                if shapes[name] != each:
                    raise UserError(f"{where}: {name} has shape {shapes[name]}, model {ours} needs {each} per expert")
            sources[ours] = per_expert
        elif leaf == "expert_bias" and topk_method != "noaux_tc":
            continue  # V2 routing has no correction bias: ours stays 0, and bias_update_rate=0 keeps it there
        else:
            raise UserError(f"{where}: no tensor {theirs} there (model {ours}, shape {want})")
    used = {name for names in sources.values() for name in names}
    n_main = cfg.n_layers + len(model.mtp)
    for name in shapes:
        layer = re.match(r"model\.layers\.(\d+)\.(.+)", name)
        ignored = layer is not None and (
            int(layer[1]) >= n_main or (int(layer[1]) >= cfg.n_layers and layer[2] in MTP_COPIES)
        )
        if name not in used and not ignored:
            raise UserError(f"{where}: unexpected tensor {name} (shape {shapes[name]}) for this model config")
    return files, sources


def _per_expert_names(fused: str, leaf: str, moe) -> list[str] | None:
    """A published checkpoint's names for a stacked expert weight: per expert, its gate and
    up weights for w13 (stacked in that order), its down weight for w2."""
    if moe is None or leaf not in ("w13", "w2"):
        return None
    experts = fused.rsplit(".", 1)[0]  # model.layers.L.mlp.experts
    parts = ("gate_proj", "up_proj") if leaf == "w13" else ("down_proj",)
    return [f"{experts}.{e}.{part}.weight" for e in range(moe.n_routed_experts) for part in parts]


def check_init_from(model_config: ModelConfig, folder: Path) -> None:
    """Names and shapes of `folder` against a model of `model_config`, built on meta (nothing allocated)."""
    import torch

    from ciuic_train.model import Transformer

    with torch.device("meta"):
        model = Transformer(model_config)
    plan_load(model, folder)


def load_hf_weights(model: Transformer, folder: Path) -> None:
    """Copy a Hugging Face DeepSeek-V3/V2 folder's weights into `model` (built, not yet
    wrapped for parallelism), after checking every name and shape: on a mismatch nothing is copied."""
    import torch
    from safetensors import safe_open

    files, sources = plan_load(model, folder)
    state = model.state_dict()
    by_file: dict[Path, list[str]] = {}
    for names in sources.values():
        for name in names:
            by_file.setdefault(files[name], []).append(name)
    read: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names:
                    read[name] = f.get_tensor(name)
            for ours, names_ in sources.items():  # copy each entry as soon as its tensors are read
                if ours in state and all(n in read for n in names_):
                    state.pop(ours).copy_(_assemble(ours, [read.pop(n) for n in names_]))


def _assemble(ours: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """One state_dict entry from its tensors: itself, or the experts' weights stacked."""
    import torch

    if len(tensors) == 1:
        return tensors[0]
    if ours.endswith("w13"):  # gate_0, up_0, gate_1, up_1, ...
        return torch.stack([torch.cat(tensors[i : i + 2]) for i in range(0, len(tensors), 2)])
    return torch.stack(tensors)


# --- Tensors out ------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from `123`, `5GB`, `500MB`, `2GiB` (decimal and binary units, as transformers reads them)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not found:
        raise UserError(f"--max-shard-size={text!r} is not a size: bytes, or a number with KB, MB, GB (or KiB, MiB, GiB)")
    number, unit = float(found[1]), (found[2] or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    size = int(number * scale)
    if size < 1:
        raise UserError(f"--max-shard-size={text!r} must be at least 1 byte")
    return size


def shard(names: list[str], sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Consecutive tensors grouped into shards of at most max_shard_size bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name in names:
        if shards[-1] and filled + sizes[name] > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += sizes[name]
    return shards


def write_hf_folder(model: Transformer, out: Path, max_shard_size: int, generation: dict[str, Any]) -> Path:
    """Write `model` as a Hugging Face folder: into a temporary folder beside `out`, then renamed over it."""
    import os
    import shutil

    from safetensors.torch import save_file

    config = config_json(model.config)  # refuses what transformers cannot express, before anything is written
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / CONFIG_FILE).is_file())):
        raise UserError(f"--out {out} exists and is not a Hugging Face folder; name a new or an exported folder")
    state = model.state_dict()
    names = exported_names(model)
    tensors = {theirs: state[ours].detach().contiguous() for theirs, ours in names.items()}
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    groups = shard(list(tensors), sizes, max_shard_size)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files = [WEIGHTS_FILE] if len(groups) == 1 else [
            f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)
        ]
        for file, group in zip(files, groups):
            # Copies (MTP layers' embedding and head) must not share memory within a file.
            save_file({name: tensors[name].clone() if _shares(name) else tensors[name] for name in group},
                      tmp / file, metadata={"format": "pt"})
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {name: file for file, group in zip(files, groups) for name in group}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _shares(name: str) -> bool:
    layer = re.match(r"model\.layers\.\d+\.(.+)", name)
    return layer is not None and layer[1] in MTP_COPIES


def generation_config(sample: dict[str, Any] | None) -> dict[str, Any]:
    """generation_config.json: sampling as the run's own sample (sample.* of its config) did."""
    if not sample:
        return {"do_sample": True}
    return {"do_sample": True, "temperature": sample["temperature"], "top_k": sample["top_k"]}
