#!/usr/bin/env bash
# Seconds from the command to the first training steps, cold (every cache empty) and warm (the same
# command again), for each experiment and trainer.compile setting:
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
# from the process start to the end of each of its first steps (training/metrics.py: StartupClock).
# Writes to $OUT: startup.md (environment, command, table), startup.jsonl (each run's times), and
# <experiment>-compile_<setting>-<cold|warm>.log. PYTHON picks the interpreter; RUN_TIMEOUT (default
# 300 s) limits each run; a run that fails is marked in the table and the next one runs.
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
            name="$experiment-compile_$setting-$kind"
            echo "== $name"
            run_dir="$caches/run-$kind"
            started=$(date +%s.%N)
            TORCHINDUCTOR_CACHE_DIR="$caches/inductor" TRITON_CACHE_DIR="$caches/triton" XDG_CACHE_HOME="$caches/xdg" \
                timeout "${RUN_TIMEOUT:-300}" "$PYTHON" train.py "experiment=$experiment" "trainer.compile=$setting" \
                "trainer.max_steps=$STEPS" trainer.eval_iters=1 trainer.sample_tokens=0 trainer.resume=none \
                logger.progress=false "data.cache_dir=$caches/data" "hydra.run.dir=$run_dir" "$@" >"$OUT/$name.log" 2>&1
            rc=$?
            "$PYTHON" - "$run_dir/run.json" "$experiment" "$setting" "$kind" "$rc" "$started" >>"$OUT/startup.jsonl" <<'EOF'
import json, sys, time
path, experiment, setting, kind, rc, started = sys.argv[1:]
try:
    info = json.load(open(path))
except OSError:
    info = {}
print(json.dumps({"experiment": experiment, "compile": setting, "cache": kind, "status": int(rc),
                  "wall_s": time.time() - float(started), **info}))
EOF
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
         "command again. Seconds from the process start; step N: the end of the N-th optimizer step, the device" \
         "waited for (with trainer.cuda_graph the 3rd step is captured); whole run: until the process exits."
    echo
    "$PYTHON" - "$OUT/startup.jsonl" <<'EOF'
import json, sys
fmt = lambda v: "n/a" if v is None else f"{v:.1f}"
print("| experiment | compile | caches | loop start | step 1 | last step timed | whole run | status |")
print("|---|---|---|---|---|---|---|---|")
for line in open(sys.argv[1]):
    r = json.loads(line)
    steps = r.get("steps_done_s") or [None]
    print(f"| {r['experiment']} | {r['compile']} | {r['cache']} | {fmt(r.get('loop_start_s'))} | "
          f"{fmt(r.get('first_step_s'))} | {fmt(steps[-1])} (step {len(r.get('steps_done_s') or [])}) | "
          f"{fmt(r['wall_s'])} | {'ok' if r['status'] == 0 else 'failed: ' + str(r['status'])} |")
EOF
} >"$OUT/startup.md"
cat "$OUT/startup.md"
! grep -q '"status": [1-9]' "$OUT/startup.jsonl"
