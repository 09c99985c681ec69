"""The device mesh, the process group and its collectives, and the parallelisms applied to a model."""
