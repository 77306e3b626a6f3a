#!/usr/bin/env bash
# Data-parallel scaling: the same per-GPU micro-batch on one GPU, then on N GPUs with DDP and FSDP.
#
#   bash scripts/bench_scaling.sh 2 bench/scaling                      # model=gpt2, attention=flash
#   bash scripts/bench_scaling.sh 4 bench/scaling4 attention=sdpa      # extra overrides go to every run
#
# Writes one run folder per setting under the output folder and compare/table.md, whose tokens/s
# (summed over ranks) gives the scaling: N-GPU tokens/s / 1-GPU tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS=${1:-2}
OUT=${2:-bench/scaling}
shift $(( $# < 2 ? $# : 2 ))
COMMON=(experiment=gpt2 attention=flash trainer.max_steps=150 trainer.grad_accum=1 trainer.eval_interval=150
        trainer.eval_iters=5 trainer.log_interval=15 trainer.sample_tokens=0 logger.progress=false
        trainer.resume=none "$@")
python3 train.py "${COMMON[@]}" hydra.run.dir="$OUT/1gpu"
for kind in ddp fsdp; do
    python3 -m torch.distributed.run --standalone --nproc_per_node="$GPUS" train.py "${COMMON[@]}" trainer.distributed="$kind" \
        hydra.run.dir="$OUT/${GPUS}gpu-$kind"
done
python3 -m scripts.compare_runs "$OUT/1gpu" "$OUT/${GPUS}gpu-ddp" "$OUT/${GPUS}gpu-fsdp" --out "$OUT/compare"
