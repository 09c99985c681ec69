"""How the processes of a run come to exist: launch paths, Slurm tasks, the run-folder lock."""
