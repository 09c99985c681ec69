"""DeepSeek-style transformer: config, model, parameter counting and sampling."""

from ciuic_train.model.config import ModelConfig

__all__ = ["ModelConfig", "Transformer", "count_mtp_parameters", "count_parameters", "generate"]
_IN_DEEPSEEK = {"Transformer", "count_mtp_parameters", "count_parameters", "generate"}


def __getattr__(name: str):
    """The model imports torch; the config schema must not (a CLI that only checks or
    prints answers fast, and a Slurm task sets its thread count before torch loads)."""
    if name in _IN_DEEPSEEK:
        from ciuic_train.model import deepseek

        return getattr(deepseek, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
