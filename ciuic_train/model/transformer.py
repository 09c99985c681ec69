"""A DeepSeek-V2/V3 style decoder: Multi-head Latent Attention plus DeepSeekMoE, in plain PyTorch.

This file is the model: the loss, the table of the costliest computations, and the
`Transformer` (embedding, blocks, final norm, head, the multi-token-prediction depths,
init, forward and the expert balancing step). Its parts live beside it, one to a file:
`norm.py` (RMSNorm), `rope.py` and `yarn.py` (positions), `attention.py` (MLA), `moe.py`
(the dense SwiGLU and the MoE), `block.py`, `mtp.py`; `counting.py` counts parameters and
FLOPs, `sampling.py` samples.

Most of a training step's time goes to four computations, the norms, the attention, the
routed experts and the loss, and to the linear layers' matmuls around them. Each is one
plain function (`norm.rms_norm`, `attention.causal_attention`, `common.grouped_swiglu`,
`lm_cross_entropy` here, and `F.linear` for every `common.Linear`), gathered in
`REFERENCE`. `model.kernels=auto` (the default) swaps in the fast versions from
`ciuic_train/model/kernels/` where they serve the device; `model.kernels=reference` runs
these formulas everywhere. Tests hold the two to the same results, forward and gradients.

Weight decay rule for the trainer: decay parameters with ndim >= 2 except
`tok_embeddings.weight`. That excludes norms and keeps matrices, including the stacked
expert weights and `lm_head.weight`.

Built on a device, the model initializes itself from `seed`. Built on meta (`with
torch.device("meta"): model = Transformer(cfg)`, what the trainer does) it allocates
nothing; after `model.to_empty(device=...)`, `model.init_weights(ParameterInit(seed,
locate))` fills in parameters and buffers, each rank only the rows it holds (`init.py`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ciuic_train.model.attention import causal_attention
from ciuic_train.model.block import Block, LayerStack
from ciuic_train.model.common import IGNORE_INDEX, Kernels, Linear, grouped_swiglu
from ciuic_train.model.config import ModelConfig
from ciuic_train.model.init import ParameterInit
from ciuic_train.model.kernels import AUTO
from ciuic_train.model.moe import MoE
from ciuic_train.model.mtp import MultiTokenPrediction
from ciuic_train.model.norm import RMSNorm, rms_norm
from ciuic_train.model.rope import rope_tables


def lm_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """Cross-entropy, in fp32, of the logits h @ weight^T [N, vocab] against targets [N]."""
    return F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def balance_terms(blocks: list[Block]) -> list[torch.Tensor]:
    """The weighted balance losses of the last training forward of `blocks`' MoE layers."""
    return [term for block in blocks if isinstance(block.ffn, MoE) for term in block.ffn.balance_loss.values()]


def side_loss_figures(blocks: list[Block], mtp_loss: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The last training forward's side losses over `blocks`: each balance loss summed over
    their MoE layers (`aux_loss`, `seq_aux_loss`), and `mtp_loss` where given; detached 0-d
    tensors, left on the device for the step's one sync."""
    terms: dict[str, list[torch.Tensor]] = {}
    for block in blocks:
        if isinstance(block.ffn, MoE):
            for name, value in block.ffn.balance_loss.items():
                terms.setdefault(name, []).append(value.detach())
    if mtp_loss is not None:
        terms["mtp_loss"] = [mtp_loss.detach()]
    return {name: torch.stack(values).sum() for name, values in terms.items()}


def with_gradient_of(value: torch.Tensor, terms: list[torch.Tensor]) -> torch.Tensor:
    """`value`, unchanged, carrying the gradient of the sum of `terms` as well."""
    if not terms:
        return value
    total = torch.stack(terms).sum()
    return value + (total - total.detach())  # adds their gradient, and exactly 0


REFERENCE = Kernels(rms_norm, causal_attention, grouped_swiglu, lm_cross_entropy, F.linear)


def kernels_for(choice: str) -> Kernels:
    """`reference`: the plain formulas of the model's files; `auto`: the fast paths of model/kernels/."""
    return REFERENCE if choice == "reference" else AUTO


class Transformer(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab_size], or with targets the loss (see forward).

    Parameter names the trainer relies on: `tok_embeddings` (not weight-decayed) and
    `lm_head` (decayed like any matrix). `mtp` holds the multi-token-prediction depths
    (`model.n_mtp_layers`, none by default); only training forwards run them.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.config = cfg
        self.kernels = kernels_for(cfg.kernels)
        # Given its weight, nn.Embedding skips its own normal_ draw: init_weights draws every
        # parameter anyway, and on meta that draw imports torch._dynamo (2-5 s a process).
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = LayerStack(
            {i: Block(cfg, use_moe=i >= cfg.n_dense_layers, kernels=self.kernels) for i in range(cfg.n_layers)}
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, self.kernels.rms_norm)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, self.kernels.linear)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.mtp = nn.ModuleList(MultiTokenPrediction(cfg, self.kernels) for _ in range(cfg.n_mtp_layers))
        # The mean MTP loss of the last training forward that ran them (`loss_figures`).
        self.mtp_loss: torch.Tensor | None = None
        # Recomputable from the config, so kept out of checkpoints.
        half_rope = cfg.qk_rope_head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half_rope), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half_rope), persistent=False)
        if not self.rope_cos.is_meta:
            self.init_weights(ParameterInit(seed))

    @torch.no_grad()
    def init_weights(self, init: ParameterInit | None = None, provided: frozenset[str] = frozenset()) -> None:
        """(Re)initialise every parameter and buffer: matrices and embeddings normal(0,
        `init_std`), norms 1, the experts' bias and counts 0, the RoPE tables computed;
        except the parameters named in `provided`, which the caller fills itself (values
        it would draw here only to overwrite: seconds a rank for a big model).

        Each parameter's values come from `init`'s seed and the parameter's name
        (`model/init.py`), so they do not depend on how the parameters are sharded, on
        which parameters exist (MTP depths leave the main model's as they were), or on the
        global RNG. `init` defaults to seed 0 with every tensor whole. Called by __init__
        unless built on meta; after `to_empty()`, call it with the rows each rank holds.
        """
        init = init or ParameterInit(0)
        std = self.config.init_std
        done: set[int] = set()  # a tied head is the embedding: drawn once, under its first name
        for module_name, module in self.named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                if id(param) in done:
                    continue
                done.add(id(param))
                if f"{module_name}.{leaf}" in provided:
                    continue
                if isinstance(module, RMSNorm):
                    init.constant_(param, 1.0)
                else:  # Linear and Embedding weights, and the MoE's stacked experts
                    init.normal_(f"{module_name}.{leaf}", param, std)
            if isinstance(module, MoE):
                module.expert_bias.zero_()
        self.init_unsaved_buffers()

    @torch.no_grad()
    def init_unsaved_buffers(self) -> None:
        """The buffers no checkpoint holds: the RoPE tables computed, the experts' token
        counts 0. All a model loaded from a checkpoint needs besides what it loads."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.tokens_per_expert.zero_()
        cos, sin = rope_tables(
            self.config.qk_rope_head_dim,
            self.config.max_seq_len,
            self.config.rope_theta,
            device=self.rope_cos.device,
            cfg=self.config,
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        reduction: str = "mean",
        mtp_loss_weight: float = 0.0,
        docs: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab], or with `targets` [B, T] the fp32 cross-entropy ("mean" or "sum").

        `docs` [B, T], each position's document in its window, keeps attention inside
        documents; `positions` [B, T] are the positions RoPE rotates by (default 0 .. T-1
        in every row; `model/documents.py`).

        The loss goes through forward so that DDP and FSDP see it. Targets equal to
        `IGNORE_INDEX` (-100) are ignored, as in `F.cross_entropy`. In training, the
        balance losses and, with MTP depths and `mtp_loss_weight` > 0, that weight times the
        mean MTP loss join the gradient; the value returned stays the next-token loss, so it
        compares across runs with and without them (`loss_figures` gives the others).
        """
        h = self.norm(self.trunk(idx, docs, positions))  # [B, T, dim]
        if targets is None:
            return self.lm_head(h)
        return self.head_loss(h, idx, targets, reduction, mtp_loss_weight, list(self.layers), docs, positions)

    def head_loss(
        self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor, reduction: str,
        mtp_loss_weight: float, blocks: list[Block], docs: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of the normalised output h [B, T, dim] (see forward); in training with the
        gradients of the balance losses of `blocks`' MoE layers and of the MTP depths joined.

        A pipeline's last stage calls it with its own blocks; the other stages' balance
        losses reach the gradient on their own stage (ciuic_train/distributed/pipeline.py).
        """
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
        loss = self.kernels.loss(h.flatten(0, 1), self.lm_head.weight, targets.flatten(), reduction)
        if not self.training:
            return loss
        extra = balance_terms(blocks)
        if self.mtp and mtp_loss_weight:
            self.mtp_loss = self.multi_token_loss(h, idx, targets, reduction, docs, positions)
            extra.append(mtp_loss_weight * self.mtp_loss)
            extra += balance_terms([depth.block for depth in self.mtp])
        return with_gradient_of(loss, extra)

    def multi_token_loss(
        self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor, reduction: str,
        docs: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mean over MTP depths of each depth's loss, from the main model's output h [B, T, dim].

        Depth k sees positions 0 .. T-k-1 (a position needs the token k ahead as input and
        the one k+1 ahead as target): h of the previous depth there (the main model's
        normalised output for k = 1, as inference engines feed DeepSeek's MTP weights),
        the tokens idx[:, k:], the targets targets[:, k:]; the documents and positions are
        h's, docs[:, :T-k] and positions[:, :T-k].
        """
        seq = idx.shape[1]
        losses = []
        for k, depth in enumerate(self.mtp, start=1):
            cut = slice(0, seq - k)
            cos, sin = self.rope_at(seq - k, positions[:, cut] if positions is not None else None)
            depth_docs = docs[:, cut] if docs is not None else None
            h, normed = depth(h[:, cut], self.tok_embeddings(idx[:, k:]), cos, sin, docs=depth_docs)
            losses.append(self.kernels.loss(normed.flatten(0, 1), self.lm_head.weight, targets[:, k:].flatten(), reduction))
        return torch.stack(losses).mean()

    def loss_figures(self) -> dict[str, torch.Tensor]:
        """The last training forward's side losses: the weighted balance losses summed over MoE
        layers (`aux_loss`, `seq_aux_loss`) and the mean MTP loss (`mtp_loss`), where on; 0-d
        tensors, left on the device for the step's one sync."""
        return side_loss_figures(self.blocks(), self.mtp_loss)

    def rope_at(self, seq: int, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin tables for positions 0 .. seq-1 ([seq, d/2]), or for `positions`
        [B, seq] ([B, 1, seq, d/2]: one row per window, broadcast over the heads)."""
        if positions is None:
            return self.rope_cos[:seq], self.rope_sin[:seq]
        return self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)

    def trunk(
        self, idx: torch.Tensor, docs: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token ids [B, T] -> the last block's hidden states [B, T, dim] (before the final norm)."""
        seq = idx.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds model.max_seq_len={self.config.max_seq_len}"
            )
        cos, sin = self.rope_at(seq, positions)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, docs=docs)
        return x

    def blocks(self) -> list[Block]:
        """Every transformer block: the main model's, then those of the MTP depths."""
        return [*self.layers, *(depth.block for depth in self.mtp)]

    def moe_layers(self, mtp: bool = True) -> dict[int, MoE]:
        """The MoE layers by layer index; MTP depth j counts as layer n_layers + j, as in
        DeepSeek's checkpoints (`mtp=False`: the main model's only)."""
        indexed = self.layers.indexed()
        if mtp:
            indexed += [(self.config.n_layers + j, depth.block) for j, depth in enumerate(self.mtp)]
        return {i: block.ffn for i, block in indexed if isinstance(block.ffn, MoE)}

    def mtp_moe_layers(self) -> list[MoE]:
        return [depth.block.ffn for depth in self.mtp if isinstance(depth.block.ffn, MoE)]

    @torch.no_grad()
    def balance_experts(self, all_reduce: Callable[[torch.Tensor], object] | None = None) -> torch.Tensor:
        """One auxiliary-loss-free balancing step from the tokens counted since the last call.

        Call after each optimizer step. `all_reduce`, if given, must sum a tensor in place
        across ranks (e.g. `torch.distributed.all_reduce`), so every rank sees the global
        load and makes the same bias update; all layers' counts go through it as one
        tensor. Returns the worst layer's load imbalance, max over mean tokens per expert
        (1.0 is perfect balance; n_routed_experts / n_activated_experts is total collapse),
        as a 0-d tensor on the counts' device: reading it waits for the device.
        """
        moes = list(self.moe_layers().values())
        if not moes:
            return torch.ones((), device=self.rope_cos.device)
        loads = torch.stack([moe.tokens_per_expert for moe in moes])  # [MoE layers, E]
        if all_reduce is not None:
            all_reduce(loads)
        imbalance = (loads.amax(dim=1) / loads.mean(dim=1).clamp_min(1)).max()
        for moe, load in zip(moes, loads):
            moe.update_bias(load)
            moe.tokens_per_expert.zero_()
        return imbalance

    def expert_counts(self) -> list[torch.Tensor]:
        """Each MoE layer's token counts since the last balancing step (summed in place
        across replica groups before it, so that every group makes the same step)."""
        return [moe.tokens_per_expert for moe in self.moe_layers().values()]

    def forget_expert_counts(self) -> None:
        """Drop the counts of a step that is not applied, instead of `balance_experts`."""
        for moe in self.moe_layers().values():
            moe.tokens_per_expert.zero_()
