"""Expert parallelism's overlap (`dist.ep_overlap`): the shared experts compute while the
token rows travel, in forward and in backward, and nothing of the step changes.

On a 1-rank gloo group every exchange is real (gloo's async all-to-all, waited for) but
sends to itself, so these run in the quick tier; tests/test_scale_out.py and
tests/test_netns.py hold 2 and 4 ranks, and two hosts, to the blocking dispatch and to one
process.
"""

from __future__ import annotations


import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from ciuic_train.distributed import expert_parallel
from ciuic_train.distributed.expert_parallel import split_experts
from ciuic_train.model import ModelConfig, Transformer
from ciuic_train.model.moe import MoE

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture
def ep_mesh(one_rank_gloo):
    return init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))


def built_model(mesh=None, overlap: bool = True) -> Transformer:
    """A two-MoE-layer model (one of them in the MTP depth), the same weights every call."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=2, n_dense_layers=1, n_mtp_layers=1, n_shared_experts=1))
    if mesh is not None:
        split_experts(model, mesh, overlap=overlap)
    return model


def step_gradients(model: Transformer) -> dict[str, torch.Tensor]:
    idx = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    model(idx, idx.roll(-1, dims=1), mtp_loss_weight=0.3).backward()
    return {
        name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
        for name, p in model.named_parameters() if p.grad is not None
    }  # fmt: skip


def recorded_events(model: Transformer, monkeypatch) -> list[str]:
    """What a training step does, in order: each exchange's start and wait, each shared
    expert projection's forward, and each of their weights' gradient as it is accumulated.
    The probes add no autograd node, so they cannot change the order they record."""
    events: list[str] = []
    start, wait = expert_parallel.RowExchange.start, expert_parallel.RowExchange.wait

    def logged_start(self, *args, **kwargs):
        events.append("start")
        return start(self, *args, **kwargs)

    def logged_wait(self):
        events.append("wait")
        return wait(self)

    monkeypatch.setattr(expert_parallel.RowExchange, "start", logged_start)
    monkeypatch.setattr(expert_parallel.RowExchange, "wait", logged_wait)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        for name in ("w1", "w2", "w3"):
            linear = getattr(moe.shared_experts, name)
            linear.register_forward_hook(lambda *_, n=name: events.append(f"{n} forward"))
            linear.weight.register_post_accumulate_grad_hook(lambda _, n=name: events.append(f"{n} grad"))
    step_gradients(model)
    return events


def windows(events: list[str]) -> list[list[str]]:
    """The events between each start and its wait (exchanges never nest: each is waited for
    before the next starts), and, as a window of its own, whatever ran outside them."""
    inside, outside, current = [], [], None
    for event in events:
        if event == "start":
            assert current is None, "an exchange started before the last one was waited for"
            current = []
        elif event == "wait":
            inside.append(current)
            current = None
        elif current is None:
            outside.append(event)
        else:
            current.append(event)
    return [*inside, outside]


def test_the_shared_experts_run_while_the_rows_travel_in_forward_and_backward(ep_mesh, monkeypatch):
    *exchanges, outside = windows(recorded_events(built_model(ep_mesh), monkeypatch))
    # 2 MoE layers x (out, back) x (forward, backward)
    assert exchanges == [
        ["w1 forward", "w3 forward"], ["w2 forward"],  # main layer 1, forward
        ["w1 forward", "w3 forward"], ["w2 forward"],  # MTP layer, forward
        ["w2 grad"], ["w3 grad", "w1 grad"],  # MTP layer, backward (last in first out)
        ["w2 grad"], ["w3 grad", "w1 grad"],  # main layer 1, backward
    ]
    assert outside == []


def test_blocking_exchanges_leave_the_shared_experts_outside(ep_mesh, monkeypatch):
    """The same probe on `dist.ep_overlap=false`: nothing runs while an exchange is open."""
    monkeypatch.setattr(expert_parallel.RowExchange, "start", lambda *a: pytest.fail("no async exchange expected"))
    events = []
    all_to_all = expert_parallel.all_to_all

    def logged(*args):
        events.append("start")
        out = all_to_all(*args)
        events.append("wait")
        return out

    monkeypatch.setattr(expert_parallel, "all_to_all", logged)
    step_gradients(built_model(ep_mesh, overlap=False))
    assert events == ["start", "wait"] * 4  # forward's exchanges; backward's run inside autograd's nodes


@pytest.mark.parametrize("overlap", [True, False])
def test_the_dispatch_gives_the_one_process_gradients_bit_for_bit(ep_mesh, overlap):
    """On one rank the dispatch's exchanges send every row to itself: the step must equal the
    model's own, undivided one exactly, whichever order the shared experts ran in."""
    reference = step_gradients(built_model())
    dispatched = step_gradients(built_model(ep_mesh, overlap=overlap))
    assert dispatched.keys() == reference.keys()
    for name, grad in reference.items():
        assert torch.equal(dispatched[name], grad), name
