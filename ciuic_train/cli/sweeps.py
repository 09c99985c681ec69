"""The jobs a command line describes: one, or with `-m` one per point of its sweeps.

Hydra expands sweeps only once it runs, after it has made the sweep folder. To check
every job first, `job_overrides` expands them here as Hydra's basic sweeper will; for a
sweeper that samples a search space itself (hydra/sweeper=optuna) it checks the space's
ends and choices instead (`_sweep_samples`).
"""

from __future__ import annotations

import importlib.util
import itertools
import math

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep

from ciuic_train.errors import UserError


def parse_overrides(overrides: list[str]) -> list[Override]:
    """The overrides as Hydra parses them (inside `compose.config_module`)."""
    loader = GlobalHydra.instance().config_loader()  # glob() sweeps list a group's options through it
    return OverridesParser.create(config_loader=loader).parse_overrides(overrides)


def job_overrides(parsed: list[Override], multirun: bool) -> list[list[str]]:
    """The overrides of each job: the command's own, or with -m one job per point of the
    sweeps' product, as Hydra's basic sweeper expands them (a key given twice: the later).
    Another sweeper (hydra/sweeper=NAME) expands its sweeps itself: `_sweep_samples`."""
    if not multirun:
        sweep = next((o.input_line for o in parsed if o.is_sweep_override()), None)
        if sweep is not None:
            raise UserError(f"{sweep!r} is a sweep; add -m (--multirun) to run one job per value")
        return [[o.input_line for o in parsed]]
    if _sweeper(parsed) != "basic":
        return _sweep_samples(parsed)
    values: dict[str, list[str]] = {}
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise UserError(
                f"{override.input_line!r}: an interval has no points to run; sweep a list, range() or glob(), "
                "or choose a sweeper that samples intervals (e.g. hydra/sweeper=optuna)"
            )
    return [list(job) for job in itertools.product(*values.values())]


def _sweeper(parsed: list[Override]) -> str:
    """The sweeper that -m hands the sweeps to: hydra/sweeper=NAME, Hydra's basic one by default."""
    chosen = [str(o.value()) for o in parsed if o.key_or_group == "hydra/sweeper"]
    if "optuna" in chosen and importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None:
        raise UserError("hydra/sweeper=optuna needs the optuna extra: pip install 'ciuic-train[optuna]'")
    return chosen[-1] if chosen else "basic"


def _sweep_samples(parsed: list[Override]) -> list[list[str]]:
    """Jobs that check a search space another sweeper will sample, without expanding it: the
    fixed overrides with each swept key at each of its choices or either end of its range or
    interval, the other swept keys at their first point (one job per point, not their product)."""
    points: dict[str, list[str]] = {}
    for override in parsed:
        key = override.get_key_element()
        points[key] = [f"{key}={value}" for value in _sweep_points(override)]
    first = {key: values[0] for key, values in points.items()}
    jobs = [list(first.values())]
    for key, values in points.items():
        jobs += [list({**first, key: value}.values()) for value in values[1:]]
    return jobs


def _sweep_points(override: Override) -> list[str]:
    """The values `_sweep_samples` tries for one override (the value itself if it sweeps nothing)."""
    value = override.value()
    if not override.is_sweep_override():
        return [override.get_value_element_as_str()]
    if isinstance(value, IntervalSweep):
        return [str(value.start), str(value.end)]
    if isinstance(value, RangeSweep) and not value.shuffle:
        count = math.ceil((value.stop - value.start) / value.step)
        if count < 1:
            raise UserError(f"{override.input_line!r}: the range is empty")
        return [str(value.start), str(value.start + (count - 1) * value.step)]
    points = list(override.sweep_string_iterator())
    if not points:
        raise UserError(f"{override.input_line!r}: the sweep has no points")
    return points
