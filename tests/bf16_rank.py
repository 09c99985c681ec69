"""Under torchrun: a short sharded run through the Trainer, recording the dtypes each
block's parameters have while its forward runs (what FSDP2 gathered) and after the step
(what the optimizer updates).

`python bf16_rank.py OUT RUN_DIR OVERRIDES...`; rank 0 writes JSON to OUT: the dtypes
seen, split into the routed experts and the rest, the losses logged and the final
validation loss. tests/test_distributed.py compares an fp32 run with a bf16 one.
"""

import json
import sys
from pathlib import Path

import torch

from ciuic_train.model.moe import MoE
from ciuic_train.train.trainer import Trainer
from conftest import compose_config


def main(out: str, run_dir: str, *overrides: str) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # as the CLI makes it
    trainer = Trainer(compose_config(*overrides), Path(run_dir))
    gathered: dict[str, set[str]] = {"experts": set(), "other": set()}

    def record(block, args):
        experts = {id(p) for m in block.modules() if isinstance(m, MoE) for p in (m.w13, m.w2)}
        for p in block.parameters():
            gathered["experts" if id(p) in experts else "other"].add(str(p.dtype))

    for block in trainer.model.blocks():
        block.register_forward_pre_hook(record)  # after FSDP2's own: sees the gathered parameters
    summary = trainer.fit()
    kept = sorted({str(p.dtype) for p in trainer.model.parameters()})
    if trainer.parallel.is_main:
        metrics = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        Path(out).write_text(json.dumps({
            "gathered": {kind: sorted(dtypes) for kind, dtypes in gathered.items()},
            "kept": kept,
            "losses": [m["loss"] for m in metrics],
            "val_loss": summary["final_val_loss"],
            "strategy": summary["strategy"], "mesh": summary["mesh"],
        }))
    trainer.parallel.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
