"""data=hf: Hugging Face datasets (parquet, JSON lines) written by the tests, cached or streamed.

A row is a document as a text file is one: the same texts as files or as rows give the
same tokens and document starts. Streamed, a rank's windows are those of the cached
corpus read in order, and a resumed stream reads on exactly where it stopped.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ciuic_train.config import DataConfig
from ciuic_train.data.corpus import load_tokens
from ciuic_train.data.hf_dataset import held_out
from ciuic_train.data.sampler import train_windows
from ciuic_train.data.sources import find_sources
from ciuic_train.data.stream import StreamedSplit, StreamWindows
from ciuic_train.data.token_cache import encode_document
from ciuic_train.data.tokenizer import ByteTokenizer
from ciuic_train.errors import UserError
from conftest import compose_config, free_port, run_cli, torchrun

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("datasets")

TINY = ["model=tiny", "train.seq_len=64", "train.batch_size=4", "train.eval_windows=8", "sample.max_new_tokens=0",
        "progress=plain"]


def documents(count: int = 40) -> list[str]:
    """Texts of different lengths (some with non-ASCII characters, one empty)."""
    line = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n"
    texts = [f"# document {i} — ü\n" + line * (3 + i % 7) for i in range(count)]
    texts[min(5, count - 1)] = ""
    return texts


def write_rows(path: Path, texts: list[str]) -> Path:
    rows = [{"id": i, "text": text} for i, text in enumerate(texts)]
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_files(folder: Path, texts: list[str]) -> Path:
    folder.mkdir()
    for i, text in enumerate(texts):
        if text:  # a text corpus leaves empty files out; an empty row is an empty document
            (folder / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return folder


def hf_args(tmp_path: Path, files: str, builder: str = "parquet") -> list[str]:
    return ["data=hf", f"data.dataset={builder}", f"data.data_files={files}", f"data.cache_dir={tmp_path / 'cache'}"]


def encoded(texts: list[str], eos_id=None) -> np.ndarray:
    return np.concatenate([encode_document(text, ByteTokenizer(eos_id is not None), eos_id) for text in texts])


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("tokenizer", [[], ["data.eos=true"], ["data.tokenizer=bpe", "data.vocab_size=300",
                                                              "data.workers=2"]], ids=["bytes", "eos", "bpe"])
def test_rows_give_the_tokens_and_documents_of_the_same_texts_as_files(tmp_path, suffix, tokenizer):
    texts = [text for text in documents() if text]  # the text corpus has no empty file
    builder = "parquet" if suffix == ".parquet" else "json"
    rows = write_rows(tmp_path / f"rows{suffix}", texts)
    # A fraction no file or row hashes below: both hold out the tail of the training tokens.
    common = ["data.val_fraction=1e-3", f"data.cache_dir={tmp_path / 'cache'}", *tokenizer]
    files_cfg = compose_config("data=text", f"data.path={write_files(tmp_path / 'files', texts)}", *common).data
    assert not find_sources(files_cfg).val and not any(held_out(text, 1e-3) for text in texts)
    as_files = load_tokens(files_cfg)
    as_rows = load_tokens(compose_config("data=hf", f"data.dataset={builder}", f"data.data_files={rows}",
                                         *common).data)
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(getattr(as_rows, split)), np.asarray(getattr(as_files, split))), split
        rows_docs, files_docs = getattr(as_rows, f"{split}_docs"), getattr(as_files, f"{split}_docs")
        assert np.array_equal(rows_docs.parts[0][1], files_docs.parts[0][1]), split
    assert as_rows.train_docs.count() == len(texts)
    assert as_rows.vocab_size == as_files.vocab_size
    if tokenizer == ["data.eos=true"]:
        assert sum(np.count_nonzero(np.asarray(split) == 256) for split in (as_rows.train, as_rows.val)) == len(texts)


def test_a_validation_split_named_in_a_mapping_of_files(tmp_path):
    texts = documents()
    train = write_rows(tmp_path / "train.parquet", texts[:30])
    val = write_rows(tmp_path / "val.parquet", texts[30:])
    splits = load_tokens(compose_config(
        "data=hf", "data.dataset=parquet", f'data.data_files={{train:"{train}",validation:"{val}"}}',
        "data.val_split=validation", f"data.cache_dir={tmp_path / 'cache'}").data)
    assert np.array_equal(np.asarray(splits.train), encoded(texts[:30]))
    assert np.array_equal(np.asarray(splits.val), encoded(texts[30:]))
    lengths = [len(encode_document(t, ByteTokenizer(), None)) for t in texts[30:]]
    assert splits.val_docs.parts[0][1].tolist() == np.cumsum([0] + lengths[:-1]).tolist()


def test_without_a_validation_split_the_rows_hashing_below_the_fraction_are_held_out(tmp_path):
    texts = documents(60)
    files = write_rows(tmp_path / "rows.parquet", texts)
    splits = load_tokens(compose_config(*hf_args(tmp_path, files), "data.val_fraction=0.3").data)
    val = [t for t in texts if held_out(t, 0.3)]
    assert 0 < len(val) < len(texts)
    assert np.array_equal(np.asarray(splits.val), encoded(val))
    assert np.array_equal(np.asarray(splits.train), encoded([t for t in texts if not held_out(t, 0.3)]))
    assert splits.val_docs.count() == len(val)


@pytest.mark.parametrize("named_validation", [True, False], ids=["val_split", "held-out"])
def test_a_stream_gives_the_windows_of_the_cached_rows_in_order(tmp_path, named_validation):
    texts = documents(60)
    train = write_rows(tmp_path / "a.parquet", texts[:45])
    val = write_rows(tmp_path / "b.parquet", texts[45:])
    if named_validation:
        files = [f'data.data_files={{train:"{train}",validation:"{val}"}}', "data.val_split=validation"]
    else:
        files = [f"data.data_files=[{train},{val}]", "data.val_fraction=0.2"]
    common = ["data=hf", "data.dataset=parquet", *files, f"data.cache_dir={tmp_path / 'cache'}", "data.shuffle=false",
              "data.doc_mask=true", "data.doc_positions=true"]
    cached_cfg, stream_cfg = compose_config(*common).data, compose_config(*common, "data.streaming=true").data
    cached, streamed = load_tokens(cached_cfg), load_tokens(stream_cfg, stream_val_tokens=500)
    assert isinstance(streamed.train, StreamedSplit)
    assert np.array_equal(streamed.val, np.asarray(cached.val)[:500])
    cached_windows = train_windows(cached, cached_cfg, 32, 0, 0, 1)
    stream_windows = train_windows(streamed, stream_cfg, 32, 0, 0, 1)
    for _ in range(12):
        for a, b in zip(cached_windows.next_batch(4), stream_windows.next_batch(4)):
            if isinstance(a, dict):
                assert a.keys() == b.keys() == {"docs", "positions"}
                for key in a:
                    assert torch.equal(a[key], b[key]), key
            else:
                assert torch.equal(a, b)


def _batches(windows, count: int) -> list[torch.Tensor]:
    return [torch.cat([windows.next_batch(4)[0], windows.next_batch(4)[1]]) for _ in range(count)]


@pytest.mark.parametrize("world", [1, 2])
def test_a_stream_restored_from_its_state_reads_on_exactly_across_epochs(tmp_path, world):
    files = write_rows(tmp_path / "rows.parquet", documents(6))  # a few thousand tokens: several epochs
    cfg = compose_config(*hf_args(tmp_path, files), "data.streaming=true", "data.shuffle_windows=8").data
    split = StreamedSplit(cfg, ByteTokenizer(), validation=False)
    for rank in range(world):
        whole = _batches(StreamWindows(split, 16, 3, rank, world, cfg), 60)
        cut = StreamWindows(split, 16, 3, rank, world, cfg)
        got = _batches(cut, 17)
        for stop in (25, 45, 60):  # restored mid-epoch, and again past an epoch's end
            state = json.loads(json.dumps(cut.state_dict()))  # as a checkpoint's rank file holds it
            cut = StreamWindows(split, 16, 3, rank, world, cfg)
            cut.load_state_dict(state)
            got += _batches(cut, stop - len(got))
        assert cut.epoch >= 2
        assert all(torch.equal(a, b) for a, b in zip(got, whole)) and len(got) == len(whole)


def test_ranks_read_disjoint_shares_and_shuffling_reorders_windows(tmp_path):
    files = write_rows(tmp_path / "rows.parquet", documents(40))
    cfg = compose_config(*hf_args(tmp_path, files), "data.streaming=true", "data.shuffle=false").data
    split = StreamedSplit(cfg, ByteTokenizer(), validation=False)
    firsts = [StreamWindows(split, 16, 0, rank, 2, cfg).next_batch(1)[0][0].tolist() for rank in range(2)]
    assert firsts[0] != firsts[1]
    in_order = StreamWindows(split, 16, 0, 0, 1, cfg).next_batch(32)[0]
    shuffled_cfg = compose_config(*hf_args(tmp_path, files), "data.streaming=true", "data.shuffle_windows=16").data
    shuffled = StreamWindows(split, 16, 0, 0, 1, shuffled_cfg).next_batch(32)[0]
    assert not torch.equal(in_order, shuffled)
    # A pool of 16 draws among the first 16 + k windows only: the first one drawn is among the first 16.
    assert any(torch.equal(shuffled[0], row) for row in in_order[:16])


def test_a_hub_id_offline_fails_in_one_line_that_says_how_to_use_local_files(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cfg = compose_config("data=hf", "data.dataset=someone/corpus").data
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match=r"someone/corpus is a hub id and HF_HUB_OFFLINE is set; download it"):
        find_sources(cfg)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(UserError, match=r"cannot be reached .*data.dataset=parquet 'data.data_files=DIR/\*\*/\*.parquet'"):
        find_sources(cfg)


def test_a_missing_text_field_names_the_fields_before_any_run_folder(tmp_path):
    files = write_rows(tmp_path / "rows.jsonl", documents(5))
    result = run_cli(*hf_args(tmp_path, files, "json"), "data.text_field=body", *TINY,
                     f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("ciuic-train: error: data.text_field=body is not a field of json (train); "
                                     "its fields: id, text")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, message", [
    (["data.path=corpus.txt"], "data.path=corpus.txt is read by data=text or data=tokens, not data=stdlib"),
    (["data=text", "data.path=x", "data.dtype=uint32"], "data.dtype=uint32 is the type of data=tokens' .bin files"),
    (["data=text", "data.path=x", "data.streaming=true"], "data.streaming is for data=hf"),
    (["data=hf", "data.dataset=parquet", "data.data_files=x", "data.path=y"], "not data.path=y"),
    (["data=hf", "data.dataset=json", "data.data_files=3"], "data.data_files=3 must be a path or glob"),
    (["data=hf", "data.dataset=json", "data.data_files=x", "data.val_split=train"], "is the training split too"),
    (["data=hf", "data.dataset=json", "data.data_files=x", "data.streaming=true", "data.tokenizer=bpe",
      "data.vocab_size=300"], "data.tokenizer=bpe trains on the whole training split"),
    (["data=hf", "data.dataset=json", "data.data_files=x", "data.streaming=true", "+trick=chaotic_sampler"],
     r"\+trick=chaotic_sampler reorders the windows"),
])
def test_settings_a_dataset_cannot_take_are_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        compose_config(*overrides)


def test_files_that_are_not_there_are_refused_by_name(tmp_path):
    cfg = compose_config("data=hf", "data.dataset=parquet", f"data.data_files=[{tmp_path}/none*.parquet]").data
    with pytest.raises(UserError, match=r"data.data_files: .*none\*.parquet matches no file"):
        find_sources(cfg)
    with pytest.raises(UserError, match="data.dataset=parquet reads files"):
        find_sources(DataConfig(name="hf", dataset="parquet"))


def test_a_missing_split_names_the_splits_there_are(tmp_path):
    files = write_rows(tmp_path / "rows.parquet", documents(5))
    cfg = compose_config(*hf_args(tmp_path, files), "data.val_split=validation").data
    with pytest.raises(UserError, match=r"data.val_split=validation is not a split of parquet: .*\['train'\]"):
        find_sources(cfg)


@pytest.mark.slow
def test_two_ranks_streaming_resumed_after_a_kill_end_bit_identical(tmp_path):
    files = write_rows(tmp_path / "rows.parquet", documents(80))
    common = [*TINY, *hf_args(tmp_path, files), "data.streaming=true", "train.max_steps=12", "ckpt.every=5",
              "train.log_every=1", "train.eval_every=6"]

    def restartable(*extra):
        return torchrun("--nproc_per_node=2", "--max-restarts=1", "-m", "ciuic_train", *common, *extra,
                        cwd=tmp_path, timeout=420)

    whole = restartable(f"hydra.run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = restartable("fault.kill_rank=1", "fault.at_step=7", f"hydra.run.dir={tmp_path / 'killed'}")
    assert killed.returncode == 0, killed.stderr[-3000:]
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in ("whole", "killed")]
    assert summaries[1]["resumed_from"].endswith("step_000005")
    assert summaries[1]["param_checksum"] == summaries[0]["param_checksum"]
    metrics = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
               for run in ("whole", "killed")]
    assert [m["loss"] for m in metrics[1]] == [m["loss"] for m in metrics[0]]
    # A stream's position is per rank: one rank cannot take over two ranks' positions.
    again = run_cli(*common, "train.max_steps=14", "resume=auto", f"hydra.run.dir={tmp_path / 'killed'}",
                    cwd=tmp_path)
    assert again.returncode == 2
    assert "position in its share of a data=hf stream is its own" in again.stderr
    assert again.stderr.count("\n") == 1
    assert os.path.exists(tmp_path / "killed" / "summary.json")
