#!/usr/bin/env bash
# One GPU run of the flash kernel's tests and measurements, for an H100 (about 8.5 minutes):
#
#   OUT=some/folder bash scripts/perf_round.sh
#
# Steps, each under its own `timeout` (a step that fails or runs out of time is logged and the next
# one runs):
#   a. the kernel tests on the GPU (flash incl. gate and dropout, the packed op, tuning, the
#      attention backends' dropout, the cross-entropy kernel), failures listed (-rf);
#      pytest-xdist with 14 workers when it imports, else one process;
#   b. scripts/profile_flash.py: host time per piece and per-kernel GPU time;
#   c. scripts/bench_attention.py --preset anchors: flash, FA2, cuDNN, flex, fwd and fwd+bwd, eager;
#   d. scripts/bench_flash.py --dropout 0.1: p=0.1 against p=0, ours and FA2;
#   e. scripts/bench_flash.py --gate: the forget gate's cost, beside FLA's parallel_attn (FLA from
#      /tmp/site when the coordinator installed its wheels there);
#   f. scripts/bench_flash.py --first-call: first call at new shapes, cold and warm caches.
#
# STEPS picks steps by name (default: all, "tests profile anchors dropout gate first-call"). On a
# fresh machine, whose Triton cache is empty, every step compiles its kernels first: the tests,
# gate and first-call steps then run past their limits (logged as exit 124). There, run the steps
# over two calls, e.g. STEPS=tests, then STEPS="profile anchors dropout gate first-call".
#
# Writes to "$OUT" run.log (every step's output, exit status and seconds) and each step's files:
# tests.txt, profile.md, anchors.md and anchors.csv, dropout.md, gate.md, first_call.md. Each
# report names the device, torch/triton versions, date and commit itself.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
ALL_STEPS="tests profile anchors dropout gate first-call"
STEPS=${STEPS-$ALL_STEPS}
listed() { case " $2 " in *" $1 "*) return 0;; *) return 1;; esac; }  # listed WORD LIST
for name in $STEPS; do
    listed "$name" "$ALL_STEPS" || { echo "perf_round.sh: unknown step '$name' in STEPS; use some of: $ALL_STEPS" >&2; exit 2; }
done
[ -n "${STEPS// /}" ] || { echo "perf_round.sh: STEPS is empty; use some of: $ALL_STEPS" >&2; exit 2; }
wanted() { listed "$1" "$STEPS"; }
mkdir -p "$OUT"
WORK=$(mktemp -d)
LOG="$OUT/run.log"
PY=${PYTHON:-python3}
SHAPES="16,12,1024,64;4,12,2048,64;8,16,2048,128"  # the two D=64 anchors and the first D=128 one
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, its output appended to run.log
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name (limit ${limit}s): $*" >> "$LOG"
    timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    echo "=== $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$LOG"
}

copy() {  # copy SRC DST: a result into $OUT, or a line saying it is missing
    if [ -f "$1" ]; then cp "$1" "$OUT/$2"; else echo "missing: $1 (see run.log)" > "$OUT/$2"; fi
}

{ echo "# perf_round $(date -u +%FT%TZ), commit ${NANOFLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo ?)}"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  $PY -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1; } >> "$LOG" 2>&1

if wanted tests; then
    TESTS=(tests/test_flash_kernel.py tests/test_flash_gate.py tests/test_flash_tuning.py tests/test_flash_backend.py
           tests/test_attention_dropout.py tests/test_cross_entropy.py)
    PARALLEL=()
    $PY -c "import xdist" 2>/dev/null && PARALLEL=(-n 14)
    step tests 165 $PY -m pytest "${PARALLEL[@]}" -v -rf --tb=line -p no:cacheprovider "${TESTS[@]}"
    # failures as they happen (-v: kept if the step runs out of time), the summary and the counts
    sed -n '/^=== tests (limit/,/^=== tests: exit/p' "$LOG" | grep -E "FAILED|ERROR|[0-9]+ (passed|failed)|^=== tests" \
        > "$OUT/tests.txt"
fi

if wanted profile; then
    step profile 45 $PY -m scripts.profile_flash --out "$WORK/profile"
    copy "$WORK/profile/profile.md" profile.md
fi

if wanted anchors; then
    step anchors 95 $PY -m scripts.bench_attention --preset anchors --backends flash,sdpa-fa2,sdpa-cudnn,flex \
        --modes fwd,fwd+bwd --out "$WORK/anchors"
    copy "$WORK/anchors/summary.md" anchors.md
    copy "$WORK/anchors/results.csv" anchors.csv
fi

if wanted dropout; then
    step dropout 35 $PY -m scripts.bench_flash --dropout 0.1 --shapes "$SHAPES" --out "$WORK/dropout"
    copy "$WORK/dropout/dropout.md" dropout.md
fi

if wanted gate; then
    step gate 40 $PY -m scripts.bench_flash --gate --shapes "$SHAPES" --out "$WORK/gate"
    copy "$WORK/gate/gate.md" gate.md
fi

if wanted first-call; then
    step first-call 110 $PY -m scripts.bench_flash --first-call --out "$WORK/first_call"
    copy "$WORK/first_call/first_call.md" first_call.md
fi

rm -rf "$WORK"
ls -l "$OUT"
