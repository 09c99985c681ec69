"""The whole model: causal next-token logits, its loss, bf16 autocast, materialising from
the meta device, learning, and sampling (`generate`)."""

import pytest
import torch
import torch.nn.functional as F

from model_helpers import KERNELS, load_preset, tiny_model
from ciuic_train.model import Transformer, generate

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.mark.parametrize("kernels", KERNELS)
def test_changing_a_token_never_changes_earlier_logits(kernels):
    model = tiny_model(kernels=kernels).eval()
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    changed_at = 17
    edited = idx.clone()
    edited[:, changed_at] = (edited[:, changed_at] + 1) % 256
    with torch.no_grad():
        before, after = model(idx), model(edited)
    assert before.shape == (2, 40, 256)
    torch.testing.assert_close(before[:, :changed_at], after[:, :changed_at], atol=1e-6, rtol=0)
    assert not torch.allclose(before[:, changed_at], after[:, changed_at])


@pytest.mark.parametrize("kernels", KERNELS)
def test_bf16_autocast_loss_and_grads_stay_close_to_fp32(kernels):
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    fp32, bf16 = tiny_model(kernels=kernels), tiny_model(kernels=kernels)
    expected = fp32(idx, idx)
    expected.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = bf16(idx, idx)
    assert loss.dtype == torch.float32
    loss.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=0.02, rtol=0.01)
    for name, p in fp32.named_parameters():
        q = dict(bf16.named_parameters())[name]
        assert q.grad.dtype == torch.float32, name
        torch.testing.assert_close(q.grad, p.grad, atol=2e-3, rtol=0.1, msg=name)


def test_loss_refuses_an_unknown_reduction():
    model = tiny_model()
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction"):
        model(idx, idx, reduction="none")


def test_sequence_longer_than_max_seq_len_is_refused():
    model = tiny_model(max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_meta_model_materialises_with_init_weights():
    with torch.device("meta"):
        model = Transformer(load_preset("tiny"))
    model.to_empty(device="cpu")
    model.init_weights()
    reference = tiny_model()
    torch.testing.assert_close(model.rope_cos, reference.rope_cos)
    assert model.layers[1].ffn.expert_bias.abs().sum() == 0
    assert model.norm.weight.eq(1).all()
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_tiny_model_overfits_one_batch():
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    idx = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    losses = []
    for _ in range(200):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        if not losses:
            for name, param in model.named_parameters():
                assert param.grad is not None and param.grad.abs().sum() > 0, name
        optimizer.step()
        model.balance_experts()
        losses.append(loss.item())
        if losses[-1] < 0.2 * losses[0]:
            break
    assert losses[-1] < 0.2 * losses[0], f"loss went {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_generate_length_determinism_and_mode():
    model = tiny_model(max_seq_len=16).train()
    prompt = torch.tensor([[1, 2, 3, 4, 5]])

    def sample(seed):
        generator = torch.Generator().manual_seed(seed)
        return generate(model, prompt, 20, temperature=1.0, top_k=50, generator=generator)

    first = sample(7)
    # 25 tokens outgrow max_seq_len=16, so this also exercises cropping the context.
    assert first.shape == (1, 25)
    assert torch.equal(first[:, :5], prompt)
    assert torch.equal(first, sample(7))
    assert model.training, "generate must restore training mode"
    assert model.layers[1].ffn.tokens_per_expert.sum() == 0, "sampling must not count load"


def test_generate_top_k_one_is_greedy():
    model = tiny_model()
    prompt = torch.tensor([[10, 20]])
    out = generate(model, prompt, 3, top_k=1, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        greedy = model.eval()(out[:, :-1]).argmax(-1)
    assert torch.equal(out[:, 2:], greedy[:, 1:])
