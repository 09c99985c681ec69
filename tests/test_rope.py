"""RoPE's tables (model/rope.py) and their YaRN scaling (model.rope_scaling), held to their
formulas and to transformers' DeepseekV3."""

import math

import pytest
import torch

from model_helpers import load_preset, tiny_model
from ciuic_train.checkpoint.hf_config import config_json
from ciuic_train.checkpoint.hf_weights import exported_names
from ciuic_train.model import Transformer
from ciuic_train.model.attention import MultiHeadLatentAttention
from ciuic_train.model.rope import apply_rope, rope_tables
from ciuic_train.model.transformer import REFERENCE

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def test_rope_rotates_adjacent_pairs_and_depends_only_on_relative_position():
    cos, sin = rope_tables(8, 64, theta=10000.0)
    x = torch.randn(64, 8)
    rotated = apply_rope(x, cos, sin)
    # Interleaved convention: channels (2i, 2i+1) turn together by angle pos * theta^(-2i/8).
    for i in range(4):
        pair = x[:, 2 * i : 2 * i + 2]
        c, s = cos[:, i], sin[:, i]
        expected = torch.stack(
            [pair[:, 0] * c - pair[:, 1] * s, pair[:, 0] * s + pair[:, 1] * c], dim=-1
        )
        torch.testing.assert_close(rotated[:, 2 * i : 2 * i + 2], expected)

    q, k = torch.randn(8), torch.randn(8)

    def score(q_pos, k_pos):
        q_rot = apply_rope(q.expand(64, 8), cos, sin)[q_pos]
        k_rot = apply_rope(k.expand(64, 8), cos, sin)[k_pos]
        return q_rot @ k_rot

    torch.testing.assert_close(score(9, 4), score(40, 35))
    torch.testing.assert_close(score(0, 0), q @ k)


# --- YaRN (model.rope_scaling) -------------------------------------------------------------


def test_rope_scaling_none_keeps_the_plain_tables_and_softmax_scale_bit_identical():
    model = tiny_model()
    cfg = model.config
    assert cfg.rope_scaling == "none", "YaRN is off by default"
    # The unscaled RoPE tables and softmax scale, written out.
    head_dim = cfg.qk_rope_head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
    assert torch.equal(model.rope_cos, angles.cos()) and torch.equal(model.rope_sin, angles.sin())
    cos, sin = rope_tables(head_dim, cfg.max_seq_len, cfg.rope_theta, cfg=cfg)
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert all(layer.attn.softmax_scale == qk_head_dim**-0.5 for layer in model.layers)


def transformers_twin(model: Transformer):
    """transformers' DeepseekV3ForCausalLM with `model`'s shape, RoPE and weights, eager throughout,
    through the names and config.json of ciuic_train/checkpoint/hf_weights.py and hf_config.py."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    assert model.config.score_func == "sigmoid", "transformers' DeepseekV3 routes with sigmoid scores only"
    config = transformers.DeepseekV3Config.from_dict(
        {**config_json(model.config), "use_cache": False},
        attn_implementation="eager", experts_implementation="eager",
    )
    state = model.state_dict()
    twin = transformers.DeepseekV3ForCausalLM(config).eval()
    twin.load_state_dict({theirs: state[ours] for theirs, ours in exported_names(model).items()}, strict=True)
    return twin


YARN_CASES = {
    # DeepSeek-V2-Lite's mscale pair: cos/sin untouched, the softmax scale corrected.
    "v2_lite_mscale": dict(rope_mscale=0.707, rope_mscale_all_dim=0.707),
    # The paper's YaRN: the magnitude on cos/sin (the rope channels only), no softmax correction.
    "paper": dict(rope_mscale=1.0, rope_mscale_all_dim=0.0),
    # Both at once, other betas, compressed queries.
    "both_scales": dict(rope_factor=8.0, rope_mscale=0.5, rope_mscale_all_dim=1.0, rope_beta_fast=16.0,
                        rope_beta_slow=0.25, q_lora_rank=24),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_logits_match_transformers_deepseek_v3(case):
    settings = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=32, qk_rope_head_dim=16,
                    score_func="sigmoid", norm_topk_prob=True, route_scale=2.5, init_std=0.1, kernels="reference")
    settings |= YARN_CASES[case]
    settings["max_seq_len"] = int(settings["rope_factor"] * settings["rope_original_max_seq_len"])
    model = tiny_model(**settings).eval()
    with torch.no_grad():
        model.layers[1].ffn.expert_bias.normal_(std=0.1)
    twin = transformers_twin(model)
    seq = 100  # well past the original 32 positions
    idx = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cos, sin = twin.model.rotary_emb(model.tok_embeddings(idx), torch.arange(seq)[None])
        logits, expected = model(idx), twin(idx).logits
        plain = tiny_model(**{**settings, "rope_scaling": "none"}).eval()
        plain.load_state_dict(model.state_dict())
        plain_logits = plain(idx)
    # transformers' tables hold each pair's angle twice, cat(angles, angles).
    torch.testing.assert_close(model.rope_cos[:seq], cos[0, :, :8], atol=1e-6, rtol=0)
    torch.testing.assert_close(model.rope_sin[:seq], sin[0, :, :8], atol=1e-6, rtol=0)
    assert model.layers[0].attn.softmax_scale == pytest.approx(twin.model.layers[0].self_attn.scaling, rel=1e-12)
    error = (logits - expected).abs().max().item()
    print(f"{case}: max |logit difference| {error:.2e}, logits up to {expected.abs().max().item():.2f}")
    assert error < 1e-5
    # And YaRN mattered: without it the same weights give other logits.
    assert (plain_logits - expected).abs().max() > 1e-2


def test_published_yarn_presets_correct_the_softmax_scale():
    """DeepSeek's mscale: V3 and V2-Lite both scale the softmax by m^2, m = 0.1 * w * ln(40) + 1."""
    for name, weight in (("deepseek_v3", 1.0), ("deepseek_v2_lite", 0.707)):
        cfg = load_preset(name)
        assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_seq_len) == ("yarn", 40.0, 4096)
        with torch.device("meta"):
            attn = MultiHeadLatentAttention(cfg, REFERENCE)
        mscale = 0.1 * weight * math.log(40) + 1
        assert attn.softmax_scale == pytest.approx((128 + 64) ** -0.5 * mscale**2, rel=1e-12)
        # mscale equals mscale_all_dim: cos and sin keep their unit magnitude.
        cos, sin = rope_tables(cfg.qk_rope_head_dim, 64, cfg.rope_theta, cfg=cfg)
        torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos))


def test_yarn_keeps_fast_pairs_and_slows_slow_ones_by_the_factor():
    cfg = load_preset("tiny", rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=32, qk_rope_head_dim=16)
    plain_cos, _ = rope_tables(16, 200, cfg.rope_theta)
    cos, _ = rope_tables(16, 200, cfg.rope_theta, cfg=cfg)
    positions = torch.arange(200).float()
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, 16, 2).float() / 16)
    # Over the original 32 positions pair 0 turns 5 times, pair 2 about once (under beta_fast
    # 32, over beta_slow 1): the ramp runs from pair 0, clamped there, to pair 2, rounded up.
    torch.testing.assert_close(cos[:, 0], plain_cos[:, 0], atol=0, rtol=0)
    torch.testing.assert_close(cos[:, 2:], torch.outer(positions, inv_freq[2:] / 4).cos())
    torch.testing.assert_close(cos[:, 1], torch.outer(positions, inv_freq[1:2] * (1 / 4 + 1) / 2)[:, 0].cos())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rope_scaling", "linear"),
        ("rope_factor", 0.5),
        ("rope_original_max_seq_len", 0),
        ("rope_beta_fast", 1.0),  # not above rope_beta_slow
        ("rope_beta_slow", -1.0),
        ("rope_mscale", -0.1),
        ("rope_mscale_all_dim", -1.0),
    ],
)
def test_rope_scaling_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^model\.{field}=") as error:
        load_preset("tiny", **{"rope_scaling": "yarn", field: value})
    assert str(value) in str(error.value) and "\n" not in str(error.value)
