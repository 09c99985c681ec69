"""What the model's tests share: the presets of conf/model/, the tiny model built from one,
and a lone MoE layer with weights large enough that routing decisions are clear-cut."""

from pathlib import Path

import torch
from omegaconf import OmegaConf

from ciuic_train.model import ModelConfig, Transformer
from ciuic_train.model.moe import MoE
from ciuic_train.model.transformer import REFERENCE

REPO = Path(__file__).parents[1]
KERNELS = ["auto", "reference"]


def load_preset(name: str, **overrides) -> ModelConfig:
    fields = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
    return ModelConfig(**{**fields, **overrides})


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(load_preset("tiny", **overrides))


def make_moe(**overrides) -> MoE:
    torch.manual_seed(0)
    settings = dict(n_routed_experts=8, n_activated_experts=3) | overrides
    moe = MoE(load_preset("tiny", **settings), REFERENCE)
    for weight in (moe.gate.weight, moe.w13, moe.w2):
        torch.nn.init.normal_(weight, std=0.3)
    return moe
