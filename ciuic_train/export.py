"""`ciuic-train-export CHECKPOINT [--out FILE]`: one consolidated file of model weights.

The file holds `{"model_config": ..., "state_dict": ..., "step": N}` and loads with
`torch.load(path, weights_only=True)`, without torch.distributed or this package's
training code: `Transformer(ModelConfig(**d["model_config"])).load_state_dict(d["state_dict"])`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ciuic_train.errors import UserError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ciuic-train-export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (step_<N>) or a run folder (its latest checkpoint)")
    parser.add_argument("--out", help="output file (default: <run folder>/model_step<N>.pt)")
    args = parser.parse_args(argv)
    from ciuic_train.checkpoint import export_model, resolve_resume

    try:
        path = resolve_resume(args.checkpoint, Path(args.checkpoint))
        step = int(path.name.rpartition("_")[2])
        out = Path(args.out) if args.out else path.parent.parent / f"model_step{step}.pt"
        written = export_model(path, out)
    except UserError as err:
        print(f"ciuic-train-export: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
