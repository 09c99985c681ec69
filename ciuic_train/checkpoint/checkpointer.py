"""Complete, atomic, resumable checkpoints.

Layout of one checkpoint, `<run dir>/checkpoints/step_<N>/`:
- model and optimizer state through `torch.distributed.checkpoint` (DCP): under FSDP each
  rank writes its own shards, replicated DDP state is written once. The optimizer's
  state and hyperparameters are keyed by parameter name (DCP's flattened form), not by
  group index: a pipeline's ranks hold different parameters in their groups, and a
  checkpoint must load on any split;
- beside them, under `ft`, what the replica groups keep (`extra`: DiLoCo's weights the
  groups last agreed on and its outer momentum), by DCP too;
- `rank<R>.json`: what differs between ranks or is not a tensor: step, data position,
  every RNG stream, each trick's state;
- `meta.json`: what a resume must agree with (model shape, tricks), and what it needs to
  continue on another number of ranks (the data position of the whole world).

A checkpoint is written under a temporary name and renamed once every rank has
finished, so a crash mid-save leaves only a `.tmp-*` folder that nothing reads, and the
previous checkpoint intact. A save that fails (a full disk, a read-only or vanished
folder) fails on every rank together: the temporary folder is removed and the run stops
with one line (`RunFailed`), since a run that cannot save must not believe it can.
Loading never unpickles: DCP reads tensors, the rest is JSON.

`ckpt.async_save=true`: the save stages the state into CPU memory (`dcp.async_save`'s
default stager: a copy, not pinned) and returns; a background thread writes the shards,
then the rank files (their state, RNG streams included, taken when the save was
called), agrees with the other ranks' threads and publishes as above, over a process
group of its own (gloo), so that its collectives never meet the training's. At most one
save is in flight: the next one, the end of the run and a stop signal wait for it
(`wait`), and a failed background save stops the run there, on every rank at once,
with the previous checkpoint intact. A kill during the write leaves a `.tmp-*` folder,
as a kill during a synchronous save does.

Which checkpoint a run continues from, and whether it may, is `resume.py`'s; `load_model`
reads one checkpoint's model whole, for `export.py`.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import shutil
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ciuic_train.checkpoint.resume import complete_checkpoints, read_meta
from ciuic_train.errors import RunFailed, UserError, first_line
from ciuic_train.files import format_bytes, free_bytes, tree_bytes
from ciuic_train.model.config import ModelConfig

log = logging.getLogger("ciuic_train")

BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)
# The key of the replica groups' tensors (`extra`) in a checkpoint.
EXTRA = "ft"


@contextmanager
def _single_process_is_fine():
    """DCP warns each time it runs without a process group; one process is a normal case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _encode_rng() -> dict[str, Any]:
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": _jsonable(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _decode_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    random.setstate(_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class Checkpointer:
    """Saves and restores a trainer's whole state; every rank calls each method together."""

    def __init__(self, folder: Path, rank: int, world_size: int, keep_last: int, asynchronous: bool = False):
        self.folder = folder
        self.rank = rank
        self.world_size = world_size
        self.keep_last = keep_last
        self.saves = 0
        self.seconds = 0.0  # the time training stood still for saves
        self.asynchronous = asynchronous
        # The background saves' own group: created by every rank together, here.
        self.background_group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None
        if asynchronous and not dist.is_initialized():  # DCP's thread warns, where `_single_process_is_fine` cannot hear
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        self._in_flight: threading.Thread | None = None
        self._in_flight_step = 0
        self._background_failure: RunFailed | None = None

    def save(self, step: int, model, optimizer, rank_state: dict[str, Any], meta: dict[str, Any],
             extra: dict[str, Any] | None = None) -> Path:
        """Write `step_<step>`: temporary folder, shards and rank files, then meta.json and the rename.

        Each phase ends with the ranks agreeing that all of them succeeded; if any failed,
        every rank raises RunFailed after rank 0 has removed the temporary folder.
        """
        if self._in_flight is not None:
            busy, previous, began = self._in_flight.is_alive(), self._in_flight_step, time.perf_counter()
            self.wait()  # counts its own time; raises if that save failed
            if busy:  # said once it is over: a failed write may have filled the disk the log is on
                log.info(f"checkpoint step_{step:06d} came due while step_{previous:06d} was still being written; "
                         f"waited {time.perf_counter() - began:.2f} s for it")
        tic = time.perf_counter()
        final = self.folder / f"step_{step:06d}"
        tmp = self.folder / f".tmp-step_{step:06d}"

        def prepare() -> None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
                tmp.mkdir(parents=True)

        def write() -> None:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=BY_NAME)
            with _single_process_is_fine():
                dcp.save({"model": model_sd, "optim": optim_sd, **_extra(extra)}, checkpoint_id=str(tmp))
            (tmp / f"rank{self.rank}.json").write_text(json.dumps({**rank_state, "rng": _encode_rng()}))

        def publish() -> None:
            if self.rank == 0:
                (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "world_size": self.world_size}))
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                for old in complete_checkpoints(self.folder)[: -self.keep_last or None]:
                    shutil.rmtree(old, ignore_errors=True)

        if not self.asynchronous:
            for phase in (prepare, write, publish):
                self._on_every_rank(phase, final, tmp)
        else:
            rank_file = json.dumps({**rank_state, "rng": _encode_rng()})  # as they are now, not when written
            upload = []

            def stage() -> None:
                model_sd, optim_sd = get_state_dict(model, optimizer, options=BY_NAME)
                with _single_process_is_fine():
                    response = dcp.async_save({"model": model_sd, "optim": optim_sd, **_extra(extra)},
                                              checkpoint_id=str(tmp),
                                              process_group=self.background_group, no_dist=not dist.is_initialized())
                upload.append(getattr(response, "upload_completion", response))

            def write_in_background() -> None:
                upload[0].result()
                (tmp / f"rank{self.rank}.json").write_text(rank_file)

            for phase in (prepare, stage):
                self._on_every_rank(phase, final, tmp)
            self._in_flight_step = step
            self._in_flight = threading.Thread(target=self._finish_in_background, name=f"checkpoint step {step}",
                                               args=([write_in_background, publish], final, tmp))
            self._in_flight.start()
        self.saves += 1
        self.seconds += time.perf_counter() - tic
        return final

    def _finish_in_background(self, phases: list[Callable[[], None]], final: Path, tmp: Path) -> None:
        """The background thread of an asynchronous save: its phases agreed over the
        background group; a failure is kept for `wait` to raise."""
        try:
            for phase in phases:
                self._on_every_rank(phase, final, tmp, self.background_group)
        except RunFailed as failure:
            self._background_failure = failure
        except BaseException as err:  # the agreement itself failed (a rank gone): no rank may go on believing it saved
            self._background_failure = RunFailed(f"saving checkpoint {final} failed: {first_line(err)}; the run stops here")

    def wait(self) -> None:
        """Wait for the save in flight, if any (every rank together); raise RunFailed if it failed."""
        if self._in_flight is None:
            return
        tic = time.perf_counter()
        self._in_flight.join()
        self._in_flight = None
        self.seconds += time.perf_counter() - tic
        failure, self._background_failure = self._background_failure, None
        if failure is not None:
            raise failure

    def _on_every_rank(self, phase: Callable[[], None], final: Path, tmp: Path, group=None) -> None:
        """Run one phase of a save and agree on its outcome over `group` (the collective is
        also the barrier between phases); a failure anywhere fails the save everywhere."""
        try:
            phase()
            error = None
        except (Exception, CheckpointException) as err:  # DCP's own derives from BaseException
            error = _cause(err)
        errors = [error]
        if dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error, group=group)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if not failed:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier(group=group)  # the folder is gone before any rank reports
        raise RunFailed(self._failure_message(final, tmp, failed))

    def _failure_message(self, final: Path, tmp: Path, failed: list[tuple[int, str]]) -> str:
        rank, error = failed[0]
        where = f" on rank {rank}" if self.world_size > 1 else ""
        previous = [p for p in complete_checkpoints(self.folder) if p != final]
        size = tree_bytes(previous[-1]) if previous else None
        free = free_bytes(self.folder)
        space = f"{format_bytes(free)} free"
        if size:
            space = ("not enough space: " if free < size else "") + f"{space}, a checkpoint needs about {format_bytes(size)}"
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        left = f"; {tmp} could not be removed" if tmp.exists() else ""
        return f"saving checkpoint {final} failed{where}: {error} ({space}); {kept}{left}; the run stops here"

    def warn_if_space_is_short(self, model, latest: Path | None) -> None:
        """Warn when the run folder's filesystem cannot hold `keep_last + 1` checkpoints (a
        new one is complete before the oldest is pruned). Their size is the latest
        checkpoint's when resuming, else the model's state plus AdamW's two moments."""
        size = tree_bytes(latest) if latest is not None else 3 * sum(
            t.numel() * t.element_size() for t in model.state_dict().values()
        )
        needed, free = (self.keep_last + 1) * size, free_bytes(self.folder)
        if free < needed:
            log.warning(
                f"only {format_bytes(free)} free under {self.folder}: ckpt.keep_last={self.keep_last} needs room for "
                f"{self.keep_last + 1} checkpoints of about {format_bytes(size)} ({format_bytes(needed)})"
            )

    def load(self, path: Path, model, optimizer, state_of_rank: int | None = None,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Restore model and optimizer in place, and `extra` where the checkpoint has it
        (one written without leaves it as it is); return the JSON state of rank
        `state_of_rank` (default this rank's; another when the checkpoint was written by a
        different world)."""
        try:
            saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            # A checkpoint written before the optimizer was keyed by name has its groups by index.
            options = StateDictOptions() if "optim.param_groups.0.lr" in saved else BY_NAME
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            has_extra = any(key.startswith(f"{EXTRA}.") for key in saved)
            state = {"model": model_sd, "optim": optim_sd, **(_extra(extra) if has_extra else {})}
            with _single_process_is_fine():
                dcp.load(state, checkpoint_id=str(path))
            rank = self.rank if state_of_rank is None else state_of_rank
            rank_state = json.loads((path / f"rank{rank}.json").read_text())
        except (Exception, CheckpointException) as err:  # DCP's own derives from BaseException
            raise _damaged(path, err) from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
        _decode_rng(rank_state.pop("rng"))
        return rank_state


def _extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    return {EXTRA: extra} if extra else {}


def _damaged(path: Path, err: BaseException) -> UserError:
    return UserError(f"checkpoint {path} is corrupt or incomplete ({_cause(err)})")


def _cause(err: BaseException) -> str:
    """The cause in one line; for DCP's exception, that of the first rank it lists."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    return first_line(err)[:200]


def load_model(path: Path):
    """The checkpoint's model, whole on the CPU in one process (whatever mesh wrote it), and its meta."""
    from ciuic_train.model import Transformer

    meta = read_meta(path)
    with torch.device("meta"):
        model = Transformer(ModelConfig(**meta["model"]))
    model.to_empty(device="cpu")
    model.init_unsaved_buffers()  # the rest, every parameter among it, comes from the checkpoint (DCP loads strictly)
    state = {"model": model.state_dict()}
    try:
        with _single_process_is_fine():
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as err:
        raise _damaged(path, err) from None
    return model, meta
