"""`ciuic-train-export CHECKPOINT [--format pt|hf] [--out PATH]`: a checkpoint's model weights, whole.

--format pt (the default): one file holding `{"model_config": ..., "state_dict": ..., "step": N}`;
it loads with `torch.load(path, weights_only=True)`, without torch.distributed or this package's
training code: `Transformer(ModelConfig(**d["model_config"])).load_state_dict(d["state_dict"])`.

--format hf: a Hugging Face folder (config.json, generation_config.json, model.safetensors,
sharded above --max-shard-size) that `transformers.AutoModelForCausalLM.from_pretrained`
loads as DeepseekV3ForCausalLM, and `init_from=` reads back (ciuic_train/checkpoint/hf.py); with the
run's tokenizer (tokenizer.json, tokenizer_config.json) for `AutoTokenizer`, unless it was bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ciuic_train.errors import UserError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ciuic-train-export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (step_<N>) or a run folder (its latest checkpoint)")
    parser.add_argument("--format", choices=("pt", "hf"), default="pt",
                        help="pt: one torch file (default); hf: a Hugging Face DeepseekV3 folder")
    parser.add_argument("--out", help="output file or folder (default: <run folder>/model_step<N>.pt, or hf_step<N>/)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="hf: the largest safetensors file, bytes or e.g. 500MB, 5GB (default 5GB, as transformers)")
    args = parser.parse_args(argv)
    from ciuic_train.checkpoint.checkpointer import export_model, resolve_resume

    try:
        path = resolve_resume(args.checkpoint, Path(args.checkpoint))
        step = int(path.name.rpartition("_")[2])
        run_dir = path.parent.parent
        if args.format == "pt":
            written = export_model(path, Path(args.out) if args.out else run_dir / f"model_step{step}.pt")
        else:
            written = export_hf(path, Path(args.out) if args.out else run_dir / f"hf_step{step}", args.max_shard_size)
    except UserError as err:
        print(f"ciuic-train-export: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {written}")


def export_hf(path: Path, out: Path, max_shard_size: str) -> Path:
    """The checkpoint at `path` as a Hugging Face folder; generation_config.json samples as the run did."""
    from omegaconf import OmegaConf

    from ciuic_train.checkpoint.checkpointer import load_model, read_meta
    from ciuic_train.checkpoint.hf import config_json, generation_config, parse_size, write_hf_folder
    from ciuic_train.model.config import ModelConfig
    from ciuic_train.data.tokenizer import export_tokenizer

    limit = parse_size(max_shard_size)
    config_json(ModelConfig(**read_meta(path)["model"]))  # what transformers cannot express fails before loading
    run_config = path.parent.parent / ".hydra" / "config.yaml"
    sample = OmegaConf.to_container(OmegaConf.load(run_config)).get("sample") if run_config.is_file() else None
    model, _ = load_model(path)
    written = write_hf_folder(model, out, limit, generation_config(sample))
    export_tokenizer(path.parent.parent, written, model.config.max_seq_len)  # the run's, for AutoTokenizer
    return written


if __name__ == "__main__":
    main()
