"""DeepSeek-style transformer: config, model, parameter counting and sampling."""

from ciuic_train.model.config import ModelConfig
from ciuic_train.model.deepseek import Transformer, count_parameters, generate

__all__ = ["ModelConfig", "Transformer", "count_parameters", "generate"]
