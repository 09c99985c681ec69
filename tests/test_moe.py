"""The MoE layer past routing: what the routed experts compute (dispatch, grouped matmuls),
and how their load is balanced (the expert bias, the auxiliary balance losses)."""

import pytest
import torch
import torch.nn.functional as F

from model_helpers import KERNELS, make_moe, tiny_model
from ciuic_train.model.common import grouped_mm_supported, grouped_swiglu, swiglu_per_expert
from ciuic_train.model.transformer import kernels_for

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.mark.parametrize("kernels", KERNELS)
def test_grouped_dispatch_equals_a_per_token_reference(kernels):
    moe = make_moe(score_func="sigmoid", norm_topk_prob=True, route_scale=2.5).eval()
    moe.routed_experts = kernels_for(kernels).routed_experts
    moe.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(3, 7, moe.gate.in_features)
    weights, indices = moe.route(x.reshape(-1, x.shape[-1]))
    expected = []
    for n, token in enumerate(x.reshape(-1, x.shape[-1])):
        out = moe.shared_experts(token)
        for weight, e in zip(weights[n], indices[n]):
            w1, w3 = moe.w13[e].chunk(2)
            hidden = F.silu(w1 @ token) * (w3 @ token)
            out = out + weight * (moe.w2[e] @ hidden)
        expected.append(out)
    with torch.no_grad():
        got = moe(x)
    torch.testing.assert_close(got, torch.stack(expected).view_as(x), atol=1e-5, rtol=1e-5)


needs_grouped_mm = pytest.mark.skipif(
    not grouped_mm_supported(torch.zeros(1), torch.float32), reason="torch._grouped_mm has no CPU kernel here"
)


@needs_grouped_mm
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_grouped_mm_experts_match_the_loop_forward_and_grads(precision):
    moe = make_moe()
    # Expert 5 gets no token: an empty group must be harmless in both directions.
    counts = torch.tensor([7, 1, 12, 3, 9, 0, 4, 4])
    x = torch.randn(int(counts.sum()), moe.gate.in_features, requires_grad=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    results = []
    for experts in (grouped_swiglu, swiglu_per_expert):
        with autocast:
            out = experts(x, counts, moe.w13, moe.w2)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        results.append((out, *torch.autograd.grad(out, (x, moe.w13, moe.w2), grad_out)))
    assert results[0][0].dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    tolerance = dict(atol=1e-5, rtol=1e-5) if precision == "fp32" else dict(atol=0.1, rtol=0.02)
    for got, expected in zip(*results):
        torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    assert results[0][2][5].abs().sum() == 0, "the idle expert got a gradient"


@needs_grouped_mm
def test_moe_uses_grouped_mm_when_it_can(monkeypatch):
    moe = make_moe()
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    moe(torch.randn(2, 5, moe.gate.in_features))
    assert len(calls) == 2, "one grouped matmul for gate+up, one for down"


# --- load balancing: the expert bias -------------------------------------------------------


def test_training_forward_counts_tokens_per_expert_and_eval_does_not():
    model = tiny_model()
    moe = model.layers[1].ffn
    idx = torch.randint(0, 256, (2, 10))
    model.eval()
    with torch.no_grad():
        model(idx)
    assert moe.tokens_per_expert.sum() == 0
    model.train()
    model(idx)
    assert moe.tokens_per_expert.sum() == 2 * 10 * model.config.n_activated_experts


def test_balance_experts_steps_toward_balance_reports_the_imbalance_and_clears_counts():
    model = tiny_model(bias_update_rate=0.01)
    moe = model.layers[1].ffn
    moe.expert_bias.copy_(torch.tensor([0.5, 0.0, 0.0, 0.0]))
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    assert model.balance_experts().item() == 2.0  # max 10 over mean 5
    # Mean load is 5: expert 0 is overloaded, expert 1 underloaded, 2 and 3 exactly even.
    torch.testing.assert_close(moe.expert_bias, torch.tensor([0.49, 0.01, 0.0, 0.0]))
    assert moe.tokens_per_expert.sum() == 0


def test_balance_experts_uses_the_all_reduced_load():
    model = tiny_model(bias_update_rate=0.01)
    moe = model.layers[1].ffn
    moe.tokens_per_expert.copy_(torch.tensor([6.0, 2.0, 4.0, 4.0]))
    other_rank = torch.tensor([[0.0, 8.0, 4.0, 4.0]])

    def all_reduce(tensor):  # as if a second rank saw `other_rank`
        tensor += other_rank

    imbalance = model.balance_experts(all_reduce=all_reduce)
    # Global load [6, 10, 8, 8], mean 8: locally expert 1 looked underloaded, globally it is not.
    torch.testing.assert_close(moe.expert_bias, torch.tensor([0.01, -0.01, 0.0, 0.0]))
    assert imbalance.item() == pytest.approx(10 / 8)  # the global load's, not this rank's 6 / 4


# --- balance losses ------------------------------------------------------------------------


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_balance_losses_rise_on_a_planted_imbalance_and_their_gradient_evens_it(score_func):
    """E=8, k=2: every token sent to experts 0 and 1 costs E/k = 4; the gradient step on
    the gate lowers those experts' affinity share, and with it the loss."""
    moe = make_moe(score_func=score_func, n_activated_experts=2, aux_loss_alpha=1.0, seq_aux_loss_alpha=1.0)
    x = torch.randn(3, 20, moe.gate.in_features)
    spread = moe.balance_losses(moe.affinities(x), moe.choose(moe.affinities(x))[1])
    common = F.normalize(torch.randn(moe.gate.in_features), dim=0)
    x = 0.1 * x + 3 * common  # tokens that share one direction
    with torch.no_grad():
        moe.gate.weight[:2] += common  # experts 0 and 1 now win for every token,
        moe.gate.weight[2:] -= common  # and hold most of its affinity
    scores = moe.affinities(x)
    indices = moe.choose(scores)[1]
    assert set(indices.unique().tolist()) == {0, 1}
    planted = moe.balance_losses(scores, indices)
    for name in ("aux_loss", "seq_aux_loss"):
        assert spread[name] < 1.6 and planted[name] > 3.0, (name, spread[name], planted[name])

    share_before = (scores / scores.sum(-1, keepdim=True))[..., :2].sum(-1).mean()
    sum(planted.values()).backward()
    with torch.no_grad():
        moe.gate.weight -= 0.5 * moe.gate.weight.grad
    scores = moe.affinities(x)
    share_after = (scores / scores.sum(-1, keepdim=True))[..., :2].sum(-1).mean()
    assert share_after < share_before
    assert sum(moe.balance_losses(scores, moe.choose(scores)[1]).values()) < sum(planted.values())


def test_sequence_wise_loss_sees_imbalance_within_sequences_that_a_batch_hides():
    """Sequence 0 all to experts {0, 1} (its affinity too), sequence 1 all to {2, 3}: the
    batch is balanced over E=4, k=2 (expert-level loss 1), each sequence is not (sequence-wise loss 2)."""
    moe = make_moe(n_routed_experts=4, n_activated_experts=2, aux_loss_alpha=1.0, seq_aux_loss_alpha=1.0)
    scores = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]]).view(2, 1, 4).expand(2, 5, 4)
    indices = torch.tensor([[0, 1], [2, 3]]).view(2, 1, 2).expand(2, 5, 2)
    losses = moe.balance_losses(scores, indices)
    assert losses["aux_loss"].item() == pytest.approx(1.0) and losses["seq_aux_loss"].item() == pytest.approx(2.0)


def test_balance_losses_change_the_gradient_not_the_returned_loss():
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 16))
    plain = tiny_model(seed=0)
    weighted = tiny_model(seed=0, aux_loss_alpha=0.5, seq_aux_loss_alpha=0.25)
    loss, weighted_loss = plain(idx, idx), weighted(idx, idx)
    assert torch.equal(loss, weighted_loss)  # the LM loss, bit for bit
    assert all(moe.balance_loss == {} for moe in plain.moe_layers().values())  # off: nothing computed
    balance = sum(term for moe in weighted.moe_layers().values() for term in moe.balance_loss.values())
    figures = weighted.loss_figures()
    assert set(figures) == {"aux_loss", "seq_aux_loss"}
    assert sum(figures.values()).item() == pytest.approx(balance.item())
    loss.backward()
    weighted_loss.backward(retain_graph=True)
    gate = next(iter(weighted.moe_layers().values())).gate.weight
    extra = torch.autograd.grad(balance, gate)[0]
    plain_gate = next(iter(plain.moe_layers().values())).gate.weight
    assert torch.allclose(gate.grad, plain_gate.grad + extra, atol=1e-7)
    assert extra.abs().max() > 0
    assert torch.equal(weighted.lm_head.weight.grad, plain.lm_head.weight.grad)
    weighted.eval()
    weighted(idx, idx)
    assert weighted.loss_figures() == figures  # evaluation forwards leave them alone
