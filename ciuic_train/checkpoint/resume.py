"""Which checkpoint a run continues from, and whether it can.

`resume=auto` takes the latest complete checkpoint of the run folder, `resume=PATH` a
`step_<N>` folder or a run folder's latest. Before continuing, the checkpoint's
`meta.json` must agree with this run (`run_fingerprint`, `check_resumable`): same model
shape, same tricks, and a world size it can be resharded to. The CLI asks all this before
Hydra touches the run folder, so nothing here imports torch; what a checkpoint holds and
how it is written is `checkpointer.py`'s.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ciuic_train.errors import UserError
from ciuic_train.model.config import IMPLEMENTATION_FIELDS, ModelConfig

STEP_DIR = re.compile(r"^step_(\d+)$")


def complete_checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoints under `folder`, oldest first (temporary folders are never listed)."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def rerun_from(run_dir: Path, resume: str) -> tuple[Path | None, str]:
    """What a rerun of a run that stopped continues from, for the line that says how: the
    run folder's last complete checkpoint (None if none was saved), and the override it
    needs (" resume=auto", or "" where the run resumes automatically already)."""
    found = complete_checkpoints(run_dir / "checkpoints")
    return (found[-1] if found else None), ("" if resume == "auto" else " resume=auto")


def resolve_resume(choice: str, run_dir: Path) -> Path | None:
    """`none`, `auto` (latest complete checkpoint of this run folder, if any) or a path."""
    if choice == "none":
        return None
    if choice == "auto":
        found = complete_checkpoints(run_dir / "checkpoints")
        return found[-1] if found else None
    path = Path(choice).expanduser()
    if (path / "meta.json").is_file():
        return path
    for folder in (path / "checkpoints", path):
        found = complete_checkpoints(folder)
        if found:
            return found[-1]
    raise UserError(f"no complete checkpoint at {choice} (expected a step_<N> folder with meta.json, or a run folder)")


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint {path} has an unreadable meta.json ({err})") from None


def run_fingerprint(model_config, trick_names: list[str], world_size: int) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed: model shape and tricks; and the
    world size (the ranks that see different data), which may differ where the state is
    reshardable (`check_resumable`).

    Fields that change only how the model is computed (`model.kernels`) are left out, and
    so is the mesh: DCP reshards tensors to any layout.
    """
    model = {k: v for k, v in asdict(model_config).items() if k not in IMPLEMENTATION_FIELDS}
    return {"model": model, "tricks": sorted(trick_names), "world_size": world_size}


def check_resumable(meta: dict[str, Any], expected: dict[str, Any], allow_trick_change: bool) -> None:
    """Refuse a checkpoint from a run this one cannot continue, naming the difference."""
    saved_model, model = meta["model"], expected["model"]
    predated = asdict(ModelConfig())  # a field newer than the checkpoint: it ran with the default
    for key in model:
        saved = saved_model.get(key, predated.get(key))
        if saved != model[key]:
            raise UserError(f"checkpoint model differs: model.{key} is {saved!r} there, {model[key]!r} now")
    if data_world(meta) != expected["world_size"]:
        _check_reshardable(meta, expected["world_size"])
    if meta["tricks"] != expected["tricks"] and not allow_trick_change:
        raise UserError(
            f"checkpoint tricks {meta['tricks']} differ from this run's {expected['tricks']}; "
            "set ckpt.allow_trick_change=true to resume anyway"
        )


def data_world(meta: dict[str, Any]) -> int:
    """The shares of the data the checkpoint's run split its batches into: its world size,
    but for a pipeline, whose stages see the same data."""
    return meta.get("data_parallel_size", meta["world_size"])


def _check_reshardable(meta: dict[str, Any], world_size: int) -> None:
    """A checkpoint resumes on another number of ranks when its per-rank state can be split anew.

    Tensors always can: DCP stores global tensors, whatever the mesh that wrote them. The
    data position can when the windows consumed so far this epoch divide among the new
    ranks (`WindowSampler.global_position`). Tricks keep state per rank, which cannot.
    """
    written = f"checkpoint was written by {data_world(meta)} ranks, this run has {world_size}"
    if meta["tricks"]:
        raise UserError(
            f"{written}: the state of its tricks ({', '.join(meta['tricks'])}) is per rank and cannot be "
            f"resharded; resume on {data_world(meta)} ranks"
        )
    data = meta.get("data")
    if data is None:
        raise UserError(f"{written}: it predates resharding (no data position); resume on {data_world(meta)} ranks")
    if data.get("stream"):
        raise UserError(f"{written}: each rank's position in its share of a data=hf stream is its own and "
                        f"cannot be split anew; resume on {data_world(meta)} ranks")
    if data["windows"] % world_size:
        raise UserError(
            f"{written}: the {data['windows']} windows consumed in its epoch do not split evenly over "
            f"{world_size} ranks; resume on a number of ranks that divides {data['windows']}"
        )

