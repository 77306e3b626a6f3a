# What the ablation scripts share (ablation_gate.sh, ablation_recipe.sh, time_to_first_step.sh,
# time_to_target.sh), sourced from the repository root with PYTHON set: each step under a time limit, with
# its failure recorded in STATUS; every run's records in one file; the environment line a table is
# labelled with; a run timed from the command with caches of its own.
STATUS=()

step() {  # step NAME SECONDS LOG COMMAND...: run COMMAND under a time limit, its output into LOG
    local name=$1 limit=$2 log=$3
    shift 3
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || STATUS+=("$name failed with status $rc$([ "$rc" -eq 124 ] && echo " (out of time)"); see $(basename "$log")")
}

tagged_records() {  # tagged_records MULTIRUN: every run's metrics.jsonl records, each tagged with its run folder
    for f in "$1"/*/metrics.jsonl; do
        [ -f "$f" ] && sed "s/^{/{\"run\": \"$(basename "$(dirname "$f")")\", /" "$f"
    done
}

environment_line() {  # the device, versions, commit and date, for a table's heading
    "$PYTHON" -c 'import torch; from scripts.bench_common import environment
d = "cuda" if torch.cuda.is_available() else "cpu"; print(", ".join(f"{k} {v}" for k, v in environment(torch.device(d)).items()))'
}

status_lines() {  # the failed steps, one paragraph each
    for line in "${STATUS[@]+"${STATUS[@]}"}"; do echo; echo "**$line**"; done
}

cached_run() {  # cached_run RUNS NAME CACHES LIMIT "LABELS" ARGS...: python train.py ARGS with every cache in the folder
                # CACHES (cold when it is new, warm when a run used it before: Inductor's FX graphs, AOTAutograd graphs and
                # autotuning, Triton's kernels, the flash kernel's tuning picks, the token cache) and its run folder
                # CACHES/run-NAME, under a time limit; its output into $OUT/NAME.log, its line (scripts/startup_report.py
                # collect, labelled with LABELS: key=value ...) added to the file RUNS
    local runs=$1 name=$2 caches=$3 limit=$4 labels=$5 started rc
    shift 5
    echo "== $name (limit ${limit}s)"
    started=$(date +%s.%N)
    TORCHINDUCTOR_CACHE_DIR="$caches/inductor" TRITON_CACHE_DIR="$caches/triton" XDG_CACHE_HOME="$caches/xdg" \
        timeout "$limit" "$PYTHON" train.py "$@" "data.cache_dir=$caches/data" "hydra.run.dir=$caches/run-$name" \
        >"$OUT/$name.log" 2>&1
    rc=$?
    # shellcheck disable=SC2086  # the labels are separate words
    "$PYTHON" -m scripts.startup_report collect "$caches/run-$name" $labels --status "$rc" \
        --wall "$(awk "BEGIN { print $(date +%s.%N) - $started }")" >>"$runs"
}
