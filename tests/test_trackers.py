"""Experiment trackers (`+logger=...`) and Hydra sweeper plugins (`hydra/sweeper=optuna`).

One tiny run logs to all three trackers at once; each tracker's store is read back with
the tracker's own reader and compared with the run's metrics.jsonl and summary.json.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ciuic_train.train import trackers
from ciuic_train.cli.preflight import check_request
from ciuic_train.errors import UserError
from conftest import compose_config, write_text_corpus

TINY = ["model=tiny", "train.seq_len=64", "train.batch_size=4", "train.eval_windows=8", "sample.max_new_tokens=0",
        "progress=plain"]


def ciuic_train(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The console script with no W&B mode in the environment, so the default (offline)
    applies; one thread, as tiny models gain nothing from more on a busy 2-core box."""
    env = {**{k: v for k, v in os.environ.items() if k != "WANDB_MODE"}, "OMP_NUM_THREADS": "1"}
    exe = Path(sys.executable).with_name("ciuic-train")
    return subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tracked")
    corpus = write_text_corpus(root / "corpus")
    run_dir = root / "run"
    result = ciuic_train(
        *TINY, "data=text", f"data.path={corpus}", f"data.cache_dir={root / 'cache'}",
        "train.max_steps=6", "train.log_every=2", "train.eval_every=3",
        "+logger=[tensorboard,mlflow,wandb]", f"hydra.run.dir={run_dir}", cwd=root,
    )
    assert result.returncode == 0, result.stderr
    return run_dir


def logged(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as each figure's (step, value) series."""
    series: dict[str, list[tuple[int, float]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in trackers._numbers(record).items():
            series.setdefault(key, []).append((record["step"], value))
    return series


def same_series(got, expected, rel: float = 0.0) -> bool:
    return len(got) == len(expected) and all(
        s == t and (math.isclose(v, w, rel_tol=rel) or (math.isnan(v) and math.isnan(w)))
        for (s, v), (t, w) in zip(got, expected)
    )


def test_tensorboard_holds_what_metrics_jsonl_does(tracked_run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(tracked_run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    expected = logged(tracked_run)
    assert [s for s, _ in expected["loss"]] == [2, 3, 4, 6] and [s for s, _ in expected["val_loss"]] == [3, 6]
    summary_tags = {t for t in events.Tags()["scalars"] if t.startswith("summary/")}
    assert set(events.Tags()["scalars"]) - summary_tags == set(expected)
    for key, series in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert same_series(got, series, rel=1e-6), key  # TensorBoard keeps float32
    summary = json.loads((tracked_run / "summary.json").read_text())
    (final,) = events.Scalars("summary/final_val_loss")
    assert final.step == summary["steps"] and math.isclose(final.value, summary["final_val_loss"], rel_tol=1e-6)
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["train.max_steps"].number_value == 6 and hparams["model.name"].string_value == "tiny"


def test_mlflow_holds_what_metrics_jsonl_does(tracked_run: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tracked_run / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("ciuic-train").experiment_id])
    assert run.info.run_id == json.loads((tracked_run / trackers.IDS_FILE).read_text())["mlflow"]
    assert run.info.status == "FINISHED" and run.info.run_name == tracked_run.name
    for key, series in logged(tracked_run).items():
        got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert same_series(got, series), key
    assert run.data.params["train.max_steps"] == "6" and run.data.params["logger.wandb.project"] == "ciuic-train"
    summary = json.loads((tracked_run / "summary.json").read_text())
    assert run.data.metrics["summary/final_val_loss"] == summary["final_val_loss"]
    assert json.loads(run.data.tags["summary/strategy"]) == summary["strategy"]


def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file: a LevelDB-style log (32 KiB blocks, each
    chunk with a 7-byte header: checksum, length, kind) after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_runs_offline_in_the_run_folder_with_what_metrics_jsonl_does(tracked_run: Path):
    run_id = json.loads((tracked_run / trackers.IDS_FILE).read_text())["wandb"]
    (folder,) = (tracked_run / "wandb").glob(f"offline-run-*-{run_id}")
    records = wandb_records(folder / f"run-{run_id}.wandb")
    history: dict[str, list[tuple[int, float]]] = {}
    for record in (r for r in records if r.WhichOneof("record_type") == "history"):
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for key, value in items.items():
            if not key.startswith("_"):
                history.setdefault(key, []).append((items["_step"], float(value)))
    expected = logged(tracked_run)
    assert set(history) == set(expected) and all(same_series(history[k], s) for k, s in expected.items())
    config = {item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for item in r.config.update}
    assert config["train"]["max_steps"] == 6 and config["model"]["name"] == "tiny"
    summary = json.loads((tracked_run / "summary.json").read_text())
    final = {item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "summary"
             for item in r.summary.update}
    assert final["final_val_loss"] == summary["final_val_loss"] and final["strategy"] == summary["strategy"]


def test_a_resumed_tracker_logs_no_step_twice(tmp_path: Path):
    """TensorBoard purges the steps after the checkpoint's; MLflow skips the ones it has."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    selected = {"tensorboard": {}, "mlflow": {}}
    config = compose_config("model=tiny", "+logger=[tensorboard,mlflow]")
    first = trackers.Trackers.open(selected, tmp_path, 0, config)
    for step in (1, 2, 3, 4):
        first.log_metrics({"step": step, "loss": float(step)})
    first.close()  # as a run killed after step 4, whose last checkpoint is step 2
    again = trackers.Trackers.open(selected, tmp_path, 2, config)
    for step in (3, 4, 5):
        again.log_metrics({"step": step, "loss": 10.0 * step})
    again.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1), (2, 2), (3, 30), (4, 40), (5, 50)]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = json.loads((tmp_path / trackers.IDS_FILE).read_text())["mlflow"]
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 50)]


def test_a_run_that_fails_ends_its_tracker_run_failed(tmp_path: Path):
    """A diverged run (a planted NaN, train.on_nonfinite=stop): MLflow says FAILED, not RUNNING."""
    from mlflow.tracking import MlflowClient

    from ciuic_train.errors import RunFailed
    from ciuic_train.train.trainer import Trainer

    corpus = write_text_corpus(tmp_path / "corpus")
    config = compose_config(*TINY, "data=text", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                            "train.max_steps=6", "fault.nan_rank=0", "fault.nan_at_step=2", "+logger=mlflow")
    with pytest.raises(RunFailed, match="training diverged at step 2"):
        Trainer(config, tmp_path).fit()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("ciuic-train").experiment_id])
    assert run.info.status == "FAILED"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+logger=tensorbord"], "unknown logger 'tensorbord' (did you mean 'tensorboard'?)"),
        (["+logger=tensorboard", "+logger.tensorboard.dri=x"], "parameters of tensorboard: dir"),
        (["+logger=wandb", "logger.wandb.mode=onlin"], "logger.wandb: mode='onlin' is not one of: offline, online"),
        (["+logger=mlflow", "logger.mlflow.experiment=[a]"], "logger.mlflow.experiment"),
    ],
)
def test_a_logger_mistake_is_one_line_before_any_work(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        check_request(["model=tiny", *overrides], config_only=True)


def test_a_logger_without_its_package_names_the_extra(monkeypatch, tmp_path):
    """Checked with the config, before Hydra makes a run folder."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError) as err:
        check_request(["model=tiny", "+logger=[tensorboard,wandb]", f"hydra.run.dir={tmp_path / 'run'}"])
    assert str(err.value) == "logger=wandb needs the wandb package: pip install 'ciuic-train[wandb]'"
    assert not (tmp_path / "run").exists()


def test_another_sweeper_gets_the_sweeps_and_the_check_tries_their_ends():
    """Intervals reach the sweeper; the check composes each swept value or end once."""
    jobs = check_request(["-m", "hydra/sweeper=optuna", "model=tiny", "train.lr=interval(1e-4,3e-3)",
                          "+trick=choice([],[warm_restart])", "seed=range(0,10,3)"], config_only=True)
    assert len(jobs) == 1 + 1 + 1 + 1
    assert {j.config.train.lr for j in jobs} == {1e-4, 3e-3}
    assert {tuple(j.config.trick) for j in jobs} == {(), ("warm_restart",)}
    assert {j.config.seed for j in jobs} == {0, 9}
    with pytest.raises(UserError, match=re.escape("train.lr=-0.1 must be positive")):
        check_request(["-m", "hydra/sweeper=optuna", "model=tiny", "train.lr=interval(-0.1,3e-3)"], config_only=True)


def test_the_optuna_sweeper_without_its_package_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    hidden = "hydra_plugins.hydra_optuna_sweeper"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a))
    with pytest.raises(UserError, match=re.escape("hydra/sweeper=optuna needs the optuna extra: pip install")):
        check_request(["-m", "hydra/sweeper=optuna", "train.lr=interval(1e-4,3e-3)"], config_only=True)


def test_an_optuna_study_reports_its_best_trial(tmp_path: Path):
    corpus = write_text_corpus(tmp_path / "corpus")
    sweep_dir = tmp_path / "sweep"
    result = ciuic_train(
        "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", *TINY, "data=text", f"data.path={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=3", "train.eval_every=3",
        "train.lr=interval(1e-4,3e-3)", "+trick=choice([],[warm_restart])", f"hydra.sweep.dir={sweep_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    losses = [json.loads(p.read_text())["final_val_loss"] for p in sweep_dir.glob("*/summary.json")]
    assert len(losses) == 3
    report = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert report["best_value"] == min(losses)
    assert 1e-4 <= report["best_params"]["train.lr"] <= 3e-3
