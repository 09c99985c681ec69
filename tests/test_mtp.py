"""Multi-token prediction (model.n_mtp_layers, DeepSeek-V3's MTP): its loss and gradients
against a written-out reference, what it leaves of the main model, and how it is counted."""

import pytest
import torch
import torch.nn.functional as F

from model_helpers import tiny_model
from ciuic_train.model import Transformer, count_mtp_parameters, count_parameters, generate
from ciuic_train.model.counting import training_flops_per_token

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def written_out_mtp_loss(model: Transformer, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP (report, eq. 21-25), spelled out: depth k joins RMSNorm(h^{k-1}_i) with
    RMSNorm(Emb(t_{i+k})), projects, runs its block, and scores t_{i+k+1} with the shared head."""

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.norm_eps) * weight

    seq = idx.shape[1]
    h = norm(model.trunk(idx), model.norm.weight)  # what the main head scores
    losses = []
    for k, depth in enumerate(model.mtp, start=1):
        joined = torch.cat([norm(model.tok_embeddings.weight[idx[:, k:]], depth.enorm.weight),
                            norm(h[:, : seq - k], depth.hnorm.weight)], dim=-1)
        h = depth.block(joined @ depth.eh_proj.weight.T, model.rope_cos[: seq - k], model.rope_sin[: seq - k])
        logits = norm(h, depth.norm.weight) @ model.lm_head.weight.T
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets[:, k:].flatten()))
    return sum(losses) / len(losses)


def test_mtp_loss_and_its_gradient_equal_the_written_out_reference():
    model = tiny_model(seed=0, n_mtp_layers=2, kernels="reference")
    torch.manual_seed(1)
    with torch.no_grad():  # norms that differ, so that swapping two of them shows
        for param in model.parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5)
    idx = torch.randint(0, 256, (2, 24))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    weight = 0.3
    returned = model(inputs, targets, mtp_loss_weight=weight)
    reference_mtp = written_out_mtp_loss(model, inputs, targets)
    assert model.loss_figures()["mtp_loss"].item() == pytest.approx(reference_mtp.item(), rel=1e-6)
    main = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    assert returned.item() == pytest.approx(main.item(), rel=1e-6)  # the value stays the next-token loss

    params = [p for p in model.parameters()]
    grads = torch.autograd.grad(returned, params, allow_unused=True)
    expected = torch.autograd.grad(main + weight * reference_mtp, params, allow_unused=True)
    for (name, _), grad, want in zip(model.named_parameters(), grads, expected):
        if want is None:
            assert grad is None or not grad.any(), name
        else:
            torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-7, msg=name)


def test_mtp_gradients_reach_its_block_and_the_shared_head_and_embedding():
    torch.manual_seed(1)
    idx = torch.randint(0, 256, (2, 24))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    plain, predicting = tiny_model(seed=0), tiny_model(seed=0, n_mtp_layers=1)
    plain(inputs, targets).backward()
    predicting(inputs, targets, mtp_loss_weight=0.3).backward()
    depth = predicting.mtp[0]
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "block.attn.wkv_a.weight",
                 "block.ffn.gate.weight", "block.ffn.shared_experts.w1.weight"):
        assert depth.get_parameter(name).grad.abs().max() > 0, name
    for shared in ("lm_head.weight", "tok_embeddings.weight", "layers.0.attn.wo.weight"):
        ours, theirs = predicting.get_parameter(shared).grad, plain.get_parameter(shared).grad
        assert not torch.allclose(ours, theirs), shared  # the MTP loss reaches the shared weights too


def test_mtp_leaves_the_main_model_its_weights_loss_and_samples():
    """Turning MTP on changes neither the main model's first weights nor its next-token loss,
    and generation never runs the MTP depths."""
    plain, predicting = tiny_model(seed=0), tiny_model(seed=0, n_mtp_layers=2)
    main = plain.state_dict()
    assert all(torch.equal(predicting.state_dict()[name], value) for name, value in main.items())
    assert {name.split(".")[0] for name in predicting.state_dict().keys() - main.keys()} == {"mtp"}
    torch.manual_seed(1)
    idx = torch.randint(0, 256, (2, 24))
    assert torch.equal(plain(idx[:, :-1], idx[:, 1:]), predicting(idx[:, :-1], idx[:, 1:], mtp_loss_weight=0.3))
    predicting.eval()
    calls = []
    predicting.mtp[0].register_forward_hook(lambda *_: calls.append(1))
    first = generate(plain, idx[:1, :4], 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(generate(predicting, idx[:1, :4], 8, generator=torch.Generator().manual_seed(0)), first)
    predicting(idx[:, :-1], idx[:, 1:])  # evaluation: the next-token loss only
    assert calls == []


def test_mtp_parameters_and_flops_are_counted_apart():
    plain, predicting = tiny_model(n_mtp_layers=0), tiny_model(n_mtp_layers=1)
    assert count_parameters(predicting) == count_parameters(plain)
    total, active = count_mtp_parameters(predicting)
    assert total == sum(p.numel() for p in predicting.mtp.parameters())
    cfg = predicting.config
    idle = (cfg.n_routed_experts - cfg.n_activated_experts) * 3 * cfg.moe_ffn_dim * cfg.dim
    assert active == total - idle
    head = cfg.vocab_size * cfg.dim
    attention = 6 * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 256
    added = training_flops_per_token(predicting, 256) - training_flops_per_token(plain, 256)
    assert added == 6 * (active + head) + attention
