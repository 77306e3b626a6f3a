#!/usr/bin/env bash
# Seconds from the command to the first training steps, cold (every cache empty) and warm (the same
# command again), for each experiment and trainer.compile setting, and where they went:
#
#   OUT=bench/startup bash scripts/time_to_first_step.sh                          # on a GPU
#   OUT=bench/startup COMPILES=true EXPERIMENTS=gpt2 bash scripts/time_to_first_step.sh
#   OUT=/tmp/startup EXPERIMENTS=quick COMPILES=false bash scripts/time_to_first_step.sh trainer.device=cpu
#
# EXPERIMENTS (default "shakespeare_char gpt2") and COMPILES (default "true blocks") name the pairs;
# extra arguments go to every run. A cold run starts with fresh folders for every cache: Inductor's
# FX graphs, AOTAutograd graphs and autotuning (TORCHINDUCTOR_CACHE_DIR), Triton's kernels
# (TRITON_CACHE_DIR), our flash kernel's tuning picks (XDG_CACHE_HOME) and the token cache
# (data.cache_dir); the warm run reuses them. Each run takes STEPS optimizer steps (default 5),
# evaluates once on one batch at the end, writes no sample, and records in its run.json the seconds
# of each phase of its start and torch.compile's disk-cache hits (training/metrics.py: StartupClock).
# Writes to $OUT: startup.md (environment, command, tables: scripts/startup_report.py), startup.jsonl
# (each run's line), and <experiment>-compile_<setting>-<cold|warm>.log. PYTHON picks the interpreter;
# RUN_TIMEOUT (default 300 s) limits each run; a run that fails is marked in the table and the next
# one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-5}
source scripts/ablation_common.sh
mkdir -p "$OUT"
: >"$OUT/startup.jsonl"

for experiment in ${EXPERIMENTS:-shakespeare_char gpt2}; do
    for setting in ${COMPILES:-true blocks}; do
        caches=$(mktemp -d)
        for kind in cold warm; do
            cached_run "$OUT/startup.jsonl" "$experiment-compile_$setting-$kind" "$caches" "${RUN_TIMEOUT:-300}" \
                "experiment=$experiment compile=$setting cache=$kind" \
                "experiment=$experiment" "trainer.compile=$setting" "trainer.max_steps=$STEPS" trainer.eval_iters=1 \
                trainer.sample_tokens=0 trainer.resume=none logger.progress=false "$@"
        done
        rm -rf "$caches"
    done
done

{
    echo "# Seconds from the command to the first training steps"
    echo
    environment_line
    echo
    echo "Command per run: \`python train.py experiment=<e> trainer.compile=<c> trainer.max_steps=$STEPS" \
         "trainer.eval_iters=1 trainer.sample_tokens=0 $*\`; cold: every cache in a fresh folder, warm: the same" \
         "command again. Seconds of each phase of the start (step 3 is the one trainer.cuda_graph captures);" \
         "step 1 ends: seconds from the command; whole run: until the process exits."
    echo
    "$PYTHON" -m scripts.startup_report table "$OUT/startup.jsonl"
} >"$OUT/startup.md"
cat "$OUT/startup.md"
! grep -q '"status": [1-9]' "$OUT/startup.jsonl"
