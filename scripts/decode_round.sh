#!/usr/bin/env bash
# One GPU run of the KV cache's and the decode kernel's tests and measurements (about 6 minutes on an
# H100 or H200):
#
#   bash scripts/decode_round.sh OUT
#
# Steps, each under its own `timeout` (a step that fails or runs out of time is logged and the next
# one runs):
#   a. tests: the decode kernel's and the KV cache's tests (tests/test_flash_decoding.py,
#      tests/test_kv_cache.py), failures listed; pytest-xdist with 8 workers when it imports;
#   b. checkpoint: GPT-2 124M trained 2 steps (experiment=gpt2, uncompiled), as sample.py's input;
#   c. sample: scripts/sample.py on it, 256 tokens with --timings: cold (Triton's and Inductor's
#      caches empty), warm (the same command again), warm with --samples 8, and warm with cuDNN
#      taken out of SDPA's choices for the prefill (torch.backends.cuda.enable_cudnn_sdp(False));
#   d. generate: scripts/bench_decode.py --parts generate (batch 1 and 8);
#   e. kernel: scripts/bench_decode.py --parts kernel at round 1's shapes (batch 1, 8, 32; caches of
#      1k to 64k);
#   f. sweep: scripts/bench_decode.py --parts sweep (launch settings, both head shapes, batch 1 and 8).
#
# STEPS picks steps by name (default: all, "tests checkpoint sample generate kernel sweep"; sample
# needs checkpoint's run). Writes to OUT: run.log (each step's command, exit status and seconds),
# env.txt, tests.log, train.log, sample256_cold.log, sample256_warm.log, sample256x8_warm.log,
# sample256_nocudnn_warm.log (each with the text, the --timings lines and bash's `time`), decode_generate.log, decode_kernel.log,
# decode_sweep.log, and decode/ (bench_decode's tables: generate.md/.json, kernel.md/.csv,
# sweep.md/.csv, env.json). PYTHON picks the interpreter; RUN names the run folder (default: a
# temporary one, removed at the end); wheels in /tmp/site (hydra-core on the GPU image) are put on
# PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: bash scripts/decode_round.sh OUT (the folder for the logs)" >&2; exit 2; }
OUT=$1
ALL_STEPS="tests checkpoint sample generate kernel sweep"
STEPS=${STEPS-$ALL_STEPS}
listed() { case " $2 " in *" $1 "*) return 0;; *) return 1;; esac; }  # listed WORD LIST
for name in $STEPS; do
    listed "$name" "$ALL_STEPS" || { echo "decode_round.sh: unknown step '$name' in STEPS; use some of: $ALL_STEPS" >&2; exit 2; }
done
[ -n "${STEPS// /}" ] || { echo "decode_round.sh: STEPS is empty; use some of: $ALL_STEPS" >&2; exit 2; }
wanted() { listed "$1" "$STEPS"; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
LOG="$OUT/run.log"
PY=${PYTHON:-python3}
RUN=${RUN:-$WORK/gpt2run}  # the checkpoint step's run folder; another run's folder to sample from it
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS FILE CMD...: run CMD under a time limit, its output in FILE
    local name=$1 limit=$2 file=$3 start rc
    shift 3
    start=$(date +%s)
    echo "=== $name (limit ${limit}s): $*" >> "$LOG"
    timeout --kill-after=10 "$limit" "$@" > "$file" 2>&1
    rc=$?
    echo "=== $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$LOG"
}

sample() {  # sample FILE NAME OPTIONS START...: python START... (how sample.py starts) on the run, 256 tokens, timed,
            # then OPTIONS (one string, split into words); caches in $WORK/caches
    local file=$1 name=$2 options=$3
    shift 3
    # shellcheck disable=SC2086  # the options are separate words
    step "$name" 120 "$file" env TRITON_CACHE_DIR="$WORK/caches/triton" \
        TORCHINDUCTOR_CACHE_DIR="$WORK/caches/inductor" XDG_CACHE_HOME="$WORK/caches/xdg" \
        bash -c 'TIMEFORMAT="real %3R s, user %3U s, sys %3S s"; time "$@"' _ "$PY" "$@" "$RUN" --tokens 256 --timings $options
}
# sample.py with cuDNN taken out of SDPA's choices (its prefill then runs FlashAttention-2): cuDNN builds an
# execution plan at the first call of each shape in a process, which the prefill's --timings line includes.
NO_CUDNN="import runpy, torch; torch.backends.cuda.enable_cudnn_sdp(False); \
runpy.run_module('scripts.sample', run_name='__main__', alter_sys=True)"

{ echo "decode_round $(date -u +%FT%TZ), commit ${NANOFLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo ?)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  $PY -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if wanted tests; then
    PARALLEL=()
    $PY -c "import xdist" 2>/dev/null && PARALLEL=(-n 8)
    step tests 200 "$OUT/tests.log" "$PY" -m pytest "${PARALLEL[@]}" -q -rf -p no:cacheprovider \
        tests/test_flash_decoding.py tests/test_kv_cache.py
fi
if wanted checkpoint; then
    step checkpoint 180 "$OUT/train.log" "$PY" train.py experiment=gpt2 trainer.max_steps=2 trainer.compile=false \
        trainer.cuda_graph=false trainer.sample_tokens=0 trainer.eval_iters=1 logger.progress=false \
        "data.cache_dir=$WORK/data" "hydra.run.dir=$RUN"
fi
if wanted sample; then
    sample "$OUT/sample256_cold.log" "sample.py" "" -m scripts.sample
    sample "$OUT/sample256_warm.log" "sample.py" "" -m scripts.sample
    sample "$OUT/sample256x8_warm.log" "sample.py --samples 8" "--samples 8" -m scripts.sample
    sample "$OUT/sample256_nocudnn_warm.log" "sample.py without cuDNN" "" -c "$NO_CUDNN"
fi
if wanted generate; then
    step generate 240 "$OUT/decode_generate.log" "$PY" -m scripts.bench_decode --out "$OUT/decode" --parts generate \
        --batches 1,8
fi
if wanted kernel; then
    step kernel 180 "$OUT/decode_kernel.log" "$PY" -m scripts.bench_decode --out "$OUT/decode" --parts kernel \
        --kernel-batches 1,8,32 --lengths 1024,4096,16384,32768,65536
fi
if wanted sweep; then
    step sweep 180 "$OUT/decode_sweep.log" "$PY" -m scripts.bench_decode --out "$OUT/decode" --parts sweep
fi
rm -rf "$WORK"
! grep -q ': exit [1-9]' "$LOG"
