"""What a replica group that heals receives from a peer: each rank's state, local to it.

Tensors travel as this rank's part (a DTensor's local shard, as a plain tensor): the peer
that sends has the same layout, so each rank copies its part into its own.
"""

from __future__ import annotations

from typing import Any

import torch


def load_local_state(model, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """A peer's `local_state` of the model and optimizer, into this rank's (the same layout)."""
    for name, tensor in model.state_dict().items():
        local_tensor(tensor).copy_(model_state[name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in optimizer_state["state"].items():
        param = params[int(index)]
        state[index] = {key: _like(param, value) for key, value in values.items()}
    optimizer.load_state_dict({**optimizer_state, "state": state})


def _like(param: torch.Tensor, value: Any) -> Any:
    """An optimizer state's local `value` as `param` holds it: a DTensor for a DTensor's
    moments (the same shards), anything else (the step count) as it came."""
    if hasattr(param, "to_local") and isinstance(value, torch.Tensor) and value.shape == param.to_local().shape:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor` (a DTensor's local shard), as a plain tensor sharing its memory."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_state(tree: Any) -> Any:
    """`tree` with every DTensor replaced by its local shard (what a peer sends).

    A CPU tensor is copied: torchft serves it by reference while the peer downloads, and
    this rank may train on meanwhile (DiLoCo overlaps an exchange with steps); a GPU's it
    copies to the host itself."""
    if isinstance(tree, dict):
        return {key: local_state(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_state(value) for value in tree)
    if not isinstance(tree, torch.Tensor):
        return tree
    local = local_tensor(tree).detach()
    return local.clone() if local.device.type == "cpu" else local
