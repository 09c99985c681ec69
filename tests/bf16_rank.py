"""Under torchrun: a short sharded run through the Trainer in fp32, then in bf16 (one
launch, one process group: tests/train_layouts.py), recording the dtypes each block's
parameters have while its forward runs (what FSDP2 gathered) and after the steps (what
the optimizer updates).

`python bf16_rank.py OUT OVERRIDES...`; each precision trains in OUT/<precision>, and rank
0 writes OUT/<precision>.json: the dtypes seen, split into the routed experts and the
rest, the losses logged and the final validation loss. tests/test_distributed.py compares
the two.
"""

import json
import sys
from pathlib import Path

from ciuic_train.model.moe import MoE
from ciuic_train.train.trainer import Trainer
from train_layouts import train_layouts


def fit_recording(trainer: Trainer) -> None:
    """`trainer.fit()`, and what it saw written beside its run folder, named after it."""
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
        run_dir = trainer.run_dir
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        run_dir.with_suffix(".json").write_text(json.dumps({
            "gathered": {kind: sorted(dtypes) for kind, dtypes in gathered.items()},
            "kept": kept,
            "losses": [m["loss"] for m in metrics],
            "val_loss": summary["final_val_loss"],
            "strategy": summary["strategy"], "mesh": summary["mesh"],
        }))


if __name__ == "__main__":
    out, *overrides = sys.argv[1:]
    train_layouts(Path(out), {precision: [f"precision={precision}"] for precision in ("fp32", "bf16")}, *overrides,
                  fit=fit_recording)
