"""Hugging Face checkpoints' tensors: DeepSeek-V3's names for ours, and reading a folder in.

Moving weights between `ciuic_train.model.Transformer` and transformers'
DeepseekV3ForCausalLM is renaming, plus stacking for published checkpoints that store
each routed expert apart. `hf_name` is our parameter -> theirs and `exported_names` every
tensor an export writes (`checkpoint/export.py` writes them); `load_hf_weights` reads
`init_from=DIR` into a freshly built model, and `check_init_from` checks names and shapes
first (the CLI calls it before a run folder exists). The folder's config.json is
`hf_config.py`'s.

Multi-token-prediction depths are named as DeepSeek released them: depth j is decoder
layer n_layers + j with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the block's own
names, and copies of the shared embedding and head. transformers drops them when loading.

torch and safetensors are imported where tensors move, not with the module.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ciuic_train.checkpoint.hf_config import read_config_json, topk_method
from ciuic_train.errors import UserError
from ciuic_train.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from ciuic_train.model import Transformer

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

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


def is_mtp_copy(name: str) -> bool:
    """Whether transformers' `name` is an MTP layer's copy of the shared embedding or head."""
    layer = re.match(r"model\.layers\.\d+\.(.+)", name)
    return layer is not None and layer[1] in MTP_COPIES


# --- Reading a folder (init_from) -------------------------------------------------------


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
    from ciuic_train.model.moe import MoE

    files = tensor_files(folder)
    shapes = _shapes(files)
    cfg = model.config
    where = f"init_from={folder}"
    quantized = next((name for name in shapes if name.endswith("_scale_inv")), None)
    if quantized:
        raise UserError(f"{where}: {quantized} is an FP8 scale: dequantize the weights (e.g. to bf16) first")
    corrects_routing = topk_method(read_config_json(folder)) == "noaux_tc"  # has e_score_correction_bias
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
        elif leaf == "expert_bias" and not corrects_routing:
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

