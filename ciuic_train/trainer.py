"""The training loop: one optimizer step is micro-batches of forward, loss, backward; clip; step.

Tricks change behaviour only through the seams of `TrickSet` (init, sample order, lr,
loss, micro-batch weights); the loop below reads the same with or without them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ciuic_train.config import Config, Device, Precision
from ciuic_train.data import (
    WindowSampler,
    eval_indices,
    get_batch,
    load_tokens,
    n_windows,
    unigram_entropy,
)
from ciuic_train.errors import UserError
from ciuic_train.metrics import MetricsFile, ProgressDisplay
from ciuic_train.model import Transformer, count_parameters, generate
from ciuic_train.optim import WarmupCosine, build_optimizer
from ciuic_train.tricks import TrickContext, build_tricks

log = logging.getLogger("ciuic_train")


def resolve_device(choice: Device) -> torch.device:
    if choice is Device.cuda and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA device is available; use device=cpu or device=auto")
    if choice is Device.auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice.value)


def param_checksum(model: torch.nn.Module) -> str:
    """A hash of every parameter's name and bytes: equal only for bit-identical weights."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


class Trainer:
    def __init__(self, config: Config, run_dir: Path):
        self.config = config
        self.run_dir = run_dir
        self.device = resolve_device(config.device)
        train = config.train

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
            TrickContext(config.seed, rank=0, world_size=1, max_steps=train.max_steps, grad_accum=train.grad_accum),
        )

        self.model = Transformer(config.model).to(self.device)
        self.tricks.init_weights(self.model)
        self.optimizer = build_optimizer(self.model, config.optim, train.lr)
        self.schedule = WarmupCosine(train.lr, train.warmup_steps, train.max_steps, config.optim.min_lr_ratio)
        self.sampler = WindowSampler(
            n_windows(self.data.train, train.seq_len), config.seed, order=self.tricks.order_indices
        )
        self.val_windows = eval_indices(self.data.val, train.seq_len, train.eval_batches * train.batch_size)
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if config.precision is Precision.bf16
            else nullcontext()
        )
        self.tokens_per_step = train.batch_size * train.seq_len * train.grad_accum
        self.step = 0

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.autocast:
            logits = self.model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def _batch(self, indices: torch.Tensor, split) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = get_batch(split, indices, self.config.train.seq_len)
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `grad_accum` micro-batches; returns its figures."""
        train = self.config.train
        lr = self.tricks.lr_at(self.step, self.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        loss_sum = 0.0
        weights = self.tricks.micro_batch_weights(self.step, train.grad_accum)
        for weight in weights:
            inputs, targets = self._batch(self.sampler.next_indices(train.batch_size), self.data.train)
            loss = self.tricks.transform_loss(self._loss(inputs, targets), self.step)
            (loss * weight).backward()
            loss_sum += loss.item() * weight

        max_norm = train.grad_clip if train.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        imbalance = self.model.expert_load_imbalance()
        self.model.update_expert_bias()
        self.step += 1
        return {
            "loss": loss_sum / sum(weights),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            # Worst MoE layer's max/mean tokens per expert this step (1.0 is perfect balance).
            "moe_imbalance": max(imbalance.values(), default=1.0),
        }

    @torch.no_grad()
    def evaluate(self) -> float:
        was_training = self.model.training
        self.model.eval()
        batch_size = self.config.train.batch_size
        losses = [
            self._loss(*self._batch(self.val_windows[i : i + batch_size], self.data.val)).item()
            for i in range(0, len(self.val_windows), batch_size)
        ]
        self.model.train(was_training)
        return sum(losses) / len(losses)

    def fit(self) -> dict[str, Any]:
        train = self.config.train
        n_params, n_active = count_parameters(self.model)
        log.info(
            f"model {self.config.model.name}: {n_params:,} params ({n_active:,} active) on {self.device}; "
            f"data {self.data.description}: {len(self.data.train):,} train / {len(self.data.val):,} val tokens"
        )
        metrics = MetricsFile(self.run_dir / "metrics.jsonl")
        started = time.perf_counter()
        # Throughput counts the whole loop (data, step, logging) but not evaluation.
        eval_seconds, window_start, window_eval, window_steps = 0.0, started, 0.0, 0
        window_loss, last_val = 0.0, float("nan")
        self.model.train()
        with ProgressDisplay(train.max_steps, self.config.progress.value) as progress:
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
                    window_eval += time.perf_counter() - tic
                    record["val_loss"] = last_val
                if self.step % train.log_every == 0 or is_last or record:
                    now = time.perf_counter()
                    record = {
                        "step": self.step,
                        "loss": window_loss / window_steps,
                        "lr": figures["lr"],
                        "grad_norm": figures["grad_norm"],
                        "moe_imbalance": figures["moe_imbalance"],
                        "tokens_per_s": self.tokens_per_step * window_steps / (now - window_start - window_eval),
                        "elapsed_s": now - started,
                        **record,
                        **self.tricks.metrics(),
                    }
                    metrics.write(record)
                    progress.report(record)
                    final_train_loss = record["loss"]
                    eval_seconds += window_eval
                    window_start, window_eval, window_steps, window_loss = now, 0.0, 0, 0.0
        metrics.close()
        wall = time.perf_counter() - started

        summary = {
            "steps": self.step,
            "final_train_loss": final_train_loss,
            "final_val_loss": last_val,
            "unigram_entropy": unigram_entropy(self.data.train, self.data.vocab_size),
            "tokens_per_s": self.tokens_per_step * self.step / (wall - eval_seconds),
            "wall_s": wall,
            "world_size": 1,
            "tricks": self.tricks.names,
            "n_params": n_params,
            "n_active_params": n_active,
            "param_checksum": param_checksum(self.model),
            "model": self.config.model.name,
            "device": str(self.device),
            "precision": self.config.precision.value,
        }
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
            out = generate(self.model, prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None, generator)
        return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
