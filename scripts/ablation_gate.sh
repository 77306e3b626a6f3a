#!/usr/bin/env bash
# The forget gate's ablation on Tiny Shakespeare (GPT-2 BPE): one multirun of experiment=fox_ablation
# over model.gate=none,forget x model.pos=learned,rope,none, the validation loss at 1x and 2x the
# training context (scripts/eval_length.py), and the loss plots (scripts/compare_runs.py).
#
#   OUT=bench/fox bash scripts/ablation_gate.sh                          # on a GPU: flash, bf16
#   OUT=/tmp/fox EVAL_ARGS="--batches 2 --tokens 256" bash scripts/ablation_gate.sh trainer.max_steps=4 model.n_layer=1
#                                                  # extra overrides go to every run; EVAL_ARGS to eval_length.py
#   OUT=bench/fox bash scripts/ablation_gate.sh model.gate_bias_init=0,3  # also sweep where the gates start
#
# Writes to $OUT (7 files): ablation.md (environment, command, table), length.json, metrics.jsonl
# (every run's records, each tagged with its run), loss_vs_step.png, loss_vs_time.png, train.log,
# eval.log. The run folders go to $WORK (default: a fresh temporary folder). Each step has its own
# time limit (TRAIN_TIMEOUT, EVAL_TIMEOUT, PLOT_TIMEOUT seconds); a step that fails or runs out is
# recorded in ablation.md and the next steps run on what is there. Outside git (a copy of the tree)
# set NANOFLASH_COMMIT to the commit the copy was made from. PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
WORK=${WORK:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
SWEEP=(experiment=fox_ablation model.gate=none,forget model.pos=learned,rope,none)
STATUS=()

step() {  # step NAME SECONDS LOG COMMAND...: run COMMAND under a time limit, its output into LOG
    local name=$1 limit=$2 log=$3
    shift 3
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || STATUS+=("$name failed with status $rc$([ "$rc" -eq 124 ] && echo " (out of time)"); see $(basename "$log")")
}

step training "${TRAIN_TIMEOUT:-400}" "$OUT/train.log" \
    "$PYTHON" train.py -m "${SWEEP[@]}" logger.progress=false trainer.resume=none hydra.sweep.dir="$WORK/multirun" "$@"
step "length test" "${EVAL_TIMEOUT:-120}" "$OUT/eval.log" \
    "$PYTHON" scripts/eval_length.py "$WORK/multirun" --factors 1 2 ${EVAL_ARGS:-} --out "$WORK/length"
step plots "${PLOT_TIMEOUT:-60}" "$WORK/plots.log" \
    "$PYTHON" scripts/compare_runs.py "$WORK/multirun" --out "$WORK/compare"

for f in "$WORK"/multirun/*/metrics.jsonl; do
    [ -f "$f" ] && sed "s/^{/{\"run\": \"$(basename "$(dirname "$f")")\", /" "$f"
done >"$OUT/metrics.jsonl"
cp "$WORK"/length/length.json "$WORK"/compare/loss_vs_step.png "$WORK"/compare/loss_vs_time.png "$OUT"/ 2>/dev/null

{
    echo "# Forget gate ablation (experiment=fox_ablation)"
    echo
    "$PYTHON" -c 'import json, torch; from scripts.bench_common import environment
d = "cuda" if torch.cuda.is_available() else "cpu"; print(", ".join(f"{k} {v}" for k, v in environment(torch.device(d)).items()))'
    echo
    echo "Command: \`python train.py -m ${SWEEP[*]} $*\`, then \`python scripts/eval_length.py <multirun> --factors 1 2\`."
    echo "Final val loss: the run's last evaluation; tokens/s: the median of its log records after the first;"
    echo "val loss at Nx: its newest checkpoint on validation windows of N x model.block_size tokens."
    echo
    if [ -f "$WORK/length/length.md" ]; then cat "$WORK/length/length.md"; else echo "(no length table: see eval.log)"; fi
    echo
    echo "![loss against step](loss_vs_step.png)"
    for line in "${STATUS[@]+"${STATUS[@]}"}"; do echo; echo "**$line**"; done
} >"$OUT/ablation.md"
cat "$OUT/ablation.md"
ls "$OUT"
[ ${#STATUS[@]} -eq 0 ]
