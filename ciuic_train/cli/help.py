"""The answers that only print: `--help` (our config groups and the composed config) and
`--list-tricks`. Neither imports torch."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import string
from typing import Any

from omegaconf import OmegaConf

from ciuic_train.cli.compose import CONFIG_MODULE, compose, config_module, job_config, without_hydra
from ciuic_train.cli.messages import as_user_errors
from ciuic_train.cli.sweeps import job_overrides, parse_overrides


def print_help(args: argparse.Namespace) -> None:
    """`--help`: Hydra's help template (conf/config.yaml) filled with our config groups and
    the config the command's overrides compose.

    Hydra's own `--help` lists its own groups as well, and reads the whole config
    repository again for each of some seventy groups: over a second. This lists ours.
    """
    with config_module(), as_user_errors():
        overrides = job_overrides(parse_overrides(args.overrides), args.multirun)[0]
        cfg = compose(overrides)
        template = cfg.hydra.help.template
        job_config(without_hydra(cfg), overrides)  # the run's own checks: a help on a mistake would mislead
    config = OmegaConf.to_yaml(cfg, resolve=args.resolve)
    groups = "\n".join(_config_groups(importlib.resources.files(CONFIG_MODULE)))
    print(string.Template(template).safe_substitute(APP_CONFIG_GROUPS=groups, CONFIG=config))


def _config_groups(folder: Any, parent: str = "") -> list[str]:
    """`group: option, ...` for each of our config groups: the folders of the conf package
    (`folder`, an importlib.resources Traversable). Hydra's loader lists them too, but
    copies its whole config repository for each question."""
    lines = []
    for sub in sorted((f for f in folder.iterdir() if f.is_dir()), key=lambda f: f.name):
        group = f"{parent}{sub.name}"
        if group == "hydra":
            continue
        options = sorted(f.name.removesuffix(".yaml") for f in sub.iterdir() if f.name.endswith(".yaml"))
        if options:
            lines.append(f"{group}: {', '.join(options)}")
        lines += _config_groups(sub, f"{group}/")
    return lines


def list_tricks() -> None:
    """One line per trick, with its parameters and how to select it."""
    from rich.console import Console
    from rich.table import Table

    from ciuic_train.tricks import registry

    table = Table(title="tricks: +trick=NAME, several: '+trick=[a,b]', parameters: trick.NAME.PARAM=VALUE")
    for column in ("name", "what it does", "parameters (defaults)"):
        table.add_column(column)
    for name, cls in sorted(registry().items()):
        defaults = ", ".join(f"{f.name}={getattr(cls.Params(), f.name)}" for f in dataclasses.fields(cls.Params))
        table.add_row(name, cls.summary, defaults)
    Console(markup=False).print(table)  # '+trick=[a,b]' is no markup
