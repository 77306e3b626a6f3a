#!/usr/bin/env bash
# The recipe's ablation on the baby GPT (experiment=speedrun_char): one multirun of the baseline (every
# switch off), the baseline plus each switch alone, the full recipe, and the recipe minus each switch
# alone, all at speedrun_char's steps, schedule and evaluation; then a table (final and best val loss,
# step and seconds to TARGET, tokens/s) and plots of the val loss against steps and wall time.
#
#   OUT=bench/recipe bash scripts/ablation_recipe.sh                       # on a GPU: 22 runs
#   OUT=bench/recipe SIDES=add bash scripts/ablation_recipe.sh             # baseline, + each switch, recipe (12)
#   OUT=bench/recipe SIDES=remove bash scripts/ablation_recipe.sh          # baseline, recipe, - each switch (12)
#   ONTO=linux_corpus SIDES=none TARGET=base OUT=bench/linux bash scripts/ablation_recipe.sh model=gpt2
#                                                   # the second corpus: baseline and recipe, and how soon
#                                                   # the recipe reaches the baseline's final val loss
#   OUT=bench/recipe QUICK=1 bash scripts/ablation_recipe.sh               # the 22 runs in about 8 minutes
#   OUT=/tmp/recipe bash scripts/ablation_recipe.sh trainer.max_steps=4 trainer.device=cpu model.n_embd=36
#                                                   # extra overrides go to every run
#
# QUICK=1 fits the 22 runs into one GPU call of about 8 minutes (H100): half of speedrun_char's steps
# (trainer.max_steps=750; the warmup-stable-decay schedule follows the steps), evaluated every 50 steps
# on 10 batches (so the step at which TARGET is reached is known to 50 steps), uncompiled
# (trainer.compile=false: no job compiles, the steps are still captured as one CUDA graph), one
# checkpoint at the end and no best one, no sample; TRAIN_TIMEOUT 480 s. It is a shorter experiment
# than the full ablation, and ablation.md says which ran. Overrides given after still win.
#
# The switches and the variants' configs: scripts/recipe_ablation.py (each a generated experiment that
# builds on ONTO, default speedrun_char, found through train.py -cd). TARGET (default 1.47; base: the
# baseline's final val loss) is the val loss timed.
# Writes to $OUT: ablation.md (environment, command, table), table.md, metrics.jsonl (every run's
# records, each tagged with its run), val_vs_step.png, val_vs_time.png, train.log. The run folders go
# to $WORK (default: a fresh temporary folder). TRAIN_TIMEOUT (default 1500 s) limits the multirun;
# a step that fails or runs out is recorded in ablation.md and the report is made from what is there.
# Outside git (a copy of the tree) set NANOFLASH_COMMIT to the commit the copy was made from.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
WORK=${WORK:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
TARGET=${TARGET:-1.47}
mkdir -p "$OUT" "$WORK"
source scripts/ablation_common.sh

QUICK_ARGS=()
if [ "${QUICK:-0}" = 1 ]; then
    QUICK_ARGS=(trainer.max_steps=750 trainer.eval_interval=50 trainer.eval_iters=10 trainer.compile=false
                trainer.keep_best=false trainer.ckpt_interval=750 trainer.sample_tokens=0)
fi
SIDES=${SIDES:-add remove}
VARIANTS=$("$PYTHON" -m scripts.recipe_ablation variants --out "$WORK/configs" --onto "${ONTO:-speedrun_char}" \
           --sides ${SIDES/none/}) || exit 2
SWEEP=(-cd "$WORK/configs" "experiment=$VARIANTS")
step training "${TRAIN_TIMEOUT:-$([ ${#QUICK_ARGS[@]} -gt 0 ] && echo 480 || echo 1500)}" "$OUT/train.log" \
    "$PYTHON" train.py -m "${SWEEP[@]}" logger.progress=false trainer.resume=none hydra.sweep.dir="$WORK/multirun" \
    'hydra.sweep.subdir=${hydra.job.num}-${trainer.run_name}' "${QUICK_ARGS[@]+"${QUICK_ARGS[@]}"}" "$@"
step report 120 "$WORK/report.log" \
    "$PYTHON" -m scripts.recipe_ablation report "$WORK/multirun" --target "$TARGET" --out "$WORK/report"

tagged_records "$WORK/multirun" >"$OUT/metrics.jsonl"
cp "$WORK"/report/table.md "$WORK"/report/val_vs_step.png "$WORK"/report/val_vs_time.png "$OUT"/ 2>/dev/null

{
    echo "# The recipe's ablation (on experiment=${ONTO:-speedrun_char})"
    echo
    environment_line
    echo
    [ ${#QUICK_ARGS[@]} -gt 0 ] && echo "QUICK=1: the shorter ablation (${QUICK_ARGS[*]})." && echo
    echo "Command: \`python train.py -m -cd <configs> experiment=$VARIANTS ${QUICK_ARGS[*]+${QUICK_ARGS[*]} }$*\` (the variants written by"
    echo "\`python -m scripts.recipe_ablation variants\`), then \`python -m scripts.recipe_ablation report <multirun> --target $TARGET\`."
    echo "Seconds from each run's first log record (the steps before it carry the kernel builds, tuning and compilation, which the"
    echo "multirun's first job pays for the jobs after it: the last column); tokens/s: the median of a run's log records after the first."
    echo
    if [ -f "$WORK/report/table.md" ]; then cat "$WORK/report/table.md"; else echo "(no table: see report.log)"; fi
    echo
    echo "![val loss against step](val_vs_step.png)"
    echo "![val loss against wall time](val_vs_time.png)"
    status_lines
} >"$OUT/ablation.md"
cat "$OUT/ablation.md"
ls "$OUT"
[ ${#STATUS[@]} -eq 0 ]
