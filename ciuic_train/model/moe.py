"""The feed-forward layers: the dense SwiGLU and DeepSeekMoE.

The MoE routes each token to its top-k routed experts, runs them as one grouped matmul per
projection (`Kernels.routed_experts`, `common.grouped_swiglu` in the reference), adds the
shared experts every token uses, and keeps the balance: DeepSeek-V3's bias step and
DeepSeek-V2's auxiliary losses.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ciuic_train.model.common import Kernels, Linear
from ciuic_train.model.config import ModelConfig


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): the dense layers' feed-forward, and the MoE's shared experts."""

    def __init__(self, dim: int, hidden_dim: int, linear: Callable = F.linear):
        super().__init__()
        self.w1 = Linear(dim, hidden_dim, linear)
        self.w2 = Linear(hidden_dim, dim, linear)
        self.w3 = Linear(dim, hidden_dim, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """silu(w1 x) * w3 x: the first half, which expert parallelism runs apart from the second."""
        return F.silu(self.w1(x)) * self.w3(x)


class MoE(nn.Module):
    """DeepSeekMoE: top-k of many small routed experts, plus shared experts every token uses.

    Balance comes from `expert_bias` (DeepSeek-V3's auxiliary-loss-free scheme): it is
    added to the scores only to choose experts, so it steers load without distorting
    the gate weights that mix the chosen experts' outputs. Training forwards count the
    tokens each expert received in `tokens_per_expert`; `Transformer.balance_experts`
    turns those counts into a bias step. (Activation checkpointing re-runs the forward
    and counts every token twice; neither the sign-based step nor the imbalance ratio
    minds.) DeepSeek-V2's auxiliary balance losses are there too, off by default
    (`balance_losses`).
    """

    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.n_routed_experts = cfg.n_routed_experts
        self.n_activated_experts = cfg.n_activated_experts
        self.n_expert_groups = cfg.n_expert_groups
        self.n_limited_groups = cfg.n_limited_groups
        self.score_func = cfg.score_func
        self.norm_topk_prob = cfg.norm_topk_prob
        self.route_scale = cfg.route_scale
        self.bias_update_rate = cfg.bias_update_rate
        self.aux_loss_alpha = cfg.aux_loss_alpha
        self.seq_aux_loss_alpha = cfg.seq_aux_loss_alpha
        # The weighted balance losses of the last training forward ({} when both are off).
        self.balance_loss: dict[str, torch.Tensor] = {}
        self.routed_experts = kernels.routed_experts
        # Expert parallelism's ExpertDispatch (ciuic_train/distributed/expert_parallel.py), set
        # when the routed experts are split over ranks.
        self.dispatch = None
        self.gate = Linear(cfg.dim, cfg.n_routed_experts, kernels.linear)
        # Stacked over experts for one grouped matmul; w13 holds each expert's gate (w1)
        # and up (w3) projections as one [2 * hidden, dim] matrix, so both take one product.
        n_experts, hidden, dim = cfg.n_routed_experts, cfg.moe_ffn_dim, cfg.dim
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.shared_experts = (
            SwiGLU(cfg.dim, cfg.n_shared_experts * cfg.moe_ffn_dim, kernels.linear)
            if cfg.n_shared_experts > 0
            else None
        )
        # fp32 so steps of ~1e-3 are not rounded away; persistent because it is model state.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer(
            "tokens_per_expert", torch.zeros(n_experts, dtype=torch.float32), persistent=False
        )

    def affinities(self, x: torch.Tensor) -> torch.Tensor:
        """Token-to-expert scores [N, E] (fp32) of tokens x [N, dim]."""
        logits = self.gate(x).float()
        return logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For tokens x[N, dim], return (gate weights [N, k] fp32, expert indices [N, k])."""
        return self.choose(self.affinities(x))

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts of each token (biased scores choose) and their gate weights."""
        choice = scores + self.expert_bias
        if self.n_expert_groups > 1:
            # Group-limited routing, as DeepSeek-V3 (and transformers' DeepseekV3TopkRouter):
            # a group scores the sum of its top-2 choice scores, and the top-k experts come
            # only from the n_limited_groups best groups. The others are masked to -inf, not
            # 0, so that a negative biased score in a kept group still beats them.
            grouped = choice.view(-1, self.n_expert_groups, self.n_routed_experts // self.n_expert_groups)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [N, G]
            kept = group_scores.topk(self.n_limited_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        indices = choice.topk(self.n_activated_experts, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, indices

    def balance_losses(self, scores: torch.Tensor, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weighted balance losses of one forward: scores [B, T, E], indices [B, T, k].

        Each is sum_i f_i * P_i: f_i, expert i's share of the chosen slots times E (1 for
        every expert at perfect balance, no gradient), P_i its mean affinity, normalized per
        token (the gradient: it lowers the affinity of overloaded experts). 1 at perfect
        balance, E / k when k experts take every token.
        """
        n_experts, k = scores.shape[-1], indices.shape[-1]
        chosen = torch.zeros_like(scores).scatter_(-1, indices, 1.0)  # [B, T, E]
        share = scores / scores.sum(dim=-1, keepdim=True)
        losses = {}
        if self.aux_loss_alpha:  # over every token of the micro-batch
            f = chosen.mean(dim=(0, 1)) * n_experts / k  # [E]
            losses["aux_loss"] = self.aux_loss_alpha * (f * share.mean(dim=(0, 1))).sum()
        if self.seq_aux_loss_alpha:  # within each sequence, then averaged
            f = chosen.mean(dim=1) * n_experts / k  # [B, E]
            losses["seq_aux_loss"] = self.seq_aux_loss_alpha * (f * share.mean(dim=1)).sum(dim=-1).mean()
        return losses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, dim]
        scores = self.affinities(x)  # [N, E]
        weights, indices = self.choose(scores)  # [N, k] each
        if self.training and (self.aux_loss_alpha or self.seq_aux_loss_alpha):
            losses = self.balance_losses(scores.view(*shape[:-1], -1), indices.view(*shape[:-1], -1))
            # Kept from the forward only. When activation checkpointing recomputes the block
            # in backward (it must compute them again, to save what the forward saved), losses
            # kept here until the next forward would hold the recomputed graph, and with it
            # every MoE block's recomputed attention activations, to the end of backward.
            if torch._C._current_graph_task_id() == -1:
                self.balance_loss = losses

        # Sort the N * k (token, expert) assignments by expert, so each expert's tokens form
        # one contiguous slice for the grouped matmul.
        expert_of_assignment = indices.flatten()
        order = expert_of_assignment.argsort(stable=True)
        token_of_assignment = order // self.n_activated_experts  # [N * k]
        # Summed into a fixed [E] (bincount's length would depend on the values), so every
        # shape of the step follows from the input's, which a simulation on fake tensors needs.
        counts = expert_of_assignment.new_zeros(self.n_routed_experts).scatter_add_(
            0, expert_of_assignment, torch.ones_like(expert_of_assignment)
        )  # [E]
        if self.training:
            self.tokens_per_expert += counts
        routed, shared = self.experts(x.index_select(0, token_of_assignment), counts, x)
        routed = routed * weights.flatten()[order].unsqueeze(-1)  # [N * k, dim]
        # The routed outputs add into the shared experts' output in place.
        y = shared.to(x.dtype) if shared is not None else torch.zeros_like(x)
        return y.index_add_(0, token_of_assignment, routed.type_as(x)).view(shape)

    def experts(self, rows: torch.Tensor, counts: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed experts' outputs for the expert-sorted rows, and the shared experts'
        for the tokens x (None without shared experts). Under expert parallelism `dispatch`
        sends the rows to their experts' ranks and back, the shared experts running meanwhile."""
        if self.dispatch is not None:
            return self.dispatch(rows, counts, self.w13, self.w2, self.routed_experts, x, self.shared_experts)
        routed = self.routed_experts(rows, counts, self.w13, self.w2)
        return routed, self.shared_experts(x) if self.shared_experts is not None else None

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Nudge underloaded experts up and overloaded ones down by a fixed step."""
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
