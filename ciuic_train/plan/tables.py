"""`--plan`'s output: the model, the memory of one rank and the bytes it sends, as three tables,
and for a CPU run whether it fits this machine (the check a run would make, `memory_check`);
with `--simulate`, the memory rank 0 held in a simulated step beside them (`simulate.py`).

The figures are `plan.plan_figures`'s; this module only lays them out (with rich).
"""

from __future__ import annotations

from typing import Any

from ciuic_train.config import Config
from ciuic_train.step.batch import tokens_per_step
from ciuic_train.files import format_bytes
from ciuic_train.plan.memory_check import check_memory, run_device
from ciuic_train.memory_limits import usable_bytes_per_rank
from ciuic_train.plan.figures import plan_figures, resolve_plan_mesh
from ciuic_train.plan.memory import GPUS, build_meta_model


def print_plan(config: Config, simulate: bool = False) -> None:
    """Build the model on the meta device (no memory) and print its size, the run's shape,
    and the per-rank memory and communication for the mesh; with `simulate`, then run rank
    0's step on fake tensors and print what it measured beside the plan's figures."""
    from rich.console import Console
    from rich.table import Table

    from ciuic_train.model import count_mtp_parameters, count_parameters

    mesh = resolve_plan_mesh(config)  # a bad mesh is a one-line error before torch loads
    if simulate:
        from ciuic_train.plan.simulate import (
            simulable_mesh, simulate as simulate_rank, simulated_rank_figures, simulation_table,
        )

        simulable_mesh(config)  # refused before anything prints
    model = build_meta_model(config)
    total, active = count_parameters(model)
    mtp_total, mtp_active = count_mtp_parameters(model)
    m, t = config.model, config.train
    table = Table(title=f"plan: model={m.name}", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    rows = {
        "parameters (total)": f"{total:,} ({total / 1e9:.2f} B)",
        "parameters (active per token)": f"{active:,} ({active / 1e9:.2f} B)",
        **({
            f"MTP ({m.n_mtp_layers} depth{'s' * (m.n_mtp_layers > 1)})": (
                f"+ {mtp_total:,} ({mtp_total / 1e9:.2f} B, {mtp_active / 1e9:.2f} B active); shares the "
                f"embedding and head, which DeepSeek's released MTP weights copy "
                f"({(mtp_total + 2 * m.vocab_size * m.dim) / 1e9:.2f} B with them)"
            )
        } if mtp_total else {}),
        "layers (dense + MoE)": f"{m.n_layers} ({m.n_dense_layers} + {m.n_layers - m.n_dense_layers})",
        "experts per MoE layer": f"{m.n_routed_experts} routed (top-{m.n_activated_experts}) + {m.n_shared_experts} shared",
        "attention": f"MLA, {m.n_heads} heads, kv_lora_rank {m.kv_lora_rank}, q_lora_rank {m.q_lora_rank or 'none'}",
        "fp32 weights + AdamW state": f"{(total + mtp_total) * 16 / 2**30:,.1f} GiB",
        "tokens per optimizer step": f"{tokens_per_step(t, mesh.data_parallel_size):,}",
        "data": config.data.name + (f" ({config.data.path})" if config.data.path else ""),
        "tricks": ", ".join(sorted(config.trick)) or "none",
    }
    for key, value in rows.items():
        table.add_row(key, value)
    console = Console(markup=False)  # a data.path is shown as it is: "[/x]" is no markup
    console.print(table)
    figures = plan_figures(config, model)
    console.print(_memory_table(config, figures))
    if "pipeline" in figures:
        console.print(_pipeline_table(config, figures))
    console.print(_comm_table(figures))
    if simulate:
        console.print(simulation_table(config, simulated_rank_figures(figures), simulate_rank(config)))
    if run_device(config) == "cpu":  # a GPU layout is for the GPUs' columns above, not this machine
        room = usable_bytes_per_rank("cpu", config.dist.nproc_per_node)
        if room is not None:
            console.print(f"this machine: {check_memory(config, room, model).line}", highlight=False)


def _memory_table(config: Config, f: dict[str, Any]) -> Any:
    from rich.table import Table

    mem, mesh, w = f["memory"], f["mesh"], f["widths"]
    gathered = {2: "bf16", 4: "fp32"}[w["gather"]]
    pipeline = (f"pp={mesh['pp']} x " if "pipeline" in f else "")
    busiest = (f"; pipeline rank {f['pipeline']['busiest']}, the one that needs the most" if "pipeline" in f else "")
    table = Table(
        title=f"per rank: {f['world_size']} ranks ({config.dist.nnodes} x {config.dist.nproc_per_node}), "
        f"{pipeline}{mesh['strategy']} dp_replicate={mesh['dp_replicate']} x dp_shard={mesh['dp_shard']}, "
        f"ep={mesh['ep']}, efsdp={mesh['efsdp']}{busiest}",
    )
    table.add_column("memory", style="bold")
    table.add_column("per rank", justify="right")
    table.add_column("how")

    def split(d: dict[str, int]) -> str:
        return f"experts {format_bytes(d['experts'])} + other {format_bytes(d['other'])}"

    table.add_row("parameters", format_bytes(sum(mem["params"].values())), f"fp32; {split(mem['params'])} (exact)")
    table.add_row("gradients", format_bytes(sum(mem["grads"].values())),
                  "fp32, as the parameters; under DDP views of its buckets, held all step (exact)"
                  if mem["grads_held"] else "fp32, as the parameters (exact)")
    table.add_row("AdamW state", format_bytes(sum(mem["optimizer"].values())), "2 x fp32 per parameter, a step count per tensor (exact)")
    if mem["accumulated_grads"]:
        table.add_row("accumulated grads", format_bytes(mem["accumulated_grads"]),
                      "grad_accum > 1: FSDP2 keeps unsharded fp32 gradients between micro-batches")
    if mesh["strategy"] in ("fsdp", "hsdp"):
        table.add_row("largest block all-gather", format_bytes(mem["largest_block_all_gather"]), f"{gathered} (exact)")
        table.add_row("root all-gather", format_bytes(mem["root_all_gather"]), f"{gathered}, held all step (exact)")
        table.add_row("FSDP buffers", format_bytes(mem["fsdp_buffers"]),
                      "root + 2 x largest block + one unit's gradients (estimate)")
    acts = mem["activations"]
    tokens = f"{config.train.batch_size} x {config.train.seq_len} tokens"
    for key, label in (("no_ac", "without AC"), ("ac", "with AC")):
        configured = ", as configured" if (key == "ac") == f["activation_checkpointing"] else ""
        table.add_row(f"activations {label}", format_bytes(acts[key]), f"{tokens}, estimate{configured}")
    for key, label in (("no_ac", "without AC"), ("ac", "with AC")):
        verdicts = ", ".join(
            f"{gpu} ({cap:g} GiB): {'fits' if f['fits'][gpu][key] else 'does not fit'}" for gpu, cap in GPUS.items()
        )
        table.add_row(f"total {label}", format_bytes(mem["total"][key]), f"the larger of backward's start and end; {verdicts}")
    return table


def _pipeline_table(config: Config, f: dict[str, Any]) -> Any:
    """One row per pipeline rank (every data share of a stage holds the same)."""
    from rich.table import Table

    p, key = f["pipeline"], "ac" if config.activation_checkpointing else "no_ac"
    table = Table(title=f"per pipeline rank: {p['schedule']}, {p['stages']} stages of {p['layers_per_stage']} layers, "
                        f"{p['microbatches']} micro-batches of {p['micro_batch_size']}; bubble {p['bubble']:.1%} "
                        "(F = I = W, B = 2; the schedule's own order)")
    for column in ("pp rank", "stages", "state", "activations", "total", "80 GB", "P2P sent"):
        table.add_column(column, justify="right")
    for rank in p["ranks"]:
        memory = rank["memory"]
        table.add_row(
            str(rank["rank"]), ", ".join(f"{s} ({n} layers)" for s, n in zip(rank["stages"], rank["layers"])),
            format_bytes(memory["state"]),
            f"{format_bytes(memory['activations'][key])} ({rank['in_flight']} in flight)",
            format_bytes(memory["total"][key]), "fits" if rank["fits"]["80 GB"][key] else "does not fit",
            format_bytes(rank["p2p_bytes"]),
        )
    return table


def _comm_table(f: dict[str, Any]) -> Any:
    from rich.table import Table

    comm = f["comm"]
    title = "communication per optimizer step: bytes each rank sends"
    if "pipeline" in f:
        title += (f" (pipeline rank {f['pipeline']['busiest']}; within its stage, each FSDP gather counted once a "
                  "step, as the multi-stage schedules unshard; gpipe and 1f1b may gather again per micro-batch)")
    table = Table(title=title)
    table.add_column("collective", style="bold")
    table.add_column("per rank", justify="right")
    table.add_column("what")
    ar = comm["all_reduce"]
    parts = [
        f"{name} {format_bytes(ar[key])}"
        for key, name in (("ddp_grads", "DDP grads"), ("hsdp_replicas", "HSDP replicas"), ("moe_load", "MoE load"))
        if ar[key]
    ]
    table.add_row("all-gather", format_bytes(comm["all_gather"]), "FSDP: blocks forward + backward, root and a kept last block once (exact)")
    table.add_row("reduce-scatter", format_bytes(comm["reduce_scatter"]), "FSDP: fp32 gradients, once a step (exact)")
    table.add_row("all-reduce", format_bytes(ar["total"]), (", ".join(parts) or "none") + " (exact)")
    table.add_row("all-to-all", format_bytes(comm["all_to_all"]), "EP: token rows, uniform routing (estimate)")
    return table
