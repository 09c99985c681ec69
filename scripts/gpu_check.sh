#!/usr/bin/env bash
# The CUDA checks in one command, sized for about 7.5 minutes on one H200.
#
#   bash scripts/gpu_check.sh --build-wheels   # here first (pip works here): .whl/, see "Installing"
#   OUT=$OUT bash scripts/gpu_check.sh         # on the GPU machine (device tool: carry [".whl"], timeout_s 540)
#   bash scripts/gpu_check.sh --dry-run        # on CPU: every stage's set-up and command, without CUDA
#
# Options: --budget SECONDS (the whole run's; default 450, 900 for --dry-run). Environment:
# OUT (outputs go to ${OUT:-gpu_check_out}/), PYTHON (the interpreter with torch; default
# python3), PEAK_TFLOPS (datasheet dense bf16 peak for MFU, default 989 = H100/H200 SXM).
#
# Stages, each under `timeout` with its own cap, clipped to what is left of the budget (the
# caps add up to less than it); a failing stage does not stop the next, but where torch
# sees no CUDA device (outside --dry-run) the stages after install, which could only fail
# or skip for that one reason, are SKIPPED. Each prints one summary line, and
# OUT/summary.txt holds them all:
#   standin    (--dry-run only) the GPU image's interpreter played by a fresh venv holding
#              what that image has (torch, numpy, rich, safetensors, PyYAML, packaging,
#              pytest), linked from BUILD_PYTHON's, and not what it lacks (hydra-core,
#              omegaconf, antlr4): scripts/gpu_image_standin.py, no package index asked
#   env        the GPU (nvidia-smi), the interpreter, its torch and what it sees
#   install    the carried wheels into a folder on PYTHONPATH (no index, no dependencies,
#              no editable install), after checking the project's wheel was built from
#              this very tree (.whl/SOURCE)
#   tests      pytest tests/test_gpu.py -m gpu, all but the meta build
#   meta_build a 1.6 GB model built on meta and materialized straight onto the GPU
#   ranks      `torchrun --nproc_per_node=1` on NCCL; and `dist.nproc_per_node=2` on one
#              GPU refused in one line before a worker starts (NCCL takes one rank per
#              GPU; with two GPUs, it trains). --dry-run: two gloo ranks on CPU
#   bench      scripts/bench.py at ~1 B parameters in bf16, trainer and bare loop, MFU
#              against the measured matmul peak and against PEAK_TFLOPS. --dry-run: tiny, fp32
# Outputs in OUT: summary.txt, gpu_check.log (everything), nvidia-smi.txt, test_gpu.xml,
# bench.json. The work folder (stage logs, run folders, the stand-in venv, the dry run's
# wheels) is deleted at exit. Exit status: 0 every stage passed, 1 one failed or ran out of
# time, 2 no interpreter with torch.
#
# Installing: the GPU machine has no network, and its python3 (torch 2.11 with CUDA 13, and
# most of what the project needs) lacks hydra-core, omegaconf and antlr4-python3-runtime.
# `--build-wheels` puts in .whl/ (git-ignored; WHEELS names another folder) this tree's
# project wheel and those three, repacked from the versions installed here
# (scripts/repack_wheel.py: no package index asked), with .whl/SOURCE naming the tree they
# were built from; rebuild after every change (the GPU run refuses a stale wheel). --dry-run
# builds its own in the work folder and writes nothing into the tree. BUILD_PYTHON: the
# interpreter that builds them and lends the stand-in its packages (default
# .venv/bin/python, else python3).
set -euo pipefail
if [[ " $* " == *" -h "* || " $* " == *" --help "* ]]; then
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d'
    exit 0
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
WHEELS=${WHEELS:-$REPO/.whl}
# The three the GPU image lacks, by distribution name.
CARRIED=(hydra-core omegaconf antlr4-python3-runtime)

# What the project's wheel is built from: its sources, configs and packaging.
tree_hash() {
    find ciuic_train conf hydra_plugins pyproject.toml -type f \
        \( -name '*.py' -o -name '*.yaml' -o -name '*.md' -o -name '*.toml' \) -not -path '*/__pycache__/*' |
        LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
}

build_python() {
    if [[ -n ${BUILD_PYTHON:-} ]]; then echo "$BUILD_PYTHON"
    elif [[ -x $REPO/.venv/bin/python ]]; then echo "$REPO/.venv/bin/python"
    else echo python3; fi
}

build_wheels() {
    local py
    py=$(build_python)
    mkdir -p "$WHEELS"
    rm -f "$WHEELS"/*.whl "$WHEELS/SOURCE"
    echo "+ scripts/repack_wheel.py ${CARRIED[*]} (the versions installed for $py) and pip wheel this tree"
    "$py" "$REPO/scripts/repack_wheel.py" "$WHEELS" "${CARRIED[@]}" || return 1
    # From a copy of what the wheel is built from: setuptools builds in the tree it is given.
    local src
    src=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_src.XXXXXX")
    tar -C "$REPO" --exclude=__pycache__ -cf - ciuic_train conf hydra_plugins pyproject.toml README.md | tar -C "$src" -xf -
    "$py" -m pip wheel -q --no-index --no-deps --no-build-isolation -w "$WHEELS" "$src" 2>&1 |
        grep -v '^WARNING: Location' || true
    rm -rf "$src"
    tree_hash >"$WHEELS/SOURCE"
    ls "$WHEELS"
    local count
    count=$(find "$WHEELS" -type f -name '*.whl' | wc -l)
    if ((count != ${#CARRIED[@]} + 1)); then
        echo "gpu_check.sh: expected $((${#CARRIED[@]} + 1)) wheels in $WHEELS, found $count"
        return 1
    fi
    echo "wheels for tree $(cat "$WHEELS/SOURCE") in $WHEELS ($(du -sh "$WHEELS" | cut -f1)): carry .whl"
}

# run_stage NAME CAP FUNCTION: FUNCTION under `timeout` (clipped to the budget left), its
# output to the terminal and WORK/NAME.log; its summary line is what it writes to
# WORK/NAME.line. Verdicts: PASS, FAIL (exit N), TIMEOUT, SKIPPED (with the reason as its
# line: SKIP_REASON where the run has set it, else a budget too short to start).
run_stage() {
    local name=$1 cap=$2 fn=$3
    local left=$((DEADLINE - $(date +%s) - 5))
    local limit=$((cap < left ? cap : left))
    local skipped=${SKIP_REASON:-}
    STAGES+=("$name")
    printf '\n======== %s ======== (cap %ss, %ss of the budget left)\n' "$name" "$cap" "$left"
    if [[ -z $skipped ]] && ((limit < 10)); then skipped="budget spent"; fi
    if [[ -n $skipped ]]; then
        VERDICT[$name]=SKIPPED TOOK[$name]=0
        echo "$skipped" >"$WORK/$name.line"
        return 0
    fi
    local t0 rc
    t0=$(date +%s)
    set +o pipefail
    GPU_CHECK_STAGE=$fn timeout --kill-after=10 "$limit" bash "${BASH_SOURCE[0]}" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    set -o pipefail
    TOOK[$name]=$(($(date +%s) - t0))
    case $rc in
        0) VERDICT[$name]=PASS ;;
        124 | 137) VERDICT[$name]="TIMEOUT"; echo "ran out of its ${limit}s" >>"$WORK/$name.line" ;;
        *) VERDICT[$name]="FAIL($rc)" ;;
    esac
    echo "[$name] ${VERDICT[$name]} in ${TOOK[$name]}s: $(line_of "$name")"
}

line_of() { awk 'NR > 1 {printf "; "} {printf "%s", $0}' "$WORK/$1.line" 2>/dev/null || true; }
say() { echo "$*" >>"$WORK/$STAGE.line"; } # a stage's summary line (the stage function runs in a child)

# --- the stages: each runs as `GPU_CHECK_STAGE=name bash gpu_check.sh` (so `timeout` can stop it) ---

stage_standin() {
    local venv=$WORK/standin
    "$(build_python)" "$REPO/scripts/gpu_image_standin.py" "$venv" || { say "the stand-in venv could not be made"; return 1; }
    "$venv/bin/python" -c 'import torch, numpy, rich, safetensors, yaml, pytest' || { say "the stand-in venv lacks a package"; return 1; }
    if "$venv/bin/python" -c 'import hydra' 2>/dev/null; then say "the stand-in has hydra: it proves nothing"; return 1; fi
    say "a fresh venv with torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') and the image's packages, without hydra-core/omegaconf/antlr4"
}

stage_env() {
    local gpu=none
    if command -v nvidia-smi >/dev/null; then
        timeout 20 nvidia-smi 2>&1 | tee "$OUT_DIR/nvidia-smi.txt" || true
        gpu=$(timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
            head -1 || echo "nvidia-smi failed")
    fi
    local seen
    seen=$("$PY" -c 'import sys, torch
cuda = torch.cuda.is_available()
name = torch.cuda.get_device_name() + f" (sm{torch.cuda.get_device_capability()[0]}{torch.cuda.get_device_capability()[1]})" if cuda else "no CUDA device"
print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__} (CUDA build {torch.version.cuda}): {torch.cuda.device_count()} device(s), {name}")') ||
        { say "no torch in $PY (PYTHON names another interpreter)"; return 2; }
    echo "$seen"
    say "GPU: $gpu; $seen"
    if [[ $DRY_RUN == 0 ]] && ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
        say "(torch sees no CUDA device: use --dry-run on a machine without a GPU)"
        touch "$WORK/no_cuda"  # the run skips the stages that need one
        return 1
    fi
}

stage_install() {
    if [[ $DRY_RUN == 1 ]]; then
        echo "dry run: building the wheels in the work folder"
        build_wheels
    fi
    local want have
    want=$(tree_hash)
    have=$(cat "$WHEELS/SOURCE" 2>/dev/null || echo none)
    if [[ $have != "$want" ]]; then
        say ".whl was built from tree $have, this is tree $want: run bash scripts/gpu_check.sh --build-wheels here and carry .whl"
        return 1
    fi
    local wheels=("$WHEELS"/*.whl)
    echo "+ $PY -m pip install --no-index --no-deps --target $SITE .whl/*.whl"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
    (cd "$WORK" && "$PY" -c 'import importlib.metadata as m, pathlib, ciuic_train, ciuic_train.conf, ciuic_train.train.trainer
where = pathlib.Path(ciuic_train.__file__).parent
print(", ".join(f"{n} {m.version(n)}" for n in ("ciuic-train", "hydra-core", "omegaconf", "antlr4-python3-runtime")) + f"; ciuic_train from {where}")') >"$WORK/imported" ||
        { say "installed, but ciuic_train does not import (see the log)"; return 1; }
    cat "$WORK/imported"
    if ! grep -q "ciuic_train from $SITE" "$WORK/imported"; then say "ciuic_train came from elsewhere: $(cat "$WORK/imported")"; return 1; fi
    say "${#wheels[@]} wheels of tree $want: $(sed 's/; ciuic_train from.*//' "$WORK/imported")"
}

pytest_line() { grep -E '^=+ .*(passed|failed|error|skipped|deselected).* =+$' "$1" | tail -1 | tr -d '=' | xargs || true; }

stage_tests() {
    local rc=0
    (cd "$WORK" && "$PY" -m pytest "$REPO/tests/test_gpu.py" -m gpu -k "not meta_build" -v -rA -p no:cacheprovider \
        --junitxml="$OUT_DIR/test_gpu.xml") >"$WORK/pytest.out" 2>&1 || rc=$?
    cat "$WORK/pytest.out"
    say "$(pytest_line "$WORK/pytest.out")$(grep -E '^(FAILED|ERROR) ' "$WORK/pytest.out" | cut -d' ' -f2 | sed 's/^.*:://' | tr '\n' ' ' | sed 's/^/; /;s/; $//')"
    return $rc
}

stage_meta_build() {
    local rc=0
    (cd "$WORK" && "$PY" -m pytest "$REPO/tests/test_gpu.py" -m gpu -k meta_build -v -s -rA -p no:cacheprovider) \
        >"$WORK/meta.out" 2>&1 || rc=$?
    cat "$WORK/meta.out"
    say "$(pytest_line "$WORK/meta.out")$(grep -m1 -o 'model [0-9.]* GiB on the GPU.*' "$WORK/meta.out" | sed 's/^/: /')"
    return $rc
}

TINY=(model=tiny train.seq_len=64 train.max_steps=3 train.log_every=1 train.eval_windows=8 sample.max_new_tokens=0 progress=plain)

stage_ranks() {
    local device=cuda nproc=1
    if [[ $DRY_RUN == 1 ]]; then device=cpu nproc=2; fi
    cd "$WORK"
    echo "+ torchrun --nproc_per_node=$nproc -m ciuic_train device=$device ${TINY[*]}"
    "$PY" -m torch.distributed.run --nproc_per_node=$nproc -m ciuic_train "device=$device" "${TINY[@]}" \
        "hydra.run.dir=$WORK/torchrun" || { say "torchrun --nproc_per_node=$nproc on $device failed"; return 1; }
    local ran
    ran=$("$PY" -c 'import json, sys
s = json.load(open(sys.argv[1]))
print("{world_size} rank(s) on {device}, {steps} steps, loss {final_train_loss:.4f}".format(**s))' "$WORK/torchrun/summary.json")
    say "torchrun: $ran ($([[ $device == cuda ]] && echo NCCL || echo gloo))"
    if [[ $DRY_RUN == 1 ]]; then
        say "two ranks on one GPU: not rehearsed (no CUDA here)"
        return 0
    fi
    local gpus rc=0
    gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
    echo "+ python -m ciuic_train device=cuda dist.nproc_per_node=2 (this node shows $gpus GPU(s))"
    "$PY" -m ciuic_train device=cuda dist.nproc_per_node=2 "${TINY[@]}" "hydra.run.dir=$WORK/two" \
        >"$WORK/two.out" 2>"$WORK/two.err" || rc=$?
    cat "$WORK/two.out" "$WORK/two.err"
    if ((gpus >= 2)); then
        [[ $rc == 0 ]] && say "2 ranks on $gpus GPUs trained" || { say "2 ranks on $gpus GPUs failed (exit $rc)"; return 1; }
    elif [[ $rc == 2 && $(wc -l <"$WORK/two.err") == 1 ]] && grep -q "ranks on CUDA, but this node shows" "$WORK/two.err"; then
        say "2 ranks on 1 GPU refused in one line, exit 2"
    else
        say "2 ranks on 1 GPU: exit $rc, not the one-line refusal: $(head -c 200 "$WORK/two.err" | tr '\n' ' ')"
        return 1
    fi
}

stage_bench() {
    local args=(--model bench --device cuda --precision bf16 --steps 10 --rounds 1 --batch-size 8 --seq-len 1024)
    # ~1 B parameters: DeepSeek-V2-Lite-like attention (16 heads, qk 128+64, v 128, kv
    # latent 512), 64 fine-grained routed experts of 256, top-6, 2 shared.
    local overrides=(model.vocab_size=32768 model.dim=1024 model.n_layers=16 model.n_dense_layers=1 model.n_heads=16
        model.q_lora_rank=0 model.kv_lora_rank=512 model.qk_nope_head_dim=128 model.qk_rope_head_dim=64
        model.v_head_dim=128 model.dense_ffn_dim=4096 model.moe_ffn_dim=256 model.n_routed_experts=64
        model.n_shared_experts=2 model.n_activated_experts=6 model.max_seq_len=1024)
    if [[ $DRY_RUN == 1 ]]; then # the plumbing only; fp32, as bf16 matmuls crawl on CPUs without native bf16
        args=(--model tiny --device cpu --precision fp32 --steps 2 --rounds 1 --batch-size 2 --seq-len 64)
        overrides=(model.vocab_size=512 model.max_seq_len=64)
    fi
    for o in "${overrides[@]}"; do args+=(--override "$o"); done
    # The trainer side saves a checkpoint (~12 GB at 1 B): on tmpfs when it has room.
    local shm_gb
    shm_gb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}' || echo 0)
    if [[ ${shm_gb:-0} -ge 40 ]]; then export TMPDIR=/dev/shm; fi
    cd "$WORK"
    echo "+ python scripts/bench.py ${args[*]} --datasheet-tflops $PEAK_TFLOPS"
    local rc=0
    "$PY" "$REPO/scripts/bench.py" "${args[@]}" --datasheet-tflops "$PEAK_TFLOPS" --json "$OUT_DIR/bench.json" \
        >"$WORK/bench.out" 2>&1 || rc=$?
    cat "$WORK/bench.out"
    [[ $rc == 0 ]] || { say "bench.py failed (exit $rc): $(tail -1 "$WORK/bench.out" | head -c 200)"; return 1; }
    say "$(grep -m1 '^summary: ' "$WORK/bench.out" | sed 's/^summary: //')"
}

if [[ -n ${GPU_CHECK_STAGE:-} ]]; then # a stage, in its own process (run_stage), set up by the run below
    STAGE=${GPU_CHECK_STAGE#stage_}
    "$GPU_CHECK_STAGE"
    exit
fi

ARGS=("$@")
DRY_RUN=0
BUDGET_S=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --build-wheels) build_wheels; exit ;;
        --dry-run) DRY_RUN=1 ;;
        --budget) BUDGET_S=$2; shift ;;
        *) echo "gpu_check.sh: unknown option $1 (see --help)"; exit 2 ;;
    esac
    shift
done
BUDGET_S=${BUDGET_S:-$([[ $DRY_RUN == 1 ]] && echo 900 || echo 450)}

OUT_DIR=${OUT:-gpu_check_out}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
# Everything this script prints also goes to OUT/gpu_check.log.
if [[ -z ${GPU_CHECK_LOGGED:-} ]]; then
    export GPU_CHECK_LOGGED=1
    set +o pipefail
    bash "${BASH_SOURCE[0]}" "${ARGS[@]}" 2>&1 | tee "$OUT_DIR/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi

export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
# Stage logs and run folders; every command runs from here, outside the repo root, so the
# installed ciuic_train (whose ciuic_train.conf Hydra needs) is the one imported.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
# Gone at exit: a stage's output is already in OUT/gpu_check.log, and CI runs the dry run
# on a disk that every run would otherwise fill further.
trap 'rm -rf "$WORK"' EXIT
SITE=$WORK/site
if [[ $DRY_RUN == 1 ]]; then WHEELS=$WORK/whl; fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
STAGES=()
declare -A VERDICT=() TOOK=()

export REPO WORK SITE PY DRY_RUN OUT_DIR PEAK_TFLOPS WHEELS

# --- the run ---------------------------------------------------------------------------------
echo "gpu_check.sh $([[ $DRY_RUN == 1 ]] && echo "--dry-run (CPU) ")at $(git rev-parse --short HEAD 2>/dev/null || echo '?'),"\
    "budget ${BUDGET_S}s, work folder $WORK, outputs in $OUT_DIR"
if [[ $DRY_RUN == 1 ]]; then
    run_stage standin 300 stage_standin
    if [[ ${VERDICT[standin]} == PASS ]]; then PY=$WORK/standin/bin/python; export PY; fi
fi
run_stage env 20 stage_env
if [[ ${VERDICT[env]} == "FAIL(2)" ]]; then
    FATAL=2
else
    FATAL=0
    run_stage install 45 stage_install
    # Without a CUDA device (stage_env found none) the rest could only fail or skip for that.
    if [[ -e $WORK/no_cuda ]]; then SKIP_REASON="torch sees no CUDA device"; fi
    run_stage tests 120 stage_tests
    run_stage meta_build 45 stage_meta_build
    run_stage ranks 60 stage_ranks
    run_stage bench 150 stage_bench
fi

status=$FATAL
for stage in "${STAGES[@]}"; do
    if [[ ${VERDICT[$stage]} != PASS && $status == 0 ]]; then status=1; fi
done
{
    echo "gpu_check.sh$([[ $DRY_RUN == 1 ]] && echo " --dry-run") summary: $(date -u +%Y-%m-%dT%H:%M:%SZ)," \
        "tree $(tree_hash), $(($(date +%s) - START))s of a ${BUDGET_S}s budget"
    for stage in "${STAGES[@]}"; do
        printf '%-10s %-8s %4ss  %s\n' "$stage" "${VERDICT[$stage]}" "${TOOK[$stage]}" "$(line_of "$stage")"
    done
} | tee "$OUT_DIR/summary.txt"
exit "$status"
