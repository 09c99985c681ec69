"""Document boundaries: the index the cache writes, end-of-text ids, and attention that stays
inside each document (data.doc_mask), checked against each document run alone."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from ciuic_train.cli.compose import compose, config_module, job_config, without_hydra
from ciuic_train.config import DataConfig
from ciuic_train.data.corpus import load_tokens
from ciuic_train.data.documents import DocumentIndex, write_index
from ciuic_train.data.sampler import window_documents
from ciuic_train.errors import UserError
from ciuic_train.model import ModelConfig, Transformer
from ciuic_train.model.attention import causal_attention
from ciuic_train.model.documents import document_causal_mask, document_positions
from ciuic_train.model.kernels import attention

DOCS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 7, [0] * 12 + [1] * 9])


def load_config(overrides: list[str]):
    """The typed config `ciuic-train <overrides>` would run with, the data's model fields followed."""
    with config_module():
        return job_config(without_hydra(compose(overrides)), overrides)


def _alone(attend, q, k, v, docs):
    """Each document of each row through `attend` on its own, put back in place."""
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    for row in range(q.shape[0]):
        for doc in docs[row].unique():
            at = (docs[row] == doc).nonzero().flatten()
            out[row, :, at] = attend(q[row : row + 1, :, at], k[row : row + 1, :, at], v[row : row + 1, :, at], 0.3)[0]
    return out


@pytest.mark.parametrize(
    "attend",
    [causal_attention, attention.causal_attention, partial(attention.blocked_attention, block_rows=4),
     attention.padded_sdpa],
    ids=["reference", "auto", "blocked-4", "padded-sdpa"],
)
def test_masked_attention_equals_each_document_alone_forward_and_grads(attend):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 21, d, dtype=torch.float64, requires_grad=True) for d in (8, 8, 6))
    grad_out = torch.randn(2, 3, 21, 6, dtype=torch.float64)
    masked = attend(q, k, v, 0.3, docs=DOCS)
    alone = _alone(causal_attention, q, k, v, DOCS)
    torch.testing.assert_close(masked, alone, rtol=0, atol=1e-12)
    got = torch.autograd.grad(masked, (q, k, v), grad_out)
    expected = torch.autograd.grad(alone, (q, k, v), grad_out)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # One document per row is plain causal attention.
    torch.testing.assert_close(attend(q, k, v, 0.3, docs=torch.zeros(2, 21, dtype=torch.long)),
                               causal_attention(q, k, v, 0.3), rtol=0, atol=1e-12)


def test_blocked_attention_without_documents_is_unchanged_bit_for_bit():
    torch.manual_seed(1)
    q, k, v = (torch.randn(6, 130, d) for d in (48, 48, 32))
    plain = attention.BlockedCausalAttention.apply(q, k, v, 0.2, 64)
    assert torch.equal(plain, attention.BlockedCausalAttention.apply(q, k, v, 0.2, 64, None, 1))


def test_the_mask_and_positions_follow_the_documents():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0]]
    mask = document_causal_mask(docs)[0, 0].int().tolist()
    assert mask[3] == [0, 0, 1, 1, 0, 0] and mask[5] == [0, 0, 0, 0, 0, 1] and mask[1] == [1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("kernels", ["reference", "auto"])
@pytest.mark.parametrize("restart", [False, True])
def test_a_window_of_two_documents_has_the_loss_of_each_alone(kernels, restart):
    """The loss summed over a two-document window equals the sums of each document run
    alone (its own targets, the first one's last target being the second's first token)."""
    cfg = ModelConfig(n_layers=3, max_seq_len=64, kernels=kernels)
    model = Transformer(cfg, seed=3).double().eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 41), generator=torch.Generator().manual_seed(5))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    docs = torch.tensor([[0] * 13 + [1] * 27])
    extra = {"docs": docs, "positions": document_positions(docs)} if restart else {"docs": docs}
    together = model(inputs, targets, reduction="sum", **extra)
    alone = model(inputs[:, :13], targets[:, :13], reduction="sum") + model(inputs[:, 13:], targets[:, 13:], reduction="sum")
    # The loss is fp32 (the logits are cast): a sum of 40 terms and one of 13 + 27 may round
    # apart by a few ulps (they do on an AVX2 CPU, not on an AVX-512 one), nothing more.
    torch.testing.assert_close(together, alone, rtol=1e-6, atol=0)
    # Without the mask, the second document sees the first: a different loss (by 0.45%).
    assert abs(model(inputs, targets, reduction="sum") - alone) > 1e-3 * alone


def test_the_index_gives_each_windows_documents_across_files_and_a_tail():
    index = DocumentIndex([(0, np.array([0, 4, 9], dtype="<u8")), (12, np.array([0, 2], dtype="<u8"))])
    docs = index.window_documents([0, 8, 10], 6)
    assert docs.tolist() == [[0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2]]
    assert index.tail(8).window_documents([0], 6).tolist() == docs[1:2].tolist()
    batch = window_documents(index, torch.tensor([1]), 5, restart_positions=True)  # window 1 = tokens 5..9
    assert batch["docs"].tolist() == [[0, 0, 0, 0, 1]] and batch["positions"].tolist() == [[0, 1, 2, 3, 0]]


def _text_corpus(folder, texts):
    folder.mkdir()
    for name, text in texts.items():
        (folder / name).write_text(text)
    return folder


def test_the_cache_records_where_each_file_starts_and_eos_ends_it(tmp_path):
    corpus = _text_corpus(tmp_path / "c", {f"f{i}.txt": "ab\n" * (i + 2) for i in range(40)})
    base = dict(name="text", path=str(corpus), cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    plain = load_tokens(DataConfig(**base))
    with_eos = load_tokens(DataConfig(**base, eos=True))
    for splits, separator in ((plain, 2), (with_eos, 1)):  # a blank line, or one end-of-text id
        for split, index in ((splits.train, splits.train_docs), (splits.val, splits.val_docs)):
            starts = np.concatenate([part for _, part in index.parts]).astype(np.int64)
            tokens = np.asarray(split)
            assert starts[0] == 0 and len(set(starts)) == len(starts)
            # Each document is one file's text, "ab\n" repeated, then its separator.
            for begin, end in zip(starts, list(starts[1:]) + [len(tokens)]):
                body = bytes(tokens[begin : end - separator].astype(np.uint8).tolist()).decode()
                assert body and body == "ab\n" * (len(body) // 3), body
    assert with_eos.vocab_size == 257 and with_eos.tokenizer.vocab_size == 257
    eos_at = np.asarray(with_eos.train) == 256
    assert eos_at.sum() == with_eos.train_docs.count()
    assert plain.vocab_size == 256 and (np.asarray(plain.train) < 256).all()


def test_a_bytes_model_follows_eos_to_257_tokens_and_old_corpora_stay_256():
    assert load_config(["data.eos=true"]).model.vocab_size == 257
    assert load_config([]).model.vocab_size == 256
    assert load_config(["data.eos=true", "model.vocab_size=300"]).model.vocab_size == 300


def test_data_tokens_reads_the_index_beside_each_shard_and_doc_mask_refuses_a_corpus_without(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    for i, (tokens, starts) in enumerate([(np.arange(30), [0, 10]), (np.arange(20), [5])]):
        tokens.astype(np.uint16).tofile(folder / f"train_{i}.bin")
        write_index(folder / f"train_{i}.idx", starts)
    np.arange(12).astype(np.uint16).tofile(folder / "val_0.bin")
    cfg = DataConfig(name="tokens", path=str(folder), doc_mask=True)
    with pytest.raises(UserError, match=r"val_0\.idx is not there"):
        load_tokens(cfg)
    write_index(folder / "val_0.idx", [0, 6])
    splits = load_tokens(cfg)
    # A shard's end is not a document's (the second shard's index has no 0): only 10 and 30 + 5 start one.
    assert splits.train_docs.window_documents([8, 28, 33], 4).tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1]]
    assert splits.val_docs.window_documents([4], 4).tolist() == [[0, 0, 1, 1]]


@pytest.mark.parametrize("overrides, message", [
    (["data.doc_positions=true"], "needs data.doc_mask=true"),
    (["data=tokens", "data.path=x", "data.eos=true"], "already tokenized"),
    (["data.doc_mask=true", "dist.pp=2"], "does not run in a pipeline"),
])
def test_document_options_that_cannot_hold_are_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(overrides)


def test_a_masked_run_trains_on_its_documents_and_one_document_per_window_changes_nothing(tmp_path):
    """With every window inside one document the mask is plain causal attention: the same
    losses as without it. With documents inside windows: different losses, still finite."""
    import json

    from ciuic_train.train.trainer import Trainer
    from conftest import compose_config

    ids = np.random.default_rng(4).integers(0, 256, 12_000, dtype=np.uint16)
    losses = {}
    for name, starts, mask in (("plain", [0], "false"), ("one", [0], "true"), ("many", range(0, 9_000, 50), "true")):
        folder = tmp_path / name
        folder.mkdir()
        ids[:9_000].tofile(folder / "train.bin")
        ids[9_000:].tofile(folder / "val.bin")
        write_index(folder / "train.idx", list(starts))
        write_index(folder / "val.idx", [0])
        run = tmp_path / f"{name}_run"
        run.mkdir()
        Trainer(compose_config("model=tiny", "data=tokens", f"data.path={folder}", f"data.doc_mask={mask}",
                               "train.seq_len=64", "train.max_steps=3", "train.log_every=1", "train.eval_windows=8",
                               "sample.max_new_tokens=0", "train.batch_size=4"), run).fit()
        losses[name] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["plain"]) == 3 and losses["one"] == losses["plain"]
    assert losses["many"] != losses["plain"] and all(np.isfinite(losses["many"]))
