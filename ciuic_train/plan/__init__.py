"""The planner: what a run would hold and do, on the meta device or fake tensors, before
anything is allocated (`--plan`, `--simulate`, the memory check before a run starts and
the one-line out-of-memory error during it). Below the trainer: the trainer may ask it,
it never asks the trainer."""
