"""ciuic-train's launchers, where Hydra's plugin scan finds them (`hydra/launcher=slurm|local`).

They build on hydra-submitit-launcher, the `slurm` extra; without it there is nothing
to register, and Hydra's scan must not warn on every run.
"""

try:
    from hydra_plugins.ciuic_train_launcher._launchers import LocalLauncher, SlurmLauncher
except ImportError:
    pass
else:
    __all__ = ["LocalLauncher", "SlurmLauncher"]
