"""`ciuic-train-export CHECKPOINT [--format pt|hf] [--out PATH]`: a checkpoint's model weights, whole.

--format pt (the default): one file holding `{"model_config": ..., "state_dict": ..., "step": N}`;
it loads with `torch.load(path, weights_only=True)`, without torch.distributed or this package's
training code: `Transformer(ModelConfig(**d["model_config"])).load_state_dict(d["state_dict"])`.

--format hf: a Hugging Face folder (config.json, generation_config.json, model.safetensors,
split into several files above --max-shard-size) that
`transformers.AutoModelForCausalLM.from_pretrained` loads as DeepseekV3ForCausalLM, and
`init_from=` reads back; with the run's tokenizer (tokenizer.json, tokenizer_config.json)
for `AutoTokenizer`, unless it was bytes. The names and config.json it writes are
`hf_weights.py`'s and `hf_config.py`'s.

This module is the one way from a checkpoint to an export: both formats read the
checkpoint through `checkpointer.load_model`, and are written into a temporary name
renamed into place, so an interrupted export leaves no half-written file or folder.
(Hugging Face calls the files of a split folder "shards", hence the flag's name; in this
package "shard" means an FSDP2 shard, so the splitting here is `split_into_files`.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ciuic_train.checkpoint.hf_config import CONFIG_FILE, config_json
from ciuic_train.checkpoint.hf_weights import INDEX_FILE, WEIGHTS_FILE, exported_names, is_mtp_copy
from ciuic_train.checkpoint.resume import read_meta, resolve_resume
from ciuic_train.errors import UserError
from ciuic_train.files import written_atomically
from ciuic_train.model.config import ModelConfig
from ciuic_train.progress import WorkProgress

if TYPE_CHECKING:
    from ciuic_train.model import Transformer

GENERATION_CONFIG_FILE = "generation_config.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ciuic-train-export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (step_<N>) or a run folder (its latest checkpoint)")
    parser.add_argument("--format", choices=("pt", "hf"), default="pt",
                        help="pt: one torch file (default); hf: a Hugging Face DeepseekV3 folder")
    parser.add_argument("--out", help="output file or folder (default: <run folder>/model_step<N>.pt, or hf_step<N>/)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="hf: the largest safetensors file, bytes or e.g. 500MB, 5GB (default 5GB, as transformers)")
    args = parser.parse_args(argv)
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


# --- --format pt ------------------------------------------------------------------------


def export_model(path: Path, out: Path) -> Path:
    """One consolidated file of model weights plus the model config, loadable without distributed."""
    import torch

    from ciuic_train.checkpoint.checkpointer import load_model

    model, meta = load_model(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with written_atomically(out) as tmp:
        torch.save({"model_config": asdict(model.config), "state_dict": model.state_dict(), "step": meta["step"]}, tmp)
    return out


# --- --format hf ------------------------------------------------------------------------


def export_hf(path: Path, out: Path, max_shard_size: str) -> Path:
    """The checkpoint at `path` as a Hugging Face folder; generation_config.json samples as the run did."""
    from omegaconf import OmegaConf

    from ciuic_train.checkpoint.checkpointer import load_model
    from ciuic_train.data.tokenizer import export_tokenizer

    max_file_size = parse_size(max_shard_size)
    config_json(ModelConfig(**read_meta(path)["model"]))  # what transformers cannot express fails before loading
    run_config = path.parent.parent / ".hydra" / "config.yaml"
    sample = OmegaConf.to_container(OmegaConf.load(run_config)).get("sample") if run_config.is_file() else None
    model, _ = load_model(path)
    written = write_hf_folder(model, out, max_file_size, generation_config(sample))
    export_tokenizer(path.parent.parent, written, model.config.max_seq_len)  # the run's, for AutoTokenizer
    return written


def generation_config(sample: dict[str, Any] | None) -> dict[str, Any]:
    """generation_config.json: sampling as the run's own sample (sample.* of its config) did."""
    if not sample:
        return {"do_sample": True}
    return {"do_sample": True, "temperature": sample["temperature"], "top_k": sample["top_k"]}


def parse_size(text: str) -> int:
    """Bytes from `123`, `5GB`, `500MB`, `2GiB` (decimal and binary units, as transformers reads them)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not found:
        raise UserError(f"--max-shard-size={text!r} is not a size: bytes, or a number with KB, MB, GB (or KiB, MiB, GiB)")
    number, unit = float(found[1]), (found[2] or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    size = int(number * scale)
    if size < 1:
        raise UserError(f"--max-shard-size={text!r} must be at least 1 byte")
    return size


def split_into_files(names: list[str], sizes: dict[str, int], max_file_size: int) -> list[list[str]]:
    """Consecutive tensors grouped into files of at most max_file_size bytes (a larger tensor alone)."""
    files: list[list[str]] = [[]]
    filled = 0
    for name in names:
        if files[-1] and filled + sizes[name] > max_file_size:
            files.append([])
            filled = 0
        files[-1].append(name)
        filled += sizes[name]
    return files


def write_hf_folder(model: Transformer, out: Path, max_file_size: int, generation: dict[str, Any]) -> Path:
    """Write `model` as a Hugging Face folder: into a temporary folder beside `out`, then renamed over it."""
    from safetensors.torch import save_file

    config = config_json(model.config)  # refuses what transformers cannot express, before anything is written
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / CONFIG_FILE).is_file())):
        raise UserError(f"--out {out} exists and is not a Hugging Face folder; name a new or an exported folder")
    state = model.state_dict()
    tensors = {theirs: state[ours].detach().contiguous() for theirs, ours in exported_names(model).items()}
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    groups = split_into_files(list(tensors), sizes, max_file_size)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files = [WEIGHTS_FILE] if len(groups) == 1 else [
            f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)
        ]
        with WorkProgress(f"writing {len(files)} safetensors file(s)", sum(sizes.values())) as progress:
            for file, group in zip(files, groups):
                # Copies (MTP layers' embedding and head) must not share memory within a file.
                save_file({name: tensors[name].clone() if is_mtp_copy(name) else tensors[name] for name in group},
                          tmp / file, metadata={"format": "pt"})
                progress.advance(sum(sizes[name] for name in group))
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {name: file for file, group in zip(files, groups) for name in group}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
