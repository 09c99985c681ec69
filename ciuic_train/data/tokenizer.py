"""Tokenizers: bytes (vocab 256, nothing to install), a Hugging Face tokenizer.json, or a
byte-level BPE trained on the corpus's training split.

Each has an end-of-text id for `data.eos=true` (`end_of_text_id`): bytes reserve id 256
(their vocabulary becomes 257), a BPE trains `<|endoftext|>` as its first token (id 0,
within data.vocab_size), a tokenizer.json names its own (tokenizer_config.json's
`eos_token` beside it, else a special token of a well-known name).

Only the last two need the `tokenizers` package (the `tokenizers` extra), imported only
when one is asked for. Text is cut into pieces right after a newline that a non-space
character follows: a byte-level pre-tokenizer never joins tokens across such a point, so
tokenizing the pieces one by one gives the ids the whole text would, whatever the piece
size, and pieces can go to worker processes and come back in order.

A run keeps the tokenizer it trained with in its folder (`save_tokenizer`), under the
names Hugging Face loads it by, and `ciuic-train-export --format hf` carries it
(`export_tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np

from ciuic_train.errors import UserError, first_line
from ciuic_train.files import written_atomically

BYTES = "bytes"
BPE = "bpe"
EXTRA = "pip install 'ciuic-train[tokenizers]'"
# The files a run folder keeps its tokenizer in, by the names Hugging Face loads them by.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# A byte-level BPE starts from the 256 bytes, so it needs more tokens than that to merge anything.
MIN_BPE_VOCAB = 257
# What a worker hands to the tokenizer at a time: a tokenizers Encoding costs about
# 100 bytes per token, so the text of one call stays small and the ids go to numpy at once.
PIECE_BYTES = 1 << 20
_CUT = re.compile(rb"\n(?=\S)")
# The end-of-text token a BPE trained here gets with data.eos=true (GPT-2's spelling).
END_OF_TEXT = "<|endoftext|>"
# The end-of-text tokens a tokenizer.json without a tokenizer_config.json is searched for,
# most common first: GPT-2/Qwen, Llama 2/Mistral, DeepSeek, Llama 3, Gemma.
KNOWN_END_OF_TEXT = (END_OF_TEXT, "</s>", "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<eos>")


class ByteTokenizer:
    """Each UTF-8 byte is a token; with `eos`, id 256 ends each document."""

    name = BYTES
    dtype = np.uint16

    def __init__(self, eos: bool = False):
        self.vocab_size = 257 if eos else 256

    def end_of_text_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(self.dtype)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def to_str(self) -> str | None:
        return None


class JsonTokenizer:
    """A `tokenizers.Tokenizer`, held with the JSON it was made from (what workers and run folders get)."""

    def __init__(self, name: str, json_text: str):
        tokenizers = require_tokenizers(name)
        try:
            self.inner = tokenizers.Tokenizer.from_str(json_text)
        except Exception as err:  # tokenizers raises its own Exception subclass for any bad file
            raise UserError(f"data.tokenizer={name} is not a tokenizer.json tokenizers can load: {first_line(err)}") from None
        self.name = name
        self.json_text = json_text
        self.vocab_size = self.inner.get_vocab_size(with_added_tokens=True)
        self.dtype = token_dtype(self.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Ids of UTF-8 text (undecodable bytes become U+FFFD), a piece at a time."""
        parts = [
            np.asarray(self.encode(piece.decode("utf-8", errors="replace")), dtype=self.dtype)
            for piece in split_text(data, PIECE_BYTES)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=False)

    def end_of_text_id(self) -> int:
        """The id that ends a document: the `eos_token` of a tokenizer_config.json beside
        the file, else the first special token of `KNOWN_END_OF_TEXT` it has."""
        config = Path(self.name).expanduser().parent / TOKENIZER_CONFIG_FILE
        named = None
        if self.name != BPE and config.is_file():
            try:
                named = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            except ValueError as err:
                raise UserError(f"{config} is not valid JSON: {first_line(err)}") from None
            named = named.get("content") if isinstance(named, dict) else named
        vocab = self.inner.get_vocab(with_added_tokens=True)
        for token in ([named] if named else KNOWN_END_OF_TEXT):
            if token in vocab:
                return vocab[token]
        special = sorted(t.content for t in self.inner.get_added_tokens_decoder().values() if t.special)
        raise UserError(
            f"data.eos=true: data.tokenizer={self.name} has no end-of-text token "
            f"({'its eos_token ' + repr(named) + ' is not in the vocabulary' if named else 'none of ' + ', '.join(KNOWN_END_OF_TEXT)}); "
            f"its special tokens: {', '.join(special) or 'none'}; give a tokenizer_config.json with eos_token beside it"
        )

    def to_str(self) -> str:
        return self.json_text

    def fingerprint(self) -> str:
        return hashlib.sha256(self.json_text.encode("utf-8")).hexdigest()[:12]


Tokenizer = ByteTokenizer | JsonTokenizer


def token_dtype(vocab_size: int) -> type:
    """uint16 while every id fits, uint32 beyond (DeepSeek's vocabulary has 129,280 entries)."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def require_tokenizers(name: str):
    try:
        import tokenizers
    except ImportError:
        raise UserError(f"data.tokenizer={name} needs the tokenizers package: {EXTRA}") from None
    return tokenizers


def load_tokenizer_file(path: str | Path) -> JsonTokenizer:
    """A tokenizer.json named by data.tokenizer."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"data.tokenizer={path} is not a file (expected bytes, bpe or a path to a tokenizer.json)")
    return JsonTokenizer(str(path), file.read_text(encoding="utf-8"))


def model_vocab_size(tokenizer: str, bpe_vocab_size: int, eos: bool = False) -> int | None:
    """The vocabulary a model needs for `data.tokenizer`; None for bytes without `eos`, where
    the model's own (256 in the presets) stands. Cheap: a BPE is not trained for it."""
    if tokenizer == BYTES:
        return ByteTokenizer(eos).vocab_size if eos else None
    if tokenizer == BPE:  # a size too small is data.vocab_size's error (checks.validate), not the model's
        return bpe_vocab_size if bpe_vocab_size >= MIN_BPE_VOCAB else None
    return load_tokenizer_file(tokenizer).vocab_size


def check_model_vocab(model_vocab_size: int, tokenizer: Tokenizer, data_vocab_size: int) -> None:
    """Refuse a model whose vocabulary the data does not fit. `data_vocab_size` is already the
    larger of the tokenizer's size and the data's largest id + 1 (`corpus.load_tokens`), so one
    comparison covers both; the message names whichever one the model falls short of."""
    if data_vocab_size <= model_vocab_size:
        return
    if tokenizer.name != BYTES and tokenizer.vocab_size > model_vocab_size:
        raise UserError(
            f"data.tokenizer={tokenizer.name} has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size={model_vocab_size}; set model.vocab_size={tokenizer.vocab_size} or more, "
            "or leave it out to follow the tokenizer"
        )
    raise UserError(
        f"the data has token ids up to {data_vocab_size - 1} but "
        f"model.vocab_size={model_vocab_size}; set model.vocab_size={data_vocab_size} or more"
    )


def train_bpe(texts: Iterator[str], vocab_size: int, eos: bool = False) -> JsonTokenizer:
    """A byte-level BPE of `vocab_size` tokens (fewer if the text has too few pairs to merge),
    with `eos` `END_OF_TEXT` among them as id 0.

    The tokenizers trainer has no randomness: the same text gives the same merges.
    """
    tokenizers = require_tokenizers(BPE)
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=[END_OF_TEXT] if eos else [],
    )
    tokenizer.train_from_iterator(texts, trainer)
    return JsonTokenizer(BPE, tokenizer.to_str())


def split_text(data: bytes, size: int) -> Iterator[bytes]:
    """`data` in pieces of about `size` bytes, each cut right after a newline followed by a
    non-space (a piece runs longer where there is none)."""
    start = 0
    while len(data) - start > size:
        cut = _CUT.search(data, start + size)
        if cut is None:
            break
        yield data[start : cut.end()]
        start = cut.end()
    if start < len(data):
        yield data[start:]


def cut_points(path: Path, size: int) -> list[int]:
    """Offsets that cut a file into pieces of about `size` bytes, as `split_text` would,
    reading only a little around each cut."""
    total = path.stat().st_size
    points = [0]
    if total <= size:
        return [0, total]
    with path.open("rb") as f:
        while total - points[-1] > size:
            position = points[-1] + size
            f.seek(position)
            found = None
            while found is None:
                window = f.read(1 << 16)
                if len(window) < 2:
                    break
                match = _CUT.search(window)
                # A newline at the window's end may be followed by a non-space in the next one.
                if match is not None:
                    found = position + match.end()
                else:
                    position += len(window) - 1
                    f.seek(position)
            if found is None:
                break
            points.append(found)
    return points + [total]


def read_token_meta(folder: Path) -> dict:
    """tokens.json beside a folder's .bin files ({} if none): their dtype, vocab_size, counts."""
    path = folder / "tokens.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise UserError(f"{path} is not valid JSON: {first_line(err)}") from None


# --- A run folder's tokenizer ------------------------------------------------------------


def save_tokenizer(tokenizer: Tokenizer, run_dir: Path) -> None:
    """Keep the run's tokenizer in its folder (bytes need none), with the tokenizer_config.json
    found beside a tokenizer.json it was given (its special tokens and chat template)."""
    text = tokenizer.to_str()
    if text is None:
        return
    with written_atomically(run_dir / TOKENIZER_FILE) as tmp:
        tmp.write_text(text, encoding="utf-8")
    given = Path(tokenizer.name).expanduser().parent / TOKENIZER_CONFIG_FILE
    if tokenizer.name != BPE and given.is_file():
        with written_atomically(run_dir / TOKENIZER_CONFIG_FILE) as tmp:
            shutil.copyfile(given, tmp)


def run_tokenizer_file(run_dir: Path | str) -> Path | None:
    """The tokenizer.json a run trained with (None: bytes), for export to carry."""
    path = Path(run_dir) / TOKENIZER_FILE
    return path if path.is_file() else None


def export_tokenizer(run_dir: Path, folder: Path, model_max_length: int) -> bool:
    """Put a run's tokenizer into a Hugging Face model folder, as `AutoTokenizer` loads it:
    tokenizer.json, and tokenizer_config.json (the run's, from beside the tokenizer.json
    it was given, or a plain fast-tokenizer one). False for a bytes run, which has none."""
    source = run_tokenizer_file(run_dir)
    if source is None:
        return False
    (folder / TOKENIZER_FILE).write_bytes(source.read_bytes())
    given = Path(run_dir) / TOKENIZER_CONFIG_FILE
    if given.is_file():
        (folder / TOKENIZER_CONFIG_FILE).write_bytes(given.read_bytes())
    else:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
        }
        (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return True
