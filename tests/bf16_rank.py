"""Under torchrun: a short sharded run through the Trainer in fp32, then in bf16 (one
launch, one process group), recording the dtypes each block's parameters have while its
forward runs (what FSDP2 gathered) and after the steps (what the optimizer updates).

`python bf16_rank.py OUT OVERRIDES...`; each precision trains in OUT/<precision>, and rank
0 writes OUT/<precision>.json: the dtypes seen, split into the routed experts and the
rest, the losses logged and the final validation loss. tests/test_distributed.py compares
the two.
"""

import gc
import json
import sys
from pathlib import Path

import torch.distributed as dist

from ciuic_train.model.moe import MoE
from ciuic_train.train.trainer import Trainer
from conftest import compose_config


def record(out: Path, precision: str, *overrides: str):
    """Train at `precision`, write what was seen; returns the run's Parallel."""
    run_dir = out / precision
    run_dir.mkdir(parents=True, exist_ok=True)  # as the CLI makes it
    trainer = Trainer(compose_config(*overrides, f"precision={precision}"), run_dir)
    gathered: dict[str, set[str]] = {"experts": set(), "other": set()}

    def seen(block, args):
        experts = {id(p) for m in block.modules() if isinstance(m, MoE) for p in (m.w13, m.w2)}
        for p in block.parameters():
            gathered["experts" if id(p) in experts else "other"].add(str(p.dtype))

    for block in trainer.model.blocks():
        block.register_forward_pre_hook(seen)  # after FSDP2's own: sees the gathered parameters
    summary = trainer.fit()
    kept = sorted({str(p.dtype) for p in trainer.model.parameters()})
    if trainer.parallel.is_main:
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        (out / f"{precision}.json").write_text(json.dumps({
            "gathered": {kind: sorted(dtypes) for kind, dtypes in gathered.items()},
            "kept": kept,
            "losses": [m["loss"] for m in metrics],
            "val_loss": summary["final_val_loss"],
            "strategy": summary["strategy"], "mesh": summary["mesh"],
        }))
    return trainer.parallel


def main(out: str, *overrides: str) -> None:
    parallel = record(Path(out), "fp32", *overrides)  # it started the group: it ends it
    gc.collect()  # the fp32 run's FSDP state holds the group: gone before the bf16 run's
    dist.barrier()
    record(Path(out), "bf16", *overrides)
    gc.collect()
    parallel.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
