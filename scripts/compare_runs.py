"""Compare training runs end to end: one table and plots from their run folders.

    python train.py experiment=compare_backends model=tiny        # a multirun, one job per backend
    python -m scripts.compare_runs multirun/2026-11-23_10-00-00 --out compare/
    python -m scripts.compare_runs outputs/gpt2-flash-shakespeare outputs/gpt2-sdpa-shakespeare

A folder with metrics.jsonl is a run; any other folder stands for the runs in its sub-folders.
tokens/s and MFU are medians over the log records after the first (which holds compilation and
warm-up); peak VRAM is the largest record.
"""
import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

from omegaconf import OmegaConf  # noqa: E402

from data.folders import make_folder  # noqa: E402
from errors import UserError, first_line  # noqa: E402
from training.exits import ArgumentParser, exit_on_error, fail  # noqa: E402
from training.loggers import read_records  # noqa: E402

COLUMNS = ("run", "backend", "model", "tokens_per_s", "mfu", "peak_vram_mb", "train_loss", "val_loss", "wall_s", "steps")
HEADINGS = ("run", "backend", "model", "tokens/s", "MFU", "peak VRAM (MB)", "final train loss", "final val loss",
            "wall time (s)", "steps")


def natural_key(path: Path):
    """'10-flash' after '2-sdpa': digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def find_runs(paths):
    """[(run folder, name)] for the run folders (with metrics.jsonl) among ``paths`` and, for any
    other folder, anywhere below it (named by their path below it)."""
    runs = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            runs.append((p, p.name))
        elif p.is_dir():
            found = sorted((m.parent for m in p.rglob("metrics.jsonl")), key=natural_key)
            runs.extend((f, str(f.relative_to(p))) for f in found)
        else:
            fail(f"{p} is not a run folder (no metrics.jsonl) nor a folder of runs")
    if not runs:
        fail(f"no run folders (with metrics.jsonl) under {', '.join(paths)}")
    return runs


def load_run(folder: Path, name: str) -> dict:
    records, skipped = read_records(folder / "metrics.jsonl")
    if skipped:
        print(f"note: {folder / 'metrics.jsonl'}: skipped {skipped} line{'s' if skipped > 1 else ''} cut short "
              "(a run killed while writing it)", file=sys.stderr)
    train = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if r.get("val_loss") is not None]
    cfg = read_config(folder / "config.yaml")
    steady = train[1:] or train

    def median(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    peaks = [r["peak_vram_mb"] for r in train if r.get("peak_vram_mb") is not None]
    asked = OmegaConf.select(cfg, "attention.name", default="?")
    ran = run_info(folder).get("attention", asked)
    return {
        "run": name,
        "backend": asked if ran == asked else f"{asked} (ran {ran})",
        "model": OmegaConf.select(cfg, "model.name", default="?"),
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "peak_vram_mb": max(peaks) if peaks else None,
        "train_loss": train[-1]["loss"] if train else None,
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "wall_s": records[-1].get("elapsed_s") if records else None,
        "steps": max((r["step"] for r in records), default=0),
        "curve": [(r["step"], r["elapsed_s"], r["loss"]) for r in train],
        "val_curve": [(r["step"], r["elapsed_s"], r["val_loss"]) for r in evals],
        "env": environment(folder),
    }


def environment(folder: Path) -> str:
    """Device, dtype and versions from run.json (written by the training loop), or empty."""
    info = run_info(folder)
    return ", ".join(f"{k} {info[k]}" for k in ("device", "dtype", "torch", "triton") if info.get(k))


def run_info(folder: Path) -> dict:
    """run.json of a run folder ({} when there is none); UserError naming it when it is not a JSON object."""
    path = folder / "run.json"
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({first_line(err)}); restore it or remove it (the table then "
                        "lacks its device and versions)") from err
    if not isinstance(info, dict):
        raise UserError(f"{path} holds a JSON {type(info).__name__}, not the object a run writes; restore or remove it")
    return info


def read_config(path: Path):
    """A run's config.yaml (empty when there is none); UserError naming it when it is not a YAML mapping."""
    if not path.is_file():
        return OmegaConf.create()
    try:
        cfg = OmegaConf.load(path)
    except Exception as err:  # YAML syntax, or a list at the top
        raise UserError(f"{path} is not a run's config ({first_line(err)}); restore it or remove it (the table then "
                        "shows ? for its backend and model)") from err
    if not isinstance(cfg, type(OmegaConf.create())):
        raise UserError(f"{path} holds a YAML list, not a run's config; restore it or remove it")
    return cfg


def fmt(key, value) -> str:
    if value is None:
        return "n/a"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if key in ("peak_vram_mb", "wall_s"):
        return f"{value:,.1f}"
    if key in ("train_loss", "val_loss"):
        return f"{value:.4f}"
    return str(value)


def markdown(rows) -> str:
    envs = list(dict.fromkeys(r["env"] for r in rows if r["env"]))
    lines = [f"# {env}" for env in envs] + ["| " + " | ".join(HEADINGS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(k, r[k]) for k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for x_index, name, label in ((0, "loss_vs_step.png", "step"), (1, "loss_vs_time.png", "wall time (s)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, r in enumerate(rows):
            ax.plot([c[x_index] for c in r["curve"]], [c[2] for c in r["curve"]], color=f"C{i}",
                    label=f"{r['backend']} ({r['run']})")
            if r["val_curve"]:
                ax.plot([c[x_index] for c in r["val_curve"]], [c[2] for c in r["val_curve"]], color=f"C{i}",
                        linestyle="--", marker=".")
        ax.set_xlabel(label)
        ax.set_ylabel("loss (train solid, val dashed)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [f"{r['backend']}\n{r['run']}" for r in rows]
    left.bar(names, [r["tokens_per_s"] or 0 for r in rows])
    left.set_title("tokens/s")
    right.bar(names, [r["peak_vram_mb"] or 0 for r in rows])
    right.set_title("peak VRAM (MB)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput_memory.png", dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="run folders or folders of runs (a multirun folder)")
    p.add_argument("--out", help="folder for table.md, table.csv and the PNG plots")
    args = p.parse_args(argv)
    if args.out:
        make_folder(Path(args.out), "--out", args.out)  # a file there fails now, before the work
    rows = [load_run(folder, name) for folder, name in find_runs(args.paths)]
    table = markdown(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        (out / "table.md").write_text(table + "\n")
        with open(out / "table.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, out)
        print(f"wrote table.md, table.csv, loss_vs_step.png, loss_vs_time.png, throughput_memory.png to {out}")


if __name__ == "__main__":
    with exit_on_error(stopped="stopped"):
        main()
