"""The training loop: one optimizer step is micro-batches of forward, loss, backward; clip; step.

Tricks change behaviour only through the seams of `TrickSet` (init, sample order, lr,
loss, micro-batch weights); the loop below reads the same with or without them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from ciuic_train.checkpoint import Checkpointer, check_compatible, read_meta, resolve_resume, run_fingerprint
from ciuic_train.config import Config, Device, FaultConfig, Precision
from ciuic_train.data import (
    WindowSampler,
    eval_indices,
    get_batch,
    load_tokens,
    n_windows,
    unigram_entropy,
)
from ciuic_train.errors import UserError
from ciuic_train.files import written_atomically
from ciuic_train.metrics import MetricsFile, ProgressDisplay
from ciuic_train.model import Transformer, count_parameters, generate
from ciuic_train.optim import WarmupCosine, build_optimizer
from ciuic_train.parallel import Parallel, param_checksum
from ciuic_train.tricks import TrickContext, build_tricks

log = logging.getLogger("ciuic_train")


def resolve_device(choice: Device, local_rank: int = 0) -> torch.device:
    if choice is Device.cuda and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA device is available; use device=cpu or device=auto")
    if choice is Device.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


class Trainer:
    """Builds everything a run needs from the config, then `fit()` trains it."""

    def __init__(self, config: Config, run_dir: Path, parallel: Parallel | None = None):
        self.config = config
        self.run_dir = run_dir
        self.parallel = parallel or Parallel(config.dist, resolve_device(config.device))
        self.device = self.parallel.device
        train = config.train
        rank, world = self.parallel.info.rank, self.parallel.world_size

        random.seed(config.seed)
        torch.manual_seed(config.seed)

        self.data = load_tokens(config.data)
        if self.data.vocab_size > config.model.vocab_size:
            raise UserError(
                f"the data has token ids up to {self.data.vocab_size - 1} but "
                f"model.vocab_size={config.model.vocab_size}; set model.vocab_size={self.data.vocab_size} or more"
            )
        self.tricks = build_tricks(
            config.trick,
            TrickContext(config.seed, rank, world, train.max_steps, train.grad_accum, self.parallel),
        )

        # Every rank builds the same weights from the same seed; DDP also broadcasts rank 0's.
        self.module = Transformer(config.model).to(self.device)
        self.tricks.init_weights(self.module)
        self.module.activation_checkpointing = config.activation_checkpointing
        if config.compile:
            for block in self.module.layers:
                block.compile()
        self.model = self.parallel.wrap(self.module)
        self.parallel.register_comm_hook(self.model, self.tricks.comm_hook())
        self.optimizer = build_optimizer(self.module, config.optim, train.lr)
        self.schedule = WarmupCosine(train.lr, train.warmup_steps, train.max_steps, config.optim.min_lr_ratio)
        self.sampler = WindowSampler(
            n_windows(self.data.train, train.seq_len), config.seed, rank, world,
            order=self.tricks.order_indices, shuffle=config.data.shuffle,
        )
        # Each rank evaluates its own slice of the fixed validation windows.
        val_windows = eval_indices(self.data.val, train.seq_len, train.eval_batches * train.batch_size)
        self.val_windows = val_windows[rank::world]
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if config.precision is Precision.bf16
            else nullcontext()
        )
        self.tokens_per_step = train.batch_size * train.seq_len * train.grad_accum * world
        self.step = 0
        self.checkpointer = Checkpointer(run_dir / "checkpoints", rank, world, config.ckpt.keep_last)
        self.resumed_from = resolve_resume(config.resume, run_dir)
        if self.resumed_from is not None:
            self._resume(self.resumed_from)

    def _meta(self) -> dict[str, Any]:
        fingerprint = run_fingerprint(self.config.model, self.tricks.names, self.parallel.world_size)
        return {**fingerprint, "strategy": self.parallel.strategy.value}

    def save_checkpoint(self) -> Path:
        rank_state = {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "tricks": self.tricks.state_dict(),
        }
        return self.checkpointer.save(self.step, self.module, self.optimizer, rank_state, self._meta())

    def _resume(self, path: Path) -> None:
        check_compatible(read_meta(path), self._meta(), self.config.ckpt.allow_trick_change)
        state = self.checkpointer.load(path, self.module, self.optimizer)
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.tricks.load_state_dict(state["tricks"])
        if self.parallel.is_main:
            drop_metrics_after(self.run_dir / "metrics.jsonl", self.step)
        log.info(f"resumed from {path} at step {self.step}")

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        # The model computes the fp32 cross-entropy itself, over chunks of tokens (see its forward).
        with self.autocast:
            return self.model(inputs, targets, reduction=reduction)

    def _batch(self, indices: torch.Tensor, split) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = get_batch(split, indices, self.config.train.seq_len)
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `grad_accum` micro-batches; returns its figures (this rank's loss)."""
        train = self.config.train
        lr = self.tricks.lr_at(self.step, self.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        loss_sum = 0.0
        weights = self.tricks.micro_batch_weights(self.step, train.grad_accum)
        for i, weight in enumerate(weights):
            inputs, targets = self._batch(self.sampler.next_indices(train.batch_size), self.data.train)
            # Gradients cross ranks once per optimizer step, on the last micro-batch.
            with self.parallel.grad_sync(self.model, enabled=i == len(weights) - 1):
                loss = self.tricks.transform_loss(self._loss(inputs, targets), self.step)
                (loss * weight).backward()
            loss_sum += loss.item() * weight

        max_norm = train.grad_clip if train.grad_clip > 0 else float("inf")
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        imbalance = self.module.expert_load_imbalance()
        self.module.update_expert_bias(all_reduce=self.parallel.all_reduce_sum_)
        self.step += 1
        return {
            "loss": loss_sum / sum(weights),
            "lr": lr,
            "grad_norm": grad_norm,
            # Worst MoE layer's max/mean tokens per expert this step (1.0 is perfect balance).
            "moe_imbalance": max(imbalance.values(), default=1.0),
        }

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per token over the fixed validation windows, whatever the world size."""
        was_training = self.model.training
        self.model.eval()
        batch_size = self.config.train.batch_size
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i in range(0, len(self.val_windows), batch_size):
            inputs, targets = self._batch(self.val_windows[i : i + batch_size], self.data.val)
            totals[0] += self._loss(inputs, targets, reduction="sum").double()
            totals[1] += targets.numel()
        self.model.train(was_training)
        self.parallel.all_reduce_sum_(totals)
        return (totals[0] / totals[1]).item()

    def fit(self) -> dict[str, Any]:
        train = self.config.train
        n_params, n_active = count_parameters(self.module)
        log.info(
            f"model {self.config.model.name}: {n_params:,} params ({n_active:,} active) on {self.device} "
            f"({torch.get_num_threads()} threads); "
            f"data {self.data.description}: {len(self.data.train):,} train / {len(self.data.val):,} val tokens"
        )
        is_main = self.parallel.is_main
        metrics = MetricsFile(self.run_dir / "metrics.jsonl" if is_main else None)
        started = time.perf_counter()
        # Throughput counts the whole loop (data, step, logging) but not evaluation or saving.
        eval_seconds, window_start, window_paused, window_steps = 0.0, started, 0.0, 0
        window_loss, last_val, final_train_loss, stopped_by = 0.0, float("nan"), float("nan"), None
        self.model.train()
        with ProgressDisplay(train.max_steps, self.config.progress.value, enabled=is_main) as progress, \
                StopRequest() as stop:
            progress.advance(self.step)
            while self.step < train.max_steps:
                figures = self.train_step()
                window_steps += 1
                window_loss += figures["loss"]
                progress.advance(self.step)

                is_last = self.step == train.max_steps
                record: dict[str, Any] = {}
                if self.step % train.eval_every == 0 or is_last:
                    tic = time.perf_counter()
                    last_val = self.evaluate()
                    window_paused += time.perf_counter() - tic
                    record["val_loss"] = last_val
                stopped_by = stop.agreed(self.parallel)
                if is_last or stopped_by or self.tricks.should_save(self.step, self.config.ckpt.every):
                    tic = time.perf_counter()
                    self.save_checkpoint()
                    window_paused += time.perf_counter() - tic
                if self.step % train.log_every == 0 or is_last or record or stopped_by:
                    now = time.perf_counter()
                    record = {
                        "step": self.step,
                        "loss": self.parallel.mean(window_loss / window_steps),
                        "lr": figures["lr"],
                        "grad_norm": figures["grad_norm"],
                        "moe_imbalance": figures["moe_imbalance"],
                        "tokens_per_s": self.tokens_per_step * window_steps / (now - window_start - window_paused),
                        "elapsed_s": now - started,
                        **record,
                        "checkpoints": self.checkpointer.saves,
                        **self.tricks.metrics(),
                    }
                    metrics.write(record)
                    progress.report(record)
                    final_train_loss = record["loss"]
                    eval_seconds += window_paused
                    window_start, window_paused, window_steps, window_loss = now, 0.0, 0, 0.0
                if stopped_by:
                    break
                inject_fault(self.config.fault, self.parallel.info.rank, self.step)
        metrics.close()
        self.tricks.close()
        wall = time.perf_counter() - started

        checksum = param_checksum(self.module)
        self.parallel.require_same(checksum, "param_checksum")
        summary = {
            "steps": self.step,
            "stopped_by": stopped_by,
            "final_train_loss": final_train_loss,
            "final_val_loss": last_val,
            "unigram_entropy": unigram_entropy(self.data.train, self.data.vocab_size),
            "tokens_per_s": self.tokens_per_step * self.step / (wall - eval_seconds),
            "wall_s": wall,
            "world_size": self.parallel.world_size,
            "strategy": self.parallel.strategy.value,
            "tricks": self.tricks.names,
            "trick_params": self.tricks.resolved_params(),
            "n_params": n_params,
            "n_active_params": n_active,
            "param_checksum": checksum,
            "model": self.config.model.name,
            "device": str(self.device),
            "precision": self.config.precision.value,
            "checkpoint_saves": self.checkpointer.saves,
            "checkpoint_seconds": self.checkpointer.seconds,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
        }
        if is_main and stopped_by:
            log.warning(
                f"stopped by {stopped_by} after step {self.step}; checkpoint saved; continue with "
                f"resume=auto hydra.run.dir={self.run_dir}"
            )
        elif is_main:
            write_json_atomic(self.run_dir / "summary.json", summary)
            log.info("summary " + json.dumps(summary))
        return summary

    def sample(self) -> str | None:
        """Text generated from the configured prompt; None when tokens are not bytes or none are asked."""
        if self.config.data.name == "tokens" or self.config.sample.max_new_tokens == 0:
            return None
        cfg = self.config.sample
        prompt = torch.tensor([list(cfg.prompt.encode("utf-8"))], dtype=torch.long, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        with self.autocast:
            out = generate(self.module, prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None, generator)
        return bytes(out[0].tolist()).decode("utf-8", errors="replace")


class StopRequest:
    """A signal asks the loop to save a checkpoint and stop after the current step.

    SIGTERM: Slurm's cancel or preemption, or a plain `kill`; SIGUSR1: Slurm's warning
    before the time limit (`--signal=USR1@N`, submitit's default); SIGINT: Ctrl-C, where
    a second one interrupts at once. Ranks stop at the same step, under one signal name.
    """

    # Ranked: when ranks see different signals, the highest wins (a cancel must not
    # turn into a requeue).
    SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)

    def __init__(self):
        self.received = 0  # 1 + index in SIGNALS of the highest signal seen; 0: none
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = max(self.received, 1 + self.SIGNALS.index(signum))
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def agreed(self, parallel: Parallel) -> str | None:
        """The signal's name once any rank has one, the same on every rank."""
        highest = parallel.max(self.received)
        return self.SIGNALS[highest - 1].name if highest else None

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def inject_fault(fault: FaultConfig, rank: int, step: int) -> None:
    """Kill this process as a crash would, on the first attempt only, to test recovery."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and rank == fault.kill_rank and step == fault.at_step:
        log.warning(f"fault injection: rank {rank} kills itself after step {step}")
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def drop_metrics_after(path: Path, step: int) -> None:
    """On resume, forget logged steps the checkpoint does not contain, so none is duplicated."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    with written_atomically(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


def full_value(tensor: torch.Tensor) -> float:
    """A scalar as a float, gathering it first if it is a sharded (FSDP2) DTensor."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).item()


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    with written_atomically(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
