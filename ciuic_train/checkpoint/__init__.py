"""Checkpoints: DCP save and resume, Hugging Face names and folders, export."""
