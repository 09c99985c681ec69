"""Hugging Face checkpoints' tensors: DeepSeek-V3's names for ours, and reading a folder in.

Moving weights between `ciuic_train.model.Transformer` and transformers'
DeepseekV3ForCausalLM is renaming, plus stacking for published checkpoints that store
each routed expert apart. `hf_name` is our parameter -> theirs and `exported_names` every
tensor an export writes (`tools/export.py` writes them); `load_hf_weights` reads
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
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ciuic_train.checkpoint.hf_config import read_config_json, topk_method
from ciuic_train.errors import UserError
from ciuic_train.environment import launcher_rank
from ciuic_train.model.config import ModelConfig
from ciuic_train.progress import WorkProgress

if TYPE_CHECKING:
    import torch

    from ciuic_train.model import Transformer
    from ciuic_train.model.init import Rows

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
    with _readable(single) as f:
        return dict.fromkeys(f.names(), single)


def _readable(path: Path):
    """The open file, or a UserError saying why it cannot be read."""
    from ciuic_train.checkpoint.safetensors_rows import TensorFile

    try:
        return TensorFile(path)
    except (OSError, ValueError) as err:
        raise UserError(f"init_from={path.parent}: {err}") from None


def _shapes(files: dict[str, Path]) -> dict[str, list[int]]:
    """Every tensor's shape, from the files' headers (no tensor is read)."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(set(files.values())):
        if not path.is_file():
            raise UserError(f"init_from={path.parent}: {path.name}, listed in {INDEX_FILE}, is missing")
        with _readable(path) as f:
            for name in f.names():
                if files.get(name) == path:
                    shapes[name] = f.shape(name)
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


def load_hf_weights(model: Transformer, folder: Path, locate: Callable[[torch.Tensor], Rows] | None = None,
                    plan: tuple[dict[str, Path], dict[str, list[str]]] | None = None) -> None:
    """Copy a Hugging Face DeepSeek-V3/V2 folder's weights into `model`, after checking every
    name and shape: on a mismatch nothing is copied.

    Each tensor is read by rows: only the rows `locate` says this rank holds (all of them
    without `locate`; under FSDP2 and expert parallelism its shard,
    `distributed/materialize.local_rows`), `READ_ELEMENTS` values at a time, converted to
    the model's dtype as they are copied; files are read, not mapped
    (`safetensors_rows.py`), one at a time, and experts stored apart one at a time. So the
    memory a load needs beyond the model's own is one slice, whatever the model's size.
    """
    import torch

    from ciuic_train.model.init import whole_rows

    locate = locate or whole_rows
    files, sources = plan or plan_load(model, folder)
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    held = {ours: locate(targets[ours]) for ours in sources}  # the rows this rank holds of each
    total = sum(rows.local.numel() * rows.local.element_size() for rows in held.values())
    with _OpenFiles() as opened, torch.no_grad(), \
            WorkProgress(f"reading {folder.name}", total, enabled=launcher_rank() == 0) as progress:
        # File by file: a published checkpoint has many, together the size of the model.
        for ours, names in sorted(sources.items(), key=lambda entry: str(files[entry[1][0]])):
            handles = opened.only({files[name] for name in names})
            rows = held[ours]
            if len(names) == 1:
                _copy_rows(handles[files[names[0]]], names[0], rows)
            else:
                _copy_experts(ours, [(handles[files[name]], name) for name in names], rows)
            progress.advance(rows.local.numel() * rows.local.element_size())


class _OpenFiles:
    """The checkpoint files open now: `only(paths)` opens those and closes the others."""

    def __init__(self):
        self.handles: dict[Path, Any] = {}

    def only(self, paths: set[Path]) -> dict[Path, Any]:
        from ciuic_train.checkpoint.safetensors_rows import TensorFile

        for path in [p for p in self.handles if p not in paths]:
            self.handles.pop(path).close()
        for path in paths - self.handles.keys():
            self.handles[path] = TensorFile(path)
        return self.handles

    def __enter__(self) -> _OpenFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.only(set())


READ_ELEMENTS = 1 << 24  # 64 MiB of fp32 per read: big reads, a bounded extra footprint


def _copy_rows(source, name: str, rows: Rows) -> None:
    """rows.local <- rows [start, start + n) of tensor `name` of a checkpoint file, a bounded number at a time."""
    local = rows.local
    per_read = max(1, READ_ELEMENTS // max(1, math.prod(local.shape[1:])))
    for first in range(0, local.shape[0], per_read):
        last = min(first + per_read, local.shape[0])
        local[first:last].copy_(source.read_rows(name, rows.start + first, rows.start + last))


def _copy_experts(ours: str, tensors: list[tuple[Any, str]], rows: Rows) -> None:
    """rows.local <- the experts [start, start + n) of a checkpoint that stores each apart:
    w13 from each expert's gate and up weights (in that order), w2 from its down weight."""
    import torch

    per_expert = 2 if ours.endswith("w13") else 1
    for i in range(rows.local.shape[0]):
        expert = rows.start + i
        parts = [handle.read(name) for handle, name in tensors[expert * per_expert : (expert + 1) * per_expert]]
        rows.local[i].copy_(parts[0] if per_expert == 1 else torch.cat(parts))
