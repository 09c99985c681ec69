"""Parameter and FLOP counts of a built model (meta models too: nothing is computed)."""

from __future__ import annotations

from collections.abc import Iterable

from ciuic_train.model.moe import MoE
from ciuic_train.model.transformer import Transformer


def count_parameters(model: Transformer) -> tuple[int, int]:
    """(total, active per token) parameter counts of the main model.

    Active counts every parameter except the routed experts a token does not visit:
    n_activated_experts of the n_routed_experts per MoE layer. Both counts include the
    embedding and the lm head; DeepSeek's published totals do too, their active counts
    leave the input embedding out. MTP depths are left out, as DeepSeek's 671B leaves them
    out: `count_mtp_parameters` counts them. Works on meta models.
    """
    mtp = {id(p) for p in model.mtp.parameters()}
    total = sum(p.numel() for p in model.parameters() if id(p) not in mtp)
    return total, total - _inactive_expert_parameters(model.moe_layers(mtp=False).values())


def count_mtp_parameters(model: Transformer) -> tuple[int, int]:
    """(total, active per token) of the MTP depths' own parameters; the embedding and the
    head they share with the main model are counted there (DeepSeek's 14B for V3's MTP
    module counts its copies of both)."""
    total = sum(p.numel() for p in model.mtp.parameters())
    return total, total - _inactive_expert_parameters(model.mtp_moe_layers())


def _inactive_expert_parameters(moes: Iterable[MoE]) -> int:
    """The routed-expert parameters a token does not visit, over `moes`."""
    inactive = 0
    for moe in moes:
        per_expert = moe.w13.shape[1:].numel() + moe.w2.shape[1:].numel()
        inactive += per_expert * (moe.n_routed_experts - moe.n_activated_experts)
    return inactive


def training_flops_per_token(model: Transformer, seq_len: int) -> float:
    """Training FLOPs per token, torchtitan's convention: 6 x matmul params + attention scores.

    The embedding is a lookup, not a matmul, so it leaves the count, unless it is tied to
    the lm head, whose matmul is real. Attention counts the full (not causal) score matrix.
    Each MTP depth adds its own matmuls, one more pass through the shared head, and one
    block's attention (counted over the whole sequence; it runs on seq_len - k positions).
    """
    cfg = model.config
    _, active = count_parameters(model)
    _, mtp_active = count_mtp_parameters(model)
    matmul_params = active - (0 if cfg.tie_embeddings else model.tok_embeddings.weight.numel())
    matmul_params += mtp_active + cfg.n_mtp_layers * model.lm_head.weight.numel()
    attention = (cfg.n_layers + cfg.n_mtp_layers) * _attention_flops_per_layer(cfg, seq_len)
    return 6 * matmul_params + attention


def _attention_flops_per_layer(cfg, seq_len: int) -> float:
    """Training FLOPs per token of one block's attention scores (the full score matrix)."""
    return 6 * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * seq_len


def pipeline_costs(model: Transformer, seq_len: int) -> tuple[list[float], float, float]:
    """Training FLOPs per token of each main layer, of what only the first pipeline stage
    runs besides its layers (the embedding: a lookup, 0) and of what the last stage runs
    (the head's matmul and each MTP depth's block and head), for a balanced split."""
    attention = _attention_flops_per_layer(model.config, seq_len)

    def block_flops(block) -> float:
        params = sum(p.numel() for p in block.parameters())
        if isinstance(block.ffn, MoE):
            params -= _inactive_expert_parameters([block.ffn])
        return 6 * params + attention

    head = 6 * model.lm_head.weight.numel()
    last = head + sum(block_flops(depth.block) + head for depth in model.mtp)
    return [block_flops(block) for block in model.layers], 0.0, float(last)
