#!/usr/bin/env bash
# Context parallelism on 2 GPUs against 1: the longest sequence, tokens/s at T=32768, the loss curve.
#
#   bash scripts/bench_context_parallel.sh corpus                         # bench/cp/corpus.txt: Tiny Shakespeare x60
#   bash scripts/bench_context_parallel.sh longest 1 bench/cp/longest-1   # longest T at batch 1 on one GPU
#   bash scripts/bench_context_parallel.sh longest 2 bench/cp/longest-2   # ... with trainer.context_parallel=2 on 2 GPUs
#   bash scripts/bench_context_parallel.sh throughput bench/cp/throughput # T=32768: cp=2 vs DDP on 2 GPUs vs 1 GPU
#   bash scripts/bench_context_parallel.sh curve bench/cp/curve           # 100 steps at T=32768: cp=2 vs one GPU
#
# Every run is model=gpt2 attention=flash (strict) in bf16 on the corpus made by `corpus` (about 20M
# GPT-2 tokens, so the validation split holds sequences of up to about 2M tokens); extra overrides
# after the arguments go to every run (e.g. model.activation_checkpointing=true, the same for both
# `longest` runs). `longest` trains one step (uncompiled, as scripts/fit.py does) at T = START,
# doubling until one runs out of memory, then bisects to a multiple of STEP (START=65536 and
# STEP=16384 unless set); it prints each trial and the answer. `throughput` runs compiled with
# trainer.profile_steps=5 (profile.md: where a step's time goes, and how much NCCL time was hidden
# under other kernels) and writes compare/table.md. `curve` prints the largest loss difference.
set -euo pipefail
cd "$(dirname "$0")/.."
CORPUS=bench/cp/corpus.txt
COMMON=(model=gpt2 attention=flash attention.strict=true trainer.dtype=bf16 trainer.batch_size=1 trainer.grad_accum=1
        trainer.sample_tokens=0 trainer.resume=none logger.progress=false data.path="$CORPUS" data.name=shakespeare60)
TORCHRUN2=(python3 -m torch.distributed.run --standalone --nproc_per_node=2)
CP2=(trainer.distributed=ddp trainer.context_parallel=2)

make_corpus() {
    mkdir -p "$(dirname "$CORPUS")"
    python3 -c "import pathlib, sys; text = pathlib.Path('data/tinyshakespeare/input.txt').read_text(); \
pathlib.Path(sys.argv[1]).write_text(text * 60)" "$CORPUS"
    echo "wrote $CORPUS ($(du -h "$CORPUS" | cut -f1))"
}

fits() {  # fits N T OUT: 0 when one step at batch 1 and T tokens trains on N GPUs, 1 when it runs out of memory
    local n=$1 T=$2 dir=$3/T$2
    local launch=(python3) cp=()
    if [ "$n" -gt 1 ]; then launch=(python3 -m torch.distributed.run --standalone --nproc_per_node="$n")
                            cp=(trainer.distributed=ddp trainer.context_parallel="$n"); fi
    mkdir -p "$dir"
    if "${launch[@]}" train.py "${COMMON[@]}" "${cp[@]}" model.block_size="$T" trainer.max_steps=1 \
        trainer.eval_iters=1 hydra.run.dir="$dir" "${EXTRA[@]}" > "$dir/log.txt" 2>&1; then
        echo "| $n | $T | trains | $(grep -o '"peak_vram_mb": [0-9.]*' "$dir/metrics.jsonl" | tail -1 | cut -d' ' -f2) |"
        return 0
    fi
    if grep -qiE "out of (gpu )?memory|cudaMalloc|failed to cuda calloc" "$dir/log.txt"; then
        echo "| $n | $T | out of memory | |"
        return 1
    fi
    echo "T=$T on $n GPU(s) failed for another reason ($dir/log.txt):" >&2
    tail -5 "$dir/log.txt" >&2
    exit 1
}

longest() {  # longest N OUT: the longest multiple of STEP that trains, from START up
    local n=$1 out=$2 step=${STEP:-16384} good=0 bad=0 T=${START:-65536}
    echo "| GPUs | T | result | peak MB |"
    echo "|---|---|---|---|"
    while [ "$bad" = 0 ]; do
        if fits "$n" "$T" "$out"; then good=$T; T=$((T * 2)); else bad=$T; fi
    done
    while [ $((bad - good)) -gt "$step" ]; do
        T=$(( (good + bad) / 2 / step * step ))
        if fits "$n" "$T" "$out"; then good=$T; else bad=$T; fi
    done
    echo "longest T on $n GPU(s) at batch 1: $good (the next multiple of $step runs out of memory)"
}

throughput() {  # throughput OUT: the same 2 x 32768 tokens per step as cp=2, as DDP, and half of it on 1 GPU
    local out=$1
    local run=(model.block_size=32768 trainer.compile=true trainer.max_steps=40 trainer.profile_steps=5
               trainer.log_interval=5 trainer.eval_interval=1000 trainer.eval_iters=1)
    "${TORCHRUN2[@]}" train.py "${COMMON[@]}" "${run[@]}" "${CP2[@]}" trainer.batch_size=2 hydra.run.dir="$out/cp2" "${EXTRA[@]}"
    "${TORCHRUN2[@]}" train.py "${COMMON[@]}" "${run[@]}" trainer.distributed=ddp hydra.run.dir="$out/ddp2" "${EXTRA[@]}"
    python3 train.py "${COMMON[@]}" "${run[@]}" hydra.run.dir="$out/1gpu" "${EXTRA[@]}"
    python3 scripts/compare_runs.py "$out/1gpu" "$out/ddp2" "$out/cp2" --out "$out/compare"
    grep -h "Communication kernels" "$out"/*/profile.md || true
}

curve() {  # curve OUT: 100 steps at T=32768, batch 1, one GPU and cp=2 on 2 GPUs (the same batches)
    local out=$1
    local run=(model.block_size=32768 trainer.compile=true trainer.max_steps=100 trainer.log_interval=1
               trainer.eval_interval=50 trainer.eval_iters=5)
    python3 train.py "${COMMON[@]}" "${run[@]}" hydra.run.dir="$out/1gpu" "${EXTRA[@]}"
    "${TORCHRUN2[@]}" train.py "${COMMON[@]}" "${run[@]}" "${CP2[@]}" hydra.run.dir="$out/cp2" "${EXTRA[@]}"
    python3 - "$out/1gpu/metrics.jsonl" "$out/cp2/metrics.jsonl" <<'EOF'
import json, sys
one, cp = ({r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r} for p in sys.argv[1:])
worst = max(one, key=lambda s: abs(one[s] - cp[s]) / one[s])
print(f"{len(one)} steps; largest relative loss difference {abs(one[worst] - cp[worst]) / one[worst]:.2e} at step "
      f"{worst} ({one[worst]:.4f} on one GPU, {cp[worst]:.4f} with cp=2); last step {one[max(one)]:.4f} vs {cp[max(cp)]:.4f}")
EOF
}

what=${1:?"corpus | longest N OUT | throughput OUT | curve OUT"}
shift
case "$what" in
    corpus) make_corpus ;;
    longest) n=$1 out=$2; shift 2; EXTRA=("$@"); longest "$n" "$out" ;;
    throughput) out=$1; shift; EXTRA=("$@"); throughput "$out" ;;
    curve) out=$1; shift; EXTRA=("$@"); curve "$out" ;;
    *) echo "unknown: $what (corpus | longest N OUT | throughput OUT | curve OUT)" >&2; exit 2 ;;
esac
