"""Experiment trackers (`+logger=NAME`, several: `'+logger=[tensorboard,mlflow]'`).

Each selected tracker receives what metrics.jsonl does (every logged line, keyed as there),
the resolved config as hyperparameters once, and the summary at the end, from rank 0
only. Each is an optional extra, imported only when selected, and each writes under the
run folder unless the user points it elsewhere: nothing reaches the network unless the
user configures a remote tracker (an MLflow server URI, or W&B's online mode).

A resumed run continues the same tracker run and logs no step twice where the tracker
allows it: TensorBoard purges the events after the checkpoint's step (`purge_step`);
MLflow cannot delete logged points, so the resumed run skips the steps that the earlier
attempt already logged (a resume repeats them exactly, save for timing figures); W&B
ignores steps below its run's current one (online), and keeps one offline folder per
attempt under the same run id.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ciuic_train.errors import UserError
from ciuic_train.files import write_json_atomic

log = logging.getLogger("ciuic_train")

# Tracker run ids of this run folder, so that a resumed run continues the same tracker run.
IDS_FILE = "trackers.json"


@dataclass
class TensorBoardParams:
    # The event files' folder: relative to the run folder, or absolute.
    dir: str = "tb"


@dataclass
class MlflowParams:
    # Empty: a SQLite store in the run folder (mlflow.db); or any MLflow tracking URI,
    # e.g. a server's http://HOST:5000.
    tracking_uri: str = ""
    experiment: str = "ciuic-train"
    # Empty: the run folder's name.
    run_name: str = ""


WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class WandbParams:
    project: str = "ciuic-train"
    # Empty: the user's default entity (online mode only).
    entity: str = ""
    # offline | online | disabled; empty: $WANDB_MODE, else offline.
    mode: str = ""
    # Empty: the run folder's name.
    name: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("", *WANDB_MODES):
            raise ValueError(f"mode={self.mode!r} is not one of: {', '.join(WANDB_MODES)} (or empty: $WANDB_MODE)")


class Tracker:
    """What the trainer asks of a tracker; `record`s are metrics.jsonl's lines. `ids`: the
    tracker run ids to keep in the run folder (IDS_FILE) for a resume to continue."""

    ids: dict[str, str]

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        raise NotImplementedError

    def log_metrics(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def log_summary(self, summary: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self, failed: bool) -> None:
        """End the tracker's run; `failed`: the training ended by an error."""
        raise NotImplementedError


@dataclass(frozen=True)
class TrackerRun:
    """Where a tracker writes and what it continues."""

    run_dir: Path
    start_step: int  # the checkpoint's step on a resume, else 0
    ids: dict[str, str]  # IDS_FILE's content: the tracker run ids an earlier attempt made


def _numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The figures of a record that a tracker can plot (not the step itself)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"train": {"lr": 1e-3}}` -> `{"train.lr": 1e-3}`; lists and None as JSON text."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value)
    return flat


class TensorBoardTracker(Tracker):
    """Scalars keyed as in metrics.jsonl, the config in the HPARAMS tab, the summary's
    figures as `summary/KEY` at the last step."""

    def __init__(self, params: TensorBoardParams, run: TrackerRun):
        from torch.utils.tensorboard import SummaryWriter

        self.ids = {}
        # Events logged after the checkpoint's step by an earlier attempt are dropped on load.
        self.writer = SummaryWriter(str(run.run_dir / params.dir), purge_step=run.start_step + 1)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # Into this run's event file: SummaryWriter.add_hparams would start a run of its own.
        file_writer = self.writer._get_file_writer()
        for summary in hparams(flatten(params), {}):
            file_writer.add_summary(summary)

    def log_metrics(self, record: dict[str, Any]) -> None:
        for key, value in _numbers(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()  # as metrics.jsonl: a crash loses nothing logged

    def log_summary(self, summary: dict[str, Any]) -> None:
        for key, value in _numbers(summary).items():
            self.writer.add_scalar(f"summary/{key}", value, summary["steps"])

    def close(self, failed: bool) -> None:
        self.writer.close()


class MlflowTracker(Tracker):
    """Metrics keyed as in metrics.jsonl, the config as params, the summary's figures as
    `summary/KEY` metrics and its other entries as `summary/KEY` tags."""

    # MLflow's limits per log_batch call, and on a param value's length.
    PARAMS_PER_BATCH = 100
    MAX_PARAM_CHARS = 6000

    def __init__(self, params: MlflowParams, run: TrackerRun):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        uri = params.tracking_uri or f"sqlite:///{(run.run_dir / 'mlflow.db').absolute()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(params.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            local = (run.run_dir / "mlartifacts").absolute().as_uri() if not params.tracking_uri else None
            experiment_id = self.client.create_experiment(params.experiment, artifact_location=local)
        self.last_logged = -1
        known = run.ids.get("mlflow") if run.start_step > 0 else None
        if known is not None and self._exists(known):
            self.run_id = known
            history = self.client.get_metric_history(known, "loss")
            self.last_logged = max((m.step for m in history), default=-1)
            self.client.update_run(known, status="RUNNING")
        else:
            name = params.run_name or run.run_dir.name
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        self.ids = {"mlflow": self.run_id}

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException:
            return False

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # Params cannot change once logged: a resumed run adds new keys and keeps the old values.
        logged = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in flatten(params).items() if k in logged and logged[k] != self._text(v))
        if changed:
            log.warning(f"mlflow keeps this run's first values of {', '.join(changed)} (params cannot change)")
        entries = [Param(k, self._text(v)) for k, v in flatten(params).items() if k not in logged]
        for i in range(0, len(entries), self.PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=entries[i : i + self.PARAMS_PER_BATCH])

    def _text(self, value: Any) -> str:
        return str(value)[: self.MAX_PARAM_CHARS]

    def log_metrics(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = record["step"]
        if step <= self.last_logged:
            return
        now = _millis()
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in _numbers(record).items()])

    def log_summary(self, summary: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        now, step = _millis(), summary["steps"]
        numbers = _numbers(summary)
        metrics = [Metric(f"summary/{k}", v, now, step) for k, v in numbers.items()]
        tags = [RunTag(f"summary/{k}", json.dumps(v)) for k, v in summary.items() if k not in numbers]
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _millis() -> int:
    return int(time.time() * 1000)


class WandbTracker(Tracker):
    """History keyed as in metrics.jsonl (W&B's step is ours), the config as the run's
    config, the summary as its summary. Offline unless mode or $WANDB_MODE says otherwise."""

    def __init__(self, params: WandbParams, run: TrackerRun):
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        mode = params.mode or os.environ.get("WANDB_MODE") or "offline"
        run_id = run.ids.get("wandb") if run.start_step > 0 else None
        self.run = wandb.init(
            project=params.project,
            entity=params.entity or None,
            name=params.name or run.run_dir.name,
            dir=str(run.run_dir),
            mode=mode,
            id=run_id,  # None: W&B makes one
            resume="allow",
            # Our progress bar and log stay ours: W&B must not wrap the terminal.
            settings=wandb.Settings(console="off", silent=True, disable_git=True),
        )
        self.ids = {"wandb": self.run.id}

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, record: dict[str, Any]) -> None:
        if record["step"] >= self.run.step:  # online, a resumed run starts past the steps it has
            self.run.log(_numbers(record), step=record["step"])

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


@dataclass(frozen=True)
class LoggerKind:
    params: type
    open: Callable[[Any, TrackerRun], Tracker]
    # The modules it imports, and the package that brings each (the extra is named as the logger).
    modules: tuple[tuple[str, str], ...]


LOGGERS: dict[str, LoggerKind] = {
    "tensorboard": LoggerKind(TensorBoardParams, TensorBoardTracker, (("tensorboard", "tensorboard"),)),
    "mlflow": LoggerKind(
        MlflowParams, MlflowTracker,
        (("mlflow", "mlflow-skinny"), ("sqlalchemy", "sqlalchemy"), ("alembic", "alembic")),
    ),
    "wandb": LoggerKind(WandbParams, WandbTracker, (("wandb", "wandb"),)),
}


def parse_logger_params(name: str, values: Mapping[str, Any] | None) -> Any:
    """A logger's typed parameters: a misspelt or mistyped `logger.<name>.<param>` fails here."""
    cls = LOGGERS[name].params
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), dict(values or {})))
    except OmegaConfBaseException as err:
        key = f"logger.{name}.{err.key}" if getattr(err, "key", None) else f"logger.{name}"
        allowed = ", ".join(f.name for f in dataclasses.fields(cls))
        raise UserError(f"{key}: {str(err).strip().splitlines()[0]}; parameters of {name}: {allowed}") from None
    except ValueError as err:  # a Params.__post_init__ check
        raise UserError(f"logger.{name}: {err}") from None


def check_loggers(selected: Mapping[str, Any]) -> None:
    """Everything about the logger selection that can be checked before any work starts:
    known names, typed parameters, and the packages installed."""
    unknown = sorted(set(selected) - set(LOGGERS))
    if unknown:
        raise UserError(f"unknown logger {unknown[0]!r}; available loggers: {', '.join(sorted(LOGGERS))}")
    for name in sorted(selected):
        parse_logger_params(name, selected[name])
        for module, package in LOGGERS[name].modules:
            if importlib.util.find_spec(module) is None:
                raise UserError(f"logger={name} needs the {package} package: pip install 'ciuic-train[{name}]'")


class Trackers:
    """The selected trackers as one (none selected, or not rank 0: does nothing)."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    @classmethod
    def open(cls, selected: Mapping[str, Any], run_dir: Path, start_step: int, config: Any) -> "Trackers":
        """Start (or, resuming from `start_step`, continue) each selected tracker's run and
        give it the resolved `config` (the typed Config) as hyperparameters."""
        hyperparams = OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)
        ids_path = run_dir / IDS_FILE
        ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
        run = TrackerRun(run_dir, start_step, ids)
        trackers = [LOGGERS[name].open(parse_logger_params(name, selected[name]), run) for name in sorted(selected)]
        new_ids = {k: v for t in trackers for k, v in t.ids.items()}
        if new_ids:
            write_json_atomic(ids_path, {**ids, **new_ids})
        for tracker in trackers:
            tracker.log_hyperparams(hyperparams)
        return cls(trackers)

    def log_metrics(self, record: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(record)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_summary(summary)

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed)
