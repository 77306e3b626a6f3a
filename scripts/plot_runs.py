"""Draw the plots of docs/BENCHMARKS.md that no benchmark script draws, from the raw results in docs/runs/.

    python -m scripts.plot_runs                   # writes docs/img/{flash_anchors,gpt2_end_to_end,fit_gpt2,cross_entropy,scaling_2xh200,baby_gpt_2026-11-24}.png
    python -m scripts.plot_runs --out /tmp/img    # elsewhere

The attention plots (anchors, T sweep, 8 GiB budget) come from bench_attention.py itself:
`python -m scripts.bench_attention --from-json docs/runs/bench_anchors_2026-11-23.json --out /tmp/anchors`.
Needs matplotlib.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import matplotlib  # noqa: E402
import matplotlib.ticker  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

from data.folders import make_folder  # noqa: E402
from training.exits import ArgumentParser, exit_on_error  # noqa: E402

RUNS = ROOT / "docs" / "runs"
H100 = "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0"


def markdown_rows(path: Path) -> list[list[str]]:
    """The cells of every markdown table row in ``path``, header and separator lines left out."""
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return [row for row in rows if row[0] not in ("B", "budget GiB", "n × V, dtype")]


def bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    """Grouped bars: one group per label in ``groups``, one bar per series."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def save(fig, out: Path, name: str, caption: str) -> None:
    fig.suptitle(caption, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / name, dpi=80)
    plt.close(fig)


def flash_anchors(out: Path) -> None:
    """Forward+backward TFLOP/s of ours, FA2 and cuDNN at the anchors: eager calls and CUDA-graph replays."""
    saved = json.loads((RUNS / "bench_flash_final_2026-11-23.json").read_text())
    rows = saved["rows"]
    shapes = [f"{r['B']}x{r['H']}x{r['T']}x{r['D']}" for r in rows]
    names = {"nanoflash": "flash (ours)", "sdpa_fa2": "SDPA FA2", "sdpa_cudnn": "SDPA cuDNN"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), sharey=True)
    for ax, key, title in ((axes[0], "fwd_bwd_tflops", "eager calls (do_bench)"),
                           (axes[1], "graph_fwd_bwd_tflops", "replayed CUDA graphs (GPU time)")):
        bars(ax, shapes, {label: [r[name][key] for r in rows] for name, label in names.items()},
             "TFLOP/s (causal)", f"forward+backward, bf16, {title}")
        ax.set_xlabel("B x H x T x D")
    meta = saved["meta"]
    save(fig, out, "flash_anchors.png", f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
         f"{meta['date'][:10]}, commit 0a2e569: {meta['command']}")


def metrics_records(path: Path) -> list[dict]:
    """The training records (those with a loss) of a run log that holds metrics.jsonl lines."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"step"')]
    return [r for r in records if "loss" in r]


def gpt2_end_to_end(out: Path) -> None:
    """Loss and tokens/s per logged step of experiment=gpt2 with flash and sdpa, grad_accum 4 and 1."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for accum in (4, 1):
        for backend in ("flash", "sdpa"):
            records = metrics_records(RUNS / f"gpt2_graph_{backend}_accum{accum}_2026-11-23.md")
            steps = [r["step"] for r in records]
            label = f"{backend}, grad_accum {accum} (median {statistics.median(r['tokens_per_s'] for r in records[1:]):,.0f})"
            style = "-" if backend == "flash" else "--"
            axes[0].plot(steps, [r["loss"] for r in records], style, label=label)
            axes[1].plot(steps[1:], [r["tokens_per_s"] for r in records[1:]], style, marker="o", ms=2, label=label)
    axes[0].set(xlabel="step", ylabel="train loss", title="loss")
    axes[1].set(xlabel="step", ylabel="tokens/s", title="tokens/s (the first record holds compilation)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, out, "gpt2_end_to_end.png", f"experiment=gpt2, 12 x 1024 per micro-batch, bf16, compiled, captured; "
         f"{H100}, 2026-11-23, commit a4d2d8d")


def baby_gpt(out: Path) -> None:
    """Validation loss against step of nanoGPT's baby GPT and of experiment=shakespeare_char with each backend."""
    day = RUNS / "2026-11-24"
    nanogpt = re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", (day / "baby_gpt" / "nanogpt.log").read_text())
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([int(s) for s, _ in nanogpt], [float(v) for _, v in nanogpt], "k-", lw=2, label="nanoGPT (its SDPA)")
    for folder, backend in (("baby_gpt", "flash"), *(("baby_backends", b) for b in ("sdpa", "naive", "hybrid", "tiled"))):
        records = [json.loads(line) for line in (day / folder / f"ours_{backend}.metrics.jsonl").read_text().splitlines()]
        evals = [r for r in records if r.get("val_loss") is not None]
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "-" if backend == "flash" else ":",
                label=f"nanoflash attention={backend}")
    ax.set(xlabel="step", ylabel="validation loss", ylim=(1.4, 2.6), title="baby GPT on Tiny Shakespeare (char)")
    ax.axhline(1.47, color="grey", lw=0.5)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, out, "baby_gpt_2026-11-24.png", f"{H100}, 2026-11-24, commits 068d4a3 (nanoGPT, flash) and 375cf3b (others)")


def fit_rows() -> list[tuple[float, str, int, int]]:
    """(budget GiB, backend, largest batch at T=1024, longest T at batch 1), without activation checkpointing."""
    rows = [(float(budget), backend, int(batch), int(longest))
            for budget, backend, batch, longest, _ in markdown_rows(RUNS / "fit_gpt2_8gb_chunked.txt")]
    for name in ("fit_gpt2_hybrid_8_12_24gb_2026-11-23.json", "fit_gpt2_sdpa_8gb_2026-11-23.json",
                 "fit_gpt2_12_24gb_2026-11-23.json"):
        rows += [(r["budget_gb"], r["backend"], r["largest_batch"], r["longest_seq"])
                 for r in json.loads((RUNS / name).read_text())["rows"]]
    return rows


def fit_gpt2(out: Path) -> None:
    """Largest batch and longest sequence of GPT-2 124M per backend under 8, 12 and 24 GiB."""
    rows = fit_rows()
    budgets = sorted({budget for budget, *_ in rows})
    found = {(budget, backend): (batch, longest) for budget, backend, batch, longest in rows}
    backends = ("naive", "hybrid", "sdpa", "flash")
    groups = [f"{b:g} GiB" for b in budgets]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, i, label in ((axes[0], 0, "largest micro-batch at T=1024"), (axes[1], 1, "longest T at batch 1")):
        bars(ax, groups, {name: [found[(b, name)][i] for b in budgets] for name in backends}, label, label)
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:,.0f}"))
    save(fig, out, "fit_gpt2.png", f"scripts/fit.py model=gpt2, bf16, no activation checkpointing; {H100}, 2026-11-22/23\n"
         "commits 36a6c2f (12, 24 GiB), c84a16d (hybrid; sdpa at 8 GiB), 5b33559 (naive and flash at 8 GiB)")


def cross_entropy(out: Path) -> None:
    """GB/s of the cross-entropy kernel's default tile against the PyTorch code, per case."""
    rows = markdown_rows(RUNS / "bench_cross_entropy_2026-11-23.md")
    cases = list(dict.fromkeys(row[0] for row in rows))
    picks = {"kernel (default tile)": "(default)", "PyTorch, torch.compile": "PyTorch, torch.compile",
             "PyTorch, eager": "PyTorch, eager"}
    series = {label: [next(float(r[3]) for r in rows if r[0] == case and match in r[1]) for case in cases]
              for label, match in picks.items()}
    fig, ax = plt.subplots(figsize=(9, 3.8))
    bars(ax, cases, series, "GB/s (one read + one write of the logits)", "logits -> row losses and softmax - onehot")
    save(fig, out, "cross_entropy.png", f"python -m scripts.bench_cross_entropy; {H100}, 2026-11-23, commit 802eb7c")


def scaling(out: Path) -> None:
    """tokens/s of experiment=gpt2 attention=flash on one H200, and on two with DDP and with FSDP2."""
    text = (RUNS / "scaling_2xh200_2026-11-23.md").read_text()
    found = {name: float(rate.replace(",", "")) for name, rate in re.findall(r"/tmp/scal/(\w+): median tok/s ([\d,]+)", text)}
    labels = {"1gpu": "1 GPU", "outer": "2 GPUs, DDP", "fsdp": "2 GPUs, FSDP2"}
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.bar(list(labels.values()), [found[name] for name in labels], color=["C0", "C1", "C2"])
    for x, name in enumerate(labels):
        ax.text(x, found[name], f"{found[name]:,.0f} ({found[name] / found['1gpu']:.2f}x)", ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="tokens/s (summed over ranks)", title="GPT-2 124M, flash, 12 x 1024 per GPU")
    ax.grid(True, axis="y", alpha=0.3)
    save(fig, out, "scaling_2xh200.png", "2 x NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-23, commit 849785f")


PLOTS = (flash_anchors, gpt2_end_to_end, fit_gpt2, cross_entropy, scaling, baby_gpt)


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder for the PNG files")
    args = p.parse_args(argv)
    make_folder(args.out, "--out", args.out)
    for plot in PLOTS:
        plot(args.out)
    print(f"wrote {len(PLOTS)} plots to {args.out}")


if __name__ == "__main__":
    with exit_on_error(stopped="stopped"):
        main()
