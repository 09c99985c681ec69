"""Pipeline parallelism: the layers split over `dist.pp` ranks, run by torch's schedules.

`Pipeline(model, parallel, config)` takes the `Transformer` built on meta and keeps, on
this rank, only what its stages run (`pipeline_split.stages_of_rank`): their layers under
their full names (`LayerStack.keep`), the embedding on the first stage, the final norm,
the head and the MTP depths on the last. Checkpoints therefore name every tensor as the
whole model does, whatever the split, and DCP resumes them on any other layout. The
model is then parallelized within each stage, materialized and initialized by name as
in every layout (`parallelize`, with the stage modules as FSDP2's roots).

Each stage may have several ranks (`world / pp`, the mesh's data dimensions): they split
the data, and FSDP2 shards (or, for replicas, replicates) the stage's parameters over
them, with expert parallelism inside as without a pipeline. torch's schedules drive
FSDP2's gradient sync: none until a stage's last micro-batch, then one reduction.

Each stage is a `StageModule` (a view over the rank's model) inside torch's
`PipelineStage`; the schedule (`dist.pp_schedule`) runs each `train.batch_size` batch as
`dist.pp_microbatches` micro-batches. What the whole model's forward does in one place is
spread here as follows:

- the loss (and MTP, on the stage with the head) is computed inside the last stage's
  forward (`Transformer.head_loss`), so every weight it uses is the stage's own; the
  schedule's loss function only scales it by the step's micro-batch weight and the
  number of micro-batches (the schedule's own gradient scaling is off: a shared
  embedding would be scaled twice);
- the balance losses of a stage without the loss reach the gradient through that
  stage's output (`CarryLoss`, DeepSeek's `AddAuxiliaryLoss`): the activation passes
  unchanged, and backward adds the loss's gradient, the failure torchtitan's issue 2061
  describes otherwise;
- an embedding that two ranks hold (the last stage's MTP depths or tied head, with the
  first stage elsewhere) has its gradient summed over both, so the copies stay equal;
- the global gradient norm sums every stage's squares; each stage's expert bias moves
  by its layers' counts summed over the stage's ranks, and the MoE imbalance is the
  worst over stages; the loss is the last stage's, the others report 0 (the step's
  agreement divides the sum by the number of data shares).

Evaluation runs through the schedule's forward-only path. A sample is generated from the
whole model gathered on rank 0 (`sampling_model`), where it fits. Under `precision=bf16`
each stage runs under autocast, as the whole model does.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ciuic_train.config import Config, Precision
from ciuic_train.distributed.checks import check_pipeline_mesh
from ciuic_train.distributed.pipeline_split import (
    ONE_STAGE_PER_RANK,
    V_SHAPED,
    balanced_split,
    n_microbatches,
    n_stages,
    stage_owners,
    stages_of_rank,
)
from ciuic_train.distributed.process_group import Parallel
from ciuic_train.model import Transformer
from ciuic_train.model.common import IGNORE_INDEX
from ciuic_train.distributed.grads import full_value, grad_norm_squares, local_value, scale_to_max_norm_
from ciuic_train.model.counting import pipeline_costs
from ciuic_train.model.transformer import balance_terms, side_loss_figures
from ciuic_train.faults import poison_loss

log = logging.getLogger("ciuic_train")


class CarryLoss(torch.autograd.Function):
    """`x` unchanged forward; backward passes x's gradient on and gives `loss` the gradient 1,
    so a loss computed mid-pipeline joins the backward that arrives from the next stage."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        ctx.loss_dtype = loss.dtype
        return x.clone()  # not a view: zero-bubble schedules detach stage outputs in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


class StageModule(nn.Module):
    """One pipeline stage over the rank's model: stage `index` of `count`, its `layers`.

    Registers the modules it runs, so that torch's stage sees exactly its parameters; the
    rank's model (not registered) holds them under their full names.
    """

    def __init__(self, model: Transformer, index: int, count: int, layers: list[int], mtp_loss_weight: float,
                 embedding_here: bool, autocast: Any):
        """`embedding_here`: this stage registers the embedding: the first stage, and the last
        where MTP or a tied head needs it. A stage's backward (the weight half, where it is
        split) reaches only the parameters its module holds: in a V, where both stages are
        on rank 0, each must hold the embedding for its own share of the gradient (a
        sharing FSDP2 cannot do: `check_pipeline_mesh`)."""
        super().__init__()
        self.index, self.is_first, self.is_last = index, index == 0, index == count - 1
        self.blocks = nn.ModuleList(model.layers[i] for i in layers)
        if embedding_here:
            self.tok_embeddings = model.tok_embeddings
        if self.is_last:
            self.norm, self.lm_head, self.mtp = model.norm, model.lm_head, model.mtp
        object.__setattr__(self, "model", model)
        self.mtp_loss_weight, self.autocast = mtp_loss_weight, autocast
        self.loss_scale = 1.0  # the current micro-batches' share of the step's loss
        # The fault injection's NaN (`fault.nan_rank`) on a stage without the loss: its output.
        self.poison: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
        self.figures: list[dict[str, torch.Tensor]] = []  # each training micro-batch's side losses

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`x`: the token ids [mb, T] on the first stage, else the previous stage's output
        [mb, T, dim]; `tokens` and `targets` [mb, T]: the micro-batch's, on every stage."""
        with self.autocast:
            return self._forward(x, tokens, targets)

    def _forward(self, x: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model = self.model
        seq = tokens.shape[1]
        cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
        if self.is_first:
            x = model.tok_embeddings(x)
        for block in self.blocks:
            x = block(x, cos, sin)
        training = model.training
        if self.is_last:
            reduction = "mean" if training else "sum"
            loss = model.head_loss(model.norm(x), tokens, targets, reduction, self.mtp_loss_weight, list(self.blocks))
            if training:
                blocks = [*self.blocks, *(depth.block for depth in model.mtp)]
                self.figures.append(side_loss_figures(blocks, model.mtp_loss if model.mtp else None))
            return loss
        if training:
            terms = balance_terms(list(self.blocks))
            self.figures.append(side_loss_figures(list(self.blocks), None))
            if terms:
                x = CarryLoss.apply(x, torch.stack(terms).sum() * self.loss_scale)
        return self.poison(x)


def split_layers(model: Transformer, config: Config) -> list[list[int]]:
    """The layer indices of each stage: `dist.pp_layers`, or a balanced split."""
    sizes = list(config.dist.pp_layers)
    if not sizes:
        costs, first, last = pipeline_costs(model, config.train.seq_len)
        sizes = balanced_split(costs, first, last, n_stages(config.dist))
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(len(sizes))]


def keep_stage_parts(model: Transformer, stage_ids: list[int], split: list[list[int]]) -> None:
    """Drop from `model` (on meta: nothing is allocated) what none of `stage_ids` runs: the
    layers of other stages; the embedding unless the first stage is here, or the last with
    MTP or a tied head; the final norm, the head and MTP unless the last stage is here."""
    holds_first, holds_last = 0 in stage_ids, len(split) - 1 in stage_ids
    model.layers.keep([i for s in stage_ids for i in split[s]])
    if not (holds_first or (holds_last and (model.mtp or model.config.tie_embeddings))):
        model.tok_embeddings = None
    if not holds_last:
        model.norm = model.lm_head = None
        model.mtp = nn.ModuleList()


def residual_dtype(config: Config, shape: Any) -> torch.dtype:
    """The residual stream's dtype, what stages send each other: fp32 (under autocast too),
    bf16 where FSDP2 gathers the embedding in bf16 (precision=bf16 with data parallelism
    in the stages; `shape` is the mesh's MeshShape)."""
    return torch.bfloat16 if config.precision is Precision.bf16 and shape.strategy != "none" else torch.float32


def schedule_class(name: str) -> type:
    """torch's schedule for `dist.pp_schedule=name`."""
    from torch.distributed.pipelining import schedules

    return {
        "gpipe": schedules.ScheduleGPipe,
        "1f1b": schedules.Schedule1F1B,
        "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
        "zbv": schedules.ScheduleZBVZeroBubble,
        "dualpipev": schedules.ScheduleDualPipeV,
    }[name]


def stage_modules(model: Transformer, stage_ids: list[int], split: list[list[int]], config: Config,
                  autocast: Any = None) -> list[StageModule]:
    """The `StageModule`s of `stage_ids` over `model` (pruned by `keep_stage_parts`)."""
    count = len(split)
    return [StageModule(model, i, count, split[i], config.train.mtp_loss_weight,
                        embedding_here=i == 0 or (i == count - 1 and model.tok_embeddings is not None),
                        autocast=autocast or nullcontext())
            for i in stage_ids]


class Pipeline:
    """This rank's stages and the schedule that runs them (see the module docstring)."""

    full_batches = True

    def __init__(self, model: Transformer, parallel: Parallel, config: Config, autocast: Any = None):
        from torch.distributed.pipelining import PipelineStage

        self.model, self.parallel, self.config = model, parallel, config
        cfg = config.dist
        shape = parallel.mesh.shape
        check_pipeline_mesh(config, shape)
        self.n_microbatches = n_microbatches(cfg)
        self.micro_batch_size = config.train.batch_size // self.n_microbatches
        self.split = split_layers(model, config)
        count = len(self.split)
        self.stage_owner = stage_owners(cfg)
        self.stage_ids = stages_of_rank(parallel.pp_rank, cfg)
        self.holds_first, self.holds_last = 0 in self.stage_ids, count - 1 in self.stage_ids
        self.holds_loss = self.holds_last
        self.group = parallel.mesh.pipeline().get_group()  # this rank's data share in each stage
        # The ranks of this rank's stage(s), which split its data: its bias update sums their counts.
        data = shape.data_parallel_size
        self.stage_group = dist.new_subgroups_by_enumeration(
            [list(range(p * data, (p + 1) * data)) for p in range(cfg.pp)])[0] if data > 1 else None
        # The side losses every stage reports (0 where none of its layers has them): the
        # step's agreement sums the same figures on every rank.
        mcfg = model.config
        self.side_names = [name for name, on in (("aux_loss", mcfg.aux_loss_alpha), ("seq_aux_loss", mcfg.seq_aux_loss_alpha))
                           if on and model.moe_layers()] + (["mtp_loss"] if mcfg.n_mtp_layers else [])
        keep_stage_parts(model, self.stage_ids, self.split)
        self.embedding_holders = self._embedding_holders(count)
        self.stages = stage_modules(model, self.stage_ids, self.split, config, autocast)
        micro, seq, dim = self.micro_batch_size, config.train.seq_len, model.config.dim
        # What passes between stages, for torch's static stage metadata: an activation that
        # takes a gradient back.
        self.hidden_dtype = residual_dtype(config, shape)
        hidden = torch.empty(micro, seq, dim, device="meta", requires_grad=True, dtype=self.hidden_dtype)
        tokens = torch.empty(micro, seq, dtype=torch.long, device="meta")
        self.torch_stages = [
            PipelineStage(
                stage, stage.index, count, parallel.device,
                input_args=(tokens if stage.is_first else hidden,),
                output_args=(torch.empty((), device="meta", requires_grad=True) if stage.is_last else hidden,),
                group=self.group,
            )
            for stage in self.stages
        ]
        self.schedule = self._schedule(cfg.pp_schedule.value)
        self._weight, self._step, self._losses = 1.0, 0, []
        if parallel.is_main:
            sizes = ", ".join(f"{len(layers)}" for layers in self.split)
            log.info(f"pipeline: {count} stages over {cfg.pp} ranks ({cfg.pp_schedule.value}, "
                     f"{self.n_microbatches} micro-batches of {micro}); layers per stage {sizes}")

    def _embedding_holders(self, count: int) -> Any:
        """This rank's group of the two ranks (of one data share) holding the embedding when
        the last stage needs it on another pipeline rank than the first's, else None."""
        model_cfg = self.model.config
        last_rank = self.stage_owner[count - 1]
        if last_rank == 0 or not (model_cfg.n_mtp_layers or model_cfg.tie_embeddings):
            return None
        data = self.parallel.data_world
        group, _ = dist.new_subgroups_by_enumeration([[d, last_rank * data + d] for d in range(data)])
        return group

    def _schedule(self, name: str):
        stages = self.torch_stages[0] if name in ONE_STAGE_PER_RANK else self.torch_stages
        return schedule_class(name)(stages, n_microbatches=self.n_microbatches, loss_fn=self._loss_fn,
                                    scale_grads=False)

    def _evaluate(self, *args, target: torch.Tensor, return_outputs: bool, tokens: torch.Tensor,
                  targets: torch.Tensor) -> None:
        """Forward only: the schedule's `eval`, but for the V schedules, whose `eval` in torch
        2.13 also runs their backward actions and fails where two adjacent stages share a
        rank; there the stages run one after another, the activations sent point to point."""
        if self.config.dist.pp_schedule.value not in V_SHAPED:
            self.schedule.eval(*args, target=target, return_outputs=return_outputs, tokens=tokens, targets=targets)
            return
        owner, mine, micro = self.stage_owner, {stage.index: stage for stage in self.stages}, self.micro_batch_size
        for tokens_mb, targets_mb in zip(tokens.split(micro), targets.split(micro)):
            x = tokens_mb
            for index in range(len(self.split)):
                here, before = owner[index], owner.get(index - 1)
                if index and here != before and self.parallel.pp_rank in (here, before):
                    if self.parallel.pp_rank == before:
                        dist.send(x.contiguous(), group_dst=here, group=self.group)
                    else:
                        x = torch.empty(micro, tokens.shape[1], self.model.config.dim, device=tokens.device,
                                        dtype=self.hidden_dtype)
                        dist.recv(x, group_src=before, group=self.group)
                if index in mine:
                    x = mine[index](x, tokens_mb, targets_mb)
            if self.holds_last:
                self._loss_fn(x, targets_mb)

    def _loss_fn(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's micro-batch loss, scaled to its share of the step."""
        loss = self._poison(loss)
        self._losses.append(loss.detach())
        return loss * self._weight

    def _poison(self, value: torch.Tensor) -> torch.Tensor:
        """NaN on rank `fault.nan_rank` in step `fault.nan_at_step`: the loss on the last
        stage, a stage's output elsewhere (what a diverging stage would send on)."""
        return poison_loss(self.config.fault, self.parallel.info.rank, self._step + 1, value)

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, run: Callable) -> list[torch.Tensor]:
        self._losses = []
        for stage in self.stages:
            stage.figures = []
            stage.loss_scale, stage.poison = self._weight, self._poison
        args = (inputs,) if self.holds_first else ()
        run(*args, target=targets, return_outputs=False, tokens=inputs, targets=targets)
        return self._losses

    def train(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float, step: int,
              sync: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self._weight, self._step = weight / self.n_microbatches, step
        losses = self._run(inputs, targets, self.schedule.step)
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.parallel.device)
        figures = {name: torch.zeros((), device=self.parallel.device) for name in self.side_names}
        for stage in self.stages:
            for per_micro_batch in stage.figures:
                for name, value in per_micro_batch.items():
                    figures[name] = figures[name] + value / self.n_microbatches
        if sync:
            self._sum_embedding_gradients()
        return loss, figures

    def eval_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self._weight, self._step = 1.0, -2  # no fault injection in evaluation
        losses = self._run(inputs, targets, self._evaluate)
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.parallel.device)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The batch's loss through the forward-only schedule (a pipeline's backward runs
        inside its schedule: `train`); 0 on the ranks without the last stage."""
        total = self.eval_sum(inputs, targets)
        if reduction == "sum" or not self.holds_loss:
            return total
        return total / (targets != IGNORE_INDEX).sum()

    def _sum_embedding_gradients(self) -> None:
        """The two copies' gradients (each already averaged over its stage's data ranks,
        sharded alike) summed, so the copies stay equal."""
        if self.embedding_holders is None:
            return
        weight = self.model.tok_embeddings.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(local_value(weight.grad), group=self.embedding_holders)

    def grads_are_bucket_views(self) -> bool:
        return False  # a pipeline's replicas are FSDP2's

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """As `grads.clip_grad_norm_`, with every stage's squares summed (a held copy of the
        embedding counted once, on the first stage's rank)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        copy = self.model.tok_embeddings.weight if (self.embedding_holders and not self.holds_first) else None
        squares, groups = grad_norm_squares([p.grad for p in params if p is not copy])
        dist.all_reduce(squares, group=self.group)
        total = squares.sqrt()
        scale_to_max_norm_([*groups, [copy.grad] if copy is not None and copy.grad is not None else []], total, max_norm)
        return total

    def balance_experts(self) -> torch.Tensor:
        """Each stage's bias update from its own layers' counts, summed over the stage's data
        ranks; returns the worst imbalance over stages."""
        group = self.stage_group
        imbalance = self.model.balance_experts(all_reduce=(lambda t: dist.all_reduce(t, group=group)) if group else None)
        imbalance = imbalance.float()
        dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=self.group)
        return imbalance

    def sampling_model(self) -> Transformer | None:
        """The whole model gathered on rank 0 (None elsewhere) from the first data share's
        weights, where it fits: a collective (FSDP2's shards are gathered within each stage)."""
        state = {name: full_value(t).detach().cpu() for name, t in self.model.state_dict().items()}
        everyone: list[Any] = [None] * self.parallel.world_size if self.parallel.is_main else None
        dist.gather_object(state if self.parallel.data_rank == 0 else {}, everyone, dst=0)
        if not self.parallel.is_main:
            return None
        whole = Transformer(self.model.config).to(self.parallel.device)
        merged = {name: t for part in everyone for name, t in part.items()}
        whole.load_state_dict(merged)
        whole.eval()
        return whole
