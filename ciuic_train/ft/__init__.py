"""Fault tolerance across replica groups (torchft): the `ft.*` schema (config.py, no
torch) and each rank's place among the groups around a training step (replicas.py).
The CLI's launcher starts the lighthouse and the groups: ciuic_train/launch/replica_groups.py."""
