"""One training step, as the trainer runs it and as `--simulate` measures it: the layout's
passes (forward and backward of a micro-batch), the optimizer and its learning-rate
schedule. Below the planner, so the simulator runs the trainer's own step."""
