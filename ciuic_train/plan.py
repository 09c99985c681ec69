"""`ciuic-train ... --plan`: what a config would build, without allocating or training."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from ciuic_train.config import Config
from ciuic_train.model import Transformer, count_parameters


def print_plan(config: Config) -> None:
    """Build the model on the meta device (no memory) and print its size and the run's shape."""
    with torch.device("meta"):
        model = Transformer(config.model)
    total, active = count_parameters(model)
    m, t = config.model, config.train
    table = Table(title=f"plan: model={m.name}", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    rows = {
        "parameters (total)": f"{total:,} ({total / 1e9:.2f} B)",
        "parameters (active per token)": f"{active:,} ({active / 1e9:.2f} B)",
        "layers (dense + MoE)": f"{m.n_layers} ({m.n_dense_layers} + {m.n_layers - m.n_dense_layers})",
        "experts per MoE layer": f"{m.n_routed_experts} routed (top-{m.n_activated_experts}) + {m.n_shared_experts} shared",
        "attention": f"MLA, {m.n_heads} heads, kv_lora_rank {m.kv_lora_rank}, q_lora_rank {m.q_lora_rank or 'none'}",
        "fp32 weights + AdamW state": f"{total * 16 / 2**30:,.1f} GiB",
        "tokens per optimizer step": f"{t.batch_size * t.seq_len * t.grad_accum:,}",
        "data": config.data.name + (f" ({config.data.path})" if config.data.path else ""),
        "tricks": ", ".join(sorted(config.trick)) or "none",
    }
    for key, value in rows.items():
        table.add_row(key, value)
    Console().print(table)
