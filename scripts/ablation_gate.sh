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
source scripts/ablation_common.sh

step training "${TRAIN_TIMEOUT:-400}" "$OUT/train.log" \
    "$PYTHON" train.py -m "${SWEEP[@]}" logger.progress=false trainer.resume=none hydra.sweep.dir="$WORK/multirun" "$@"
step "length test" "${EVAL_TIMEOUT:-120}" "$OUT/eval.log" \
    "$PYTHON" -m scripts.eval_length "$WORK/multirun" --factors 1 2 ${EVAL_ARGS:-} --out "$WORK/length"
step plots "${PLOT_TIMEOUT:-60}" "$WORK/plots.log" \
    "$PYTHON" -m scripts.compare_runs "$WORK/multirun" --out "$WORK/compare"

tagged_records "$WORK/multirun" >"$OUT/metrics.jsonl"
cp "$WORK"/length/length.json "$WORK"/compare/loss_vs_step.png "$WORK"/compare/loss_vs_time.png "$OUT"/ 2>/dev/null

{
    echo "# Forget gate ablation (experiment=fox_ablation)"
    echo
    environment_line
    echo
    echo "Command: \`python train.py -m ${SWEEP[*]} $*\`, then \`python -m scripts.eval_length <multirun> --factors 1 2\`."
    echo "Final val loss: the run's last evaluation; tokens/s: the median of its log records after the first;"
    echo "val loss at Nx: its newest checkpoint on validation windows of N x model.block_size tokens."
    echo
    if [ -f "$WORK/length/length.md" ]; then cat "$WORK/length/length.md"; else echo "(no length table: see eval.log)"; fi
    echo
    echo "![loss against step](loss_vs_step.png)"
    status_lines
} >"$OUT/ablation.md"
cat "$OUT/ablation.md"
ls "$OUT"
[ ${#STATUS[@]} -eq 0 ]
