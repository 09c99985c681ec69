"""Multi-head latent attention (model/attention.py): its projections' shapes, and RoPE as
the attention applies it."""

import pytest
import torch

from model_helpers import KERNELS, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_mla_shapes(q_lora_rank):
    model = tiny_model(q_lora_rank=q_lora_rank).eval()
    cfg = model.config
    attn = model.layers[0].attn
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen[name] = (tuple(inputs[0].shape), tuple(output.shape))

        return hook

    for name in ("wkv_a", "kv_norm", "wkv_b", "wo", "wq_a", "wq_b", "wq"):
        if hasattr(attn, name):
            getattr(attn, name).register_forward_hook(record(name))
    batch, seq = 2, 9
    x = torch.randn(batch, seq, cfg.dim)
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    assert attn(x, cos, sin).shape == (batch, seq, cfg.dim)

    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert seen["wkv_a"][1] == (batch, seq, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    # The latent that keys and values are rebuilt from is kv_lora_rank wide.
    assert seen["kv_norm"][0] == (batch, seq, cfg.kv_lora_rank)
    assert seen["wkv_b"][1] == (batch, seq, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
    assert seen["wo"][0] == (batch, seq, cfg.n_heads * cfg.v_head_dim)
    if q_lora_rank:
        assert "wq" not in seen
        assert seen["wq_a"][1] == (batch, seq, q_lora_rank)
        assert seen["wq_b"][1] == (batch, seq, cfg.n_heads * qk_head_dim)
    else:
        assert "wq_a" not in seen
        assert seen["wq"][1] == (batch, seq, cfg.n_heads * qk_head_dim)


def test_attention_scores_depend_only_on_relative_position():
    model = tiny_model().eval()
    attn, seq = model.layers[0].attn, 12
    captured = {}
    attention = attn.attention

    def spy(q, k, v, scale, docs=None):
        captured["q"], captured["k"] = q, k
        return attention(q, k, v, scale)

    attn.attention = spy
    # The same input at every position: any variation in the scores comes from RoPE.
    x = torch.randn(1, 1, model.config.dim).expand(1, seq, -1)
    with torch.no_grad():
        attn(x, model.rope_cos[:seq], model.rope_sin[:seq])
    scores = captured["q"][0] @ captured["k"][0].transpose(-1, -2)
    torch.testing.assert_close(scores[:, 5, 2], scores[:, 9, 6])
    torch.testing.assert_close(scores[:, 3, 3], scores[:, 11, 11])
    assert (scores[:, 5, 2] - scores[:, 5, 4]).abs().max() > 1e-4


@pytest.mark.parametrize("kernels", KERNELS)
def test_rope_takes_slices_at_odd_offsets(kernels):
    """The rope parts are slices after odd-width parts here; the complex view must not refuse them."""
    model = tiny_model(kv_lora_rank=23, qk_nope_head_dim=7, kernels=kernels)
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(6))
    model(idx, idx).backward()
    assert all(p.grad is not None for p in model.parameters())
