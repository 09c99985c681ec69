"""The training loop.

One optimizer step (`Trainer.train_step`). From the first micro-batch to the cleared
gradients it is `step/training_step.py`'s, the code `--simulate` runs too; what only the
trainer does sits at that step's seams (`train/step_seams.py`, marked `seam:` below):

    quorum of the replica groups (ft.*)     a group behind the others receives their live
                                            state here (ciuic_train/ft/replicas.py)
    lr for this step                        <- tricks.lr_at
    weights of its micro-batches            <- tricks.micro_batch_weights
    for each micro-batch:
        next windows of this rank's share   (sampler, ordered by tricks.order_indices each epoch;
                                            or cut from its share of a stream)
        loss = model(inputs, targets)       <- tricks.transform_loss
                                            (under dist.ep, routed tokens visit their experts' ranks)
        backward(loss * weight)             gradients cross ranks on the last micro-batch only
                                            (DDP's all-reduce, or tricks.comm_hook in its place;
                                            FSDP2's reduce-scatter, plus all-reduce under HSDP;
                                            by hand where train.log_grad_consistency measures)
    seam: across replica groups (ft.*): gradients and losses averaged, the experts' token counts summed
    clip the global gradient norm (across every mesh: ciuic_train/distributed/grads.py)
    seam: ranks agree: mean losses, finite?, stop?  (`LossWatch.agree`, the step's one small collective)
    seam: the replica groups commit: a group lost during the step drops it (data rewound), and it runs again
    if finite: optimizer step; MoE: one balancing step from the tokens each expert received
    else: no update; stop the run, or skip the step (train.on_nonfinite)
    clear the gradients (set to None; DDP's, views of its buckets, zeroed in place)
    the replica groups' step boundary: under ft.sync=diloco they meet every few steps and
    average how far their weights moved (ciuic_train/ft/diloco.py)

The run (`Trainer.fit`): steps until `train.max_steps`; after each, the profiler's step
(`profile.*`: ciuic_train/train/profiler.py), then evaluate, log (what a line and the
summary hold: ciuic_train/train/run_record.py) and save (<- tricks.should_save) when `Cadence`
says so; a stop signal (`StopRequest`) saves and ends the run after the current step. A
non-finite step never reaches the weights, so no checkpoint ever holds them.

The model is built on the meta device and `parallelize` materializes each rank's shards
(ciuic_train/distributed/materialize.py); `Trainer._initialize` then fills them, once:
the model's init, then `tricks.init_weights`, then `init_from`'s weights. The seams are
defined in ciuic_train/tricks/base.py.
"""

from __future__ import annotations

import logging
import random
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch

from ciuic_train.checkpoint.checkpointer import Checkpointer
from ciuic_train.checkpoint.hf_weights import load_hf_weights, plan_load
from ciuic_train.checkpoint.resume import (
    check_resumable,
    data_world,
    read_meta,
    rerun_from,
    resolve_resume,
    run_fingerprint,
)
from ciuic_train.config import Config, OnNonFinite, Precision
from ciuic_train.data.corpus import load_tokens
from ciuic_train.data.sampler import eval_indices, get_batch, train_windows, window_documents
from ciuic_train.data.tokenizer import check_model_vocab, save_tokenizer
from ciuic_train.distributed.materialize import local_rows
from ciuic_train.distributed.params import peak_memory_bytes
from ciuic_train.distributed.process_group import Parallel
from ciuic_train.errors import RunFailed, first_line
from ciuic_train.faults import cap_address_space, inject_fault
from ciuic_train.files import format_bytes
from ciuic_train.ft.groups import replica_groups
from ciuic_train.ft.live_state import load_local_state, local_state
from ciuic_train.model import Transformer, generate
from ciuic_train.model.common import IGNORE_INDEX
from ciuic_train.model.init import ParameterInit
from ciuic_train.plan.memory_check import OutOfMemoryGuard
from ciuic_train.train.cadence import Cadence
from ciuic_train.train.loss_watch import LossWatch, StepCheck
from ciuic_train.train.stop_request import StopRequest
from ciuic_train.train.throughput import Throughput
from ciuic_train.train.metrics import MetricsFile, ProgressDisplay, drop_metrics_after, logged_loss
from ciuic_train.step.batch import tokens_per_step
from ciuic_train.step.layout import build_layout
from ciuic_train.step.optim import LrSchedule, build_optimizer
from ciuic_train.step.training_step import APPLY, MicroBatch, training_step
from ciuic_train.train.device import resolve_device, use_tf32  # resolve_device: also the CLI's
from ciuic_train.train.profiler import profiled_steps
from ciuic_train.train.run_record import RunRecord
from ciuic_train.train.step_seams import RETRY, TrainerSeams
from ciuic_train.train.stragglers import StepTimes
from ciuic_train.train.trackers import Trackers
from ciuic_train.tricks import TrickContext, build_tricks

log = logging.getLogger("ciuic_train")


class Trainer:
    """Builds everything a run needs from the config, then `fit()` trains it.

    `model` is the plain `Transformer` (checkpoints, counts, sampling); `wrapped_model`
    is what the training step calls, as `parallelize` wrapped it (DDP's replica, or the
    same model sharded in place by FSDP, or the model itself).
    """

    def __init__(self, config: Config, run_dir: Path, parallel: Parallel | None = None):
        self.config = config
        self.run_dir = run_dir
        self.parallel = parallel or Parallel(config.dist, resolve_device(config.device), config.model.n_routed_experts)
        self.device = self.parallel.device
        use_tf32(self.device, config.tf32)
        train = config.train
        # The replica groups (ft.*), first: a group is known to the others before it builds.
        self.replicas = replica_groups(config.ft, self.parallel, train.max_steps, self._live_state,
                                       self._load_live_state, self._rejoin_without_peer)
        # The share of the data this rank sees: a pipeline's stages see the same; the groups
        # of `ft` each their own.
        rank, world = self.replicas.data_share(self.parallel.data_rank, self.parallel.data_world)
        self.data_world = world

        random.seed(config.seed)
        torch.manual_seed(config.seed)

        self.data = load_tokens(config.data, stream_val_tokens=train.eval_windows * train.seq_len + 1)
        check_model_vocab(config.model.vocab_size, self.data.tokenizer, self.data.vocab_size)
        self.tricks = build_tricks(
            config.trick,
            TrickContext(config.seed, rank, world, train.max_steps, train.grad_accum, self.parallel),
        )

        # Built on meta: nothing is allocated until each rank materializes its own shards.
        with torch.device("meta"):
            self.model = Transformer(config.model)
        # The replica groups of `ft` share one checkpoint folder (ft.checkpoints).
        self.checkpoint_root = Path(config.ft.checkpoints) if config.ft.enabled and config.ft.checkpoints else run_dir
        self.resumed_from = resolve_resume(config.resume, self.checkpoint_root)
        self.memory = OutOfMemoryGuard(config, self.parallel.info.rank, run_dir)  # an allocator's failure: one line
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if config.precision is Precision.bf16
            else nullcontext()
        )
        with self.memory.during("building the model"):
            layout = build_layout(self.model, self.parallel, config, self.tricks, self.autocast, self._initialize)
        self.passes, self.wrapped_model, self.model_shape = layout.passes, layout.wrapped_model, layout.whole_shape
        self.optimizer = build_optimizer(self.model, config.optim, train.lr)
        self.replicas.attach(self.model)
        self.lr_schedule = LrSchedule.from_config(config.optim, train.lr, train.warmup_steps, train.max_steps)
        self.windows = train_windows(self.data, config.data, train.seq_len, config.seed, rank, world,
                                     order=self.tricks.order_indices)
        # Each rank evaluates its own slice of the fixed validation windows (the same set for
        # every layout), in the same number of batches everywhere (sharded and
        # expert-parallel forwards are collectives).
        # (A replica group evaluates them all: it may be the only one left.)
        val_windows = eval_indices(self.data.val, train.seq_len, train.eval_windows)
        val_rank, val_world = self.parallel.data_rank, self.parallel.data_world
        self.val_windows = val_windows[val_rank::val_world]
        self.val_batches = -(-len(val_windows[0::val_world]) // train.batch_size)
        self.val_filler = val_windows[:1]
        # Of this replica group (all of them without `ft`).
        self.tokens_per_step = tokens_per_step(train, val_world)
        self.cadence = Cadence(train, config.ckpt, self.tricks.should_save)
        self.watch = LossWatch(train, self.parallel.is_main)
        self.step_times = StepTimes(train, self.parallel)
        self.step = 0
        self.metrics: MetricsFile | None = None  # open while `fit` runs
        self.checkpointer = Checkpointer(self.checkpoint_root / "checkpoints", self.parallel.info.rank,
                                         self.parallel.world_size, config.ckpt.keep_last, config.ckpt.async_save)
        self.record = RunRecord(config, self.parallel, self.model, self.model_shape, self.data, self.tricks,
                                self.watch, self.step_times, self.checkpointer, self.tokens_per_step)
        # A replica group that restarts beside live ones takes their state at its first
        # quorum; the checkpoint only if none of them is ahead (`_rejoin_without_peer`).
        rejoining = self.replicas.restarted()
        if self.resumed_from is not None and not rejoining:
            self._resume(self.resumed_from)
        elif self.parallel.is_main and self.resumed_from is None and not rejoining:  # a fresh start: lines a previous attempt logged are not this run's
            drop_metrics_after(run_dir / "metrics.jsonl", 0)
        if self.parallel.is_main:
            self.checkpointer.warn_if_space_is_short(self.model_shape, self.resumed_from)
            # For export, once nothing in the set-up can fail (a failed start leaves no folder).
            save_tokenizer(self.data.tokenizer, run_dir)

    def _initialize(self, model: Transformer) -> None:
        """The step-0 values of the rows of each parameter this rank holds: the model's init
        (the same global weights for every layout and world size), a trick's, then
        `init_from`'s weights, read by shard, for the parameters it holds (no value is drawn
        for those). A resume restores every weight itself (DCP loads strictly; a rejoining
        replica group takes a peer's or the checkpoint's): only the buffers no checkpoint
        holds are made."""
        if self.resumed_from is not None:
            model.init_unsaved_buffers()
            return
        init = ParameterInit(self.config.seed, local_rows)
        folder = Path(self.config.init_from).expanduser() if self.config.init_from else None
        plan = plan_load(model, folder) if folder else None
        model.init_weights(init, provided=frozenset(plan[1]) if plan else frozenset())
        self.tricks.init_weights(model, init)
        if folder:
            load_hf_weights(model, folder, local_rows, plan)
            log.info(f"weights from {self.config.init_from}; peak memory of this rank so far "
                     f"{format_bytes(peak_memory_bytes(self.device))}")

    def _meta(self) -> dict[str, Any]:
        fingerprint = run_fingerprint(self.config.model, self.tricks.names, self.data_world)
        return {**fingerprint, "data_parallel_size": self.data_world, "strategy": self.parallel.strategy,
                "mesh": self.parallel.mesh.shape.as_dict()}

    def _rank_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "sampler": self.windows.state_dict(),
            "tricks": self.tricks.state_dict(),
            "loss_watch": self.watch.state_dict(),
        }

    def save_checkpoint(self) -> Path:
        meta = {**self._meta(), "data": self.windows.global_position()}
        return self.checkpointer.save(self.step, self.model, self.optimizer, self._rank_state(), meta,
                                      self.replicas.tensors())

    def _live_state(self) -> dict[str, Any]:
        """What a replica group that heals receives from this rank (ciuic_train/ft/replicas.py)."""
        return {"model": local_state(self.model.state_dict()), "optimizer": local_state(self.optimizer.state_dict()),
                "rank": self._rank_state()}

    def _load_live_state(self, state: dict[str, Any]) -> None:
        load_local_state(self.model, self.optimizer, state["model"], state["optimizer"])
        self._load_rank_state(state["rank"])
        log.info(f"replica group {self.replicas.group}: live state of step {self.step} received from a peer")

    def _load_rank_state(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.windows.load_state_dict(state["sampler"])
        self.tricks.load_state_dict(state["tricks"])
        if "loss_watch" in state:  # absent from checkpoints that predate it
            self.watch.load_state_dict(state["loss_watch"])

    def _resume(self, path: Path) -> None:
        meta = read_meta(path)
        check_resumable(meta, self._meta(), self.config.ckpt.allow_trick_change)
        same_world = data_world(meta) == self.data_world
        # On another number of data shares, rank 0's state serves all (check_resumable allowed
        # it only where nothing in it is per rank but the data position, split anew here);
        # on as many, the first stage's rank of this rank's share (pp is outermost).
        state_of = self.parallel.data_rank if same_world else 0
        state = self.checkpointer.load(path, self.model, self.optimizer, state_of, self.replicas.tensors())
        self._load_rank_state({**state, "sampler": state["sampler"] if same_world else self.windows.share_of(meta["data"])})
        self.replicas.set_step(self.step)
        if self.metrics is not None:  # resumed once training (a deferred resume)
            self.metrics.drop_after(self.step)
        elif self.parallel.is_main:
            drop_metrics_after(self.run_dir / "metrics.jsonl", self.step)
        log.info(f"resumed from {path} at step {self.step}; peak memory of this rank so far "
                 f"{format_bytes(peak_memory_bytes(self.device))}")

    def _rejoin_without_peer(self) -> None:
        """A restarted replica group found no peer ahead (every group restarted): it
        resumes as a first start would."""
        if self.resumed_from is not None:
            self._resume(self.resumed_from)
        else:
            self.metrics.drop_after(0)

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return self.passes.loss(inputs, targets, reduction)

    def _to_device(self, inputs: torch.Tensor, targets: torch.Tensor, documents: dict[str, torch.Tensor]):
        return (inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True),
                {name: value.to(self.device, non_blocking=True) for name, value in documents.items()})

    def _batch(self, indices: torch.Tensor, split) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = get_batch(split, indices, self.config.train.seq_len)
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def _documents(self, indices: torch.Tensor, index) -> dict[str, torch.Tensor]:
        """With data.doc_mask, the model's document keywords for the windows (else none)."""
        if not self.config.data.doc_mask:
            return {}
        extra = window_documents(index, indices, self.config.train.seq_len, self.config.data.doc_positions)
        return {name: value.to(self.device, non_blocking=True) for name, value in extra.items()}

    def train_step(self, stop: StopRequest | None = None) -> dict[str, Any]:
        """One optimizer step over `grad_accum` micro-batches; returns its figures, the
        loss as the mean over ranks, and the stop signal the ranks agreed on (`stop`).

        The step waits for the device once, to agree with the other ranks on whether to
        apply the update (and with the figures it logs); `moe_imbalance` is left a 0-d
        tensor for the steps that log it.

        Raises RunFailed when a non-finite step ends the run (`train.on_nonfinite`).
        """
        train = self.config.train
        self.step_times.start()
        self.replicas.start_step()  # a replica group behind the others takes their state here
        data_position = self.windows.state_dict()
        lr = self.tricks.lr_at(self.step, self.lr_schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        weights = self.tricks.micro_batch_weights(self.step, train.grad_accum)
        # On a step that logs it, the gradients are averaged by hand after backward, next to each rank's own.
        measure_consistency = train.log_grad_consistency and self.cadence.logs(self.step + 1, False, False)
        seams = TrainerSeams(self, stop.votes() if stop else [], measure_consistency)
        outcome = training_step(self.passes, self.optimizer, self._micro_batches(weights), len(weights), self.step,
                                train.grad_clip if train.grad_clip > 0 else float("inf"), seams,
                                sync_gradients=not measure_consistency)
        check = seams.check
        if outcome.verdict == RETRY:  # a replica group was lost during the step: it runs again
            self.windows.load_state_dict(data_position)
            return {"committed": False, "stop_signal": check.stop_signal}
        if outcome.verdict == "stop":
            raise RunFailed(self._nonfinite_message(check, lr))
        self.step += 1
        self.replicas.end_step(self.step)  # DiLoCo's groups meet here
        return {"loss": check.loss, "lr": lr, "grad_norm": check.grad_norm, "moe_imbalance": outcome.moe_imbalance,
                "committed": True, "applied": outcome.verdict == APPLY, "stop_signal": check.stop_signal,
                **check.side_losses, **seams.figures, **self.replicas.step_figures()}

    def _micro_batches(self, weights: list[float]) -> Iterator[MicroBatch]:
        """The step's micro-batches from this rank's share of the data, fetched as the step
        reaches each (the time spent counted apart: `StepTimes`)."""
        for weight in weights:
            with self.step_times.fetching_data():
                inputs, targets, documents = self.windows.next_batch(self.config.train.batch_size)
                inputs, targets, documents = self._to_device(inputs, targets, documents)
            yield MicroBatch(inputs, targets, weight, documents)

    def _nonfinite_message(self, check: StepCheck, lr: float) -> str:
        """Why the run stops, and how to continue from the last checkpoint that is good."""
        step = self.step + 1
        what = f"step {step}: loss {check.loss:.4g}, grad norm {check.grad_norm:.4g} at lr {lr:.3g}"
        if self.config.train.on_nonfinite is OnNonFinite.skip:
            what += f", {self.watch.skipped_in_a_row} non-finite steps in a row (train.max_skipped_steps)"
        saved, resume = rerun_from(self.run_dir, self.config.resume)
        last_good = f"last good checkpoint {saved}" if saved else "no checkpoint was saved before it"
        return (
            f"training diverged at {what}; that update was not applied; {last_good}; continue with a lower "
            f"learning rate: rerun with train.lr={self.config.train.lr / 10:g} hydra.run.dir={self.run_dir}{resume}"
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per token over the fixed validation windows, whatever the world size."""
        was_training = self.wrapped_model.training
        self.wrapped_model.eval()
        batch_size = self.config.train.batch_size
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i in range(0, self.val_batches * batch_size, batch_size):
            windows = self.val_windows[i : i + batch_size]
            # A rank with fewer windows joins the collectives with rows that count for nothing,
            # as many as the layout needs (a pipeline's stages: whole batches).
            fill = batch_size - len(windows) if self.passes.full_batches else int(not len(windows))
            indices = torch.cat([windows, self.val_filler.repeat(fill)])
            inputs, targets = self._batch(indices, self.data.val)
            documents = self._documents(indices, self.data.val_docs)
            if fill:
                targets[len(windows):] = IGNORE_INDEX
            totals[0] += self.passes.eval_sum(inputs, targets, **documents).double()
            totals[1] += (targets != IGNORE_INDEX).sum() if self.passes.holds_loss else 0
        self.wrapped_model.train(was_training)
        self.parallel.all_reduce_sum_(totals)
        return (totals[0] / totals[1]).item()

    def fit(self) -> dict[str, Any]:
        """Train to `train.max_steps` (or a stop signal); returns the run's summary."""
        self.record.log_start()
        is_main = self.parallel.is_main
        trackers = Trackers.open(self.config.logger, self.run_dir, self.step, self.config) if is_main else None
        metrics = self.metrics = MetricsFile(self.run_dir / "metrics.jsonl" if is_main else None, trackers)
        try:
            summary = self._train(metrics)
        except BaseException:
            metrics.close(failed=True)  # so a tracker's run ends marked failed, not left running
            raise
        finally:
            self.replicas.close()
        metrics.close()
        return summary

    def _train(self, metrics: MetricsFile) -> dict[str, Any]:
        """`fit`'s loop, logging to `metrics`."""
        is_main = self.parallel.is_main
        throughput = Throughput(self.tokens_per_step)
        losses_since_log: list[float] = []  # mean over ranks of each applied step's loss
        last_val, last_logged_loss, stopped_by = float("nan"), float("nan"), None
        rank = self.parallel.info.rank
        if self.step >= self.config.train.max_steps:
            # Resumed at its end (its command run again, or a requeue after the final save):
            # nothing to train; the final figures are those of the weights it holds.
            log.info(f"step {self.step} is train.max_steps: nothing to train (raise train.max_steps to go on)")
            last_val = self.evaluate()
            last_logged_loss = logged_loss(self.run_dir / "metrics.jsonl", self.step) if is_main else float("nan")
        self.wrapped_model.train()
        with ProgressDisplay(self.config.train.max_steps, self.config.progress.value, enabled=is_main) as progress, \
                StopRequest() as stop, profiled_steps(self.config.profile, self.run_dir, rank, self.device) as profiled:
            progress.advance(self.step)
            while self.step < self.config.train.max_steps:
                cap_address_space(self.config.fault, rank, self.step + 1)
                with self.memory.during(f"step {self.step + 1}"):
                    figures = self.train_step(stop)
                if not figures["committed"]:  # nothing changed; the step runs again
                    continue
                profiled()
                throughput.count_step()
                if figures["applied"]:
                    losses_since_log.append(figures["loss"])
                progress.advance(self.step)

                evaluated = self.cadence.evaluates(self.step)
                if evaluated:
                    with throughput.paused(), self.memory.during(f"the evaluation after step {self.step}"):
                        last_val = self.evaluate()
                stopped_by = figures["stop_signal"]
                saves = self.cadence.saves(self.step, stopping=stopped_by is not None, applied=figures["applied"])
                # Logged before the save: a crash after a save but before its line would lose
                # the line for good (the resume starts after it); one before the save drops
                # the line with the step, and the resumed run logs it again.
                if self.cadence.logs(self.step, evaluated, stopping=stopped_by is not None):
                    line = self.record.metrics_line(self.step, figures, losses_since_log, throughput,
                                                    last_val if evaluated else None, saves)
                    metrics.write(line)
                    progress.report(line)
                    last_logged_loss = line["loss"]
                    losses_since_log.clear()
                if saves and self.replicas.saves():
                    with throughput.paused():
                        self.save_checkpoint()
                if stopped_by:
                    break
                inject_fault(self.config.fault, self.replicas.global_rank(rank), self.step)
            self.checkpointer.wait()  # the last save, written in the background, is complete before the run ends
        self.tricks.close()
        run = {
            "stopped_by": stopped_by,
            "final_train_loss": last_logged_loss,
            "final_val_loss": last_val,
            "tokens_per_s": throughput.run_rate(),
            "wall_s": throughput.elapsed_s(),
            **self.replicas.summary(),
        }
        return self.record.finish(self.step, run, self.resumed_from, self.run_dir, metrics)

    def sample(self) -> str | None:
        """Text generated from the configured prompt through the run's tokenizer; None when
        none is asked, when pre-tokenized data has no tokenizer to read it (data.tokenizer),
        or when sampling fails: a finished run never fails on its sample."""
        unreadable = self.config.data.name == "tokens" and self.config.data.tokenizer == "bytes"
        if unreadable or self.config.sample.max_new_tokens == 0:
            return None
        model = self.passes.sampling_model()  # a pipeline's: gathered on rank 0, a collective
        if model is None:
            return None
        cfg = self.config.sample
        tokenizer = self.data.tokenizer
        ids = tokenizer.encode(cfg.prompt)
        if not ids:
            log.warning(f"no sample: the prompt {cfg.prompt!r} encodes to no token")
            return None
        prompt = torch.tensor([ids], dtype=torch.long, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        try:
            with self.autocast:
                out = generate(model, prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None, generator)
        except RuntimeError as err:  # e.g. weights whose logits overflow: no distribution to sample from
            log.warning(f"no sample: {first_line(err)}")
            return None
        return tokenizer.decode(out[0].tolist())
