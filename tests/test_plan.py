"""`--plan`'s per-rank figures: against the trainer's own measurements, and by hand.

Three tests start real ranks (torchrun, gloo, about 10-30 s each on 2 cores); the rest
build models on the meta device or run a tiny forward in this process.
"""

import json
import math
import weakref
from pathlib import Path

import pytest
import torch

from hydra import compose, initialize_config_dir

from ciuic_train.checks import to_config
from ciuic_train.errors import UserError
from ciuic_train.model import Transformer, count_mtp_parameters, count_parameters
from ciuic_train.plan.figures import plan_figures
from ciuic_train.plan.memory import GIB
from conftest import peak_resident_growth, run_cli, torchrun, write_text_corpus

TINY = ["model=tiny", "train.seq_len=64", "train.eval_windows=16", "sample.max_new_tokens=0", "progress=plain", "train.max_steps=2"]
V3_ON_2048 = [
    "model=deepseek_v3", "dist.nnodes=256", "dist.nproc_per_node=8", "train.batch_size=1", "train.seq_len=4096",
    "precision=bf16", "device=cuda",
]


CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_config(*overrides: str):
    """conftest's compose_config, from the repository's conf/ folder: it works under
    `python -m pytest` too, where the checkout's ciuic_train (without conf/) shadows the
    installed package."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """conftest's text_corpus, shared by this module's runs."""
    return write_text_corpus(tmp_path_factory.mktemp("plan") / "corpus")


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, []),  # DDP: whole parameters
        (2, ["dist.dp_shard=2", "dist.ep=2"]),  # FSDP, experts split over ep only (efsdp=1)
        # FSDP over 4 with experts cut over ep=2 then efsdp=2; 6 experts (3 per ep rank,
        # so 2 + 1 over efsdp) and kv_lora_rank 30 make FSDP2 pad uneven dim-0 shards.
        (4, ["dist.dp_shard=4", "dist.ep=2", "model.n_routed_experts=6", "model.kv_lora_rank=30"]),
    ],
    ids=["ddp2", "fsdp2_ep2", "fsdp4_ep2_uneven"],
)
def test_plan_parameter_bytes_equal_what_rank_0_stores(tmp_path, corpus, nproc, layout):
    run_dir = tmp_path / "run"
    data = ["data=text", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}"]
    result = torchrun(
        f"--nproc_per_node={nproc}", "-m", "ciuic_train", *TINY, *data, *layout, f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    plan = plan_figures(compose_config(*TINY, *layout, f"dist.nproc_per_node={nproc}"))
    assert summary["mesh"] == {key: plan["mesh"][key] for key in ("dp_replicate", "dp_shard", "ep")}
    assert summary["strategy"] == plan["mesh"]["strategy"]
    assert summary["param_bytes_per_rank"] == plan["memory"]["params"]
    assert summary["tokens_per_step"] == plan["tokens_per_step"] == 8 * 64 * nproc  # TINY's batch x seq_len
    if plan["mesh"]["strategy"] == "ddp":
        assert sum(summary["param_bytes_per_rank"].values()) == 4 * summary["n_params"]


def saved_tensor_bytes(config) -> int:
    """Bytes autograd keeps for backward after one forward of the loss, on CPU in fp32:
    storages counted once, parameters and buffers left out, and only what the graph still
    holds at the end (a branch whose output goes unused, like the top-k values of the
    routing, frees what it saved)."""
    torch.manual_seed(0)
    model = Transformer(config.model)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    packed = []

    def pack(t):
        packed.append(weakref.ref(t))
        return t

    batch, seq = config.train.batch_size, config.train.seq_len
    idx = torch.randint(0, config.model.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, idx, mtp_loss_weight=config.train.mtp_loss_weight)
    storages = {}
    for ref in packed:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in own:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    del loss
    return sum(storages.values())


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=tiny", "train.batch_size=2", "train.seq_len=128"],
        ["model=tiny", "train.batch_size=3", "train.seq_len=100"],  # a short last attention block
        ["model=small", "train.batch_size=2", "train.seq_len=96", "model.q_lora_rank=48"],  # query compression
        ["model=small", "train.batch_size=2", "train.seq_len=64", "model.n_expert_groups=4", "model.n_limited_groups=2"],
        ["model=tiny", "train.batch_size=3", "train.seq_len=100", "model.n_mtp_layers=2"],  # two MTP depths
    ],
)
def test_activation_formula_counts_the_saved_tensors_in_fp32_on_cpu(one_thread, overrides):
    config = compose_config(*overrides, "device=cpu")
    figures = plan_figures(config)
    assert figures["memory"]["activations"]["saved"] == saved_tensor_bytes(config)


def expert_params(m) -> int:
    return 3 * m.moe_ffn_dim * m.dim  # w13 (2 h x D) + w2 (D x h), one expert


def test_deepseek_v3_on_256_nodes_with_ep_64_by_hand():
    """HSDP 8 x 256, ep=64: 4 experts per ep rank, cut over efsdp=4 ranks: one each."""
    config = compose_config(*V3_ON_2048, "dist.dp_shard=256", "dist.ep=64")
    f = plan_figures(config)
    m = config.model
    assert m.n_mtp_layers == 1
    n_moe = m.n_layers - m.n_dense_layers + 1  # the MTP depth's block is an MoE layer too
    assert f["world_size"] == 2048
    assert f["mesh"] == {"dp_replicate": 8, "dp_shard": 256, "ep": 64, "efsdp": 4, "strategy": "hsdp"}
    mem = f["memory"]
    experts = n_moe * (256 // 64 // 4) * expert_params(m)
    assert mem["params"]["experts"] == 4 * experts
    assert mem["grads"] == mem["params"]
    model = _meta(config)
    # Two fp32 moments per element, and AdamW's fp32 step count per tensor (w13 and w2 per MoE layer).
    tensors = {"experts": 2 * n_moe, "other": len(list(model.parameters())) - 2 * n_moe}
    assert mem["optimizer"] == {key: 2 * value + 4 * tensors[key] for key, value in mem["params"].items()}
    assert count_parameters(model)[0] + count_mtp_parameters(model)[0] == sum(p.numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    dense = total - n_moe * m.n_routed_experts * expert_params(m)
    # Padding: e.g. wkv_a's 576 rows are 3 per rank, not 2.25 (62 x 192 x 7168 extra elements over 256 ranks).
    padding = 4 * 62 * (3 * 256 - 576) * m.dim // 256
    assert 4 * dense / 256 + padding <= mem["params"]["other"] <= (4 * dense / 256 + padding) * 1.001
    # The root gathers the embedding, the lm head and the final norm, in bf16; it is the largest unit.
    assert mem["root_all_gather"] == 2 * (2 * m.vocab_size * m.dim + 256 * math.ceil(m.dim / 256))
    assert mem["largest_block_all_gather"] < mem["root_all_gather"]
    # EP: 2 exchanges x 2 directions x tokens x top-k x dim x bf16 x 63/64, per MoE layer (the
    # MTP depth's routes the 4095 positions that have a token two ahead).
    assert f["comm"]["all_to_all"] == sum(
        2 * 2 * tokens * m.n_activated_experts * m.dim * 2 * 63 // 64 + 8 * m.n_routed_experts * 63 // 64
        for tokens in [4096] * (n_moe - 1) + [4095]
    )
    stored = sum(mem["params"].values()) // 4
    assert f["comm"]["all_reduce"]["hsdp_replicas"] == 2 * 7 * 4 * stored // 8
    assert f["comm"]["all_reduce"]["moe_load"] == 2 * 2047 * 4 * n_moe * 256 // 2048
    assert f["comm"]["all_reduce"]["ddp_grads"] == 0
    assert 0 < f["comm"]["all_gather"] < f["comm"]["reduce_scatter"] * 1.1  # 2 bf16 gathers vs 1 fp32 reduce
    assert mem["accumulated_grads"] == 0
    # Without checkpointing the activations alone exceed any GPU; with it, the rank fits an 80 GB one.
    assert mem["activations"]["no_ac"] > 141 * GIB
    assert f["fits"] == {"80 GB": {"no_ac": False, "ac": True}, "141 GB": {"no_ac": False, "ac": True}}


def test_deepseek_v3_with_experts_cut_over_ep_only_does_not_fit():
    """HSDP 32 x 64, ep=64: each rank keeps 4 whole experts per MoE layer, 16 B per parameter."""
    config = compose_config(*V3_ON_2048, "dist.dp_shard=64", "dist.ep=64")
    f = plan_figures(config)
    m = config.model
    assert f["mesh"]["efsdp"] == 1 and f["mesh"]["dp_replicate"] == 32
    state = sum(sum(f["memory"][key].values()) for key in ("params", "grads", "optimizer"))
    assert state >= 16 * 58 * 4 * expert_params(m) > 141 * GIB
    assert f["comm"]["all_gather"] > 0  # the dense parameters are still sharded over 64


def test_deepseek_v2_lite_on_one_node_by_hand():
    m = compose_config("model=deepseek_v2_lite").model
    n_moe = m.n_layers - m.n_dense_layers
    total, _ = count_parameters(_meta(compose_config("model=deepseek_v2_lite")))

    ddp = plan_figures(compose_config("model=deepseek_v2_lite", "dist.nproc_per_node=8"))
    assert ddp["mesh"]["strategy"] == "ddp"
    assert ddp["memory"]["params"]["experts"] == 4 * n_moe * m.n_routed_experts * expert_params(m)
    assert sum(ddp["memory"]["params"].values()) == 4 * total
    # One fp32 copy of the gradients, DDP's buckets, held all step beside the weights and AdamW:
    # the total is that state and the activations.
    mem = ddp["memory"]
    assert sum(mem["grads"].values()) == 4 * total
    assert mem["state"] == sum(mem["params"].values()) + sum(mem["grads"].values()) + sum(mem["optimizer"].values())
    assert mem["total"] == {key: mem["state"] + mem["activations"][key] for key in ("no_ac", "ac")}
    assert ddp["comm"]["all_reduce"]["ddp_grads"] == 2 * 7 * 4 * total // 8
    assert ddp["comm"]["all_gather"] == ddp["comm"]["reduce_scatter"] == ddp["comm"]["all_to_all"] == 0

    ep = plan_figures(compose_config("model=deepseek_v2_lite", "dist.nproc_per_node=8", "dist.dp_shard=8", "dist.ep=8"))
    assert ep["mesh"] == {"dp_replicate": 1, "dp_shard": 8, "ep": 8, "efsdp": 1, "strategy": "fsdp"}
    assert ep["memory"]["params"]["experts"] == 4 * n_moe * (64 // 8) * expert_params(m)
    assert ep["comm"]["all_to_all"] > 0 and ep["comm"]["all_reduce"]["hsdp_replicas"] == 0
    accumulating = plan_figures(compose_config(
        "model=deepseek_v2_lite", "dist.nproc_per_node=8", "dist.dp_shard=8", "dist.ep=8", "train.grad_accum=2",
    ))
    # FSDP2 keeps every unit's unsharded fp32 gradient between micro-batches.
    experts = n_moe * m.n_routed_experts * expert_params(m)
    assert accumulating["memory"]["accumulated_grads"] >= 4 * (total - experts + experts // 8)


def test_a_bad_mesh_is_a_user_error_before_anything_is_built():
    with pytest.raises(UserError, match="dist.ep=3 must divide dist.dp_shard=1"):
        plan_figures(compose_config("dist.nproc_per_node=4", "dist.ep=3"))
    with pytest.raises(UserError, match="world size is 16"):
        plan_figures(compose_config("dist.nnodes=2", "dist.nproc_per_node=8", "dist.dp_replicate=3", "dist.dp_shard=4"))


def test_activation_checkpointing_keeps_block_inputs_only():
    config = compose_config(*V3_ON_2048, "dist.dp_shard=256", "dist.ep=64")
    f = plan_figures(config)
    acts = f["memory"]["activations"]
    m = config.model
    # The main blocks' inputs, and the MTP block's (4095 positions).
    block_inputs = (m.n_layers * 4096 + 4095) * m.dim * 2
    assert acts["ac"] == acts["top"] + block_inputs + 2 * max(acts["dense_block"], acts["moe_block"])
    widths = f["widths"]
    assert widths == {"residual": 2, "activation": 2, "gather": 2}  # bf16 under FSDP2 on CUDA
    fp32 = compose_config(*V3_ON_2048, "dist.dp_shard=256", "dist.ep=64", "precision=fp32")
    assert plan_figures(fp32)["memory"]["activations"]["saved"] > 1.9 * acts["saved"]


def test_plan_initializes_no_cuda_and_allocates_nothing(monkeypatch):
    """The 671B model's plan, on CUDA settings: meta tensors only, and CUDA never touched
    (its initialization fails the test, on a machine with a GPU or without)."""
    def no_cuda(*args, **kwargs):
        raise AssertionError("the plan initialized CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    config = compose_config(*V3_ON_2048, "dist.dp_shard=256", "dist.ep=64")
    grown = peak_resident_growth(lambda: plan_figures(config))
    assert grown < 256 * 2**20, grown  # against 2.7 TB of fp32 weights


def test_cli_plan_prints_the_mesh_tables(tmp_path: Path):
    result = run_cli(
        "model=deepseek_v2_lite", "dist.nproc_per_node=8", "dist.dp_shard=8", "dist.ep=8", "train.seq_len=4096",
        "train.batch_size=1", "precision=bf16", "device=cuda", "--plan", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "15,706,484,224" in out
    assert "fsdp dp_replicate=1 x dp_shard=8, ep=8, efsdp=1" in out
    assert "80 GB (79 GiB): fits" in out and "all-to-all" in out
    assert list(tmp_path.iterdir()) == []


def test_cli_plan_spans_nodes(tmp_path: Path):
    result = run_cli(*V3_ON_2048, "dist.dp_shard=256", "dist.ep=64", "--plan", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "hsdp dp_replicate=8 x dp_shard=256, ep=64, efsdp=4" in " ".join(result.stdout.split())  # rich wraps


def test_cli_plan_with_a_bad_mesh_is_one_line(tmp_path: Path):
    result = run_cli("--plan", "dist.nproc_per_node=4", "dist.ep=3", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ciuic-train: error: dist.ep=3 must divide dist.dp_shard=1")


def _meta(config):
    with torch.device("meta"):
        return Transformer(config.model)
