"""The CUDA code paths: the model, its kernels and the trainer on a GPU.

Every test here needs a CUDA device and is skipped without one; `scripts/gpu_check.sh`
runs them (`pytest tests/test_gpu.py -m gpu -v -rA`, from outside the repo root so that an
installed `ciuic_train.conf` is what Hydra finds). They hold the CUDA paths
to the CPU-tested ones: bf16 autocast to fp32, CUDA to CPU, the grouped matmul to the
loop over experts, the fused attention to the written-out formula. Where the answer
depends on the machine (which SDPA backend serves which head dims) a test prints what it
found, shown by `-rA` under "PASSES" or with a failure.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ciuic_train.model import ModelConfig, Transformer
from ciuic_train.model.attention import causal_attention
from ciuic_train.model.common import grouped_mm_supported, grouped_swiglu, swiglu_per_expert
from ciuic_train.model.kernels import attention, moe
from ciuic_train.train.trainer import Trainer
from conftest import compose_config

REPO = Path(__file__).parents[1]
KERNELS = ["auto", "reference"]
CUDA = torch.cuda.is_available()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False"),
]

needs_sm80 = pytest.mark.skipif(
    CUDA and torch.cuda.get_device_capability() < (8, 0),
    reason="torch._grouped_mm takes bf16 on CUDA from sm80 (compute capability 8.0) only",
)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    """The `tiny` preset on CPU; the same seed gives the same weights."""
    fields = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "tiny.yaml"))
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**fields, **overrides}))


def batch(seed: int = 2, size: tuple[int, int] = (4, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets on CPU, a few targets ignored."""
    idx = torch.randint(0, 256, size, generator=torch.Generator().manual_seed(seed))
    targets = idx.roll(-1, dims=1)
    targets[0, 5:9] = -100
    return idx, targets


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest magnitude expected."""
    got, expected = got.double().cpu(), expected.double().cpu()
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def no_tf32():
    """fp32 matmuls in full fp32: torch's default, made sure of, since comparisons to fp32 rely on it."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = False
    yield
    matmul.allow_tf32 = before


# --- the whole model ------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", KERNELS)
def test_bf16_autocast_on_cuda_stays_close_to_fp32_on_cuda(kernels, monkeypatch, no_tf32):
    """Same weights on CUDA, fp32 and under bf16 autocast: the loss to bf16's precision,
    every gradient pointing the same way (cosine > 0.99), the MoE on the grouped matmul."""
    grouped_calls = []
    if hasattr(torch, "_grouped_mm"):
        grouped_mm = torch._grouped_mm
        monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: grouped_calls.append(1) or grouped_mm(*a, **kw))
    idx, targets = (t.cuda() for t in batch())
    fp32, bf16 = tiny_model(kernels=kernels).cuda(), tiny_model(kernels=kernels).cuda()

    expected = fp32(idx, targets)
    expected.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = bf16(idx, targets)
    loss.backward()

    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    relative = abs(loss.item() - expected.item()) / abs(expected.item())
    print(f"kernels={kernels}: loss fp32 {expected.item():.6f}, bf16 {loss.item():.6f}, relative difference {relative:.2e}")
    assert relative < 2e-2
    fp32_params = dict(fp32.named_parameters())
    cosines = {}
    for name, p in bf16.named_parameters():
        q = fp32_params[name]
        assert p.grad is not None and q.grad is not None, f"{name}: no gradient"
        assert p.grad.dtype == torch.float32, f"{name}: gradient in {p.grad.dtype}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient in bf16"
        if q.grad.norm() == 0 and p.grad.norm() == 0:
            continue  # e.g. a routed expert no token chose, in both
        cosines[name] = cosine(p.grad, q.grad)
    worst = sorted(cosines.items(), key=lambda item: item[1])[:4]
    print("lowest gradient cosines bf16 vs fp32: " + ", ".join(f"{n} {c:.5f}" for n, c in worst))
    low = {n: round(c, 5) for n, c in cosines.items() if not c > 0.99}
    assert not low, f"gradients with cosine similarity <= 0.99 between bf16 and fp32: {low}"
    if torch.cuda.get_device_capability() >= (8, 0) and hasattr(torch, "_grouped_mm"):
        assert grouped_mm_supported(idx, torch.bfloat16)
        assert grouped_calls, "bf16 on sm80+ should run the routed experts on torch._grouped_mm"
    print(f"torch._grouped_mm calls in the bf16 forward and backward: {len(grouped_calls)}")


@pytest.mark.parametrize("q_lora_rank", [0, 24])
@pytest.mark.parametrize("kernels", KERNELS)
def test_cuda_fp32_matches_cpu_fp32(kernels, q_lora_rank, no_tf32):
    """Same weights in fp32 on CPU and CUDA: logits to ~1e-4, loss and gradients to fp32 rounding."""
    idx, targets = batch()
    cpu = tiny_model(kernels=kernels, q_lora_rank=q_lora_rank)
    cuda = tiny_model(kernels=kernels, q_lora_rank=q_lora_rank).cuda()
    with torch.no_grad():
        logits_cpu, logits_cuda = cpu(idx), cuda(idx.cuda())
    error = (logits_cuda.cpu() - logits_cpu).abs().max().item()
    print(f"kernels={kernels} q_lora_rank={q_lora_rank}: max |logits CUDA - CPU| = {error:.2e} "
          f"(logits up to {logits_cpu.abs().max().item():.3f})")
    torch.testing.assert_close(logits_cuda.cpu(), logits_cpu, atol=1e-4, rtol=1e-4)

    loss_cpu, loss_cuda = cpu(idx, targets), cuda(idx.cuda(), targets.cuda())
    torch.testing.assert_close(loss_cuda.cpu(), loss_cpu, atol=1e-5, rtol=1e-5)
    loss_cpu.backward()
    loss_cuda.backward()
    cuda_params = dict(cuda.named_parameters())
    errors = {}
    for name, p in cpu.named_parameters():
        grad = cuda_params[name].grad.cpu()
        if p.grad.abs().max() == 0:
            assert grad.abs().max() == 0, f"{name}: zero gradient on CPU, not on CUDA"
            continue
        errors[name] = max_error(grad, p.grad)
    worst = sorted(errors.items(), key=lambda item: -item[1])[:3]
    print("largest gradient differences (relative to the gradient's max): "
          + ", ".join(f"{n} {e:.1e}" for n, e in worst))
    assert max(errors.values()) < 1e-3, worst


# --- routed experts: the grouped matmul -----------------------------------------------------


def expert_inputs(counts: list[int], dim: int = 64, hidden: int = 48):
    """Expert-sorted rows and stacked expert weights, fp32 leaves on CUDA."""
    generator = torch.Generator().manual_seed(0)
    n_experts, rows = len(counts), sum(counts)
    x = torch.randn(rows, dim, generator=generator)
    w13 = torch.randn(n_experts, 2 * hidden, dim, generator=generator) * 0.3
    w2 = torch.randn(n_experts, dim, hidden, generator=generator) * 0.3
    grad_out = torch.randn(rows, dim, generator=generator)
    leaves = [t.cuda().requires_grad_() for t in (x, w13, w2)]
    return (*leaves, torch.tensor(counts).cuda(), grad_out.cuda())


@needs_sm80
@pytest.mark.parametrize("experts", [grouped_swiglu, moe.routed_experts], ids=["reference", "auto"])
def test_grouped_mm_on_cuda_matches_the_per_expert_loop_forward_and_grads(experts, monkeypatch, no_tf32):
    """bf16 grouped matmul vs the loop over experts on the same bf16 operands, with experts
    that get no token first, in the middle and last: their gradients must be exactly zero."""
    assert hasattr(torch, "_grouped_mm"), f"torch {torch.__version__} has no torch._grouped_mm"
    counts = [0, 7, 1, 70, 3, 9, 0, 4, 4, 0]
    idle = [e for e, c in enumerate(counts) if c == 0]
    x, w13, w2, counts_t, grad_out = expert_inputs(counts)
    assert grouped_mm_supported(x, torch.bfloat16), "CUDA bf16 on sm80+ should take the grouped matmul"
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or grouped_mm(*a, **kw))

    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = experts(x, counts_t, w13, w2)
    assert calls, "the grouped matmul did not run"
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    got = (out, *torch.autograd.grad(out, (x, w13, w2), grad_out.to(out.dtype)))

    bf16 = [t.to(torch.bfloat16) for t in (x, w13, w2)]  # the same operands the grouped path multiplies
    loop = swiglu_per_expert(bf16[0], counts_t, bf16[1], bf16[2])
    expected = (loop, *torch.autograd.grad(loop, (x, w13, w2), grad_out.to(loop.dtype)))
    fp32_loop = swiglu_per_expert(x, counts_t, w13, w2)
    fp32 = (fp32_loop, *torch.autograd.grad(fp32_loop, (x, w13, w2), grad_out))

    for name, a, b, c in zip(("out", "grad x", "grad w13", "grad w2"), got, expected, fp32):
        assert torch.isfinite(a).all(), f"{name}: non-finite values from the grouped matmul"
        print(f"{name}: max error vs bf16 loop {max_error(a, b):.1e}, vs fp32 loop {max_error(a, c):.1e}, "
              f"cosine vs fp32 {cosine(a, c):.6f}")
        assert max_error(a, b) < 2e-2, name
        assert cosine(a, c) > 0.999, name
    grad_w13, grad_w2 = got[2], got[3]
    for e in idle:
        assert grad_w13[e].abs().sum() == 0 and grad_w2[e].abs().sum() == 0, f"idle expert {e} got a gradient"
    busy = [e for e, c in enumerate(counts) if c > 0]
    assert all(grad_w13[e].abs().sum() > 0 for e in busy), "an expert with tokens got no gradient"


# --- attention: fused SDPA with MLA's unequal head dims -------------------------------------

# (qk head dim, v head dim): model=tiny's (16 + 8, 16) and DeepSeek-V2/V3's (128 + 64, 128).
HEAD_DIMS = [pytest.param(24, 16, id="tiny-qk24-v16"), pytest.param(192, 128, id="deepseek-qk192-v128")]
ATTENTIONS = [
    pytest.param(causal_attention, id="reference"),
    pytest.param(attention.causal_attention, id="auto"),
]


def attention_inputs(qk_dim: int, v_dim: int, seq: int = 256, heads: int = 4):
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, heads, seq, qk_dim), (2, heads, seq, qk_dim), (2, heads, seq, v_dim), (2, heads, seq, v_dim)]
    q, k, v, grad_out = (torch.randn(s, generator=generator).cuda() for s in shapes)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


def bf16_attention(attend, q, k, v, grad_out):
    """Forward and input gradients under bf16 autocast, as the model runs it."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = attend(q, k, v, q.shape[-1] ** -0.5)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype)))


def written_out_attention(q, k, v, grad_out):
    """The fp32 oracle: causal attention spelled out, no fused kernel."""
    seq = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


@pytest.mark.parametrize(("qk_dim", "v_dim"), HEAD_DIMS)
@pytest.mark.parametrize("attend", ATTENTIONS)
def test_bf16_attention_on_cuda_matches_the_written_out_formula_forward_and_grads(attend, qk_dim, v_dim, no_tf32):
    q, k, v, grad_out = attention_inputs(qk_dim, v_dim)
    got = bf16_attention(attend, q, k, v, grad_out)
    expected = written_out_attention(q, k, v, grad_out)
    assert got[0].shape == (2, 4, 256, v_dim)
    for name, a, b in zip(("out", "grad q", "grad k", "grad v"), got, expected):
        print(f"{name}: max error {max_error(a, b):.1e}, cosine {cosine(a, b):.6f}")
        assert torch.isfinite(a).all(), name
        assert cosine(a, b) > 0.999, name
        assert max_error(a, b) < 0.05, name


def sdpa_ops(attend, q, k, v, grad_out) -> list[str]:
    """The aten scaled-dot-product ops one bf16 forward and backward of `attend` dispatches to."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        bf16_attention(attend, q, k, v, grad_out)
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if "scaled_dot_product" in e.key or "attention" in e.key})


@pytest.mark.parametrize(("qk_dim", "v_dim"), HEAD_DIMS)
def test_auto_attention_runs_a_fused_sdpa_kernel_on_cuda(qk_dim, v_dim):
    """The point of `padded_sdpa`: equal head dims keep SDPA off its unfused math path."""
    q, k, v, grad_out = attention_inputs(qk_dim, v_dim)
    auto_ops = sdpa_ops(attention.causal_attention, q, k, v, grad_out)
    reference_ops = sdpa_ops(causal_attention, q, k, v, grad_out)
    print(f"qk {qk_dim} / v {v_dim}, default backend choice in bf16:")
    print(f"  auto (padded):        {auto_ops}")
    print(f"  reference (unpadded): {reference_ops}")
    assert "aten::_scaled_dot_product_attention_math" not in auto_ops, auto_ops
    fused = ("flash", "efficient", "cudnn")
    assert any(kind in op for op in auto_ops for kind in fused), f"no fused SDPA op among {auto_ops}"


# --- the trainer ------------------------------------------------------------------------------


def cuda_trainer(run_dir: Path, text_corpus: Path, *overrides: str) -> Trainer:
    run_dir.mkdir(parents=True, exist_ok=True)  # the CLI's Hydra makes it; the trainer expects it
    config = compose_config(
        "model=tiny", "data=text", f"data.path={text_corpus}", f"data.cache_dir={run_dir.parent / 'cache'}",
        "train.seq_len=64", "train.batch_size=4", "train.eval_windows=8", "train.warmup_steps=1",
        "device=cuda", "precision=bf16", "progress=plain", *overrides,
    )
    return Trainer(config, run_dir)


@pytest.mark.parametrize("kernels", KERNELS)
def test_two_bf16_trainer_steps_on_cuda_end_with_a_finite_loss(tmp_path, text_corpus, kernels):
    trainer = cuda_trainer(
        tmp_path / "run", text_corpus, f"model.kernels={kernels}", "train.max_steps=2", "sample.max_new_tokens=16"
    )
    assert trainer.device.type == "cuda"
    assert all(p.is_cuda for p in trainer.model.parameters())
    summary = trainer.fit()
    print({key: summary[key] for key in ("steps", "final_train_loss", "final_val_loss", "tokens_per_s", "device")})
    assert summary["steps"] == 2
    assert math.isfinite(summary["final_train_loss"]) and math.isfinite(summary["final_val_loss"])
    assert summary["device"].startswith("cuda")
    assert (tmp_path / "run" / "summary.json").is_file()
    text = trainer.sample()  # generate() on CUDA, with a CUDA generator
    assert isinstance(text, str) and text.startswith("def "), text


def test_a_cuda_run_resumes_from_its_checkpoint_on_cuda(tmp_path, text_corpus):
    first = cuda_trainer(tmp_path / "run", text_corpus, "train.max_steps=2", "sample.max_new_tokens=0")
    first.fit()
    second = cuda_trainer(tmp_path / "run", text_corpus, "train.max_steps=3", "sample.max_new_tokens=0")
    assert second.resumed_from is not None and second.step == 2
    for (name, p), q in zip(first.model.named_parameters(), second.model.parameters()):
        assert q.is_cuda and torch.equal(p, q), f"{name} differs after resuming"
    summary = second.fit()
    assert summary["steps"] == 3 and math.isfinite(summary["final_train_loss"])


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_the_meta_build_materializes_on_the_gpu_without_a_host_copy(tmp_path, text_corpus):
    """A 1.6 GB model (400 M parameters) goes from meta straight to the GPU: the host's resident
    memory grows by far less than the model, and the same seed gives the weights a second build gives."""
    big = ["model=small", "model.dim=512", "model.n_layers=3", "model.n_routed_experts=128", "model.moe_ffn_dim=1024"]
    torch.zeros(1, device="cuda")  # the CUDA context's own host memory is not the model's
    before = resident_bytes()
    trainer = cuda_trainer(tmp_path / "run", text_corpus, *big, "sample.max_new_tokens=0")
    grown = resident_bytes() - before
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    print(f"model {model_bytes / 2**30:.2f} GiB on the GPU; host resident memory grew {grown / 2**30:.2f} GiB")
    assert model_bytes > 1.5 * 2**30
    assert all(p.is_cuda for p in trainer.model.parameters()) and all(b.is_cuda for b in trainer.model.buffers())
    assert torch.cuda.memory_allocated() >= model_bytes
    assert grown < model_bytes / 4
    again = cuda_trainer(tmp_path / "again", text_corpus, *big, "sample.max_new_tokens=0")
    for (name, p), q in zip(trainer.model.named_parameters(), again.model.parameters()):
        assert torch.equal(p, q), f"{name}: the same seed drew other weights on CUDA"


def test_fp32_on_cuda_takes_tf32_unless_told_not(tmp_path, text_corpus):
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        for setting, expected in (("tf32=true", True), ("tf32=false", False)):
            cuda_trainer(tmp_path / setting, text_corpus, "precision=fp32", setting, "sample.max_new_tokens=0")
            assert matmul.allow_tf32 is expected, setting
    finally:
        matmul.allow_tf32 = before


@pytest.mark.parametrize("model", [["model.n_dense_layers=2"], ["model.kernels=auto"]], ids=["dense", "moe"])
def test_a_bf16_step_that_logs_nothing_synchronizes_once(tmp_path, text_corpus, model):
    """CUDA's own sync detector over one training step that logs nothing: the agreement on
    the step's loss, norm and stop signal is the one wait for the GPU (the MoE's expert
    counts and bf16 grouped matmul need none, on one rank: no dispatch split sizes)."""
    trainer = cuda_trainer(tmp_path / "run", text_corpus, *model, "train.log_every=100", "sample.max_new_tokens=0")
    trainer.train_step()  # first-step set-up (allocations, cuBLAS handles) is not the step
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            figures = trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:80]}" for w in caught
             if "synchroniz" in str(w.message)]
    print(f"{len(syncs)} synchronizing call(s) in one step:", *syncs, sep="\n  ")
    assert figures["applied"] and math.isfinite(figures["loss"])
    assert len(syncs) == 1, syncs


# --- last: a backend that breaks the CUDA context cannot take the other tests with it ---------


@pytest.mark.parametrize(("qk_dim", "v_dim"), HEAD_DIMS)
def test_which_sdpa_backends_serve_each_attention(qk_dim, v_dim, no_tf32):
    """Each SDPA backend alone (torch.nn.attention.sdpa_kernel), forward and backward: a table
    of which work. What runs must be right; the auto path must have FLASH or EFFICIENT."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel")
    q, k, v, grad_out = attention_inputs(qk_dim, v_dim)
    expected = written_out_attention(q, k, v, grad_out)
    table, wrong = {}, []
    for backend_name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, backend_name, None)
        for label, attend in (("auto", attention.causal_attention), ("reference", causal_attention)):
            if backend is None:
                table[label, backend_name] = "not in this torch"
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel([backend]):
                        got = bf16_attention(attend, q, k, v, grad_out)
                    torch.cuda.synchronize()
                except Exception as err:  # noqa: BLE001 - tabulated, not hidden: see the asserts
                    reasons = "; ".join(str(w.message).strip().splitlines()[0] for w in caught)[:300]
                    table[label, backend_name] = f"refused: {str(err).strip().splitlines()[0][:80]} ({reasons})"
                    continue
            worst = min(cosine(a, b) for a, b in zip(got, expected))
            table[label, backend_name] = f"ok (lowest cosine vs fp32 formula {worst:.5f})"
            if not worst > 0.999:
                wrong.append((label, backend_name, worst))
    print(f"SDPA backends, bf16, qk {qk_dim} / v {v_dim}, {torch.cuda.get_device_name()}, torch {torch.__version__}:")
    for (label, backend_name), result in table.items():
        print(f"  {label:9s} {backend_name:20s} {result}")
    assert not wrong, f"a backend ran but gave a different answer: {wrong}"
    assert table["auto", "FLASH_ATTENTION"].startswith("ok") or table["auto", "EFFICIENT_ATTENTION"].startswith("ok")
