"""What a run says of itself: the lines it logs as it starts, one line of metrics.jsonl per
logged step, and the summary it ends with (summary.json, and the trackers' last word).

The trainer decides when (`Cadence`); this module decides what, from the run's parts. The
start lines and the summary gather every rank's peak memory, and the summary the replicas'
checksum: collectives, so every rank calls them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ciuic_train.checkpoint.checkpointer import Checkpointer
from ciuic_train.config import Config
from ciuic_train.data.corpus import TokenSplits, unigram_entropy
from ciuic_train.distributed.params import param_bytes, param_checksum, peak_memory_bytes
from ciuic_train.distributed.process_group import Parallel
from ciuic_train.files import format_bytes, write_json_atomic
from ciuic_train.model import Transformer, count_mtp_parameters, count_parameters
from ciuic_train.train.loss_watch import LossWatch
from ciuic_train.train.throughput import Throughput
from ciuic_train.train.metrics import MetricsFile
from ciuic_train.train.stragglers import StepTimes
from ciuic_train.tricks.base import TrickSet

log = logging.getLogger("ciuic_train")


def _compile_figures(compiled: bool) -> dict[str, int]:
    """With `compile=true`, rank 0's: the graphs dynamo compiled (fresh or from inductor's
    cache, for training and for evaluation) and its graph breaks, each a place where a
    block runs Python between two graphs (`TORCH_LOGS=graph_breaks` names them)."""
    if not compiled:
        return {}
    from torch._dynamo.utils import counters

    return {"compiled_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


@dataclass(eq=False)  # a holder of the run's parts, compared by identity
class RunRecord:
    """The run's words, built from its parts. `model` is what this rank holds; `model_shape`
    the whole model's shape (the same object but under a pipeline), for the counts."""

    config: Config
    parallel: Parallel
    model: Transformer
    model_shape: Transformer
    data: TokenSplits
    tricks: TrickSet
    watch: LossWatch
    step_times: StepTimes
    checkpointer: Checkpointer
    tokens_per_step: int  # of a replica group (step/batch.py)

    def log_start(self) -> None:
        """The model, the data, and what building them took: a collective."""
        n_params, n_active = count_parameters(self.model_shape)
        n_mtp, _ = count_mtp_parameters(self.model_shape)
        mtp = f" + {n_mtp:,} in {self.config.model.n_mtp_layers} MTP depth(s)" if n_mtp else ""
        log.info(
            f"model {self.config.model.name}: {n_params:,} params ({n_active:,} active){mtp} on {self.parallel.device} "
            f"({torch.get_num_threads()} threads); "
            f"data {self.data.description}: {self.data.size()}"
        )
        stored = sum(param_bytes(self.model).values())
        peaks = self.peak_memory_per_rank()
        log.info(f"built and initialized: {format_bytes(stored)} of parameters on rank 0; peak memory per rank "
                 f"so far {format_bytes(min(peaks))} to {format_bytes(max(peaks))} (rank {peaks.index(max(peaks))})")

    def metrics_line(self, step: int, figures: dict[str, Any], losses_since_log: list[float],
                     throughput: Throughput, val_loss: float | None, saving: bool) -> dict[str, Any]:
        """One line of metrics.jsonl: step `step`'s figures, the window's mean loss and speed.
        A collective (the ranks' step times): every rank calls it on a logged step."""
        return {
            "step": step,
            # The mean loss of the steps applied since the last log line (NaN: none was).
            "loss": sum(losses_since_log) / len(losses_since_log) if losses_since_log else float("nan"),
            "lr": figures["lr"],
            "grad_norm": figures["grad_norm"],
            "moe_imbalance": float(figures["moe_imbalance"]),
            **{key: figures[key] for key in ("mtp_loss", "aux_loss", "seq_aux_loss") if key in figures},
            **({"grad_consistency": figures["grad_consistency"]} if "grad_consistency" in figures else {}),
            # Under ft: the replica groups that took part in this step (their batches averaged).
            **{key: figures[key] for key in ("participants", "syncs") if key in figures},  # replica groups (ft)
            "tokens_per_s": throughput.window_rate(),
            "elapsed_s": throughput.elapsed_s(),
            **({"val_loss": val_loss} if val_loss is not None else {}),
            "checkpoints": self.checkpointer.saves + saving,  # this step's included
            **self.step_times.share(),
            **self.watch.metrics(),
            **self.tricks.metrics(),
        }

    def finish(self, step: int, run: dict[str, Any], resumed_from: Path | None, run_dir: Path,
               metrics: MetricsFile) -> dict[str, Any]:
        """Check that the replicas agree, then write the summary of the `run`'s figures
        (unless a signal stopped it); returns the summary."""
        checksum = param_checksum(self.model, self.parallel.gather)  # also fails if replicas differ
        n_params, n_active = count_parameters(self.model_shape)
        summary = {
            "steps": step,
            **run,
            # Of a stream: its validation tokens, the only ones read whole.
            "unigram_entropy": unigram_entropy(self.data.whole_split(), self.data.vocab_size),
            "world_size": self.parallel.world_size,
            "strategy": self.parallel.strategy,
            "mesh": self.parallel.mesh.shape.as_dict(),
            "tokens_per_step": self.tokens_per_step,
            "param_bytes_per_rank": param_bytes(self.model),
            "peak_memory_bytes_per_rank": self.peak_memory_per_rank(),
            "tricks": self.tricks.names,
            "trick_params": self.tricks.resolved_params(),
            "n_params": n_params,
            "n_active_params": n_active,
            "n_mtp_params": count_mtp_parameters(self.model_shape)[0],
            "param_checksum": checksum,
            "model": self.config.model.name,
            "kernels": self.config.model.kernels,
            "device": str(self.parallel.device),
            "precision": self.config.precision.value,
            **_compile_figures(self.config.compile),
            **self.watch.metrics(),
            "checkpoint_saves": self.checkpointer.saves,
            "checkpoint_seconds": self.checkpointer.seconds,
            "resumed_from": str(resumed_from) if resumed_from else None,
        }
        if self.parallel.is_main and run["stopped_by"]:
            log.warning(
                f"stopped by {run['stopped_by']} after step {step}; checkpoint saved; continue with "
                f"resume=auto hydra.run.dir={run_dir}"
            )
        elif self.parallel.is_main:
            written = _summary_of(run_dir / "summary.json", step, checksum)
            if written is not None:  # a run resumed at its end: its first summary stands
                log.info(f"summary.json of step {step} and these weights stands: {run_dir / 'summary.json'}")
                return written
            write_json_atomic(run_dir / "summary.json", summary)
            metrics.write_summary(summary)
            log.info("summary " + json.dumps(summary))
        return summary

    def peak_memory_per_rank(self) -> list[int]:
        """Each rank's peak memory so far (`peak_memory_bytes`), gathered: a collective."""
        return [int(peak) for peak in self.parallel.gather(str(peak_memory_bytes(self.parallel.device)))]


def _summary_of(path: Path, step: int, checksum: str) -> dict[str, Any] | None:
    """The summary at `path` if it is of step `step` and weights of `checksum`, else None."""
    try:
        written = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    same = isinstance(written, dict) and written.get("steps") == step and written.get("param_checksum") == checksum
    return written if same else None
