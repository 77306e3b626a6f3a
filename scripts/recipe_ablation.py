"""The recipe's ablation (scripts/ablation_recipe.sh runs it): its variants as experiment configs, and its report.

    python -m scripts.recipe_ablation variants --out WORK/configs      # writes them, prints their names
    python -m scripts.recipe_ablation variants --onto linux_corpus --sides --out WORK/configs   # base, recipe
    python -m scripts.recipe_ablation report WORK/multirun --target 1.47 --out OUT
    python -m scripts.recipe_ablation report WORK/multirun --target base --out OUT   # the baseline's final val

The switches (SWITCHES) are the settings in which experiment=speedrun_char differs from the schema's
defaults: on, a switch takes speedrun_char's value; off, the default (GPT-2 as nanoGPT trains it).
The variants, each an experiment config that builds on ``--onto`` (default speedrun_char: its steps,
schedule and evaluation): ``ablation_base`` (every switch off), ``ablation_base_plus_<switch>`` (one
on), ``ablation_recipe`` (every switch on) and ``ablation_recipe_minus_<switch>`` (one off).
``--sides add`` or ``remove`` writes only the baseline's or the recipe's half, ``--sides`` alone
neither: the two ends only.

The report: one table (final and best validation loss, the step and the seconds at which the validation
loss first reached ``--target``, that time over the baseline's whole run, tokens/s, the run's seconds, and
the seconds to the first log record) and plots of the validation loss against steps and against seconds,
the additions and the removals side by side. Seconds count from the first log record (the end of step
trainer.log_interval): the steps before it carry the kernel builds, tuning and compilation, which in a
multirun's one process the first job pays for the jobs after it; the last column shows them.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

from omegaconf import OmegaConf  # noqa: E402

from scripts.compare_runs import find_runs, load_run  # noqa: E402
from training.cli import fail  # noqa: E402
from training.exits import ArgumentParser, exit_on_error  # noqa: E402

SWITCHES = {  # name: the setting it turns on
    "muon": "optim.name", "qk_norm": "model.qk_norm", "relu2": "model.mlp", "zero_init": "model.zero_init",
    "softcap": "model.logit_softcap", "untied": "model.tie_embeddings", "value_embeds": "model.value_embeds",
    "unet": "model.skips", "rope": "model.pos", "rmsnorm": "model.norm",
}
RECIPE = "speedrun_char"


def switch_values(experiment: str = RECIPE) -> dict:
    """{switch: (off, on)}: the schema's default and the value experiment=<experiment> sets."""
    from hydra import compose, initialize_config_dir

    from training.config import TrainConfig, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        recipe = compose(config_name="train", overrides=["~local", f"experiment={experiment}"])
    defaults = OmegaConf.structured(TrainConfig())
    values = {name: (OmegaConf.select(defaults, key), OmegaConf.select(recipe, key)) for name, key in SWITCHES.items()}
    unchanged = [name for name, (off, on) in values.items() if off == on]
    if unchanged:
        fail(f"experiment={experiment} leaves {', '.join(unchanged)} at the default: nothing to ablate there")
    return values


def variants(sides) -> dict:
    """{variant name: {switch: on?}} in the report's order."""
    out = {"ablation_base": {name: False for name in SWITCHES}}
    if "add" in sides:
        out.update({f"ablation_base_plus_{s}": {name: name == s for name in SWITCHES} for s in SWITCHES})
    out["ablation_recipe"] = {name: True for name in SWITCHES}
    if "remove" in sides:
        out.update({f"ablation_recipe_minus_{s}": {name: name != s for name in SWITCHES} for s in SWITCHES})
    return out


def write_variants(out: Path, sides, onto: str) -> list:
    """One experiment file per variant, each built on experiment=<onto>, under out/experiment/; the names."""
    values = switch_values()
    folder = out / "experiment"
    folder.mkdir(parents=True, exist_ok=True)
    for name, on in variants(sides).items():
        settings = OmegaConf.create()
        for switch, key in SWITCHES.items():
            OmegaConf.update(settings, key, values[switch][1 if on[switch] else 0])
        OmegaConf.update(settings, "trainer.run_name", name)
        body = OmegaConf.to_yaml(settings)
        (folder / f"{name}.yaml").write_text(f"# @package _global_\n# {name}: written by scripts/recipe_ablation.py\n"
                                             f"defaults:\n  - {onto}\n{body}")
    return list(variants(sides))


def time_to(curve, target: float):
    """(step, seconds) of the first evaluation at or below ``target``, or (None, None)."""
    return next(((step, s) for step, s, loss in curve if loss <= target), (None, None))


def report_rows(multirun: Path, target) -> tuple:
    """(rows in the variants' order, the target loss: ``target``, or with "base" the baseline's final val)."""
    rows = []
    for folder, _ in find_runs([str(multirun)]):
        run = load_run(folder, folder.name)
        cfg = OmegaConf.load(folder / "config.yaml")
        vals = [loss for _, _, loss in run["val_curve"]]
        first_log_s = run["curve"][0][1] if run["curve"] else 0.0
        rows.append({"variant": OmegaConf.select(cfg, "trainer.run_name"), "final": vals[-1] if vals else None,
                     "best": min(vals) if vals else None, "tokens_per_s": run["tokens_per_s"],
                     "first_log_s": first_log_s, "wall_s": run["wall_s"] - first_log_s if run["wall_s"] else None,
                     "curve": [(step, s - first_log_s, loss) for step, s, loss in run["val_curve"]], "env": run["env"]})
    order = list(variants(("add", "remove")))
    rows.sort(key=lambda r: order.index(r["variant"]) if r["variant"] in order else len(order))
    base = next((r for r in rows if r["variant"] == "ablation_base"), None)
    if target == "base":
        if base is None or base["final"] is None:
            fail(f"--target base: {multirun} holds no finished ablation_base run to take the target from")
        target = base["final"]
    for r in rows:
        r["step"], r["seconds"] = time_to(r["curve"], float(target))
        r["share"] = r["seconds"] / base["wall_s"] if r["seconds"] is not None and base and base["wall_s"] else None
    return rows, float(target)


def markdown(rows, target: float) -> str:
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    lines = [f"| variant | final val | best val | step to val <= {target:.4f} | s to val <= {target:.4f} | "
             "x the baseline's run | tokens/s | run (s) | first log (s) |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {fmt(r['final'], '.4f')} | {fmt(r['best'], '.4f')} | {fmt(r['step'], 'd')} | "
              f"{fmt(r['seconds'], '.1f')} | {fmt(r['share'], '.2f')} | {fmt(r['tokens_per_s'], ',.0f')} | "
              f"{fmt(r['wall_s'], '.1f')} | {fmt(r['first_log_s'], '.1f')} |" for r in rows]
    return "\n".join(lines)


def plot(rows, target: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    halves = (("the baseline plus one switch", lambda v: "plus" in v or v in ("ablation_base", "ablation_recipe")),
              ("the recipe minus one switch", lambda v: "minus" in v or v in ("ablation_base", "ablation_recipe")))
    for x_index, name, label in ((0, "val_vs_step.png", "step"), (1, "val_vs_time.png", "seconds after the first log")):
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
        for ax, (title, keep) in zip(axes, halves):
            for i, r in enumerate(row for row in rows if keep(row["variant"])):
                style = {"color": "black", "linewidth": 2} if r["variant"] in ("ablation_base", "ablation_recipe") else {}
                ax.plot([c[x_index] for c in r["curve"]], [c[2] for c in r["curve"]], marker=".",
                        linestyle="--" if r["variant"] == "ablation_base" else "-",
                        label=r["variant"].removeprefix("ablation_"), **style)
            ax.axhline(target, color="grey", linewidth=0.8)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel(label)
            ax.legend(fontsize=7)
        axes[0].set_ylabel("validation loss")
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("variants", help="write the variants' experiment configs; print their names, comma-separated")
    v.add_argument("--out", required=True, help="a config folder (its experiment/ gets the files), for train.py -cd")
    v.add_argument("--sides", nargs="*", choices=("add", "remove"), default=["add", "remove"],
                   help="which halves (default both; none: the baseline and the recipe only)")
    v.add_argument("--onto", default=RECIPE, help=f"the experiment the variants build on (default {RECIPE})")
    r = sub.add_parser("report", help="table and plots of a finished ablation multirun")
    r.add_argument("multirun", help="the multirun folder")
    r.add_argument("--target", default="1.47", help="the validation loss to time (default 1.47), or base: the "
                                                   "baseline's final validation loss")
    r.add_argument("--out", required=True, help="folder for ablation.md's table (table.md) and the plots")
    args = p.parse_args(argv)
    if args.command == "variants":
        print(",".join(write_variants(Path(args.out), args.sides, args.onto)))
        return
    if args.target != "base":
        try:
            float(args.target)
        except ValueError:
            fail(f"--target {args.target}: give a validation loss (e.g. 1.47) or base")
    rows, target = report_rows(Path(args.multirun), args.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    envs = list(dict.fromkeys(row["env"] for row in rows if row["env"]))
    table = "\n".join([f"# {env}" for env in envs] + [markdown(rows, target)])
    (out / "table.md").write_text(table + "\n")
    plot(rows, target, out)
    print(table)


if __name__ == "__main__":
    with exit_on_error(stopped="stopped"):
        main()
