"""Tokenizers (bytes, bpe, a tokenizer.json), uint32 token files and streamed tokenizing."""

import json
import multiprocessing
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from ciuic_train.data import token_cache
from ciuic_train.checkpoint.resume import read_meta
from ciuic_train.cli.preflight import check_request
from ciuic_train.config import DataConfig
from ciuic_train.data.corpus import load_tokens
from ciuic_train.errors import UserError
from ciuic_train.tools.export import main as export_main
from ciuic_train.data.tokenizer import run_tokenizer_file, split_text, token_dtype
from ciuic_train.train.trainer import Trainer
from conftest import compose_config

tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers extra is not installed")

BPE_SIZE = 300


def python_like_corpus(folder):
    """Text whose pairs a small BPE can merge; files of different sizes, one larger than
    the chunks the streaming test cuts."""
    folder.mkdir()
    lines = [
        "def forward(self, inputs, targets=None):\n",
        "    return self.layers(inputs) + targets\n",
        "class Model(object):\n",
        "    '''a model'''\n",
        "\n",
        "    x = [i * 2 for i in range(10)]  # ünïcode\n",
    ]
    for i in range(12):
        (folder / f"mod{i:02d}.py").write_text("".join(lines[(i + j) % len(lines)] for j in range(40 * (i + 1))))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return python_like_corpus(tmp_path_factory.mktemp("bpe") / "corpus")


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory):
    """A BPE trained once for the module, and its cache."""
    cfg = bpe_config(corpus, tmp_path_factory.mktemp("cache"))
    return cfg, load_tokens(cfg)


def bpe_config(corpus, cache, vocab_size=BPE_SIZE):
    return DataConfig(name="text", path=str(corpus), cache_dir=str(cache), tokenizer="bpe", vocab_size=vocab_size)


def test_bpe_is_trained_once_cached_by_corpus_and_size_and_deterministic(bpe, corpus, tmp_path, monkeypatch):
    cfg, splits = bpe
    (entry,) = [p for p in Path(cfg.cache_dir).iterdir() if not p.name.startswith(".")]
    assert entry.name.endswith(f"-bpe{BPE_SIZE}")
    assert splits.tokenizer.vocab_size == BPE_SIZE and splits.vocab_size == BPE_SIZE
    ids = np.concatenate([splits.train, splits.val])
    assert ids.max() >= 256  # merges are used
    assert ids.max() < BPE_SIZE
    text = "".join(p.read_text() + "\n\n" for p in sorted(corpus.iterdir()))
    assert len(ids) < 0.6 * len(text.encode())  # fewer tokens than bytes: merges were learnt
    # The splits decode back to the files (val is held out by file).
    decoded = splits.tokenizer.decode(splits.train.tolist()) + splits.tokenizer.decode(splits.val.tolist())
    assert sorted(decoded.split("\n\n")) == sorted(text.split("\n\n"))
    # Cached: a second load trains nothing.
    monkeypatch.setattr(token_cache, "train_bpe", lambda *a: pytest.fail("the BPE was trained again"))
    again = load_tokens(cfg)
    assert np.array_equal(again.train, splits.train) and again.tokenizer.to_str() == splits.tokenizer.to_str()
    monkeypatch.undo()
    # Deterministic: a fresh cache trains the same tokenizer and the same ids.
    fresh = load_tokens(bpe_config(corpus, tmp_path / "fresh"))
    assert fresh.tokenizer.to_str() == splits.tokenizer.to_str()
    assert np.array_equal(fresh.val, splits.val)
    # Keyed by N: another size is another entry.
    other = load_tokens(bpe_config(corpus, tmp_path / "fresh", vocab_size=280))
    assert other.tokenizer.vocab_size == 280
    assert sorted(p.name[-7:] for p in (tmp_path / "fresh").iterdir() if not p.name.startswith(".")) == [
        "-bpe280", "-bpe300"
    ]


def test_streamed_tokenizing_in_workers_gives_the_ids_of_one_pass(bpe, corpus, tmp_path):
    """Chunks of ~1 KiB cut at newlines, tokenized by 2 worker processes, appended in order:
    the same ids as each file tokenized whole; a single file's tail becomes val."""
    _, splits = bpe
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer_file.write_text(splits.tokenizer.to_str())
    streamed = load_tokens(DataConfig(name="text", path=str(corpus), cache_dir=str(tmp_path / "s"),
                                      tokenizer=str(tokenizer_file), chunk_mb=1 / 1024, workers=2))
    assert np.array_equal(streamed.train, splits.train) and np.array_equal(streamed.val, splits.val)
    big = corpus / "mod11.py"
    assert big.stat().st_size > 8 * 1024  # cut into several chunks
    single = load_tokens(DataConfig(name="text", path=str(big), cache_dir=str(tmp_path / "s"),
                                    tokenizer=str(tokenizer_file), chunk_mb=1 / 1024, workers=2, val_fraction=0.1))
    whole = splits.tokenizer.encode(big.read_text() + "\n\n")
    assert np.concatenate([single.train, single.val]).tolist() == whole
    assert len(single.val) == int(len(whole) * 0.1)
    # No temporary folder is left behind, and the entry records its dtype.
    entries = [p for p in (tmp_path / "s").iterdir() if not p.name.endswith(".lock")]
    assert all(not p.name.startswith(".") for p in entries) and len(entries) == 2
    assert all(json.loads((p / "tokens.json").read_text())["dtype"] == "uint16" for p in entries)


def test_split_text_cuts_only_before_a_non_space_line_start():
    data = b"a\n  b\n\nc\nd" * 50
    pieces = list(split_text(data, 7))
    assert b"".join(pieces) == data and len(pieces) > 10
    for piece, following in zip(pieces, pieces[1:]):
        assert piece.endswith(b"\n") and not following[:1].isspace()


def word_level_tokenizer(path, size):
    """A tokenizer.json of `size` tokens (word level, whitespace split)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(size - 1)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def test_a_vocabulary_beyond_uint16_is_written_and_read_as_uint32(tmp_path):
    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json", 70_000)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(" ".join(f"w{i}" for i in range(60_000, 70_000, 7)))
    cfg = DataConfig(name="text", path=str(tmp_path / "text"), cache_dir=str(tmp_path / "c"), tokenizer=str(tokenizer))
    splits = load_tokens(cfg)
    assert splits.train.dtype == np.uint32 and splits.vocab_size == 70_000
    ids = np.concatenate([splits.train, splits.val])
    assert ids.tolist() == [i + 1 for i in range(60_000, 70_000, 7)]  # "w{i}" is id i + 1
    # The cache entry is a data=tokens folder: tokens.json beside the .bin files gives the dtype.
    (entry,) = [p for p in (tmp_path / "c").iterdir() if not p.name.startswith(".")]
    assert json.loads((entry / "tokens.json").read_text())["dtype"] == "uint32"
    again = load_tokens(DataConfig(name="tokens", path=str(entry)))
    assert np.array_equal(again.train, splits.train) and again.vocab_size == 69_998
    # Given the tokenizer, pre-tokenized data decodes (for the run's sample) and sizes the vocabulary by it.
    named = load_tokens(DataConfig(name="tokens", path=str(entry), tokenizer=str(tokenizer)))
    assert named.vocab_size == 70_000 and named.tokenizer.decode(named.val[:2].tolist()).split() == [
        f"w{i - 1}" for i in named.val[:2]
    ]


def test_data_tokens_reads_uint32_by_data_dtype_and_refuses_contradictions(tmp_path):
    ids = np.arange(129_000, 129_280, dtype=np.uint32)
    (tmp_path / "train.bin").write_bytes(np.tile(ids, 4).tobytes())
    (tmp_path / "val.bin").write_bytes(ids.tobytes())
    splits = load_tokens(DataConfig(name="tokens", path=str(tmp_path), dtype="uint32"))
    assert splits.vocab_size == 129_280 and list(splits.val[:2]) == [129_000, 129_001]
    # Read as uint16 the same bytes would be other ids; a recorded dtype that disagrees is refused.
    (tmp_path / "tokens.json").write_text(json.dumps({"dtype": "uint16"}))
    with pytest.raises(UserError, match="data.dtype=uint32 but .*tokens.json records uint16"):
        load_tokens(DataConfig(name="tokens", path=str(tmp_path), dtype="uint32"))
    (tmp_path / "tokens.json").write_text(json.dumps({"dtype": "uint32"}))
    assert load_tokens(DataConfig(name="tokens", path=str(tmp_path))).vocab_size == 129_280
    (tmp_path / "val.bin").write_bytes(ids.tobytes()[:-2])
    with pytest.raises(UserError, match="not a whole number of uint32 tokens"):
        load_tokens(DataConfig(name="tokens", path=str(tmp_path)))
    assert token_dtype(65_536) is np.uint16 and token_dtype(129_280) is np.uint32


def build_in_child(cfg, log_file, out):
    """One of two processes asking for the same BPE entry at once (as two ranks do)."""
    def counting_train(texts, size, *rest, _train=token_cache.train_bpe):
        with open(log_file, "a") as f:
            f.write(f"{os.getpid()}\n")
        return _train(texts, size)

    token_cache.train_bpe = counting_train
    splits = load_tokens(cfg)
    np.save(out, np.asarray(splits.train))


def test_two_processes_wanting_one_entry_tokenize_it_once(corpus, tmp_path):
    cfg = bpe_config(corpus, tmp_path / "cache")
    context = multiprocessing.get_context("fork")
    children = [
        context.Process(target=build_in_child, args=(cfg, tmp_path / "trained", tmp_path / f"{i}.npy"))
        for i in range(2)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    assert len((tmp_path / "trained").read_text().split()) == 1
    assert np.array_equal(np.load(tmp_path / "0.npy"), np.load(tmp_path / "1.npy"))


def test_tokenizer_settings_are_checked_in_one_line(corpus, tmp_path, monkeypatch):
    base = ["model=tiny", "data=text", f"data.path={corpus}"]
    with pytest.raises(UserError, match="data.tokenizer=bpe needs data.vocab_size=N of at least 257"):
        check_request([*base, "data.tokenizer=bpe"])
    with pytest.raises(UserError, match="data.vocab_size=300 is for data.tokenizer=bpe only"):
        check_request([*base, "data.vocab_size=300"])
    with pytest.raises(UserError, match=r"data.tokenizer=.*nowhere.json is not a file \(expected bytes, bpe"):
        check_request([*base, f"data.tokenizer={tmp_path / 'nowhere.json'}"])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="is not a tokenizer.json tokenizers can load"):
        check_request([*base, f"data.tokenizer={tmp_path / 'bad.json'}"])
    with pytest.raises(UserError, match="data.dtype='int8' is not one of: uint16, uint32"):
        check_request([*base, "data.dtype=int8"], config_only=True)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the extra were not installed
    with pytest.raises(UserError, match=r"^data.tokenizer=bpe needs the tokenizers package: pip install 'ciuic-train\[tokenizers\]'$"):
        check_request([*base, "data.tokenizer=bpe", "data.vocab_size=300"])


def test_model_vocab_follows_the_tokenizer_unless_given(corpus, tmp_path):
    base = ["model=tiny", "data=text", f"data.path={corpus}"]
    (job,) = check_request([*base, "data.tokenizer=bpe", "data.vocab_size=320"])
    assert job.config.model.vocab_size == 320
    (job,) = check_request([*base, "data.tokenizer=bpe", "data.vocab_size=320", "model.vocab_size=384"])
    assert job.config.model.vocab_size == 384
    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json", 1000)
    (job,) = check_request([*base, f"data.tokenizer={tokenizer}"], config_only=True)
    assert job.config.model.vocab_size == 1000
    (job,) = check_request(base)
    assert job.config.model.vocab_size == 256  # bytes: the preset's


def test_a_tokenizer_larger_than_the_model_is_a_one_line_error(bpe, corpus, tmp_path):
    cfg, _ = bpe
    config = compose_config("model=tiny", "data=text", f"data.path={corpus}", f"data.cache_dir={cfg.cache_dir}",
                            "data.tokenizer=bpe", f"data.vocab_size={BPE_SIZE}", "train.seq_len=32")
    with pytest.raises(UserError) as err:
        Trainer(config, tmp_path)
    assert str(err.value) == (
        f"data.tokenizer=bpe has {BPE_SIZE} tokens but model.vocab_size=256; set model.vocab_size={BPE_SIZE} "
        "or more, or leave it out to follow the tokenizer"
    )


def test_a_bpe_run_samples_through_it_and_export_carries_it(bpe, corpus, tmp_path, one_thread):
    """As the CLI composes it, model.vocab_size follows the BPE; the sample is BPE-decoded
    text, the run folder keeps tokenizer.json and an export hands it to AutoTokenizer."""
    cfg, splits = bpe
    run = tmp_path / "run"
    (job,) = check_request([
        "model=tiny", "data=text", f"data.path={corpus}", f"data.cache_dir={cfg.cache_dir}", "data.tokenizer=bpe",
        f"data.vocab_size={BPE_SIZE}", "model.score_func=sigmoid", "train.max_steps=2", "train.seq_len=32",
        "train.batch_size=2", "train.eval_windows=2", "sample.max_new_tokens=12", "sample.prompt=def forward",
    ])
    assert job.config.model.vocab_size == BPE_SIZE
    run.mkdir()  # as Hydra makes it
    trainer = Trainer(job.config, run)
    trainer.fit()
    sample = trainer.sample()
    saved = run_tokenizer_file(run)
    assert saved is not None and saved.read_text() == splits.tokenizer.to_str()
    assert run_tokenizer_file(tmp_path) is None
    # The prompt's BPE ids include merges (ids past the bytes): read as bytes they would not spell it.
    assert sample.startswith("def forward") and max(splits.tokenizer.encode("def forward")) >= 256
    (checkpoint,) = (run / "checkpoints").glob("step_*")
    assert read_meta(checkpoint)["model"]["vocab_size"] == BPE_SIZE

    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    folder = tmp_path / "hf"
    export_main([str(run), "--format", "hf", "--out", str(folder)])
    loaded = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "def forward(self, inputs):\n    return x"
    assert loaded(text)["input_ids"] == splits.tokenizer.encode(text)
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.model_max_length == 256
