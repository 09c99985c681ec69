"""The trainer and its loop, the optimizer and schedule, metrics and experiment trackers."""
