"""Corpora, splits, caching and the window sampler."""

import numpy as np
import pytest
import torch

from ciuic_train.config import DataConfig
from ciuic_train.data.corpus import load_tokens, unigram_entropy
from ciuic_train.data.sampler import WindowSampler, eval_indices, get_batch
from ciuic_train.data.sources import find_sources
from ciuic_train.errors import UserError


def test_stdlib_split_is_by_file_deterministic_and_disjoint():
    first, second = find_sources(DataConfig()), find_sources(DataConfig())
    assert first.train == second.train and first.val == second.val
    assert not set(first.train) & set(first.val)
    assert 0.02 < len(first.val) / (len(first.train) + len(first.val)) < 0.1
    assert not any("site-packages" in p.parts or "test" in p.parts for p in first.train + first.val)


def test_text_corpus_is_cached_and_reused(text_corpus, tmp_path):
    cfg = DataConfig(name="text", path=str(text_corpus), cache_dir=str(tmp_path / "cache"))
    splits = load_tokens(cfg)
    expected = sum(len(p.read_bytes()) + 2 for p in text_corpus.iterdir())
    assert len(splits.train) + len(splits.val) == expected
    assert splits.vocab_size == 256 and int(splits.train.max()) < 256
    (cached,) = cache_entries(tmp_path / "cache")
    before = (cached / "train.bin").stat().st_mtime_ns
    again = load_tokens(cfg)
    assert (cached / "train.bin").stat().st_mtime_ns == before
    assert np.array_equal(splits.val, again.val)
    # Editing a source file gives a new cache entry rather than stale tokens.
    victim = next(text_corpus.iterdir())
    victim.write_text(victim.read_text() + "more\n")
    load_tokens(cfg)
    assert len(cache_entries(tmp_path / "cache")) == 2


def cache_entries(cache):
    """The entries of a corpus cache (hidden files are its locks)."""
    return [p for p in cache.iterdir() if not p.name.startswith(".")]


def test_single_text_file_holds_out_its_tail(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(bytes(range(32, 127)) * 100)
    splits = load_tokens(DataConfig(name="text", path=str(f), val_fraction=0.1, cache_dir=str(tmp_path / "c")))
    assert len(splits.val) == 950 and len(splits.train) == 9500 + 2 - 950
    assert splits.val[-1] == ord("\n")


def test_glob_selects_matching_files(text_corpus):
    sources = find_sources(DataConfig(name="text", path=str(text_corpus / "doc1*.txt")))
    assert len(sources.train) + len(sources.val) == 10


def test_pretokenized_folder_and_file(tmp_path):
    (tmp_path / "train.bin").write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
    (tmp_path / "val.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    splits = load_tokens(DataConfig(name="tokens", path=str(tmp_path)))
    assert len(splits.train) == 1000 and len(splits.val) == 100 and splits.vocab_size == 1000
    single = load_tokens(DataConfig(name="tokens", path=str(tmp_path / "train.bin"), val_fraction=0.1))
    assert len(single.train) == 900 and list(single.val[:2]) == [900, 901]


@pytest.mark.parametrize(
    "cfg, message",
    [
        (DataConfig(name="text", path="/nonexistent/x"), "matches no file"),
        (DataConfig(name="tokens", path="/nonexistent"), "does not exist"),
    ],
)
def test_missing_inputs_are_clear_errors(cfg, message):
    with pytest.raises(UserError, match=message):
        find_sources(cfg)


def test_empty_inputs_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty folder"):
        find_sources(DataConfig(name="text", path=str(tmp_path / "empty")))
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(UserError, match="only empty files"):
        find_sources(DataConfig(name="text", path=str(tmp_path / "blank.txt")))
    (tmp_path / "toks").mkdir()
    (tmp_path / "toks" / "train.bin").write_bytes(b"")
    with pytest.raises(UserError, match="without val.bin"):
        find_sources(DataConfig(name="tokens", path=str(tmp_path / "toks")))


def test_a_corpus_too_small_to_train_on_says_so_and_what_to_do(tmp_path):
    """Named by the corpus and the keys to change, not by a file of the token cache."""
    (tmp_path / "tiny.txt").write_text("hello world\n")
    with pytest.raises(UserError, match=r"/tiny.txt \(1 file\) leaves its validation split without tokens "
                                        r"\(data.val_fraction=0.05\); give a larger corpus$"):
        load_tokens(DataConfig(name="text", path=str(tmp_path / "tiny.txt"), cache_dir=str(tmp_path / "cache")))
    with pytest.raises(UserError, match=r"^the validation split has 150 tokens, fewer than train.seq_len\+1=257; "
                                        "give a larger corpus, raise data.val_fraction or lower train.seq_len$"):
        eval_indices(np.zeros(150, dtype=np.uint16), 256, 8)


def test_sampler_shares_are_disjoint_and_cover_the_epoch():
    n, world = 103, 4
    samplers = [WindowSampler(n, seed=7, rank=r, world_size=world) for r in range(world)]
    epoch0 = [s.next_indices(25) for s in samplers]
    seen = torch.cat(epoch0)
    assert len(seen) == len(set(seen.tolist())) == 100
    # The next draw is epoch 1: a different permutation, same coverage.
    epoch1 = torch.cat([s.next_indices(25) for s in samplers])
    assert len(set(epoch1.tolist())) == 100 and not torch.equal(epoch1, seen)
    assert all(s.epoch == 1 for s in samplers)


def test_sampler_is_deterministic_resumable_and_ignores_the_global_rng():
    a = WindowSampler(50, seed=3)
    first = a.next_indices(30)
    state = a.state_dict()
    rest = a.next_indices(40)  # crosses into epoch 1
    torch.manual_seed(999)
    b = WindowSampler(50, seed=3)
    b.load_state_dict(state)
    assert torch.equal(b.next_indices(40), rest)
    assert torch.equal(WindowSampler(50, seed=3).next_indices(30), first)
    assert not torch.equal(WindowSampler(50, seed=4).next_indices(30), first)


def test_sampler_order_seam_reorders_within_the_share():
    plain = WindowSampler(40, seed=1).next_indices(40)
    reversed_ = WindowSampler(40, seed=1, order=lambda share, epoch: share.flip(0)).next_indices(40)
    assert torch.equal(reversed_, plain.flip(0))


def test_batches_are_shifted_windows():
    tokens = np.arange(100, dtype=np.uint16)
    x, y = get_batch(tokens, torch.tensor([0, 3]), seq_len=8)
    assert x.dtype == torch.long and x.shape == (2, 8)
    assert x[1].tolist() == list(range(24, 32)) and y[1].tolist() == list(range(25, 33))


def test_eval_windows_are_fixed_and_spread():
    tokens = np.zeros(1001, dtype=np.uint16)
    idx = eval_indices(tokens, seq_len=10, count=5)
    assert idx.tolist() == [0, 25, 50, 74, 99]


def test_unigram_entropy_of_uniform_bytes():
    tokens = np.repeat(np.arange(4, dtype=np.uint16), 10)
    assert unigram_entropy(tokens, 256) == pytest.approx(np.log(4))


def test_passes_over_a_split_count_every_chunk_the_same_as_in_one_piece(tmp_path, monkeypatch):
    """Chunks of 1000 tokens over a memory-mapped split, the last one short: the entropy and
    the vocabulary of `data=tokens` are those of the whole array."""
    from ciuic_train.data import corpus

    monkeypatch.setattr(corpus, "CHUNK_TOKENS", 1000)
    ids = np.random.default_rng(0).zipf(1.3, 10_500).clip(max=4000).astype(np.uint16)
    ids[7777] = 4321  # the largest, in the last chunk but one
    (tmp_path / "train.bin").write_bytes(ids.tobytes())
    (tmp_path / "val.bin").write_bytes(ids[:50].tobytes())
    splits = load_tokens(DataConfig(name="tokens", path=str(tmp_path)))
    assert isinstance(splits.train, np.memmap) and splits.vocab_size == 4322
    counts = np.bincount(ids, minlength=4322).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    assert unigram_entropy(splits.train, 4322) == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
    assert unigram_entropy(ids, 16) == pytest.approx(unigram_entropy(ids, 4322), rel=1e-12)  # ids past the vocabulary


@pytest.mark.slow
def test_a_large_corpus_trains_in_the_memory_of_a_small_one(tmp_path):
    """A 240 MB token corpus against a 1 MB one, a run each in a fresh process: the peak
    resident memory (the summary's) differs by less than 64 MiB (45 MB measured: mostly
    the sampler's order of 1.9 M windows, 8 bytes each, and one chunk's pass). A pass that
    widened the training split to int64 (the entropy's bincount did) took 1.2 GB more."""
    import json

    from conftest import run_cli

    peaks = {}
    rng = np.random.default_rng(0)
    for name, n_tokens in (("small", 500_000), ("large", 120_000_000)):
        folder = tmp_path / name
        folder.mkdir()
        with open(folder / "train.bin", "wb") as out:
            for _ in range(0, n_tokens, 10_000_000):
                rng.integers(0, 256, min(10_000_000, n_tokens), dtype=np.uint16).tofile(out)
        rng.integers(0, 256, 100_000, dtype=np.uint16).tofile(folder / "val.bin")
        result = run_cli("model=tiny", "data=tokens", f"data.path={folder}", "train.seq_len=64", "train.max_steps=2",
                         "train.eval_windows=8", "sample.max_new_tokens=0", "progress=plain",
                         f"hydra.run.dir={tmp_path / name / 'run'}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        (peaks[name],) = json.loads((tmp_path / name / "run" / "summary.json").read_text())["peak_memory_bytes_per_rank"]
    assert peaks["large"] - peaks["small"] < 64 * 2**20, peaks


def test_a_corpus_in_shards_gives_the_windows_of_the_same_tokens_in_one_file(tmp_path):
    """train_0..train_10.bin (natural order, one of them empty) and val_*.bin: the same
    windows, batches, vocabulary and entropy as train.bin/val.bin holding the same tokens,
    windows spanning two shards included; without val shards the tail is held out lazily."""
    from ciuic_train.data.shards import TokenShards

    rng = np.random.default_rng(1)
    ids, val_ids = rng.integers(0, 300, 5_000, dtype=np.uint16), rng.integers(0, 300, 700, dtype=np.uint16)
    one, sharded, no_val = tmp_path / "one", tmp_path / "sharded", tmp_path / "no_val"
    for folder in (one, sharded, no_val):
        folder.mkdir()
    ids.tofile(one / "train.bin")
    val_ids.tofile(one / "val.bin")
    cuts = [0, 700, 700, 1_234, 2_000, 2_001, 2_500, 3_100, 3_900, 4_000, 4_500, 5_000]  # shard 1 empty
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        ids[a:b].tofile(sharded / f"train_{i}.bin")
        ids[a:b].tofile(no_val / f"train_{i}.bin")
    val_ids[:300].tofile(sharded / "val_0.bin")
    val_ids[300:].tofile(sharded / "val_1.bin")
    whole = load_tokens(DataConfig(name="tokens", path=str(one)))
    split = load_tokens(DataConfig(name="tokens", path=str(sharded)))
    assert isinstance(split.train, TokenShards) and len(split.train.parts) == 10 and len(split.train) == 5_000
    assert "11 train / 2 val shards" in split.description
    assert split.vocab_size == whole.vocab_size and split.train.dtype == np.uint16
    assert unigram_entropy(split.train, 300) == pytest.approx(unigram_entropy(whole.train, 300), rel=1e-12)
    windows = torch.arange((len(ids) - 1) // 64)  # every window, those across a boundary too
    for got, expected in zip(get_batch(split.train, windows, 64), get_batch(whole.train, windows, 64)):
        assert torch.equal(got, expected)
    assert torch.equal(get_batch(split.val, torch.arange(10), 64)[1], get_batch(whole.val, torch.arange(10), 64)[1])
    held_out = load_tokens(DataConfig(name="tokens", path=str(no_val), val_fraction=0.1))
    assert len(held_out.train) == 4_500 and isinstance(held_out.train, TokenShards)
    assert np.array_equal(np.asarray(held_out.val), ids[4_500:])  # one shard's tail: a plain memmap slice
    (one / "train_0.bin").write_bytes(ids[:10].tobytes())
    with pytest.raises(UserError, match="holds both train.bin and train_\\*.bin shards"):
        load_tokens(DataConfig(name="tokens", path=str(one)))


def test_a_corpus_in_three_shards_trains_to_the_losses_of_one_file(tmp_path):
    import json

    from ciuic_train.train.trainer import Trainer
    from conftest import compose_config

    ids = np.random.default_rng(2).integers(0, 256, 40_000, dtype=np.uint16)
    for name, cuts in (("one", [0, 36_000]), ("three", [0, 9_999, 20_000, 36_000])):
        folder = tmp_path / name
        folder.mkdir()
        if name == "one":
            ids[:36_000].tofile(folder / "train.bin")
            ids[36_000:].tofile(folder / "val.bin")
        else:
            for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
                ids[a:b].tofile(folder / f"train_{i}.bin")
            ids[36_000:].tofile(folder / "val_0.bin")
        run = tmp_path / f"{name}_run"
        run.mkdir()
        Trainer(compose_config("model=tiny", "data=tokens", f"data.path={folder}", "train.seq_len=64",
                               "train.max_steps=4", "train.log_every=1", "train.eval_windows=8",
                               "sample.max_new_tokens=0"), run).fit()
    losses = {name: [json.loads(line)["loss"] for line in (tmp_path / f"{name}_run" / "metrics.jsonl").read_text().splitlines()]
              for name in ("one", "three")}
    assert len(losses["one"]) == 4 and losses["three"] == losses["one"]


def test_tokenizing_reports_progress_in_a_log_and_on_a_terminal(tmp_path, monkeypatch, caplog):
    """A log gets a plain line every PLAIN_EVERY_S seconds (0 here: one per chunk), the last
    at 100%; a terminal gets rich's bar instead; work quicker than that prints nothing."""
    import io

    from rich.console import Console

    from ciuic_train import progress
    from ciuic_train.data.corpus import load_tokens

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"f{i}.txt").write_text(("some text to tokenize, line by line\n" * 2000) + f"file {i}\n")
    config = DataConfig(name="text", path=str(corpus), cache_dir=str(tmp_path / "cache"), chunk_mb=0.02)
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)
    with caplog.at_level("INFO", logger="ciuic_train"):
        load_tokens(config)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenizing 3 files: ")]
    assert len(lines) > 3 and "(100%)" in lines[-1] and "/s, about 0 s left" in lines[-1], lines

    screen = io.StringIO()
    with progress.WorkProgress("writing", 4096, console=Console(file=screen, force_terminal=True, width=100)) as bar:
        for _ in range(4):
            bar.advance(1024)
    assert "writing" in screen.getvalue() and bar.done == 4096
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 30.0)
    caplog.clear()
    with caplog.at_level("INFO", logger="ciuic_train"):
        load_tokens(DataConfig(name="text", path=str(corpus), cache_dir=str(tmp_path / "cache2")))
    assert not [r for r in caplog.records if "tokenizing 3 files" in r.getMessage()]


def test_masking_a_batchs_targets_leaves_its_inputs_alone():
    """A rank with no validation window left evaluates filler rows whose targets it masks
    (train.eval_windows=1 on 2 ranks): their inputs must stay token ids."""
    tokens = np.arange(100, dtype=np.uint16)
    inputs, targets = get_batch(tokens, torch.tensor([0, 2]), seq_len=8)
    targets[1:] = -100
    assert inputs.tolist() == [list(range(0, 8)), list(range(16, 24))]
