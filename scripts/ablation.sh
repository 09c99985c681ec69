#!/usr/bin/env bash
# One-command trick ablation: every trick alone against the baseline, over seeds, then
# `ciuic_train.tools.report` on the sweep folder (report.md, report.json, loss_curves.png,
# effect.png there).
#
#   bash scripts/ablation.sh [MODEL] [STEPS] [SEEDS] [OVERRIDE ...]   # defaults: tiny 30 "0,1"
#   bash scripts/ablation.sh small 300 0,1,2,3,4
#   bash scripts/ablation.sh small 100 0,1,2 dist.nproc_per_node=2 train.batch_size=4   # tricks that act on DDP act
#
# Two seeds only show whether the pipeline works; a verdict other than "no detectable
# effect" needs more seeds (5+) and more steps. Run from the repository root, with the
# package installed (ciuic-train on PATH).
#
# Settings shared by every group, so that each trick has something to act on and the
# comparison stays fair (the baseline runs under the same settings):
#   train.grad_accum=2      time_folded_accum only re-weights micro-batches; with 1 it is a no-op.
#   data.shuffle=false      chaotic_sampler re-orders the share; on a shuffled share that changes
#                           nothing statistically (see its docstring).
#   ckpt.every=EVAL         quantum_save decides per checkpoint candidate; the default (100)
#                           gives none in a short run. The report leaves save intervals out of
#                           its step times.
#   train.eval_every=STEPS/6  six evals: the loss curves and "steps to target" resolution.
#   train.log_every=1       a metrics line per step, so the report gets per-step times.
#   train.warmup_steps=STEPS/10  the default (30) would spend all of a 30-step run warming up.
# delayed_sync sleeps before DDP's all-reduce, so in a single-process run it does nothing;
# it is kept so the sweep shape is the same on a multi-GPU launch.
set -euo pipefail

MODEL=${1:-tiny}
STEPS=${2:-30}
SEEDS=${3:-0,1}
shift $(( $# < 3 ? $# : 3 ))  # the rest are extra overrides for every job
EVAL=$(( STEPS / 6 > 0 ? STEPS / 6 : 1 ))
WARMUP=$(( STEPS / 10 ))
DIR=multirun/ablation-$(date +%Y%m%d-%H%M%S)

# A failed job must not stop the sweep's report: the report lists failed jobs.
ciuic-train -m \
    'trick=[],[delayed_sync],[warm_restart],[chaotic_sampler],[quantum_save],[async_smoothed_loss],[constellation_init],[time_folded_accum]' \
    seed="$SEEDS" model="$MODEL" \
    train.max_steps="$STEPS" train.eval_every="$EVAL" train.log_every=1 train.warmup_steps="$WARMUP" \
    train.grad_accum=2 data.shuffle=false ckpt.every="$EVAL" \
    sample.max_new_tokens=0 progress=plain "$@" \
    hydra.sweep.dir="$DIR" || echo "ablation.sh: the sweep exited with status $?; reporting what finished" >&2

python -m ciuic_train.tools.report "$DIR"
