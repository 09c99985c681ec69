"""The contract between the model's reference formulas and its fast kernels (`model.kernels`).

Each kernel must compute what the function it replaces computes, forward and gradients,
in fp32 (to float rounding) and under bf16 autocast (to bf16's); the whole model must
too. Written-out formulas here are the independent oracle both paths are held to.
"""

import json
from functools import partial
from unittest import mock
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from ciuic_train.model import ModelConfig, Transformer
from ciuic_train.model.attention import causal_attention
from ciuic_train.model.common import grouped_mm_supported, grouped_swiglu
from ciuic_train.model.norm import rms_norm
from ciuic_train.model.transformer import REFERENCE, kernels_for, lm_cross_entropy
from ciuic_train.model.kernels import AUTO, attention, gemm_choice, loss, moe, norm
from ciuic_train.model.kernels import linear as linear_kernel
from ciuic_train.model.kernels.softmax import softmax_fp32

REPO = Path(__file__).parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    fields = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "tiny.yaml"))
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**fields, **overrides}))


@pytest.fixture
def fp32_gemm(request, monkeypatch):
    """`CIUIC_FP32_GEMM` set to the test's parameter ("measured": unset), the choice remade."""
    if request.param == "measured":
        monkeypatch.delenv(gemm_choice.ENV, raising=False)
    else:
        monkeypatch.setenv(gemm_choice.ENV, request.param)
    gemm_choice.fp32_gemm_plan.cache_clear()
    yield request.param
    gemm_choice.fp32_gemm_plan.cache_clear()


def onednn_calls(monkeypatch) -> list:
    """Each call of torch's oneDNN linear operator from here on, recorded."""
    calls, op = [], torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or op(*a))
    return calls


def test_the_switch_picks_the_table():
    assert kernels_for("reference") is REFERENCE and kernels_for("auto") is AUTO
    for field in ("rms_norm", "attention", "routed_experts", "loss", "linear"):
        assert getattr(AUTO, field) is not getattr(REFERENCE, field), field
    model = tiny_model(kernels="reference")
    assert model.layers[0].attn_norm.kernel is rms_norm
    assert model.layers[1].ffn.routed_experts is grouped_swiglu
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    # per block 4 attention projections, then 3 in the dense FFN or the MoE's gate and 3 shared; the head
    assert len(linears) == 4 + 3 + 4 + 4 + 1 and all(m.kernel is F.linear for m in linears)
    assert all(m.kernel is linear_kernel.linear for m in tiny_model().modules() if isinstance(m, torch.nn.Linear))


# --- the whole model ------------------------------------------------------------------------


@pytest.mark.parametrize("fp32_gemm", ["measured", "onednn"], indirect=True)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_auto_and_reference_models_agree_forward_and_grads(precision, q_lora_rank, fp32_gemm):
    """Same weights, either kernel set: the same logits, loss and every gradient (with the
    fp32 linears on the backend measured faster here, and on oneDNN)."""
    idx = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(2))  # two attention blocks
    targets = idx.roll(-1, dims=1)
    targets[0, 5:9] = -100
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    results = []
    for kernels in ("auto", "reference"):
        model = tiny_model(kernels=kernels, q_lora_rank=q_lora_rank)
        with autocast:
            with torch.no_grad():
                logits = model(idx).float()
            loss_value = model(idx, targets)
        loss_value.backward()
        results.append((logits, loss_value, {name: p.grad for name, p in model.named_parameters()}))
    (logits, loss_auto, grads), (logits_ref, loss_ref, grads_ref) = results
    if precision == "fp32":
        tight = dict(atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(logits, logits_ref, **tight)
        torch.testing.assert_close(loss_auto, loss_ref, **tight)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, grads_ref[name], **tight, msg=name)
    else:
        torch.testing.assert_close(logits, logits_ref, atol=0.05, rtol=0.05)
        torch.testing.assert_close(loss_auto, loss_ref, atol=0.01, rtol=0.01)
        for name, grad in grads.items():
            assert grad.dtype == grads_ref[name].dtype == torch.float32, name
            torch.testing.assert_close(grad, grads_ref[name], atol=2e-3, rtol=0.1, msg=name)


def test_the_reference_model_runs_no_kernel_and_auto_runs_each_on_cpu(monkeypatch):
    calls = []

    def spy(name, owner, attr):
        original = getattr(owner, attr)
        monkeypatch.setattr(owner, attr, lambda *a, **kw: calls.append(name) or original(*a, **kw))

    spy("rms_norm", norm.RMSNormFunction, "apply")
    spy("attention", attention.BlockedCausalAttention, "apply")
    spy("loss", loss.LinearCrossEntropy, "apply")
    spy("padded_groups", moe, "pad_groups")
    idx = torch.randint(0, 256, (2, 16))
    for kernels in ("reference", "auto"):
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16: where the MoE pads its groups
            tiny_model(kernels=kernels)(idx, idx).backward()
        assert set(calls) == (set() if kernels == "reference" else {"rms_norm", "attention", "loss", "padded_groups"})


@pytest.mark.parametrize("fp32_gemm", ["onednn"], indirect=True)
def test_only_auto_in_fp32_runs_the_linears_through_onednn(monkeypatch, fp32_gemm):
    """With oneDNN chosen, a training step of the reference model never calls its linear
    operator, nor does auto under bf16 autocast; auto in fp32 calls it in every linear."""
    calls = onednn_calls(monkeypatch)
    idx = torch.randint(0, 256, (2, 16))
    # A step: 15 linears' forward and input gradient (the loss takes the head's weight
    # itself); the logits: all 16 linears' forward.
    for kernels, autocast, expected in (("reference", False, 0), ("auto", True, 0), ("reference", True, 0),
                                        ("auto", False, 15 + 15 + 16)):
        calls.clear()
        model = tiny_model(kernels=kernels)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(idx, idx).backward()
            model(idx)
        assert len(calls) == expected, (kernels, autocast)


# --- RMSNorm --------------------------------------------------------------------------------


def written_out_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("norm", [rms_norm, norm.rms_norm], ids=["reference", "kernel"])
def test_rms_norm_matches_its_formula_forward_and_grads(norm):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.empty(16, dtype=torch.float64).uniform_(0.5, 1.5, generator=generator).requires_grad_()
    grad_out = torch.randn(3, 5, 16, generator=generator, dtype=torch.float64)
    results = []
    for forward in (norm, written_out_rms_norm):
        out = forward(x, weight, 1e-6)
        results.append((out, *torch.autograd.grad(out, (x, weight), grad_out)))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("norm", [rms_norm, norm.rms_norm], ids=["reference", "kernel"])
def test_rms_norm_of_bf16_is_computed_in_fp32_and_returned_in_bf16(norm):
    x = (torch.randn(4, 64) * 1e3).bfloat16().requires_grad_()  # squares overflow nothing in fp32
    weight = torch.ones(64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x, weight, 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), written_out_rms_norm(x.float(), weight, 1e-6), atol=0.01, rtol=0.01)
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32


@pytest.mark.parametrize("dim", [0, -1])
def test_softmax_fp32_overwrites_fp32_input_and_leaves_bf16_input_alone(dim):
    scores = torch.randn(6, 9) * 5
    expected = torch.softmax(scores, dim=dim)
    fp32 = scores.clone()
    out = softmax_fp32(fp32, dim=dim)
    torch.testing.assert_close(out, expected)
    assert out.data_ptr() == fp32.data_ptr()  # no second buffer
    bf16 = scores.bfloat16()
    out = softmax_fp32(bf16, dim=dim)
    assert out.dtype == torch.float32 and torch.equal(bf16, scores.bfloat16())
    torch.testing.assert_close(out, torch.softmax(bf16.float(), dim=dim))


# --- attention ------------------------------------------------------------------------------


def written_out_attention(q, k, v, scale):
    """Causal attention spelled out, no fused kernel."""
    seq = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize(("qk_dim", "v_dim"), [(12, 8), (8, 12), (8, 8)])
@pytest.mark.parametrize(
    ("attend", "seq"),
    [
        (causal_attention, 10),
        (attention.padded_sdpa, 10),
        (attention.blocked_attention, 10),  # one block
        (partial(attention.blocked_attention, block_rows=4), 10),  # 4 + 4 + 2
        (partial(attention.blocked_attention, block_rows=3), 7),  # 3 + 3 + 1
    ],
)
def test_every_attention_matches_the_written_out_formula_forward_and_grads(attend, seq, qk_dim, v_dim):
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 3, seq, qk_dim), (2, 3, seq, qk_dim), (2, 3, seq, v_dim)]
    q, k, v = (torch.randn(s, generator=generator, dtype=torch.float64, requires_grad=True) for s in shapes)
    grad_out = torch.randn(2, 3, seq, v_dim, generator=generator, dtype=torch.float64)
    results = []
    for attend_with in (attend, written_out_attention):
        out = attend_with(q, k, v, qk_dim**-0.5)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    assert results[0][0].shape == (2, 3, seq, v_dim)
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "attend",
    [causal_attention, attention.causal_attention, partial(attention.blocked_attention, block_rows=4)],
)
def test_bf16_autocast_attention_matches_the_written_out_formula_forward_and_grads(attend):
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 10, 12, generator=generator, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 10, 8, generator=generator, requires_grad=True)
    grad_out = torch.randn(2, 3, 10, 8, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q, k, v, 12**-0.5)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype)))
    expected = written_out_attention(q, k, v, 12**-0.5)
    expected = (expected, *torch.autograd.grad(expected, (q, k, v), grad_out))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.float(), b, atol=0.05, rtol=0.05)


def test_padding_keeps_the_fused_attention_kernel():
    """The point of the padding: with MLA's head dims SDPA would take its slow math path."""
    q, k, v = torch.randn(1, 2, 16, 48), torch.randn(1, 2, 16, 48), torch.randn(1, 2, 16, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attention.padded_sdpa(q, k, v, 48**-0.5)
    ops = {event.key for event in prof.key_averages()}
    assert any("flash_attention" in op for op in ops), sorted(op for op in ops if "attention" in op)
    assert "aten::_scaled_dot_product_attention_math" not in ops


def test_mla_on_cpu_scores_only_the_causal_blocks(monkeypatch):
    """With kernels=auto on CPU the model takes the blocked path (faster there than the fused kernel)."""
    calls = []
    blocked = attention.blocked_attention
    monkeypatch.setattr(attention, "blocked_attention", lambda *a, **kw: calls.append(1) or blocked(*a, **kw))
    tiny_model()(torch.randint(0, 256, (1, 16)))
    assert len(calls) == tiny_model().config.n_layers


# --- routed experts -------------------------------------------------------------------------


needs_grouped_mm = pytest.mark.skipif(
    not grouped_mm_supported(torch.zeros(1), torch.float32),
    reason="torch._grouped_mm has no CPU kernel here",
)


@needs_grouped_mm
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_routed_experts_kernel_matches_the_reference_forward_and_grads(precision):
    """In bf16 the kernel pads each expert's group to 64 rows; the result must not show it."""
    generator = torch.Generator().manual_seed(0)
    # Expert 5 gets no token, expert 2 more than one padded group: both edges of the padding.
    counts = torch.tensor([7, 1, 70, 3, 9, 0, 4, 4])
    x = torch.randn(int(counts.sum()), 16, generator=generator, requires_grad=True)
    w13 = (torch.randn(8, 2 * 24, 16, generator=generator) * 0.3).requires_grad_()
    w2 = (torch.randn(8, 16, 24, generator=generator) * 0.3).requires_grad_()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    results = []
    for experts in (moe.routed_experts, grouped_swiglu):
        with autocast:
            out = experts(x, counts, w13, w2)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        results.append((out, *torch.autograd.grad(out, (x, w13, w2), grad_out)))
    assert results[0][0].dtype == results[1][0].dtype
    tolerance = dict(atol=1e-5, rtol=1e-5) if precision == "fp32" else dict(atol=0.02, rtol=0.02)
    for got, expected in zip(*results):
        torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    assert results[0][2][5].abs().sum() == 0, "the idle expert got a gradient"


def test_pad_groups_starts_every_group_at_a_multiple_of_64_rows():
    counts = torch.tensor([3, 0, 65, 1])
    x = torch.arange(1, 70, dtype=torch.float32).unsqueeze(1)
    padded, rows, ends = moe.pad_groups(x, counts)
    assert ends.tolist() == [64, 64, 192, 256] and ends.dtype == torch.int32
    torch.testing.assert_close(padded.index_select(0, rows), x)
    for padded_start, start, count in zip([0, 64, 64, 192], [0, 3, 3, 68], counts.tolist()):
        assert torch.equal(padded[padded_start : padded_start + count], x[start : start + count])
    assert padded.abs().sum() == x.abs().sum(), "padding rows must be zero"


# --- the loss -------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [False, True])
def test_chunked_loss_equals_cross_entropy_over_full_logits_forward_and_grads(monkeypatch, reduction, ignore):
    # 2 x 40 = 80 tokens in chunks of 12 (12 x 4 bytes x 256 = 12288): six full chunks and
    # a short last one of 8, so a dropped chunk or one weighted by its size shows.
    monkeypatch.setattr(loss, "LOSS_CHUNK_BYTES", 12 * 4 * 256 + 5)
    chunks = []
    apply = loss.LinearCrossEntropy.apply
    monkeypatch.setattr(loss.LinearCrossEntropy, "apply", lambda *a: chunks.append(a[-1]) or apply(*a))
    idx, targets = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(3)).split([40, 1], 1)
    targets = torch.cat([idx[:, 1:], targets], 1)
    if ignore:  # padding-style targets, in a full chunk and across two
        targets[0, 3:9] = -100
        targets[1, 10:30] = -100
    chunked, full = tiny_model(), tiny_model()
    # A skewed head makes every chunk's loss differ (and weigh) noticeably.
    with torch.no_grad():
        for model in (chunked, full):
            model.lm_head.weight.mul_(torch.linspace(0.0, 20.0, 256)[:, None])

    loss_value = chunked(idx, targets, reduction=reduction)
    expected = F.cross_entropy(full(idx).float().flatten(0, 1), targets.flatten(), reduction=reduction)
    assert chunks == [12]
    torch.testing.assert_close(loss_value, expected, atol=1e-5, rtol=1e-5)
    # Gradients are taken in forward and scaled in backward: a non-linear function of the
    # loss must still get the chain rule right.
    loss_value.log().backward()
    expected.log().backward()
    for (name, p), q in zip(chunked.named_parameters(), full.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_loss_chunk_is_cache_sized_on_cpu_and_compute_bound_on_a_gpu():
    """CPU: 4 MiB of fp32 logits (8 tokens at DeepSeek-V3's 129,280 words); a GPU re-reads
    the head weight per chunk, so it takes at least 1024 tokens, more up to 256 MiB."""
    assert loss.loss_chunk_tokens(4096, "cpu") == 256
    assert loss.loss_chunk_tokens(129_280, "cpu") == 8
    assert loss.loss_chunk_tokens(129_280, "cuda") == 1024
    assert loss.loss_chunk_tokens(32_768, "cuda") == 2048
    assert loss.loss_chunk_tokens(512, "cuda") == 131_072
    asked, chunks = [], []
    choose, apply = loss.loss_chunk_tokens, loss.LinearCrossEntropy.apply
    with mock.patch.object(loss, "loss_chunk_tokens", lambda *a: asked.append(a) or choose(*a)), \
            mock.patch.object(loss.LinearCrossEntropy, "apply", lambda *a: chunks.append(a[-1]) or apply(*a)):
        loss.linear_cross_entropy(torch.randn(6, 8), torch.randn(4096, 8), torch.randint(0, 4096, (6,)), "sum")
    assert asked == [(4096, "cpu")] and chunks == [256]  # the hidden states' device decides


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bf16_chunked_loss_matches_the_reference_loss_forward_and_grads(reduction):
    generator = torch.Generator().manual_seed(7)
    h = torch.randn(50, 16, generator=generator, requires_grad=True)
    weight = torch.randn(40, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 40, (50,), generator=generator)
    targets[3:7] = -100
    results = []
    for lm_loss in (loss.linear_cross_entropy, lm_cross_entropy):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = lm_loss(h, weight, targets, reduction)
        assert value.dtype == torch.float32
        results.append((value, *torch.autograd.grad(value, (h, weight))))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=0.02, rtol=0.02)


def test_loss_stays_exact_where_the_target_probability_underflows():
    """Logits 200 apart give each target a probability below fp32's smallest; each token's loss is 200."""
    h = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    weight = torch.tensor([[200.0, 0.0], [0.0, 0.0], [0.0, 200.0]], requires_grad=True)
    targets = torch.tensor([1, 0])
    value = loss.LinearCrossEntropy.apply(h, weight, targets, 1)
    expected = F.cross_entropy(h @ weight.T, targets, reduction="sum")
    assert torch.isfinite(value)
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close(value, torch.tensor(400.0))


def test_loss_without_grad_matches_and_keeps_nothing():
    model = tiny_model()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        value = model(idx, idx)
        expected = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    assert value.grad_fn is None
    torch.testing.assert_close(value, expected)


# --- the linear layers ------------------------------------------------------------------------


def linear_operands(shape: tuple, contiguous: bool, generator: torch.Generator):
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=generator)
    x = (x[..., ::2] if not contiguous else x[..., : shape[-1]].contiguous()).detach().requires_grad_()
    weight = torch.randn(40, shape[-1], generator=generator, requires_grad=True)
    return x, weight


@pytest.mark.parametrize(
    "plan", [gemm_choice.ONEDNN, gemm_choice.GemmPlan(grad_weight=True), gemm_choice.GemmPlan(forward=True)],
    ids=["onednn", "onednn weight grad", "onednn forward"],
)
@pytest.mark.parametrize("shape", [(30, 24), (3, 10, 24)], ids=["2-D", "3-D"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_onednn_linear_matches_f_linear_forward_and_grads(plan, shape, contiguous, monkeypatch):
    """Each product by either backend is x @ w^T's, to fp32 rounding, for strided x too."""
    calls = onednn_calls(monkeypatch)
    x, weight = linear_operands(shape, contiguous, torch.Generator().manual_seed(0))
    assert x.is_contiguous() == contiguous
    grad_out = torch.randn(*shape[:-1], 40, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(linear_kernel, "fp32_gemm_plan", lambda: plan)
    out = linear_kernel.linear(x, weight)
    got = (out, *torch.autograd.grad(out, (x, weight), grad_out))
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    out64 = F.linear(x64, w64)
    expected = (out64, *torch.autograd.grad(out64, (x64, w64), grad_out.double()))
    assert got[0].shape == expected[0].shape and got[1].shape == x.shape
    for a, b in zip(got, expected):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    assert len(calls) == plan.forward + plan.grad_input


@pytest.mark.parametrize("needs", ["x", "weight", "neither"])
def test_onednn_linear_gives_only_the_gradients_asked_for(needs):
    x, weight = linear_operands((8, 12), True, torch.Generator().manual_seed(0))
    x.requires_grad_(needs == "x")
    weight.requires_grad_(needs == "weight")
    out = linear_kernel.OneDNNLinear.apply(x, weight, gemm_choice.ONEDNN)
    torch.testing.assert_close(out, F.linear(x, weight))
    assert out.requires_grad == (needs != "neither")
    if needs == "neither":
        assert out.grad_fn is None
        return
    out.sum().backward()
    assert (x.grad is not None) == (needs == "x") and (weight.grad is not None) == (needs == "weight")
    torch.testing.assert_close((x if needs == "x" else weight).grad,
                               torch.ones(8, 40) @ weight if needs == "x" else torch.ones(8, 40).T @ x)


@pytest.mark.parametrize("fp32_gemm", ["onednn"], indirect=True)
def test_the_linear_kernel_leaves_what_is_not_eager_fp32_on_cpu_to_f_linear(monkeypatch, fp32_gemm):
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = onednn_calls(monkeypatch)
    x, weight = torch.randn(6, 8), torch.randn(4, 8)
    torch.testing.assert_close(linear_kernel.linear(x, weight), F.linear(x, weight))
    assert len(calls) == 1  # forced on: fp32 on CPU goes through oneDNN
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear_kernel.linear(x, weight).dtype == torch.bfloat16
    assert linear_kernel.linear(x.bfloat16(), weight.bfloat16()).dtype == torch.bfloat16
    assert linear_kernel.linear(x.double(), weight.double()).dtype == torch.float64
    assert linear_kernel.linear(x.to("meta"), weight.to("meta")).shape == (6, 4)
    with FakeTensorMode():  # what `--plan --simulate` runs the model in
        assert linear_kernel.linear(torch.empty(6, 8), torch.empty(4, 8)).shape == (6, 4)
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        linear_kernel.linear(x, weight)
    precision = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # oneDNN may round fp32 to bf16: MKL stays exact
    try:
        linear_kernel.linear(x, weight)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = precision
    assert calls == []


def test_the_linear_kernel_is_f_linear_where_mkl_wins_every_product(monkeypatch):
    monkeypatch.setattr(linear_kernel, "fp32_gemm_plan", lambda: gemm_choice.MKL)
    apply = mock.Mock(side_effect=linear_kernel.OneDNNLinear.apply)
    monkeypatch.setattr(linear_kernel.OneDNNLinear, "apply", apply)
    x, weight = torch.randn(6, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    linear_kernel.linear(x, weight).sum().backward()
    apply.assert_not_called()


# --- which fp32 GEMM backend --------------------------------------------------------------------


@pytest.fixture
def gemm_cache(tmp_path, monkeypatch):
    """An empty cache folder, no forced backend, and a stand-in measurement that counts its calls."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gemm_choice.ENV, raising=False)
    monkeypatch.setattr(gemm_choice, "onednn_available", lambda: True)
    measured = mock.Mock(return_value=({"forward": 2.2, "grad_input": 1.3, "grad_weight": 1.1}, 0.98))
    monkeypatch.setattr(gemm_choice, "measure", measured)
    return tmp_path / "ciuic-train" / gemm_choice.CACHE_FILE, measured


def test_the_choice_is_measured_once_and_cached_per_machine(gemm_cache, monkeypatch):
    path, measured = gemm_cache
    plan = gemm_choice.choose()
    assert plan == gemm_choice.GemmPlan(forward=True, grad_input=True, grad_weight=False)  # 1.1 is within the margin
    entries = json.loads(path.read_text())
    assert list(entries) == [gemm_choice.machine_key()]
    assert entries[gemm_choice.machine_key()]["mkl_over_onednn"]["forward"] == 2.2
    assert gemm_choice.choose() == plan and measured.call_count == 1  # read back, not measured again
    monkeypatch.setattr(gemm_choice, "machine_key", lambda: "another CPU")
    measured.return_value = ({"forward": 0.9, "grad_input": 0.85, "grad_weight": 0.6}, 0.98)
    assert gemm_choice.choose() == gemm_choice.MKL and measured.call_count == 2
    assert len(json.loads(path.read_text())) == 2  # both machines kept
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"%s": {"forward": true}}'])
def test_a_corrupt_cache_is_measured_again_and_rewritten(gemm_cache, content):
    path, measured = gemm_cache
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("%s", gemm_choice.machine_key()))
    assert gemm_choice.choose().forward and measured.call_count == 1
    assert json.loads(path.read_text())[gemm_choice.machine_key()]["grad_input"] is True


@pytest.mark.parametrize(("vendor", "flags", "expected"), [
    ("AuthenticAMD", {"avx2", "avx512f"}, gemm_choice.ONEDNN),
    ("AuthenticAMD", {"avx2"}, gemm_choice.MKL),
    ("GenuineIntel", {"avx2", "avx512f", "amx_tile"}, gemm_choice.MKL),
])
def test_a_disturbed_measurement_decides_nothing_and_is_not_cached(gemm_cache, monkeypatch, vendor, flags, expected):
    """Other jobs on the cores can make either backend look faster: take what is known of the
    CPU (oneDNN only on an AMD CPU with AVX-512), measure again next time."""
    path, measured = gemm_cache
    monkeypatch.setattr(gemm_choice, "cpu_info", lambda: (vendor, "some CPU", flags))
    disturbed = ({"forward": 2.2, "grad_input": 1.9, "grad_weight": 0.6}, 0.5)
    measured.side_effect = [disturbed] * gemm_choice.TRIES
    assert gemm_choice.choose() == expected and measured.call_count == gemm_choice.TRIES
    assert not path.exists()
    measured.side_effect = [disturbed, (disturbed[0], 0.97)]  # a quiet second try decides
    assert gemm_choice.choose() == gemm_choice.GemmPlan(forward=True, grad_input=True)
    assert json.loads(path.read_text())[gemm_choice.machine_key()]["cpu_share"] == 0.97


@pytest.mark.parametrize(("value", "expected"), [("onednn", gemm_choice.ONEDNN), ("MKL", gemm_choice.MKL)])
def test_the_environment_forces_the_backend_without_measuring(gemm_cache, monkeypatch, value, expected):
    path, measured = gemm_cache
    monkeypatch.setenv(gemm_choice.ENV, value)
    assert gemm_choice.choose() == expected
    measured.assert_not_called()
    assert not path.exists()
    monkeypatch.setenv(gemm_choice.ENV, "fast")
    with pytest.raises(ValueError, match="CIUIC_FP32_GEMM"):
        gemm_choice.choose()


def test_the_measurement_times_both_backends(monkeypatch):
    monkeypatch.setattr(gemm_choice, "SHAPES", ((64, 16, 8),))
    ratios, share = gemm_choice.measure()
    assert set(ratios) == {"forward", "grad_input", "grad_weight"}
    assert all(0 < r < float("inf") for r in ratios.values()) and 0 < share


def test_a_kept_eager_function_runs_between_the_graphs_of_a_compiled_caller():
    """`kept_eager` is `torch.compiler.disable` applied late (`prepare_compile`): compiled,
    its caller breaks the graph there and runs it eagerly, not traced."""
    from ciuic_train.model.eager import kept_eager, prepare_compile

    compiling = []

    @kept_eager
    def host_side(x):
        compiling.append(torch.compiler.is_compiling())
        return x + 1

    prepare_compile()
    compiled = torch.compile(lambda x: host_side(x * 2) * 3, backend="eager")
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 9.0))
    assert compiling == [False]


def test_the_trainer_imports_no_dynamo_until_it_compiles():
    """Seconds of a process's start-up stay unspent where no optimizer is built (torch's
    Optimizer imports dynamo): importing the trainer and the CLI, and building the model on
    meta, as the CLI process that starts the ranks does to check their memory (a meta
    tensor's normal_ would import it)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, ciuic_train.train.trainer, ciuic_train.cli.main\n"
        "from ciuic_train.model import Transformer\n"
        "from ciuic_train.model.config import ModelConfig\n"
        "with torch.device('meta'):\n    Transformer(ModelConfig())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr[-2000:]
