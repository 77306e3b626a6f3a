#!/usr/bin/env bash
# Context parallelism on 2 GPUs against 1: the longest sequence, tokens/s at T=32768, the loss curve.
#
#   bash scripts/bench_context_parallel.sh corpus                         # bench/cp/corpus.txt: Tiny Shakespeare x60
#   bash scripts/bench_context_parallel.sh longest 1 bench/cp/longest-1   # longest T at batch 1 on one GPU
#   bash scripts/bench_context_parallel.sh longest 2 bench/cp/longest-2   # ... with trainer.context_parallel=2 on 2 GPUs
#   bash scripts/bench_context_parallel.sh trial 2 786432 bench/cp/trial  # one of longest's trials: does T train?
#   bash scripts/bench_context_parallel.sh throughput bench/cp/throughput # T=32768: cp=2 vs DDP, 2 GPUs each
#   bash scripts/bench_context_parallel.sh curve bench/cp/curve           # 100 steps at T=32768: cp=2 vs one GPU
#   bash scripts/bench_context_parallel.sh curve-one bench/cp/curve       # the curve's one-GPU run alone (e.g. on
#   bash scripts/bench_context_parallel.sh curve-cp2 bench/cp/curve       # a free GPU), then its cp=2 run and the diff
#
# Every run is model=gpt2 attention=flash (strict) in bf16 on the corpus made by `corpus` (about 20M
# GPT-2 tokens, so the validation split holds sequences of up to about 2M tokens); extra overrides
# after the arguments go to every run (e.g. model.activation_checkpointing=true, the same for both
# `longest` runs). `longest` trains one step (uncompiled, as scripts/fit.py does) per trial: at
# START and 2 START (START=131072 unless set), whose peak memory gives a line that predicts the
# longest T for the GPU's memory; then from that guess, walking by STEP (16384 unless set; the
# stride doubles) until T fits and T + STEP does not. Under context parallelism DIST=ddp (default)
# or fsdp picks trainer.distributed. It prints each trial (peak MB, seconds) and the answer.
# `throughput` runs compiled with trainer.profile_steps=5 (profile.md: where a step's time goes,
# and how much NCCL time was hidden under other kernels) and writes compare/table.md. `curve`
# prints the largest loss difference.
set -euo pipefail
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

fits() {  # fits N T OUT: 0 when one step at batch 1 and T tokens trains on N GPUs (PEAK_MB: its peak), 1 out of memory
    local n=$1 T=$2 dir=$3/T$2
    local launch=(python3) cp=()
    if [ "$n" -gt 1 ]; then launch=(python3 -m torch.distributed.run --standalone --nproc_per_node="$n")
                            cp=(trainer.distributed="${DIST:-ddp}" trainer.context_parallel="$n"); fi
    mkdir -p "$dir"
    local started=$SECONDS ok=0
    "${launch[@]}" train.py "${COMMON[@]}" "${cp[@]}" model.block_size="$T" trainer.max_steps=1 \
        trainer.eval_iters=1 hydra.run.dir="$dir" "${EXTRA[@]}" > "$dir/log.txt" 2>&1 || ok=$?
    rm -rf "$dir/checkpoints"  # one step's checkpoint: gigabytes of position table and moments at these T
    if [ "$ok" = 0 ]; then
        PEAK_MB=$(grep -o '"peak_vram_mb": [0-9.]*' "$dir/metrics.jsonl" | tail -1 | cut -d' ' -f2)
        echo "| $n | $T | trains | $PEAK_MB | $((SECONDS - started)) |"
        return 0
    fi
    if grep -qiE "out of (gpu )?memory|cudaMalloc|failed to cuda calloc" "$dir/log.txt"; then
        echo "| $n | $T | out of memory | | $((SECONDS - started)) |"
        return 1
    fi
    echo "T=$T on $n GPU(s) failed for another reason ($dir/log.txt):" >&2
    tail -5 "$dir/log.txt" >&2
    exit 1
}

gpu_memory_mb() {  # the memory of the first GPU this process sees, in MiB
    python3 -c "import torch; print(torch.cuda.mem_get_info()[1] // 2**20)"
}

longest() {  # longest N OUT: the longest multiple of STEP that trains at batch 1
    # START and 2 START (both should fit) give the line peak = c + s T; from the GPU's memory it
    # predicts the longest T; trials then walk from that guess (doubling their stride) until one
    # fits and one STEP longer does not.
    local n=$1 out=$2 step=${STEP:-16384} start=${START:-131072} good=0 bad=0 T per_1k peak1 stride guess_failed=0
    positive START "$start"
    positive STEP "$step"
    local total_mb
    total_mb=$(gpu_memory_mb)
    echo "| GPUs | T | result | peak MB | seconds |"
    echo "|---|---|---|---|---|"
    probe() { if fits "$n" "$1" "$out"; then good=$1; return 0; else bad=$1; return 1; fi; }
    if probe "$start"; then
        peak1=$PEAK_MB
        if probe $((2 * start)); then
            read -r T per_1k < <(python3 -c "import sys; t1, p1, t2, p2, total, step = map(float, sys.argv[1:]); \
s = (p2 - p1) / (t2 - t1); print(int((t1 + (total - p1) / s) // step * step), f'{s * 1024:.1f}')" \
                "$start" "$peak1" $((2 * start)) "$PEAK_MB" "$total_mb" "$step")
            echo "peak grows by $per_1k MB per 1024 tokens; $total_mb MB on the GPU: guess T = $T"
            [ "$T" -gt "$good" ] || T=$((good + step))
            probe "$T" || guess_failed=1
        fi
    fi
    stride=$step
    while [ "$bad" = 0 ]; do probe $((good + stride)) || true; stride=$((stride * 2)); done
    stride=$step
    while [ $((bad - good)) -gt "$step" ]; do
        if [ "$guess_failed" = 1 ] && [ $((bad - stride)) -gt "$good" ]; then T=$((bad - stride)); stride=$((stride * 2))
        else T=$(( (good + bad) / 2 / step * step )); fi
        probe "$T" || continue
        guess_failed=0
    done
    echo "longest T on $n GPU(s) at batch 1: $good (the next multiple of $step runs out of memory)"
}

throughput() {  # throughput OUT: the same 2 x 32768 tokens per step with cp=2 and with DDP on 2 GPUs
    local out=$1
    local run=(model.block_size=32768 trainer.compile=true trainer.max_steps=40 trainer.profile_steps=5
               trainer.log_interval=5 trainer.eval_interval=1000 trainer.eval_iters=1)
    "${TORCHRUN2[@]}" train.py "${COMMON[@]}" "${run[@]}" "${CP2[@]}" trainer.batch_size=2 hydra.run.dir="$out/cp2" "${EXTRA[@]}"
    "${TORCHRUN2[@]}" train.py "${COMMON[@]}" "${run[@]}" trainer.distributed=ddp hydra.run.dir="$out/ddp2" "${EXTRA[@]}"
    python3 -m scripts.compare_runs "$out/ddp2" "$out/cp2" --out "$out/compare"
    grep -H "Communication kernels" "$out"/*/profile.md || true
}

CURVE=(model.block_size=32768 trainer.compile=true trainer.max_steps=100 trainer.log_interval=1
       trainer.eval_interval=50 trainer.eval_iters=5)

curve_one() {  # curve_one OUT: 100 steps at T=32768, batch 1, on one GPU
    python3 train.py "${COMMON[@]}" "${CURVE[@]}" hydra.run.dir="$1/1gpu" "${EXTRA[@]}"
}

curve_cp2() {  # curve_cp2 OUT: the same steps and batches with cp=2 on 2 GPUs
    "${TORCHRUN2[@]}" train.py "${COMMON[@]}" "${CURVE[@]}" "${CP2[@]}" hydra.run.dir="$1/cp2" "${EXTRA[@]}"
}

curve_compare() {  # curve_compare OUT: the largest relative loss difference between the two
    python3 - "$1/1gpu/metrics.jsonl" "$1/cp2/metrics.jsonl" <<'EOF'
import json, sys
one, cp = ({r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r} for p in sys.argv[1:])
worst = max(one, key=lambda s: abs(one[s] - cp[s]) / one[s])
print(f"{len(one)} steps; largest relative loss difference {abs(one[worst] - cp[worst]) / one[worst]:.2e} at step "
      f"{worst} ({one[worst]:.4f} on one GPU, {cp[worst]:.4f} with cp=2); last step {one[max(one)]:.4f} vs {cp[max(cp)]:.4f}")
EOF
}

USAGE="corpus | longest N OUT | trial N T OUT | throughput OUT | curve OUT | curve-one OUT | curve-cp2 OUT"

usage() {  # usage WHY: one line on stderr, exit status 2
    echo "bench_context_parallel.sh: $1 (usage: bash scripts/bench_context_parallel.sh $USAGE [overrides])" >&2
    exit 2
}

positive() {  # positive NAME VALUE: a positive integer, or usage
    [[ $2 =~ ^[1-9][0-9]*$ ]] || usage "$1=$2 must be a positive integer"
}

main() {
    [ $# -ge 1 ] || usage "name what to run"
    case "${DIST:-ddp}" in ddp|fsdp) ;; *) usage "DIST=$DIST must be ddp or fsdp" ;; esac
    local what=$1
    shift
    case "$what" in
        corpus) make_corpus ;;
        longest) [ $# -ge 2 ] || usage "longest needs N and OUT"; positive N "$1"
                 n=$1 out=$2; shift 2; EXTRA=("$@"); longest "$n" "$out" ;;
        trial) [ $# -ge 3 ] || usage "trial needs N, T and OUT"; positive N "$1"; positive T "$2"
               n=$1 T=$2 out=$3; shift 3; EXTRA=("$@"); echo "| GPUs | T | result | peak MB | seconds |"; fits "$n" "$T" "$out" ;;
        throughput|curve|curve-one|curve-cp2) [ $# -ge 1 ] || usage "$what needs OUT"
               out=$1; shift; EXTRA=("$@")
               case "$what" in
                   throughput) throughput "$out" ;;
                   curve) curve_one "$out"; curve_cp2 "$out"; curve_compare "$out" ;;
                   curve-one) curve_one "$out" ;;
                   curve-cp2) curve_cp2 "$out"; curve_compare "$out" ;;
               esac ;;
        *) usage "unknown: $what" ;;
    esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced (tests source it to check the search)
    cd "$(dirname "$0")/.."
    main "$@"
fi
