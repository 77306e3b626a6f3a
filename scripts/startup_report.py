"""How soon runs get going and reach a target loss: one JSON line per run folder, then tables of them.

    python -m scripts.startup_report collect RUN_DIR --status 0 --wall 41.2 experiment=gpt2 compile=true cache=cold >> runs.jsonl
    python -m scripts.startup_report table runs.jsonl [--target 1.47]

``collect`` prints one line: the labels given (key=value), the command's exit status and wall time,
the run folder's run.json (the start's phases, the evaluations' time, torch.compile's disk-cache hits:
training/metrics.py, StartupClock) and, where it has evaluations, its validation curve with each
point's seconds from the command (the loop's start from the command plus the seconds from the loop's
start) and its milliseconds per optimizer step (from the median tokens/s, evaluations left out).
``table`` prints markdown: where each run's start went, phase by phase, and for runs with
evaluations when the validation loss first reached ``--target``. scripts/time_to_first_step.sh and
scripts/time_to_target.sh use both.
"""
import argparse
import json
import sys
from pathlib import Path
from typing import Optional

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

from omegaconf import OmegaConf  # noqa: E402

from scripts.compare_runs import load_run, read_config, run_info  # noqa: E402
from training.exits import ArgumentParser, exit_on_error, fail  # noqa: E402

PHASES = ("imports", "config", "device", "data", "model", "optimizer", "setup", "step 1", "step 2", "step 3")
CACHES = (("FX graph", "fxgraph_cache"), ("AOTAutograd", "autograd_cache"))


def collect(run_dir: Path, labels: dict, status, wall_s: Optional[float]) -> dict:
    """One run's line (see the module docstring); a run that wrote nothing (or was skipped: ``status`` says
    why) has its labels, status and wall time."""
    line = {**labels, "status": status, "wall_s": wall_s, **run_info(run_dir)}
    if not (run_dir / "metrics.jsonl").is_file():
        return line
    run = load_run(run_dir, run_dir.name)
    start = line.get("loop_start_s") or 0.0
    line["val_curve"] = [[step, start + seconds, loss] for step, seconds, loss in run["val_curve"]]
    cfg = read_config(run_dir / "config.yaml")
    tokens_per_step = (line.get("batch_size") or 0) * OmegaConf.select(cfg, "trainer.grad_accum", default=1) \
        * OmegaConf.select(cfg, "model.block_size", default=0)
    if run["tokens_per_s"] and tokens_per_step:
        line["ms_per_step"] = 1000 * tokens_per_step / run["tokens_per_s"]
    return line


def fmt(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def cache_counts(run: dict, prefix: str) -> str:
    """'hit/miss/bypass' of one of torch.compile's caches in the run, or '-' where nothing was compiled."""
    counts = run.get("compile_caches") or {}
    if not any(key.startswith(prefix) for key in counts):
        return "-"
    return "/".join(str(counts.get(f"{prefix}_{kind}", 0)) for kind in ("hit", "miss", "bypass"))


def time_in(run: dict, what: str, key: str):
    """Seconds the run spent in ``what`` ("evaluation", "checkpoint", ...): key "seconds" (all), "first_seconds"."""
    return ((run.get("time_in") or {}).get(what) or {}).get(key)


def name(run: dict) -> str:
    return " | ".join(str(run.get(key, "?")) for key in ("experiment", "compile", "cache"))


def status(run: dict) -> str:
    """ok, failed: <exit status>, or why the run was skipped."""
    if isinstance(run["status"], str):
        return run["status"]
    return "ok" if run["status"] == 0 else f"failed: {run['status']}" + (" (out of time)" if run["status"] == 124 else "")


def phases_table(runs) -> str:
    """Where each run's start went: seconds per phase, the first step's end and the first evaluation."""
    head = ["experiment", "compile", "caches", *PHASES, "step 1 ends (s from the command)", "first eval",
            *(f"{cache} cache hit/miss/bypass" for cache, _ in CACHES), "whole run", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        phases = run.get("startup_phases_s") or {}
        cells = [name(run), *(fmt(phases.get(phase)) for phase in PHASES), fmt(run.get("first_step_s")),
                 fmt(time_in(run, "evaluation", "first_seconds")), *(cache_counts(run, prefix) for _, prefix in CACHES),
                 fmt(run["wall_s"]), status(run)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_table(runs, target: float) -> str:
    """For runs with evaluations: when the validation loss first reached ``target``, the best and final
    validation loss, the speed of a step and what the evaluations cost."""
    head = ["experiment", "compile", "caches", f"first val <= {target}: step", f"first val <= {target}: s from the command",
            "best val (step)", "final val", "ms/step", "evaluations: count, s in all (first)",
            "checkpoints: s in all", "whole run", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        curve = run.get("val_curve")
        if curve is None:
            continue
        reached = next((point for point in curve if point[2] <= target), None)
        best = min(curve, key=lambda point: point[2]) if curve else None
        cells = [name(run), fmt(reached and reached[0], "d"), fmt(reached and reached[1]),
                 f"{best[2]:.4f} ({best[0]})" if best else "n/a", fmt(curve[-1][2] if curve else None, ".4f"),
                 fmt(run.get("ms_per_step"), ".2f"),
                 f"{time_in(run, 'evaluation', 'count') or 0}, {fmt(time_in(run, 'evaluation', 'seconds'))} "
                 f"({fmt(time_in(run, 'evaluation', 'first_seconds'))})",
                 fmt(sum(time_in(run, what, "seconds") or 0 for what in ("checkpoint", "best checkpoint"))),
                 fmt(run["wall_s"]), status(run)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def label(text: str) -> tuple:
    """A key=value argument of collect."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not key=value")
    return key, value


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="print one run's JSON line")
    c.add_argument("run_dir", type=Path)
    c.add_argument("labels", nargs="*", type=label, help="key=value pairs naming the run (experiment=..., cache=...)")
    done = c.add_mutually_exclusive_group(required=True)
    done.add_argument("--status", type=int, help="the command's exit status (with --wall)")
    done.add_argument("--skipped", metavar="WHY", help="the run was not started, for this reason")
    c.add_argument("--wall", type=float, help="the command's wall time in seconds")
    t = sub.add_parser("table", help="markdown tables of the lines")
    t.add_argument("runs", type=Path, help="a file of collect's lines")
    t.add_argument("--target", type=float, help="the validation loss to time (runs with evaluations)")
    args = p.parse_args(argv)
    if args.command == "collect":
        if args.status is not None and args.wall is None:
            fail("collect --status needs --wall (the command's wall time in seconds)")
        status = args.status if args.skipped is None else f"skipped: {args.skipped}"
        print(json.dumps(collect(args.run_dir, dict(args.labels), status, args.wall)))
        return
    if not args.runs.is_file():
        fail(f"{args.runs}: no such file of runs")
    runs = [json.loads(line) for line in args.runs.read_text().splitlines() if line.strip()]
    print(phases_table(runs))
    if args.target is not None:
        print()
        print(target_table(runs, args.target))


if __name__ == "__main__":
    with exit_on_error():
        main()
