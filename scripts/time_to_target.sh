#!/usr/bin/env bash
# Seconds from the command to a target validation loss, and where a run's start goes: one GPU call of
# about 8 minutes on an H100 (BUDGET, default 510 s, bounds it):
#
#   bash scripts/time_to_target.sh OUT_FOLDER [overrides for every run ...]
#
# After one import of the libraries (so that no timed run reads them from disk for the first time), in
# this order, each run under `timeout` and within what is left of BUDGET (a run that cannot get
# MIN_RUN seconds, default 30, is skipped and marked so):
#   1. experiment=speedrun_char under trainer.compile=false, true and blocks (COMPILES), each cold (every
#      cache in a fresh folder: Inductor's FX graphs, AOTAutograd graphs and autotuning, Triton's
#      kernels, the flash kernel's tuning picks, the token cache) then warm (the same command again);
#   2. the baseline, experiment=shakespeare_char with trainer.max_steps=BASELINE_STEPS (default 2000),
#      once, cold;
#   3. experiment=gpt2's start (STEPS optimizer steps, default 5, one evaluation batch) under
#      trainer.compile=true and blocks (GPT2_COMPILES), cold then warm.
# Every run: trainer.sample_tokens=0, trainer.resume=none, its own run folder; its run.json records
# the seconds of each phase of its start, the time spent evaluating and saving, and torch.compile's
# disk-cache hits, misses and bypasses (training/metrics.py: StartupClock).
#   4. Last, as the budget allows, diagnoses that are not timed: speedrun_char for 16 steps under each
#      trainer.compile on the warm caches of step 1, profiling 5 steps (trainer.profile_steps: where a
#      step's GPU time goes, diagnosis-compile_<c>/profile.md) and, where it compiles, with TORCH_LOGS
#      naming Inductor's FX-graph cache and AOTAutograd's cache (it imports the compiler with torch, so
#      the timed runs go without), so that its log says why a cache missed or was bypassed.
#
# Writes to OUT_FOLDER: summary.md (environment, commands, the tables of scripts/startup_report.py:
# phases of every start; for the speedrun and the baseline, the step and the seconds from the command
# at which the validation loss first reached TARGET, default 1.47, best and final val, ms per step,
# evaluation and checkpoint time), runs.jsonl and startup.jsonl (a line per run), <run>.log (each
# run's output) and <run>/ (its metrics.jsonl, run.json, config.yaml, profile.md; checkpoints stay
# behind), and diagnosis.jsonl.
# PYTHON picks the interpreter. Exit status 0 when every run that ran finished. A dry run on a CPU:
#   COMPILES=false GPT2_COMPILES=false bash scripts/time_to_target.sh /tmp/t trainer.device=cpu trainer.compile=false \
#       trainer.max_steps=2 trainer.eval_interval=1 trainer.eval_iters=1 trainer.batch_size=2 trainer.grad_accum=1 \
#       model.n_embd=48 model.block_size=64
set -uo pipefail
OUT=$(realpath -m "${1:?give the folder for the results: bash scripts/time_to_target.sh OUT_FOLDER [overrides]}")
shift
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUDGET=${BUDGET:-510}
MIN_RUN=${MIN_RUN:-30}
TARGET=${TARGET:-1.47}
STEPS=${STEPS:-5}
BASELINE_STEPS=${BASELINE_STEPS:-2000}
source scripts/ablation_common.sh
mkdir -p "$OUT"
: >"$OUT/runs.jsonl"
: >"$OUT/startup.jsonl"
: >"$OUT/diagnosis.jsonl"
WORK=$(mktemp -d)
COMMON=(trainer.sample_tokens=0 trainer.resume=none logger.progress=false "$@")

timed() {  # timed RUNS NAME CACHES LIMIT "LABELS" ARGS...: cached_run within the budget, its files copied to $OUT/NAME
    local runs=$1 name=$2 caches=$3 limit=$4 labels=$5 left=$((BUDGET - SECONDS))
    shift 5
    if [ "$left" -lt "$MIN_RUN" ]; then
        echo "== $name: skipped, ${left}s of the budget left"
        # shellcheck disable=SC2086  # the labels are separate words
        "$PYTHON" -m scripts.startup_report collect "$caches/run-$name" $labels --skipped "${left} s of BUDGET=$BUDGET left" >>"$runs"
        return
    fi
    cached_run "$runs" "$name" "$caches" "$((left < limit ? left : limit))" "$labels" "$@"
    mkdir -p "$OUT/$name"
    cp "$caches/run-$name"/{metrics.jsonl,run.json,config.yaml,profile.md} "$OUT/$name/" 2>/dev/null
}

# "cold" means torch.compile's, Triton's and our caches, not the OS's: read the libraries once first, so
# the first run timed does not also pay for reading them from disk.
"$PYTHON" -c "import torch, triton, hydra, tiktoken, numpy; torch.zeros(1, device='cuda' if torch.cuda.is_available() else 'cpu')"
for setting in ${COMPILES:-false true blocks}; do
    caches="$WORK/speedrun-$setting"
    for kind in cold warm; do
        timed "$OUT/runs.jsonl" "speedrun_char-compile_$setting-$kind" "$caches" 150 \
            "experiment=speedrun_char compile=$setting cache=$kind" \
            experiment=speedrun_char "trainer.compile=$setting" "${COMMON[@]}"
    done
    rm -rf "$caches"/run-*/checkpoints
done
timed "$OUT/runs.jsonl" "shakespeare_char-$BASELINE_STEPS-cold" "$WORK/baseline" 150 \
    "experiment=shakespeare_char($BASELINE_STEPS) compile=true cache=cold" \
    experiment=shakespeare_char "trainer.max_steps=$BASELINE_STEPS" "${COMMON[@]}"
rm -rf "$WORK"/baseline/run-*/checkpoints
for setting in ${GPT2_COMPILES:-true blocks}; do
    for kind in cold warm; do
        timed "$OUT/startup.jsonl" "gpt2-compile_$setting-$kind" "$WORK/gpt2-$setting" 90 \
            "experiment=gpt2 compile=$setting cache=$kind" \
            experiment=gpt2 "trainer.compile=$setting" "trainer.max_steps=$STEPS" trainer.eval_iters=1 "${COMMON[@]}"
    done
    rm -rf "$WORK/gpt2-$setting"
done
diagnose() {  # diagnose SETTING: 16 steps of speedrun_char on its warm caches, 5 of them profiled
    timed "$OUT/diagnosis.jsonl" "diagnosis-compile_$1" "$WORK/speedrun-$1" 60 "experiment=speedrun_char compile=$1 cache=warm" \
        experiment=speedrun_char "trainer.compile=$1" "${COMMON[@]}" trainer.max_steps=16 trainer.profile_steps=5 \
        trainer.eval_interval=16 trainer.eval_iters=1
}
logs="torch._inductor.codecache,torch._functorch._aot_autograd.autograd_cache"  # where this torch has them
for setting in ${COMPILES:-false true blocks}; do
    if [ ! -d "$WORK/speedrun-$setting" ]; then
        continue
    elif [ "$setting" != false ] && TORCH_LOGS=$logs "$PYTHON" -c "import torch" 2>/dev/null; then
        TORCH_LOGS=$logs diagnose "$setting"
    else
        diagnose "$setting"
    fi
done

{
    echo "# Seconds from the command to val <= $TARGET, and where the start goes"
    echo
    environment_line
    echo
    echo "Commands: \`python train.py experiment=speedrun_char trainer.compile=<c> ${COMMON[*]}\`;" \
         "\`python train.py experiment=shakespeare_char trainer.max_steps=$BASELINE_STEPS ${COMMON[*]}\`;" \
         "\`python train.py experiment=gpt2 trainer.compile=<c> trainer.max_steps=$STEPS trainer.eval_iters=1" \
         "${COMMON[*]}\`. cold: every cache in a fresh folder; warm: the same command again." \
         "Phases in seconds (step 3 is the one trainer.cuda_graph captures); s from the command: the loop's start" \
         "from the process start plus the seconds from the loop's start; ms/step from the median tokens/s" \
         "(evaluations and checkpoints left out); whole run: until the process exits."
    echo
    echo "## experiment=speedrun_char and the baseline"
    echo
    "$PYTHON" -m scripts.startup_report table "$OUT/runs.jsonl" --target "$TARGET"
    echo
    echo "## experiment=gpt2's start"
    echo
    "$PYTHON" -m scripts.startup_report table "$OUT/startup.jsonl"
} >"$OUT/summary.md"
rm -rf "$WORK"
cat "$OUT/summary.md"
! grep -qE '"status": [1-9]' "$OUT/runs.jsonl" "$OUT/startup.jsonl"
