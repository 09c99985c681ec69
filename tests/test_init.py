"""Initialization by rows: the same step-0 weights whatever the layout.

In one process, a `locate` that hands out a run of rows stands in for a rank's shard; the
slow tests build the trainer for real under torchrun (gloo) in six layouts (those of one
world size one after the other, in one launch) and compare every gathered parameter bit
for bit.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import compose_config, torchrun
from ciuic_train.model import Transformer
from ciuic_train.model import init as init_module
from ciuic_train.model.init import ParameterInit, Rows
from ciuic_train.model.norm import RMSNorm
from ciuic_train.tricks.base import TrickContext
from ciuic_train.tricks.constellation_init import ConstellationInit

HERE = Path(__file__).parent


def shard_locator(full: dict[int, torch.Tensor], start: int, stop: int):
    """A `locate` giving rows [start, stop) of each tensor, written into a copy of those rows."""

    def locate(param: torch.Tensor) -> Rows:
        rows = full.setdefault(id(param), torch.zeros_like(param.data))
        lo, hi = min(start, param.shape[0]), min(stop, param.shape[0])
        return Rows(rows[lo:hi], param.shape, lo)

    return locate


@pytest.mark.parametrize("cuts", [[0, 7, 19, 64], [0, 32, 64], [0, 1, 2, 63, 64], [0, 64, 64, 64]])
def test_rows_drawn_in_pieces_equal_the_whole(monkeypatch, cuts):
    """Shards that straddle blocks, start mid-block, hold one row, or none (FSDP's padding ranks)."""
    monkeypatch.setattr(init_module, "BLOCK_ELEMENTS", 5 * 12)  # 5 rows of 12 per block
    whole = torch.empty(64, 3, 4)
    ParameterInit(7).normal_("w", whole, std=1.0)
    pieces = torch.full_like(whole, float("nan"))
    for start, stop in zip(cuts, cuts[1:]):
        ParameterInit(7, lambda p, a=start, b=stop: Rows(pieces[a:b], p.shape, a)).normal_("w", whole, std=1.0)
    assert torch.equal(pieces, whole)


def test_the_values_depend_on_the_seed_and_the_name_only():
    draw = {}
    for seed, name in ((1, "a"), (1, "a"), (2, "a"), (1, "b")):
        t = torch.empty(10, 10)
        ParameterInit(seed).normal_(name, t, std=1.0)
        draw.setdefault((seed, name), []).append(t)
    torch.manual_seed(123)  # the global RNG plays no part
    again = torch.empty(10, 10)
    ParameterInit(1).normal_("a", again, std=1.0)
    assert torch.equal(draw[(1, "a")][0], draw[(1, "a")][1]) and torch.equal(draw[(1, "a")][0], again)
    assert not torch.equal(draw[(1, "a")][0], draw[(2, "a")][0])
    assert not torch.equal(draw[(1, "a")][0], draw[(1, "b")][0])


def test_the_model_init_touches_every_parameter_by_its_rule():
    cfg = compose_config("model=tiny", "model.n_mtp_layers=1").model
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    for param in model.parameters():
        param.data.fill_(float("nan"))
    model.init_weights(ParameterInit(3))
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if id(param) in norms:
            assert param.eq(1).all(), name
        else:
            assert param.std().item() == pytest.approx(cfg.init_std, rel=0.15), name


def test_mtp_depths_and_the_global_rng_leave_the_main_model_as_it_was():
    torch.manual_seed(0)
    plain = Transformer(compose_config("model=tiny").model, seed=5)
    torch.manual_seed(1)
    with_mtp = Transformer(compose_config("model=tiny", "model.n_mtp_layers=1").model, seed=5)
    mtp = dict(with_mtp.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(param, mtp[name]), name


def test_a_model_initialized_by_shards_equals_one_initialized_whole():
    cfg = compose_config("model=tiny", "model.n_mtp_layers=1").model
    whole = Transformer(cfg, seed=11)
    with torch.device("meta"):
        sharded = Transformer(cfg)
    sharded.to_empty(device="cpu")
    full: dict[int, torch.Tensor] = {}
    for start, stop in ((0, 3), (3, 10), (10, 1 << 20)):  # three uneven "ranks"
        sharded.init_weights(ParameterInit(11, shard_locator(full, start, stop)))
    for name, param in whole.named_parameters():
        assert torch.equal(full[id(dict(sharded.named_parameters())[name])], param), name


def test_constellation_init_on_shards_equals_it_on_whole_weights():
    cfg = compose_config("model=tiny").model
    ctx = TrickContext(0, 0, 1, 10, 1)
    whole = Transformer(cfg)
    ConstellationInit(ctx).init_weights(whole, ParameterInit(0))
    sharded = Transformer(cfg)
    full: dict[int, torch.Tensor] = {}
    for start, stop in ((0, 5), (5, 1 << 20)):
        ConstellationInit(ctx).init_weights(sharded, ParameterInit(0, shard_locator(full, start, stop)))
    params = dict(sharded.named_parameters())
    linears = [n for n, m in whole.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    for name in linears:
        assert torch.equal(full[id(params[f"{name}.weight"])], whole.get_submodule(name).weight), name


# --- Real layouts (torchrun, gloo) -----------------------------------------------------------

OVERRIDES = ["model=tiny", "model.n_mtp_layers=1", "train.seq_len=64", "progress=plain", "seed=3"]
LAYOUTS = {  # name: (ranks, mesh overrides)
    "ddp2": (2, []),
    "fsdp2": (2, ["dist.dp_shard=2"]),
    "fsdp2_ep2": (2, ["dist.dp_shard=2", "dist.ep=2"]),
    "hsdp4": (4, ["dist.dp_replicate=2", "dist.dp_shard=2"]),
    "fsdp4_ep2": (4, ["dist.dp_shard=4", "dist.ep=2"]),  # experts split over ep, then sharded by FSDP
    # 6 experts (3 per ep rank, 2 + 1 over efsdp) and kv_lora_rank 30: FSDP2 pads uneven
    # dim-0 shards, and a rank may hold no row of a parameter.
    "fsdp4_ep2_uneven": (4, ["dist.dp_shard=4", "dist.ep=2", "model.n_routed_experts=6", "model.kv_lora_rank=30"]),
}
MODEL_KEYS = ("model.",)  # the overrides of a layout that change the model, not the mesh


def step0_weights(out: Path, ranks: int, layouts: dict[str, list[str]]) -> None:
    """Each layout's step-0 weights in OUT/<name>.pt, the layouts (all of `ranks` ranks)
    built one after the other in one launch (tests/step0_weights.py)."""
    args = [str(HERE / "step0_weights.py"), str(out), json.dumps(layouts), *OVERRIDES]
    if ranks == 1:
        result = subprocess.run([sys.executable, *args], cwd=HERE, capture_output=True, text=True, timeout=240)
    else:
        result = torchrun(f"--nproc_per_node={ranks}", *args, cwd=HERE)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """one_process(model overrides): that model's step-0 weights in one process, once per module."""
    done: dict[tuple[str, ...], dict] = {}

    def get(model: list[str]) -> dict:
        if tuple(model) not in done:
            out = tmp_path_factory.mktemp("init")
            step0_weights(out, 1, {"one": model})
            done[tuple(model)] = torch.load(out / "one.pt", weights_only=True)
        return done[tuple(model)]

    return get


@pytest.fixture(scope="module")
def layouts_built(tmp_path_factory) -> Path:
    """Every layout's step-0 weights, in one launch per world size."""
    out = tmp_path_factory.mktemp("layouts")
    for ranks in sorted({ranks for ranks, _ in LAYOUTS.values()}):
        step0_weights(out, ranks, {name: mesh for name, (r, mesh) in LAYOUTS.items() if r == ranks})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_starts_from_the_weights_of_one_process(one_process, layouts_built, layout):
    _, mesh = LAYOUTS[layout]
    got = torch.load(layouts_built / f"{layout}.pt", weights_only=True)
    reference = one_process([o for o in mesh if o.startswith(MODEL_KEYS)])
    assert got["mesh"] != reference["mesh"]
    assert got["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        assert torch.equal(got["params"][name], value), name
    for name, value in reference["buffers"].items():
        assert torch.equal(got["buffers"][name], value), name
