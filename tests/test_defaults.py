"""Each default written once: a value the schema's dataclasses give is not written again in
conf/, or, where a file lists it on purpose, a test holds the two equal.

- conf/config.yaml and the plain options of conf/optim and conf/data set only what the
  dataclasses of ciuic_train/config.py do not: the option's `name`, and what the option
  changes (sgd's weight decay). Every other key keeps the dataclass default, its one home.
- conf/logger's files list every parameter of their tracker, so that each shows what
  `logger.NAME.KEY` can be set to: each value there must be the default of the tracker's
  dataclass (ciuic_train/train/trackers.py), which parses it. tests/test_tricks.py holds
  conf/trick's files to the tricks' `Params` the same way.
- The optim recipes (conf/optim/deepseek_*.yaml) pin a published recipe, values equal to
  a default included, so that a changed default leaves them as published: they are
  composed here, not searched for defaults.
"""

import dataclasses
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from conftest import compose_config
from ciuic_train.config import Config, DataConfig, OptimConfig
from ciuic_train.train.trackers import LOGGERS

CONF = Path(__file__).parents[1] / "conf"
RECIPES = ("deepseek_v2_lite", "deepseek_v3")  # conf/optim files headed `# @package _global_`
SCHEMAS = {"optim": OptimConfig, "data": DataConfig}


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


PLAIN_OPTIONS = [(group, name) for group in SCHEMAS for name in options(group) if name not in RECIPES]


def restated_defaults(written: DictConfig, defaults: DictConfig, prefix: str = "") -> list[str]:
    """The keys of `written` (a YAML file as loaded), dotted, whose value is the one
    `defaults` (a structured dataclass) already gives."""
    restated = []
    for key in written:
        if key not in defaults or OmegaConf.is_missing(defaults, key) or OmegaConf.is_missing(written, key):
            continue  # not the schema's (the defaults list, hydra), or nothing to restate
        default = defaults[key]
        if isinstance(default, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(default)):
            restated += restated_defaults(written[key], default, f"{prefix}{key}.")
        elif OmegaConf.merge(defaults, {key: written[key]})[key] == default:  # typed as the schema types it
            restated.append(f"{prefix}{key}")
    return restated


def typed(value):
    """A value with the type of every scalar in it, so that 10 and 10.0 differ."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return type(value).__name__, value


def test_the_primary_config_restates_no_default():
    """conf/config.yaml picks the groups' options; train.*, dist.* and the rest come from
    the dataclasses alone."""
    written = OmegaConf.load(CONF / "config.yaml")
    assert restated_defaults(written, OmegaConf.structured(Config)) == []


@pytest.mark.parametrize(("group", "name"), PLAIN_OPTIONS, ids=[f"{g}/{n}" for g, n in PLAIN_OPTIONS])
def test_a_plain_option_sets_only_what_differs_from_the_dataclass(group, name):
    written = OmegaConf.load(CONF / group / f"{name}.yaml")
    assert written.name == name  # which option it is, whatever the dataclass's default name
    restated = [key for key in restated_defaults(written, OmegaConf.structured(SCHEMAS[group])) if key != "name"]
    assert restated == [], f"conf/{group}/{name}.yaml writes {SCHEMAS[group].__name__}'s defaults again"


def test_a_run_that_names_no_optimizer_gets_the_dataclass_defaults():
    assert compose_config().optim == OptimConfig()
    assert compose_config("optim=adamw").optim == OptimConfig()


@pytest.mark.parametrize("name", options("optim"))
def test_an_optim_option_composes_to_the_dataclass_under_its_own_keys(name):
    written = OmegaConf.load(CONF / "optim" / f"{name}.yaml")
    if name in RECIPES:
        written = written.optim  # @package _global_: the recipe's train.* keys beside it
    expected = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimConfig), written))
    assert compose_config(f"optim={name}").optim == expected


def test_every_logger_has_a_config_file():
    assert options("logger") == sorted(LOGGERS)


@pytest.mark.parametrize("name", sorted(LOGGERS))
def test_a_logger_config_file_lists_exactly_its_trackers_defaults(name):
    """Hydra composes the YAML, while the tracker reads its parameters through the
    dataclass: the defaults are written in both places, so they must agree field for field."""
    path = CONF / "logger" / f"{name}.yaml"
    assert path.read_text().splitlines()[0] == f"# @package logger.{name}"
    in_yaml = OmegaConf.to_container(OmegaConf.load(path))
    assert typed(in_yaml) == typed(dataclasses.asdict(LOGGERS[name].params()))
    assert compose_config(f"+logger={name}").logger == {name: in_yaml}
