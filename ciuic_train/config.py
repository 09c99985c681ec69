"""Typed configuration: the schema every composed config is checked against.

The dataclasses are registered in Hydra's ConfigStore as the base of `conf/config.yaml`,
so a misspelt key, a wrong type or an unknown enum value fails at composition time,
before any work starts. `to_config` converts a composed DictConfig into these objects and
re-checks it against the schema, because Hydra lets `+key=value` add keys a schema lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from ciuic_train.data.checks import validate_data
from ciuic_train.errors import UserError
from ciuic_train.ft.config import FtConfig, check_ft
from ciuic_train.model.config import ModelConfig
from ciuic_train.train.trackers import check_loggers
from ciuic_train.tricks import check_tricks, seam_owner


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Precision(Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Strategy(Enum):
    """A shorthand for the device mesh (ciuic_train/distributed/mesh.py); `auto` takes dist.dp_* as given.

    ddp: replicas only; fsdp: shards only; hsdp: shards within a node, replicas across.
    """

    auto = "auto"
    none = "none"
    ddp = "ddp"
    fsdp = "fsdp"
    hsdp = "hsdp"


class Backend(Enum):
    """Collective backend; `auto` is nccl on CUDA, gloo on CPU."""

    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


# torch.distributed.pipelining's schedules (ciuic_train/distributed/pipeline.py): gpipe and
# 1f1b run one stage per rank; interleaved_1f1b several (dist.pp_stages_per_rank), in a
# loop; zbv and dualpipev two per rank in a V, the first and last stages on rank 0. Built
# by the functional API because a member's name is what a config spells, and "1f1b" is no
# identifier.
PipelineSchedule = Enum(
    "PipelineSchedule", [(name, name) for name in ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")]
)


class Schedule(Enum):
    """The learning rate after warmup: `cosine` decays from the peak to optim.min_lr_ratio
    over the rest of the run; `wsd` (warmup-stable-decay) stays at the peak and decays
    over the last optim.decay_fraction of the steps; `step` multiplies it by
    optim.step_factor at each of optim.step_fractions of the run (DeepSeek-V2's schedule);
    `constant` stays at the peak."""

    cosine = "cosine"
    wsd = "wsd"
    step = "step"
    constant = "constant"


class DecayShape(Enum):
    """How `wsd` decays: from 1 to 0 in progress p, `cosine` (1 + cos(pi p)) / 2,
    `linear` 1 - p, `sqrt` 1 - sqrt(p) (fast first, as MiniCPM's WSD runs found best)."""

    cosine = "cosine"
    linear = "linear"
    sqrt = "sqrt"


class OnNonFinite(Enum):
    """What a step with a non-finite loss or gradient norm does (its update is never applied).

    stop: end the run, naming the step and the last good checkpoint; skip: drop the step
    and go on, stopping after `train.max_skipped_steps` such steps in a row.
    """

    stop = "stop"
    skip = "skip"


class GradCompression(Enum):
    """DDP's gradient all-reduce on the wire (ciuic_train/distributed/compression.py):
    `none` fp32, `bf16` half the bytes, `powersgd` low-rank matrices with error feedback."""

    none = "none"
    bf16 = "bf16"
    powersgd = "powersgd"


class Progress(Enum):
    """How training progress is shown: `auto` is a rich bar on a terminal, plain lines otherwise."""

    auto = "auto"
    rich = "rich"
    plain = "plain"


@dataclass
class DataConfig:
    # stdlib: the running interpreter's standard library sources (no download);
    # text: a file, folder or glob of text files; tokens: uint16 or uint32 .bin memmap(s).
    name: str = "stdlib"
    path: str = ""
    # false: each epoch visits the windows in corpus order (ranks still take strided shares).
    shuffle: bool = True
    # Fraction of files (or, with a single file, of tokens) held out for validation.
    val_fraction: float = 0.05
    # Where tokenized corpora are cached; empty means $XDG_CACHE_HOME/ciuic-train.
    cache_dir: str = ""
    # bytes: one token per byte (vocab 256); bpe: a byte-level BPE of data.vocab_size tokens
    # trained on the training split and cached with its tokens; or a path to a tokenizer.json.
    # model.vocab_size follows it unless given (needs the `tokenizers` extra).
    tokenizer: str = "bytes"
    vocab_size: int = 0
    # data=tokens: the .bin files' type, uint16 or uint32; empty: as tokens.json beside them
    # records, else uint16.
    dtype: str = ""
    # Tokenizing: worker processes (0: one per CPU) and the MiB of text each takes at a time.
    workers: int = 0
    chunk_mb: float = 32.0
    # Each document (a file of a text corpus) ends with the tokenizer's end-of-text id: bytes
    # reserve id 256 (model.vocab_size follows: 257), a BPE trains <|endoftext|> as id 0, a
    # tokenizer.json has its own. false: documents end with a blank line, as before.
    eos: bool = False
    # Attention stays inside each document, as the corpus's document index says (text
    # corpora get one when tokenized; data=tokens: an .idx beside each .bin). false: attention
    # runs across the documents a window holds, as before.
    doc_mask: bool = False
    # With doc_mask: the positions RoPE rotates by restart at 0 at each document start.
    doc_positions: bool = False
    # data=hf (the `hf` extra), each row's text_field a document: dataset is a builder
    # (parquet, json, csv, text, arrow) reading data_files (a path or glob, a list, or a
    # mapping from split to files), a local dataset folder, or a hub id (subset: its config).
    dataset: str = ""
    subset: str = ""
    data_files: Any = None
    split: str = "train"
    # The validation split; empty: the rows whose text hashes below val_fraction.
    val_split: str = ""
    text_field: str = "text"
    # Each rank tokenizes its share of the rows as it trains (nothing cached); the position
    # in the stream is saved in checkpoints. With shuffle, windows are drawn at random
    # from a pool of shuffle_windows.
    streaming: bool = False
    shuffle_windows: int = 256


@dataclass
class OptimConfig:
    # adamw, or sgd (with `momentum`: an update linear in the gradient, as DiLoCo's test needs).
    name: str = "adamw"
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # Applied to matrices only; norms, biases and embeddings are never decayed.
    weight_decay: float = 0.1
    # The learning rate after train.warmup_steps (see `Schedule`), ending at min_lr_ratio x train.lr.
    schedule: Schedule = Schedule.cosine
    min_lr_ratio: float = 0.1
    # wsd: the fraction of train.max_steps at the end that decays, and how.
    decay_fraction: float = 0.2
    decay_shape: DecayShape = DecayShape.cosine
    # step: at each of these fractions of train.max_steps the lr is multiplied by step_factor.
    step_fractions: List[float] = field(default_factory=lambda: [0.8, 0.9])
    step_factor: float = 0.316


OPTIMIZERS = ("adamw", "sgd")


@dataclass
class TrainConfig:
    max_steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 2e-3
    warmup_steps: int = 30
    eval_every: int = 50
    # The validation set: this many windows, evenly spread over the validation split and
    # the same for every layout, batch size and resume (ranks split them, and evaluate in
    # batches of train.batch_size), so val_loss compares across layouts as the loss does.
    eval_windows: int = 64
    log_every: int = 10
    # Max global grad norm; 0 disables clipping.
    grad_clip: float = 1.0
    # With model.n_mtp_layers > 0: the weight of the mean multi-token-prediction loss in the
    # training loss (DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1). The logged `loss`
    # stays the next-token loss; `mtp_loss` is logged beside it.
    mtp_loss_weight: float = 0.3
    # On logging steps, log `grad_consistency`: the mean over ranks of the cosine between a
    # rank's own gradient and the all-reduced one (1 = every rank agrees). DDP only; its
    # all-reduce is then done by hand, in one collective, on those steps.
    log_grad_consistency: bool = False
    # A step whose loss or gradient norm is NaN or infinite on any rank is never applied
    # (no optimizer step, no checkpoint of its weights); then stop (default) or skip it.
    on_nonfinite: OnNonFinite = OnNonFinite.stop
    # With on_nonfinite=skip: stop once this many steps in a row were skipped.
    max_skipped_steps: int = 5
    # A step loss above spike_factor x the median of the last spike_window steps is logged
    # as a warning and counted (`loss_spikes`), not acted on; 0 turns this off.
    spike_factor: float = 2.0
    spike_window: int = 100
    # Before anything is built, refuse a run whose weights, gradients and AdamW state (as
    # --plan computes them) exceed what a rank here can use, and warn when the estimated
    # total does (ciuic_train/tools/memory_check.py); false skips the check.
    check_memory: bool = True
    # Warn when a rank's own time in a step (up to the step's agreement) exceeds this
    # factor x the other ranks' median on straggler_windows logging steps in a row
    # (ciuic_train/train/stragglers.py); 0 turns the warning off.
    straggler_factor: float = 1.5
    straggler_windows: int = 3


@dataclass
class DistConfig:
    strategy: Strategy = Strategy.auto
    backend: Backend = Backend.auto
    # The device mesh (ciuic_train/distributed/mesh.py); -1 takes what the world size leaves. The
    # defaults are DDP over every rank; dp_shard>1 shards with FSDP2 (HSDP when
    # dp_replicate>1 too); ep>1 splits the routed experts over that many shard ranks.
    dp_replicate: int = -1
    dp_shard: int = 1
    ep: int = 1
    # Under ep>1, each token exchange runs in the background while the shared experts
    # compute (their gradients too, in backward); false: the exchanges block. Bit-identical.
    ep_overlap: bool = True
    # DDP's gradient buckets (MiB): each is all-reduced as soon as its gradients are ready,
    # so smaller ones hide more of the all-reduce behind backward on a slow link
    # (docs/bench/README.md, "DDP across two emulated hosts"). 0: sized from the model,
    # an eighth of its gradients' bytes within 1 to 25 MiB (torch's default, where one
    # bucket can hold almost a small model's gradients and fill only as backward ends).
    ddp_bucket_mb: float = 0.0
    # DDP's all-reduce compressed by torch's hooks (`GradCompression`); powersgd: the rank of
    # each matrix's approximation, and the plain steps before it starts (at least 2).
    grad_compression: GradCompression = GradCompression.none
    powersgd_rank: int = 1
    powersgd_start_step: int = 10
    # FSDP: each block starts the all-gathers of the next fsdp_prefetch blocks (the previous
    # ones in backward) once its own are in, so they run during its computation (0: FSDP's
    # own, one block ahead when it starts); fsdp_keep_last_gathered: the last block keeps
    # its parameters from forward to backward. Not in a pipeline (dist.pp>1).
    fsdp_prefetch: int = 1
    fsdp_keep_last_gathered: bool = True
    # Pipeline parallelism (ciuic_train/distributed/pipeline.py): the layers split over `pp`
    # ranks, outermost in the mesh. Each `train.batch_size` batch runs through the schedule
    # as `pp_microbatches` micro-batches (0: one per stage); `pp_layers` lists the layers of
    # each stage (empty: split so the stages' FLOPs balance, the head's and MTP's counted).
    pp: int = 1
    pp_schedule: PipelineSchedule = PipelineSchedule["1f1b"]
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 1
    pp_layers: List[int] = field(default_factory=list)
    # >1: `ciuic-train` starts this many workers itself through torch's elastic launcher
    # (as torchrun would); under torchrun it is ignored and the environment decides.
    nproc_per_node: int = 1
    # Nodes the job spans, for --plan's per-rank figures; torchrun and Slurm decide the
    # real world size.
    nnodes: int = 1
    # Worker-group restarts the CLI's launcher allows (torchrun: --max-restarts).
    max_restarts: int = 0
    # Seconds a collective may wait: a dead rank makes the others fail instead of hang.
    timeout_s: int = 300
    # Ranks other than 0 print warnings only; true also gives each a rank<N>.log file.
    rank_logs: bool = False


@dataclass
class CheckpointConfig:
    # Save every N optimizer steps (the default policy, which quantum_save replaces); 0: only
    # the final save and the save on SIGTERM/SIGINT.
    every: int = 100
    keep_last: int = 3
    # Resume a checkpoint written with a different set of tricks.
    allow_trick_change: bool = False
    # Stage each save into CPU memory and write it in the background while training goes on
    # (at most one in flight; the next save, the run's end and a stop signal wait for it).
    async_save: bool = False


@dataclass
class FaultConfig:
    """Fault injection for testing recovery: on the first attempt only, rank `kill_rank`
    SIGKILLs itself right after optimizer step `at_step`; rank `nan_rank`'s loss is NaN
    in optimizer step `nan_at_step` (every attempt), as a diverging rank's would be (on a
    pipeline rank without the loss, its stage's output);
    rank `oom_rank` caps its address space at what it maps before step `oom_at_step`
    (every attempt), so that step's first allocation needing more fails in the allocator."""

    kill_rank: int = -1
    at_step: int = 0
    nan_rank: int = -1
    nan_at_step: int = 0
    oom_rank: int = -1
    oom_at_step: int = 0
    # Rank `slow_rank` sleeps `slow_s` seconds in every step before the step's agreement,
    # as a slower machine would take longer (rehearses the straggler warning).
    slow_rank: int = -1
    slow_s: float = 0.0


@dataclass
class ProfileConfig:
    """torch.profiler over a few training steps (ciuic_train/train/profiler.py): per cycle,
    `wait` steps untraced, `warmup` traced and dropped, `active` recorded; `repeat` cycles
    (0: until the run ends). One trace per rank and cycle in RUN/profile/."""

    enabled: bool = False
    wait: int = 5
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    # Record tensor shapes with each operator (grouped by them in the top-operator table).
    record_shapes: bool = True
    # Allocations in the trace; on CUDA also a memory snapshot (RUN/profile/memory_rank<R>.pickle).
    memory: bool = False
    # Rows of the top-operator table rank 0 logs at the end (by self time).
    top: int = 15


@dataclass
class SampleConfig:
    """The text generated after training, so a user sees what the model learnt."""

    prompt: str = "def "
    # 0 skips the sample.
    max_new_tokens: int = 200
    temperature: float = 0.8
    # 0 samples from the whole distribution.
    top_k: int = 0


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    # One entry per selected trick (`+trick=name`), keyed by the trick's name.
    trick: Dict[str, Any] = field(default_factory=dict)
    # One entry per selected experiment tracker (`+logger=name`): ciuic_train/train/trackers.py.
    logger: Dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    # Fault tolerance across replica groups (torchft): ciuic_train/ft/config.py.
    ft: FtConfig = field(default_factory=FtConfig)
    # none: start fresh; auto: the latest complete checkpoint in the run folder, if any;
    # or a path to a checkpoint (step_<N>) or to a run folder.
    resume: str = "auto"
    # A Hugging Face DeepSeek-V3/V2 folder (config.json and safetensors, sharded or not) whose
    # weights a fresh run starts from, with a fresh optimizer. Its config.json sets the model
    # fields it holds, over the preset's and under the command line's own model.FIELD=...;
    # names and shapes are checked before anything runs. Not read again when a run resumes.
    init_from: str = ""
    seed: int = 0
    device: Device = Device.auto
    precision: Precision = Precision.fp32
    # fp32 matmuls on CUDA take TensorFloat-32 tensor cores (Ampere and later; inputs
    # rounded to 10 mantissa bits, fp32 accumulation), several times IEEE fp32's rate.
    # false: IEEE fp32. No effect on CPU, nor on bf16 autocast's matmuls.
    tf32: bool = True
    progress: Progress = Progress.auto
    # torch.compile each transformer block (inductor; needs a C++ compiler on CPU).
    compile: bool = False
    # Recompute each block's activations in backward instead of storing them.
    activation_checkpointing: bool = False


def register_configs() -> None:
    ConfigStore.instance().store(name="ciuic_train_schema", node=Config)


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
    if config.dist.nproc_per_node < 1:
        raise UserError(f"dist.nproc_per_node={config.dist.nproc_per_node} must be at least 1")
    if config.dist.ddp_bucket_mb < 0:
        raise UserError(f"dist.ddp_bucket_mb={config.dist.ddp_bucket_mb} must be positive, or 0 to size the "
                        "buckets from the model")
    if config.dist.powersgd_rank < 1 or config.dist.powersgd_start_step < 2:
        raise UserError(f"dist.powersgd_rank={config.dist.powersgd_rank} must be at least 1 and "
                        f"dist.powersgd_start_step={config.dist.powersgd_start_step} at least 2")
    if config.dist.fsdp_prefetch < 0:
        raise UserError(f"dist.fsdp_prefetch={config.dist.fsdp_prefetch} must be 0 (FSDP's own order) or more")
    if config.dist.nnodes < 1:
        raise UserError(f"dist.nnodes={config.dist.nnodes} must be at least 1")
    if config.dist.timeout_s < 1:
        raise UserError(f"dist.timeout_s={config.dist.timeout_s} must be at least 1")
    check_ft(config.ft, config.train.log_grad_consistency, config.model.n_layers)
    check_tricks(config.trick)
    check_loggers(config.logger)
    from ciuic_train.distributed.pipeline_split import check_pipeline  # the package needs this module first

    check_pipeline(config)
    if config.sample.temperature <= 0:
        raise UserError(f"sample.temperature={config.sample.temperature} must be positive")
