"""A composed config made typed and checked: `to_config`, and `validate`, the rules that
cross fields or sections, each section's in one place.

This module sits above every package whose rules it calls (the data's, the trackers',
the tricks', `dist.*`'s, `ft.*`'s), so that the schema below them (`config.py`) imports
none of them.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ciuic_train.config import OPTIMIZERS, Config, ProfileConfig
from ciuic_train.data.checks import validate_data
from ciuic_train.distributed.checks import check_dist
from ciuic_train.errors import UserError
from ciuic_train.ft.config import check_ft
from ciuic_train.train.trackers import check_loggers
from ciuic_train.tricks import check_tricks, seam_owner


def to_config(cfg: DictConfig) -> Config:
    """Turn a composed config into typed objects, refusing keys the schema does not know."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    try:
        checked = OmegaConf.merge(OmegaConf.structured(Config), plain)
        config = OmegaConf.to_object(checked)
    except ValueError as err:  # raised by a dataclass __post_init__ check
        raise UserError(str(err)) from None
    validate(config)
    return config


def _validate_profile(profile: ProfileConfig, max_steps: int) -> None:
    for key in ("wait", "warmup", "repeat", "top"):
        if getattr(profile, key) < 0:
            raise UserError(f"profile.{key}={getattr(profile, key)} must be 0 or more")
    if profile.active < 1:
        raise UserError(f"profile.active={profile.active} must be at least 1")
    cycle = profile.wait + profile.warmup + profile.active
    if profile.enabled and cycle > max_steps:
        raise UserError(
            f"profile.wait+warmup+active={cycle} steps exceed train.max_steps={max_steps}: no trace would be "
            "written; lower profile.wait or profile.active"
        )


def validate(config: Config) -> None:
    """Cross-field checks that a schema cannot express."""
    train = config.train
    for key in ("max_steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_windows", "log_every"):
        if getattr(train, key) < 1:
            raise UserError(f"train.{key}={getattr(train, key)} must be at least 1")
    if train.warmup_steps < 0:
        raise UserError(f"train.warmup_steps={train.warmup_steps} must be 0 or more")
    if train.lr <= 0:
        raise UserError(f"train.lr={train.lr} must be positive")
    if train.max_skipped_steps < 1:
        raise UserError(f"train.max_skipped_steps={train.max_skipped_steps} must be at least 1")
    if train.spike_factor != 0 and train.spike_factor <= 1:
        raise UserError(f"train.spike_factor={train.spike_factor} must be above 1, or 0 (off)")
    if train.straggler_factor != 0 and train.straggler_factor <= 1:
        raise UserError(f"train.straggler_factor={train.straggler_factor} must be above 1, or 0 (off)")
    if train.straggler_windows < 1:
        raise UserError(f"train.straggler_windows={train.straggler_windows} must be at least 1")
    if train.spike_window < 1:
        raise UserError(f"train.spike_window={train.spike_window} must be at least 1")
    if train.grad_clip < 0:
        raise UserError(f"train.grad_clip={train.grad_clip} must be 0 (off) or positive")
    if train.mtp_loss_weight < 0 or (config.model.n_mtp_layers and train.mtp_loss_weight == 0):
        raise UserError(
            f"train.mtp_loss_weight={train.mtp_loss_weight} must be positive with "
            f"model.n_mtp_layers={config.model.n_mtp_layers} (turn MTP off with model.n_mtp_layers=0)"
        )
    if train.seq_len <= config.model.n_mtp_layers:
        raise UserError(f"train.seq_len={train.seq_len} must exceed model.n_mtp_layers={config.model.n_mtp_layers} "
                        "(MTP depth k predicts k + 1 tokens ahead)")
    if train.seq_len > config.model.max_seq_len:
        raise UserError(f"train.seq_len={train.seq_len} exceeds model.max_seq_len={config.model.max_seq_len}")
    _validate_profile(config.profile, train.max_steps)
    validate_data(config.data, config.dist.pp, seam_owner(config.trick, "order_indices"))
    if config.optim.name not in OPTIMIZERS:
        raise UserError(f"optim.name={config.optim.name!r} is not an optimizer; choose one of {', '.join(OPTIMIZERS)}")
    if not 0.0 <= config.optim.momentum < 1.0:
        raise UserError(f"optim.momentum={config.optim.momentum} must be at least 0 and below 1")
    if not 0.0 <= config.optim.min_lr_ratio <= 1.0:
        raise UserError(f"optim.min_lr_ratio={config.optim.min_lr_ratio} must be between 0 and 1")
    fractions = config.optim.step_fractions
    if any(not 0.0 < f < 1.0 for f in fractions) or fractions != sorted(set(fractions)):
        raise UserError(f"optim.step_fractions={fractions} must rise strictly, each between 0 and 1")
    if not 0.0 < config.optim.step_factor <= 1.0:
        raise UserError(f"optim.step_factor={config.optim.step_factor} must be above 0 and at most 1")
    if not 0.0 < config.optim.decay_fraction <= 1.0:
        raise UserError(f"optim.decay_fraction={config.optim.decay_fraction} must be above 0 and at most 1")
    if not config.sample.prompt:
        raise UserError("sample.prompt must not be empty")
    if config.sample.max_new_tokens < 0:
        raise UserError(f"sample.max_new_tokens={config.sample.max_new_tokens} must be 0 (no sample) or more")
    if config.ckpt.every < 0:
        raise UserError(f"ckpt.every={config.ckpt.every} must be 0 (final save only) or positive")
    if config.ckpt.keep_last < 1:
        raise UserError(f"ckpt.keep_last={config.ckpt.keep_last} must be at least 1")
    check_dist(config)
    check_ft(config.ft, config.train.log_grad_consistency, config.model.n_layers)
    if config.fault.slow_alone and not config.ft.enabled:
        raise UserError("fault.slow_alone=true slows a replica group while the others are gone: "
                        "it needs ft.enabled=true (without it the one group is never alone)")
    check_tricks(config.trick)
    check_loggers(config.logger)
    if config.sample.temperature <= 0:
        raise UserError(f"sample.temperature={config.sample.temperature} must be positive")
