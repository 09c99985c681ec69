"""A job's config as every part of a run sees it: composed by Hydra, then completed.

Some model fields follow from other keys unless the command line gives them: the
vocabulary from the tokenizer, the shape from `init_from`'s config.json. `job_config`
applies them wherever a job's config is composed (the pre-flight check, `--help`,
`--plan`, and every rank inside Hydra's job), so all of them see the same model.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import hydra
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

from ciuic_train.config import Config, register_configs
from ciuic_train.checks import to_config

CONFIG_MODULE = "ciuic_train.conf"
CONFIG_NAME = "config"

register_configs()


@contextlib.contextmanager
def config_module() -> Iterator[None]:
    """Hydra initialised on our configs, as @hydra.main will be."""
    GlobalHydra.instance().clear()
    with hydra.initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        yield


def compose(overrides: list[str]) -> DictConfig:
    """Our config under `overrides`, with its `hydra` node (inside `config_module`)."""
    return hydra.compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=True)


def without_hydra(cfg: DictConfig) -> DictConfig:
    """The job's part of a composed config (the `hydra` node's sweep keys only resolve
    inside a running sweep)."""
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def job_config(cfg: DictConfig, overrides: list[str]) -> Config:
    """A job's typed config: the composed one, with the model fields its data and init_from
    decide (`_model_follows_data`, `_model_from_init_from`), checked against the schema."""
    return to_config(_model_from_init_from(_model_follows_data(cfg, overrides), overrides))


def _model_follows_data(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Model fields the data decides, unless the command line gives them: model.vocab_size
    becomes the tokenizer's size (data.tokenizer=bpe: data.vocab_size; a tokenizer.json:
    its vocabulary, added tokens included; bytes with data.eos=true: at least 257, the
    preset's 256 and the end-of-text id)."""
    given = {override.split("=", 1)[0].lstrip("+~") for override in overrides}
    eos = bool(cfg.data.get("eos", False))
    if "model.vocab_size" not in given and (cfg.data.tokenizer != "bytes" or eos):  # bytes: the preset's stands
        from ciuic_train.data.tokenizer import model_vocab_size

        size = model_vocab_size(cfg.data.tokenizer, cfg.data.vocab_size, eos)
        if size is not None:
            cfg.model.vocab_size = max(size, cfg.model.vocab_size) if cfg.data.tokenizer == "bytes" else size
    return cfg


def _model_from_init_from(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """With init_from=DIR, the model fields its config.json sets, under the command line's
    own model.FIELD=... (ciuic_train/checkpoint/hf_config.py). Applied after the data's, so the
    checkpoint's shape wins over a tokenizer's size."""
    if cfg.init_from:
        from ciuic_train.checkpoint.hf_config import model_with_init_from

        model = model_with_init_from(OmegaConf.to_container(cfg.model, resolve=True), cfg.init_from, overrides)
        for key, value in model.items():
            cfg.model[key] = value
    return cfg
