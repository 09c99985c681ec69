"""DeepSeek-style transformer: config, model, parameter counting and sampling."""

from ciuic_train.model.config import ModelConfig

__all__ = ["ModelConfig", "Transformer", "count_mtp_parameters", "count_parameters", "generate"]


def __getattr__(name: str):
    """The model imports torch; the config schema must not (a CLI that only checks or
    prints answers fast, and a Slurm task sets its thread count before torch loads)."""
    if name == "Transformer":
        from ciuic_train.model.transformer import Transformer

        return Transformer
    if name in ("count_parameters", "count_mtp_parameters"):
        from ciuic_train.model import counting

        return getattr(counting, name)
    if name == "generate":
        from ciuic_train.model.sampling import generate

        return generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
