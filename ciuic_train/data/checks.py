"""The data config's cross-field checks (`checks.validate` runs them before any work).

They read the fields only: nothing here imports the schema, a corpus or a library, so a
mistake is refused in one line at once.
"""

from __future__ import annotations

from ciuic_train.errors import UserError

CORPORA = ("stdlib", "text", "tokens", "hf")
# The keys only data=hf reads: set away from their defaults with another corpus, a mistake.
HF_KEYS = ("dataset", "subset", "data_files", "val_split", "streaming")


def validate_data(data, pp: int, order_owner: str | None) -> None:
    """`data` (a DataConfig) under `dist.pp=pp`, with `order_owner` the selected trick
    that reorders the sampler's windows, if any."""
    if not 0.0 < data.val_fraction < 1.0:
        raise UserError(f"data.val_fraction={data.val_fraction} must be between 0 and 1")
    if data.name not in CORPORA:
        raise UserError(f"data.name={data.name!r} is not one of: {', '.join(CORPORA)}")
    if data.name in ("text", "tokens") and not data.path:
        raise UserError(f"data={data.name} needs data.path=FILE, FOLDER or GLOB")
    # Ignored, it would leave the run on the standard library, not on the corpus it names.
    if data.name == "stdlib" and data.path:
        raise UserError(f"data.path={data.path} is read by data=text or data=tokens, not data=stdlib (the default); "
                        "add data=text or data=tokens")
    _validate_tokenizer(data)
    if data.dtype and data.name != "tokens":
        raise UserError(f"data.dtype={data.dtype} is the type of data=tokens' .bin files, not data={data.name}'s")
    _validate_documents(data, pp)
    _validate_dataset(data, order_owner)


def _validate_dataset(data, order_owner: str | None) -> None:
    if data.name != "hf":
        defaults = type(data)()  # the schema's own defaults, not restated here
        given = next((key for key in HF_KEYS if getattr(data, key) != getattr(defaults, key)), None)
        if given:
            raise UserError(f"data.{given} is for data=hf (a Hugging Face dataset), not data={data.name}")
        return
    if not data.dataset:
        raise UserError("data=hf needs data.dataset: a builder (parquet, json, csv, text, arrow) with "
                        "data.data_files=PATH, a local dataset folder, or a hub id")
    if data.path:
        raise UserError(f"data=hf reads data.dataset and data.data_files, not data.path={data.path}")
    if not _valid_data_files(data.data_files):
        raise UserError(f"data.data_files={data.data_files} must be a path or glob, a list of them, or a mapping "
                        "from split name to them")
    if not data.text_field:
        raise UserError("data.text_field must name the field holding each row's text")
    if data.val_split and data.val_split == data.split:
        raise UserError(f"data.val_split={data.val_split} is the training split too; name another split, "
                        "or leave it empty to hold out rows by data.val_fraction")
    if not data.streaming:
        return
    if data.tokenizer == "bpe":
        raise UserError("data.tokenizer=bpe trains on the whole training split, which a stream never holds; "
                        "train it once with data.streaming=false and pass its tokenizer.json (the run folder's)")
    if data.shuffle and data.shuffle_windows < 1:
        raise UserError(f"data.shuffle_windows={data.shuffle_windows} must be at least 1 (or data.shuffle=false)")
    if order_owner:
        raise UserError(f"+trick={order_owner} reorders the windows of each epoch, which a stream reads once in order; "
                        "drop it or set data.streaming=false")


def _valid_data_files(value) -> bool:
    if value is None or isinstance(value, str):
        return True
    if hasattr(value, "keys"):
        return all(isinstance(key, str) and _valid_data_files(value[key]) and value[key] is not None for key in value)
    try:
        return all(isinstance(item, str) for item in value)
    except TypeError:
        return False


def _validate_tokenizer(data) -> None:
    if not data.tokenizer:
        raise UserError("data.tokenizer must be bytes, bpe or a path to a tokenizer.json")
    if data.tokenizer == "bpe":
        if data.vocab_size < 257:
            raise UserError(
                f"data.tokenizer=bpe needs data.vocab_size=N of at least 257 (the 256 bytes plus merges), "
                f"not {data.vocab_size}"
            )
        if data.name == "tokens":
            raise UserError(
                "data=tokens is already tokenized, data.tokenizer=bpe trains on text; "
                "give data.tokenizer=PATH/tokenizer.json to decode its samples"
            )
    elif data.vocab_size:
        raise UserError(f"data.vocab_size={data.vocab_size} is for data.tokenizer=bpe only (not {data.tokenizer})")
    if data.dtype not in ("", "uint16", "uint32"):
        raise UserError(f"data.dtype={data.dtype!r} is not one of: uint16, uint32 (or empty: as recorded)")
    if data.workers < 0:
        raise UserError(f"data.workers={data.workers} must be 0 (one per CPU) or more")
    if data.chunk_mb <= 0:
        raise UserError(f"data.chunk_mb={data.chunk_mb} must be positive")


def _validate_documents(data, pp: int) -> None:
    if data.doc_positions and not data.doc_mask:
        raise UserError("data.doc_positions=true restarts positions per document: it needs data.doc_mask=true")
    if data.eos and data.name == "tokens":
        raise UserError("data.eos=true ends documents while tokenizing text; data=tokens is already tokenized")
    if data.doc_mask and pp > 1:
        raise UserError(
            f"data.doc_mask=true does not run in a pipeline yet (dist.pp={pp}); "
            "set dist.pp=1 or data.doc_mask=false"
        )
