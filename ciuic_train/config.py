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
from omegaconf import MISSING

from ciuic_train.faults import FaultConfig
from ciuic_train.ft.config import FtConfig
from ciuic_train.model.config import ModelConfig


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
    # tokenizer.json has its own. false: documents end with a blank line.
    eos: bool = False
    # Attention stays inside each document, as the corpus's document index says (text
    # corpora get one when tokenized; data=tokens: an .idx beside each .bin). false: attention
    # runs across the documents a window holds.
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
    # total does (ciuic_train/plan/memory_check.py); false skips the check.
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
    # Save after the last step. false: a run that needs no final checkpoint (a benchmark, a
    # smoke test of a big model) skips its write; saves every N steps and on a stop signal
    # still happen.
    at_end: bool = True
    keep_last: int = 3
    # Resume a checkpoint written with a different set of tricks.
    allow_trick_change: bool = False
    # Stage each save into CPU memory and write it in the background while training goes on
    # (at most one in flight; the next save, the run's end and a stop signal wait for it).
    async_save: bool = False


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
