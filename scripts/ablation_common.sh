# What the ablation scripts share (ablation_gate.sh, ablation_recipe.sh, time_to_first_step.sh), sourced
# from the repository root with PYTHON set: each step under a time limit, with its failure recorded in
# STATUS; every run's records in one file; the environment line a table is labelled with.
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
