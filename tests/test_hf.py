"""Hugging Face checkpoints out (`ciuic-train-export --format hf`) and in (`init_from=DIR`).

Exactness is the point: an exported tiny run must give transformers' DeepseekV3ForCausalLM
our logits (fp32, 1e-5), and a run started from the folder must take its first step from
exactly those weights (its first loss is the exported model's loss on that batch). The
trained runs are module-scoped: each costs a second or two here.
"""

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from safetensors.torch import load_file, save_file

from conftest import torchrun, write_text_corpus
from ciuic_train.tools import export
from ciuic_train.cli import main as cli
from ciuic_train.cli.compose import _model_from_init_from
from ciuic_train.checks import to_config
from ciuic_train.data.sampler import WindowSampler
from ciuic_train.errors import UserError
from ciuic_train.tools.export import parse_size, write_hf_folder
from ciuic_train.checkpoint.hf_config import config_json, model_fields
from ciuic_train.checkpoint.hf_weights import INDEX_FILE, check_init_from, hf_name, load_hf_weights
from ciuic_train.checkpoint.safetensors_rows import TensorFile
from ciuic_train.model import Transformer
from ciuic_train.model.config import ModelConfig
from ciuic_train.model.init import ParameterInit
from ciuic_train.train.trainer import Trainer

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")

SEQ, BATCH = 32, 4
# transformers' DeepseekV3 routes with sigmoid scores only (tiny's default is softmax).
VARIANTS = {
    "plain": ["model.score_func=sigmoid"],
    # Compressed queries, and group-limited routing: 2 groups of 2 experts, 1 kept per token.
    "q_lora_groups": ["model.score_func=sigmoid", "model.q_lora_rank=24", "model.n_expert_groups=2",
                      "model.n_limited_groups=1", "model.norm_topk_prob=true", "model.route_scale=2.5"],
}


def config_of(*overrides: str):
    """The typed config `ciuic-train OVERRIDES` runs with, init_from's config.json applied as the CLI does."""
    with initialize_config_module(config_module="ciuic_train.conf", version_base="1.3"):
        return to_config(_model_from_init_from(compose(config_name="config", overrides=list(overrides)), list(overrides)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("hf")
    text = write_text_corpus(root / "corpus")
    return ["model=tiny", "data=text", f"data.path={text}", f"data.cache_dir={root / 'cache'}",
            f"train.seq_len={SEQ}", f"train.batch_size={BATCH}", f"train.eval_windows={BATCH}", "train.eval_every=100",
            "ckpt.every=0", "progress=plain"]


@pytest.fixture(scope="module")
def export_of(corpus, tmp_path_factory):
    """export_of(variant): (a trained tiny run's model, its exported folder, the run's
    overrides but the model's); each variant trains once per module."""
    done = {}

    def get(variant: str):
        if variant not in done:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            overrides = [*corpus, "train.max_steps=3", "train.lr=1e-2", "train.warmup_steps=0"]
            run_dir = tmp_path_factory.mktemp(variant)
            try:
                trainer = Trainer(config_of(*overrides, *VARIANTS[variant]), run_dir)
                trainer.fit()  # ends with a save
            finally:
                torch.set_num_threads(threads)
            export.main([str(run_dir), "--format", "hf"])
            done[variant] = trainer.model.eval(), run_dir / "hf_step3", overrides
        return done[variant]

    return get


@pytest.fixture(params=list(VARIANTS))
def exported(request, export_of):
    return export_of(request.param)


@pytest.fixture
def plain(export_of):
    return export_of("plain")


def load_transformers(folder: Path, caplog):
    with caplog.at_level(logging.WARNING, logger="transformers"):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, output_loading_info=True, attn_implementation="eager", experts_implementation="eager"
        )
    return model.eval(), info, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def fixed_batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(7))


def test_transformers_loads_the_export_with_our_logits(exported, caplog):
    model, folder, _ = exported
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    twin, info, warnings = load_transformers(folder, caplog)
    assert type(twin).__name__ == "DeepseekV3ForCausalLM" and twin.dtype == torch.float32
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not warnings, warnings
    idx = fixed_batch()
    with torch.no_grad():
        error = (model(idx) - twin(idx).logits).abs().max().item()
    assert error < 1e-5
    config = json.loads((folder / "config.json").read_text())
    cfg = model.config
    assert (config["n_group"], config["topk_group"], config["q_lora_rank"] or 0) == (
        cfg.n_expert_groups, cfg.n_limited_groups, cfg.q_lora_rank)
    assert json.loads((folder / "generation_config.json").read_text())["do_sample"] is True


def test_a_run_started_from_the_export_takes_its_first_step_from_those_weights(exported, tmp_path, caplog):
    model, folder, overrides = exported
    trainer = Trainer(config_of(*overrides, f"init_from={folder}"), tmp_path)
    # The model's shape and routing come from config.json: the command line has only model=tiny.
    shape = ("score_func", "q_lora_rank", "n_expert_groups", "n_limited_groups", "norm_topk_prob", "route_scale")
    assert [getattr(trainer.config.model, k) for k in shape] == [getattr(model.config, k) for k in shape]
    for (name, ours), theirs in zip(trainer.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(ours, theirs), name
    # The batch its first step takes, and the exported model's loss on it in transformers.
    first = WindowSampler(trainer.windows.sampler.n_windows, trainer.config.seed).next_indices(BATCH)
    inputs, targets = trainer._batch(first, trainer.data.train)
    twin, _, _ = load_transformers(folder, caplog)
    with torch.no_grad():
        expected = F.cross_entropy(twin(inputs).logits.flatten(0, 1), targets.flatten()).item()
    assert trainer.train_step()["loss"] == pytest.approx(expected, abs=1e-5)


def test_an_export_split_into_files_loads_the_same(plain, tmp_path, caplog):
    model, folder, _ = plain
    split = tmp_path / "split"
    export.main([str(folder.parent), "--format", "hf", "--out", str(split), "--max-shard-size", "20KB"])
    index = json.loads((split / INDEX_FILE).read_text())
    files = sorted(p.name for p in split.glob("*.safetensors"))
    assert len(files) > 3 and set(index["weight_map"].values()) == set(files)
    for file in files:  # at most 20KB of tensors, or one larger tensor alone
        tensors = load_file(split / file).values()
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors) <= 20_000
    twin, info, warnings = load_transformers(split, caplog)
    assert not info["unexpected_keys"] and not info["missing_keys"] and not warnings
    idx = fixed_batch()
    with torch.no_grad():
        assert (model(idx) - twin(idx).logits).abs().max().item() < 1e-5
    fresh = Transformer(model.config)
    load_hf_weights(fresh, split)
    for (name, ours), theirs in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_a_resumed_run_keeps_its_own_weights_not_init_from(plain, tmp_path, monkeypatch):
    _, folder, overrides = plain
    first = Trainer(config_of(*overrides, f"init_from={folder}"), tmp_path)
    first.train_step()
    first.save_checkpoint()

    def not_again(*args):
        raise AssertionError("init_from read again on resume")

    monkeypatch.setattr("ciuic_train.train.trainer.load_hf_weights", not_again)
    resumed = Trainer(config_of(*overrides, f"init_from={folder}"), tmp_path)
    assert resumed.resumed_from is not None and resumed.step == 1
    for (name, ours), theirs in zip(resumed.model.state_dict().items(), first.model.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_no_value_is_drawn_for_a_weight_init_from_or_a_resume_will_overwrite(plain, tmp_path, monkeypatch):
    """Drawing them would only cost time: seconds a rank for a big model."""
    _, folder, overrides = plain
    drawn, draw = [], ParameterInit.fill_
    monkeypatch.setattr(ParameterInit, "fill_", lambda self, key, *args: drawn.append(key) or draw(self, key, *args))
    fresh = Trainer(config_of(*overrides), tmp_path / "fresh")
    assert sorted(drawn) == sorted(name for name, p in fresh.model.named_parameters() if p.dim() > 1)  # the control
    drawn.clear()
    Trainer(config_of(*overrides, f"init_from={folder}"), tmp_path / "started")
    assert drawn == []  # the export holds every weight
    fresh.train_step()
    fresh.save_checkpoint()
    resumed = Trainer(config_of(*overrides), tmp_path / "fresh")
    assert resumed.resumed_from is not None and drawn == []
    assert torch.equal(resumed.model.rope_cos, fresh.model.rope_cos)  # what no checkpoint holds is made


def test_explicit_model_overrides_win_over_config_json_and_a_mismatch_is_one_line(plain, corpus, tmp_path, capsys):
    _, folder, _ = plain
    config = config_of(*corpus, f"init_from={folder}", "model.kv_lora_rank=16", "model.bias_update_rate=0.5")
    assert (config.model.kv_lora_rank, config.model.bias_update_rate, config.model.score_func) == (16, 0.5, "sigmoid")
    with pytest.raises(UserError, match=r"model\.layers\.0\.self_attn\.kv_a_proj_with_mqa\.weight has shape "
                                        r"\[40, 64\], model layers\.0\.attn\.wkv_a\.weight needs \[24, 64\]"):
        check_init_from(config.model, folder)
    # Through the command line, before Hydra makes a folder: one line, status 2, nothing written.
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        cli.main([*corpus, f"init_from={folder}", "model.kv_lora_rank=16", f"hydra.run.dir={run_dir}"])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and stderr.count("\n") == 1 and "kv_a_proj_with_mqa.weight has shape" in stderr
    assert not run_dir.exists()


def test_a_missing_or_unexpected_tensor_is_named(plain, tmp_path):
    model, folder, _ = plain
    tensors = load_file(folder / "model.safetensors")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    renamed = dict(tensors)
    renamed["model.layers.1.mlp.gate.bias"] = renamed.pop("model.layers.1.mlp.gate.weight")
    save_file(renamed, broken / "model.safetensors")
    with pytest.raises(UserError, match=r"^init_from=.*: no tensor model\.layers\.1\.mlp\.gate\.weight there"):
        load_hf_weights(Transformer(model.config), broken)
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, broken / "model.safetensors")
    with pytest.raises(UserError, match=r"unexpected tensor model\.extra\.weight \(shape \[2\]\)"):
        check_init_from(model.config, broken)


def test_published_layouts_load_experts_stored_apart_and_v2_softmax_routing(tmp_path):
    """DeepSeek's releases store each routed expert's gate/up/down apart; V2 routes with
    softmax and has no correction bias. Both load into the same weights."""
    model = Transformer(ModelConfig(n_routed_experts=4)).eval()  # tiny, softmax
    with torch.no_grad():
        model.layers[1].ffn.expert_bias.zero_()
    config = config_json(ModelConfig(score_func="sigmoid"))
    config |= {"model_type": "deepseek_v2", "scoring_func": "softmax", "topk_method": "greedy"}
    tensors = {}
    for name, tensor in model.state_dict().items():
        theirs = hf_name(name, model.config.n_layers)
        if name.endswith("ffn.w13"):
            experts = theirs.rsplit(".", 1)[0]
            gates, ups = tensor.chunk(2, dim=1)  # [E, hidden, dim] each
            for e in range(len(tensor)):
                tensors[f"{experts}.{e}.gate_proj.weight"], tensors[f"{experts}.{e}.up_proj.weight"] = gates[e], ups[e]
        elif name.endswith("ffn.w2"):
            for e, down in enumerate(tensor):
                tensors[f"{theirs.rsplit('.', 1)[0]}.{e}.down_proj.weight"] = down
        elif not name.endswith("expert_bias"):
            tensors[theirs] = tensor
    folder = tmp_path / "v2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    fields = model_fields(folder)
    assert (fields["score_func"], fields["bias_update_rate"]) == ("softmax", 0.0)
    fresh = Transformer(ModelConfig(**fields))
    load_hf_weights(fresh, folder)
    for (name, ours), theirs in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_what_transformers_cannot_express_is_one_line_naming_the_field():
    with pytest.raises(UserError, match=r"^model\.score_func='softmax' cannot be exported to Hugging Face "
                                        r"DeepseekV3: its router scores experts with sigmoid only$"):
        config_json(ModelConfig())


@pytest.mark.parametrize("text, size", [("123", 123), ("5GB", 5 * 10**9), ("2MiB", 2 * 2**20), ("1.5kb", 1500)])
def test_max_shard_sizes_read_as_transformers_reads_them(text, size):
    assert parse_size(text) == size


def test_mtp_depths_are_written_under_deepseeks_names_and_read_back(tmp_path, caplog):
    model = Transformer(ModelConfig(score_func="sigmoid", n_mtp_layers=1, init_std=0.1)).eval()
    folder = write_hf_folder(model, tmp_path / "mtp", 10**9, {"do_sample": True})
    config = json.loads((folder / "config.json").read_text())
    names = set(load_file(folder / "model.safetensors"))
    assert config["num_nextn_predict_layers"] == 1
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.shared_head.head.weight",
            "model.layers.2.embed_tokens.weight", "model.layers.2.self_attn.kv_b_proj.weight",
            "model.layers.2.mlp.experts.gate_up_proj"} <= names
    # transformers drops the MTP layer; it ignores only layer 61 (DeepSeek-V3's), so it lists it as unexpected.
    twin, info, _ = load_transformers(folder, caplog)
    assert not info["missing_keys"] and all(k.startswith("model.layers.2.") for k in info["unexpected_keys"])
    idx = fixed_batch()
    with torch.no_grad():
        assert (model(idx) - twin(idx).logits).abs().max().item() < 1e-5
    back = Transformer(ModelConfig(**model_fields(folder)))
    assert back.config.n_mtp_layers == 1
    load_hf_weights(back, folder)
    for (name, ours), theirs in zip(back.state_dict().items(), model.state_dict().values()):
        assert torch.equal(ours, theirs), name
    load_hf_weights(Transformer(ModelConfig(score_func="sigmoid")), folder)  # without MTP: its layer is ignored


@pytest.mark.slow
def test_init_from_under_two_rank_fsdp_gives_the_same_first_loss(plain, tmp_path, caplog):
    model, folder, overrides = plain
    result = torchrun("--nproc_per_node=2", "-m", "ciuic_train", *overrides, f"init_from={folder}",
                      "train.max_steps=1", "train.log_every=1", "dist.dp_shard=2", "sample.max_new_tokens=0",
                      f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["strategy"] == "fsdp"
    trainer = Trainer(config_of(*overrides), tmp_path / "peek")
    twin, _, _ = load_transformers(folder, caplog)
    losses = []
    for rank in range(2):
        first = WindowSampler(trainer.windows.sampler.n_windows, trainer.config.seed, rank, 2).next_indices(BATCH)
        inputs, targets = trainer._batch(first, trainer.data.train)
        with torch.no_grad():
            losses.append(F.cross_entropy(twin(inputs).logits.flatten(0, 1), targets.flatten()).item())
    assert logged["step"] == 1 and logged["loss"] == pytest.approx(sum(losses) / 2, abs=1e-5)


# --- Reading checkpoint files by rows ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_rows_read_from_a_file_equal_safetensors_own_reading(tmp_path, dtype):
    from safetensors import safe_open

    tensors = {"a": (torch.randn(7, 3, 5) * 100).to(dtype), "b": torch.arange(11).to(dtype), "c": torch.ones(2, 4).to(dtype)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    with TensorFile(tmp_path / "x.safetensors") as ours, safe_open(tmp_path / "x.safetensors", framework="pt") as theirs:
        assert sorted(ours.names()) == sorted(theirs.keys())
        for name in tensors:
            assert ours.shape(name) == list(theirs.get_slice(name).get_shape())
            assert torch.equal(ours.read(name), theirs.get_tensor(name))
        for start, stop in ((0, 7), (2, 5), (6, 7), (3, 3)):
            assert torch.equal(ours.read_rows("a", start, stop), theirs.get_slice("a")[start:stop])


def test_a_file_that_is_not_safetensors_is_one_line(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(UserError, match=r"init_from=.*hf: model.safetensors is not a safetensors file"):
        check_init_from(ModelConfig(), folder)
