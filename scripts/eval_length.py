"""Validation loss of trained runs at multiples of their training context (length extrapolation).

    python -m scripts.eval_length multirun/2026-11-25_10-00-00 --out length/   # every run below the folder
    python -m scripts.eval_length outputs/run-a outputs/run-b --factors 1 2 4 --batches 20

Each run's newest checkpoint is evaluated on the validation split of its own data at sequence
lengths factor x model.block_size (the same seed, so the same window starts at every length),
with the run's attention backend (flash falls back to sdpa where it cannot run). A learned position
table has block_size rows, so a model.pos=learned run is n/a beyond 1x; RoPE, no positions and the
forget gate work at any length. The table also holds each run's final validation loss and median
tokens/s from its metrics.jsonl (scripts/compare_runs.py). Writes length.md and length.json to --out.
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402

from data.config import DataConfig  # noqa: E402
from data.loader import BatchLoader  # noqa: E402
from data.prepare import prepare  # noqa: E402
from errors import UserError  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from model.attention import build_attention  # noqa: E402
from model.config import AttentionConfig  # noqa: E402
from scripts.compare_runs import find_runs, fmt, load_run  # noqa: E402
from training.checkpoint import latest_checkpoint, load_into_plain_model, validate_checkpoint  # noqa: E402
from training.exits import ArgumentParser, exit_on_error  # noqa: E402
from training.precision import autocast, resolve_device, resolve_dtype  # noqa: E402

SEED = 4242  # the validation windows' seed, the same for every run and length


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="run folders or folders of runs (a multirun folder)")
    p.add_argument("--factors", type=int, nargs="+", default=[1, 2], help="lengths as multiples of model.block_size")
    p.add_argument("--batches", type=int, default=20, help="validation batches per length")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (batch size = tokens // length, at least 1)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", help="folder for length.md and length.json")
    return p.parse_args(argv)


def why_not(model_cfg: ModelConfig, length: int) -> str:
    """Why a model cannot be evaluated at ``length`` tokens; empty when it can."""
    if model_cfg.pos == "learned" and length > model_cfg.block_size:
        return f"n/a (learned positions: a table of {model_cfg.block_size} rows)"
    return ""


@torch.no_grad()
def val_loss(model: GPT, data, length: int, args, device, dtype) -> float:
    """Mean loss over ``args.batches`` validation batches of ``length``-token windows."""
    loader = BatchLoader(data.val_path, data.dtype, block_size=length, batch_size=max(1, args.tokens // length),
                         seed=SEED, device=device)
    total = 0.0
    for _ in range(args.batches):
        x, y, _ = loader.next_batch()
        with autocast(device, dtype):
            total += model(x, y)[1].float().item()
    return total / args.batches


def evaluate_run(folder: Path, args, device, dtype) -> dict:
    """{factor: loss or the reason there is none} at each length, for the newest checkpoint of ``folder``."""
    path, state = latest_checkpoint(folder)
    if state is None:
        raise UserError(f"{folder} holds no checkpoint to evaluate; train it with checkpoints (trainer.ckpt_interval)")
    trained = validate_checkpoint(path, state)
    config = state["config"]
    data = prepare(DataConfig(**config.get("data", {})))
    backend, _ = build_attention(AttentionConfig(**config.get("attention", {})), device)
    results = {}
    for factor in args.factors:
        length = factor * trained.block_size
        reason = why_not(trained, length)
        if reason:
            results[factor] = reason
            continue
        model_cfg = dataclasses.replace(trained, block_size=max(length, trained.block_size), dropout=0.0,
                                        attention_dropout=None)
        model = GPT(model_cfg, backend).to(device).eval()
        validate_checkpoint(path, state, model)
        load_into_plain_model(path, state, model)
        results[factor] = val_loss(model, data, length, args, device, dtype)
    return {"checkpoint": str(path), "step": state["step"], "gate": trained.gate, "pos": trained.pos,
            "gate_bias_init": trained.gate_bias_init if trained.gate == "forget" else None,
            "block_size": trained.block_size, "losses": results}


def markdown(rows: list, factors: list) -> str:
    heads = ["run", "model.gate", "model.pos", "model.gate_bias_init", "steps", "final val loss", "tokens/s"]
    heads += [f"val loss at {f}x ({f * rows[0]['block_size']} tokens)" for f in factors]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        bias = "-" if r["gate_bias_init"] is None else f"{r['gate_bias_init']:g}"
        cells = [r["run"], r["gate"], r["pos"], bias, str(r["step"]), fmt("val_loss", r["val_loss"]),
                 fmt("tokens_per_s", r["tokens_per_s"])]
        cells += [v if isinstance(v, str) else f"{v:.4f}" for v in (r["losses"][f] for f in factors)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if min(args.factors) < 1 or args.batches < 1 or args.tokens < 1:
        raise UserError("--factors, --batches and --tokens must be positive")
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    rows = []
    for folder, name in find_runs(args.paths):
        run = load_run(folder, name)
        rows.append(dict(evaluate_run(folder, args, device, dtype), run=name, val_loss=run["val_loss"],
                         tokens_per_s=run["tokens_per_s"], env=run["env"]))
    table = markdown(rows, args.factors)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "length.md").write_text(table + "\n")
        (out / "length.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    with exit_on_error(stopped="stopped"):
        main()
