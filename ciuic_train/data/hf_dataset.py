"""`data=hf`: a Hugging Face dataset as the corpus, each row's `data.text_field` a document.

`data.dataset` names what `datasets.load_dataset` loads: a packaged builder (`parquet`,
`json`, `csv`, `text`, `arrow`) reading `data.data_files` (a path or glob, a list, or a
mapping from split name to files), a local dataset folder, or a hub id (downloaded by
`datasets` into `data.cache_dir`; offline, one line saying how to point at local files).

Validation is `data.val_split` (a split of the dataset), else the rows whose text hashes
below `data.val_fraction`: the same rows whatever their order, streamed or not, as a text
corpus holds out files by a hash of their path. Not streaming, the rows are tokenized once
into the token cache (`token_cache.cache_entry`, keyed by the dataset's own fingerprint);
streaming, each rank reads its share as it trains (`stream.py`).

`check_dataset` runs in the CLI before any run folder exists: the library is there, the
files are, the hub is reachable for a hub id, the split and the text field exist.
"""

from __future__ import annotations

import glob
import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

from ciuic_train.config import DataConfig
from ciuic_train.errors import UserError

PACKAGED_BUILDERS = ("parquet", "json", "csv", "text", "arrow")
# Rows read from the dataset at a time (tokenized as one piece of work).
ROW_BATCH = 512


def require_datasets():
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the datasets library: pip install 'ciuic-train[hf]'") from None
    datasets.logging.set_verbosity_error()  # its progress bars and notices are not this run's log
    datasets.disable_progress_bars()
    return datasets


def held_out(text: str, fraction: float) -> bool:
    """Whether a row belongs to validation when no split is named: its text's hash."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def row_text(row: dict, field: str) -> str:
    return row[field] or ""  # a null text is an empty document


def _plain(value: Any) -> Any:
    """data.data_files as plain Python (OmegaConf's containers are not lists and dicts)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _patterns(data_files: Any) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [p for value in data_files.values() for p in _patterns(value)]
    return [p for value in data_files for p in _patterns(value)]


def _is_hub_id(cfg: DataConfig) -> bool:
    return cfg.dataset not in PACKAGED_BUILDERS and not Path(cfg.dataset).expanduser().exists()


def _check_hub_reachable(cfg: DataConfig) -> None:
    """A hub id needs the hub: fail at once when it cannot be reached (`datasets` would
    retry for half a minute first)."""
    from huggingface_hub import constants

    local = (f"download it where there is a network (huggingface-cli download --repo-type dataset {cfg.dataset} "
             f"--local-dir DIR) and give its files: data.dataset=parquet 'data.data_files=DIR/**/*.parquet' "
             "(or data.dataset=DIR)")
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"data.dataset={cfg.dataset} is a hub id and HF_HUB_OFFLINE is set; {local}")
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5).close()
    except OSError as err:
        raise UserError(
            f"data.dataset={cfg.dataset} is not a builder ({', '.join(PACKAGED_BUILDERS)}) or a local folder, and "
            f"the Hugging Face Hub at {constants.ENDPOINT} cannot be reached ({err.strerror or err}); {local}"
        ) from None


def load_split(cfg: DataConfig, split: str, streaming: bool):
    """One split of the dataset, as `datasets` gives it (a memory-mapped `Dataset`, or an
    `IterableDataset` when streaming); every failure a user can mend in one line."""
    datasets = require_datasets()
    kwargs: dict[str, Any] = {"split": split, "streaming": streaming}
    if cfg.subset:
        kwargs["name"] = cfg.subset
    if cfg.data_files:
        kwargs["data_files"] = _plain(cfg.data_files)
    if cfg.cache_dir:
        kwargs["cache_dir"] = str(Path(cfg.cache_dir).expanduser() / "hf-datasets")
    try:
        return datasets.load_dataset(cfg.dataset, **kwargs)
    except ValueError as err:
        if "Unknown split" in str(err) or "Bad split" in str(err):  # loaded whole, streamed
            key = "data.split" if split == cfg.split else "data.val_split"
            splits = str(err).split(". ", 1)[-1].rstrip(".")
            raise UserError(f"{key}={split} is not a split of {cfg.dataset}: {splits}") from None
        raise UserError(f"data.dataset={cfg.dataset} could not be read: {str(err).splitlines()[0]}") from None
    except ConnectionError as err:
        raise UserError(f"data.dataset={cfg.dataset}: {str(err).splitlines()[0]}") from None
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as err:
        raise UserError(f"data.dataset={cfg.dataset} was not found: {str(err).splitlines()[0]}") from None


def _column_names(dataset) -> list[str]:
    names = dataset.column_names
    if names is None:  # a stream whose features are not declared: its first row says
        names = list(next(iter(dataset), {}).keys())
    return list(names)


def check_text_field(cfg: DataConfig, dataset, split: str) -> None:
    names = _column_names(dataset)
    if cfg.text_field not in names:
        raise UserError(
            f"data.text_field={cfg.text_field} is not a field of {cfg.dataset} ({split}); "
            f"its fields: {', '.join(names) or 'none'}"
        )


def check_dataset(cfg: DataConfig) -> None:
    """Everything about a data=hf corpus that can fail before any run folder exists."""
    require_datasets()
    if cfg.data_files:
        for pattern in _patterns(_plain(cfg.data_files)):
            if not glob.glob(os.path.expanduser(pattern), recursive=True) and "://" not in pattern:
                raise UserError(f"data.data_files: {pattern} matches no file")
    elif cfg.dataset in PACKAGED_BUILDERS:
        raise UserError(f"data.dataset={cfg.dataset} reads files: give data.data_files=PATH, a GLOB, or a list")
    if _is_hub_id(cfg):
        _check_hub_reachable(cfg)
    for split in [cfg.split] + ([cfg.val_split] if cfg.val_split else []):
        check_text_field(cfg, load_split(cfg, split, streaming=True), split)


@dataclass
class DatasetRows:
    """The rows of a data=hf corpus loaded whole (not streamed): the training split's,
    and the validation split's or None (then the hash decides, `held_out`)."""

    cfg: DataConfig
    train: Any
    val: Any | None
    kind = "hf"

    @property
    def tail_fraction(self) -> float:
        """Of the training tokens, what validation takes where no row went to it."""
        return self.cfg.val_fraction

    @classmethod
    def load(cls, cfg: DataConfig) -> DatasetRows:
        train = load_split(cfg, cfg.split, streaming=False)
        check_text_field(cfg, train, cfg.split)
        val = None
        if cfg.val_split:
            val = load_split(cfg, cfg.val_split, streaming=False)
            check_text_field(cfg, val, cfg.val_split)
        return cls(cfg, train, val)

    def cache_key(self) -> str:
        """The dataset's own fingerprints (its files' names, sizes and times, for local
        files) and what this run takes of it."""
        held = "" if self.val is not None else f" held {self.cfg.val_fraction}"
        parts = [self.train._fingerprint, self.val._fingerprint if self.val is not None else "", self.cfg.text_field]
        return hashlib.sha256(f"hf v1{held} {' '.join(parts)}".encode()).hexdigest()[:16]

    def n_rows(self) -> int:
        return len(self.train) + (len(self.val) if self.val is not None else 0)

    def _row_texts(self, dataset) -> Iterator[list[str]]:
        """A split's texts, a batch of rows at a time (a null text: an empty document)."""
        field = self.cfg.text_field
        for batch in dataset.select_columns([field]).iter(batch_size=ROW_BATCH):
            yield [text or "" for text in batch[field]]

    def batches(self) -> Iterator[tuple[str, list[str]]]:
        """(split, texts) a batch of rows at a time: the training split's rows, then the
        validation split's (without one, each training row goes where its hash says)."""
        if self.val is not None:
            yield from (("train", texts) for texts in self._row_texts(self.train))
            yield from (("val", texts) for texts in self._row_texts(self.val))
            return
        for texts in self._row_texts(self.train):
            held = [held_out(text, self.cfg.val_fraction) for text in texts]
            train = [text for text, h in zip(texts, held) if not h]
            val = [text for text, h in zip(texts, held) if h]
            if train:
                yield "train", train
            if val:
                yield "val", val

    def texts(self) -> Iterator[str]:
        """The training rows' text (what a BPE trained here learns from); a validation
        split is not read."""
        if self.val is not None:
            batches = (("train", texts) for texts in self._row_texts(self.train))
        else:
            batches = self.batches()
        for split, texts in batches:
            if split == "train":
                yield from texts
