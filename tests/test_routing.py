"""Which experts a token goes to (`MoE.route`): the top-k of the biased scores, weighted by
the unbiased ones, and group-limited routing (DeepSeek-V2 device-limited, V3 node-limited)."""

import pytest
import torch

from model_helpers import load_preset, make_moe, tiny_model
from ciuic_train.model.moe import MoE

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_routing_picks_the_top_k_distinct_experts_of_the_biased_scores(score_func):
    moe = make_moe(score_func=score_func, norm_topk_prob=True, route_scale=2.5)
    moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, 8))
    x = torch.randn(50, moe.gate.in_features)
    weights, indices = moe.route(x)
    assert indices.shape == weights.shape == (50, 3)
    assert (indices.sort(dim=-1).values.diff(dim=-1) > 0).all(), "an expert was chosen twice"
    logits = x @ moe.gate.weight.T
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    expected = (scores + moe.expert_bias).topk(3).indices
    assert torch.equal(indices.sort(-1).values, expected.sort(-1).values)
    torch.testing.assert_close(weights.sum(-1), torch.full((50,), 2.5))


def test_expert_bias_changes_the_choice_but_not_the_combine_weights():
    moe = make_moe(n_routed_experts=4, n_activated_experts=2, score_func="softmax")
    dim = moe.gate.in_features
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[:, 0] = torch.tensor([3.0, 2.0, 1.0, 0.0])
    token = torch.zeros(1, dim)
    token[0, 0] = 1.0
    scores = torch.tensor([3.0, 2.0, 1.0, 0.0]).softmax(-1)

    weights, indices = moe.route(token)
    assert indices.tolist() == [[0, 1]]
    torch.testing.assert_close(weights[0], scores[[0, 1]])

    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    weights, indices = moe.route(token)
    assert indices.tolist() == [[3, 0]], "the bias should have pulled in expert 3"
    # Expert 3 is mixed with its unbiased score, and expert 0's weight did not move.
    torch.testing.assert_close(weights[0], scores[[3, 0]])


# --- Group-limited routing -----------------------------------------------------------------


def group_limited_route_reference(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter) one token at a time in
    plain Python: rank the groups by the sum of their top-2 biased scores, keep the best
    n_limited_groups, take the top-k biased scores among those groups' experts only, and
    weight them by their unbiased scores. Returns (weights, indices), sorted by expert."""
    logits = (x @ moe.gate.weight.T).float()
    scores = logits.softmax(-1) if moe.score_func == "softmax" else logits.sigmoid()
    choice = scores + moe.expert_bias  # fp32, as route adds them
    size = moe.n_routed_experts // moe.n_expert_groups
    all_weights, all_indices = [], []
    for token_scores, token_choice in zip(scores.tolist(), choice.tolist()):
        group_score = [
            sum(sorted(token_choice[g * size : (g + 1) * size], reverse=True)[:2])
            for g in range(moe.n_expert_groups)
        ]
        groups = sorted(range(moe.n_expert_groups), key=lambda g: -group_score[g])[: moe.n_limited_groups]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen = sorted(sorted(allowed, key=lambda e: -token_choice[e])[: moe.n_activated_experts])
        weights = [token_scores[e] for e in chosen]
        if moe.norm_topk_prob:
            weights = [w / sum(weights) for w in weights]
        all_weights.append([w * moe.route_scale for w in weights])
        all_indices.append(chosen)
    return torch.tensor(all_weights), torch.tensor(all_indices)


def by_expert(weights: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, indices) with each token's experts in ascending order."""
    order = indices.argsort(dim=-1)
    return weights.gather(-1, order), indices.gather(-1, order)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize(
    ("n_experts", "n_groups", "n_limited", "k"),
    [(32, 8, 4, 8), (32, 8, 1, 4), (32, 4, 2, 6), (16, 8, 3, 2), (8, 8, 3, 3), (16, 4, 4, 5)],
)
def test_group_limited_routing_matches_a_per_token_reference(score_func, n_experts, n_groups, n_limited, k):
    moe = make_moe(
        n_routed_experts=n_experts, n_activated_experts=k, n_expert_groups=n_groups,
        n_limited_groups=n_limited, score_func=score_func, norm_topk_prob=True, route_scale=2.5,
    )
    # Large enough that some biased sigmoid scores go negative: masking the dropped groups
    # to 0 instead of -inf would then let their experts in.
    moe.expert_bias.normal_(std=0.5)
    x = torch.randn(200, moe.gate.in_features)
    weights, indices = by_expert(*moe.route(x))
    expected_weights, expected_indices = group_limited_route_reference(moe, x)
    assert torch.equal(indices, expected_indices)
    torch.testing.assert_close(weights, expected_weights)
    if n_limited < n_groups:
        groups_used = (indices // (n_experts // n_groups)).sort(-1).values
        assert ((groups_used.diff(dim=-1) > 0).sum(-1) + 1 <= n_limited).all()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_group_limit_passes_over_a_strong_expert_in_a_weak_group(score_func):
    """Expert 0 scores highest, but its group-mate is weak, so group 0 loses to groups 1
    and 2, whose two experts are both good: grouped routing must not pick expert 0."""
    settings = dict(n_routed_experts=8, n_activated_experts=2, score_func=score_func)
    grouped = make_moe(n_expert_groups=4, n_limited_groups=2, **settings)
    plain = make_moe(**settings)
    logits = torch.tensor([3.0, -5.0, 2.8, 2.8, 2.7, 2.7, 0.0, 0.0])
    for moe in (grouped, plain):
        with torch.no_grad():
            moe.gate.weight.zero_()
            moe.gate.weight[:, 0] = logits
    token = torch.zeros(1, grouped.gate.in_features)
    token[0, 0] = 1.0
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()

    assert sorted(plain.route(token)[1][0].tolist())[0] == 0, "ungrouped routing takes expert 0"
    weights, indices = by_expert(*grouped.route(token))
    assert indices.tolist() == [[2, 3]]
    torch.testing.assert_close(weights[0], scores[[2, 3]])


def test_one_group_routes_bit_identically_to_plain_top_k():
    moe = make_moe(score_func="sigmoid", norm_topk_prob=True, route_scale=2.5)
    assert (moe.n_expert_groups, moe.n_limited_groups) == (1, 1), "grouping is off by default"
    moe.expert_bias.normal_(std=0.1)
    x = torch.randn(64, moe.gate.in_features)
    # Plain top-k routing, written out.
    scores = moe.gate(x).float().sigmoid()
    indices = (scores + moe.expert_bias).topk(moe.n_activated_experts, dim=-1).indices
    weights = scores.gather(-1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True) * moe.route_scale
    got_weights, got_indices = moe.route(x)
    assert torch.equal(got_indices, indices)
    assert torch.equal(got_weights, weights)


def test_keeping_every_group_changes_nothing():
    tokens = torch.randint(0, 256, (2, 32))
    plain, grouped = tiny_model(), tiny_model(n_expert_groups=2, n_limited_groups=2)
    with torch.no_grad():
        assert torch.equal(plain.eval()(tokens), grouped.eval()(tokens))


@pytest.mark.parametrize(
    ("overrides", "field", "value"),
    [
        (dict(n_expert_groups=0), "n_expert_groups", 0),
        (dict(n_limited_groups=-1), "n_limited_groups", -1),
        (dict(n_expert_groups=3), "n_expert_groups", 3),  # tiny has 4 experts
        (dict(n_expert_groups=2, n_limited_groups=3), "n_limited_groups", 3),
        # 4 groups of 1 expert, 1 kept, cannot hold tiny's top-2.
        (dict(n_expert_groups=4, n_limited_groups=1), "n_limited_groups", 1),
    ],
)
def test_group_routing_validation_names_the_field(overrides, field, value):
    with pytest.raises(ValueError, match=rf"^model\.{field}={value} ") as error:
        load_preset("tiny", **overrides)
    assert "\n" not in str(error.value)


def test_group_limited_routing_matches_transformers_deepseek_v3_moe():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    moe = make_moe(
        n_routed_experts=32, n_activated_experts=8, n_expert_groups=8, n_limited_groups=4,
        score_func="sigmoid", norm_topk_prob=True, route_scale=2.5,
    ).eval()
    moe.expert_bias.normal_(std=0.5)
    config = transformers.DeepseekV3Config(
        hidden_size=moe.gate.in_features, moe_intermediate_size=moe.w2.shape[-1],
        n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, experts_implementation="eager",
    )
    peer = DeepseekV3MoE(config).eval()
    with torch.no_grad():
        peer.gate.weight.copy_(moe.gate.weight)
        peer.gate.e_score_correction_bias.copy_(moe.expert_bias)
        peer.experts.gate_up_proj.copy_(moe.w13)
        peer.experts.down_proj.copy_(moe.w2)
        peer.shared_experts.gate_proj.weight.copy_(moe.shared_experts.w1.weight)
        peer.shared_experts.up_proj.weight.copy_(moe.shared_experts.w3.weight)
        peer.shared_experts.down_proj.weight.copy_(moe.shared_experts.w2.weight)

        x = torch.randn(4, 50, moe.gate.in_features)
        _, peer_weights, peer_indices = peer.gate(x)
        weights, indices = by_expert(*moe.route(x.reshape(-1, x.shape[-1])))
        peer_weights, peer_indices = by_expert(peer_weights, peer_indices)
        assert torch.equal(indices, peer_indices)
        torch.testing.assert_close(weights, peer_weights)
        torch.testing.assert_close(moe(x), peer(x))
