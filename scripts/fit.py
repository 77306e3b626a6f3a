"""Find what trains within a GPU memory budget, per attention backend.

    python -m scripts.fit model=gpt2 trainer.vram_budget_gb=8
    python -m scripts.fit model=gpt2 --budgets 8,12,24 --backends naive,hybrid,sdpa,flash --out fit.json
    python -m scripts.fit experiment=gpt2 model.activation_checkpointing=true --budgets 8

For each backend: the largest micro-batch at the configured model.block_size, the longest sequence
at batch 1 (a multiple of 256, model.block_size raised as needed), and the grad_accum that reaches
--target-tokens tokens per optimizer step. Each answer comes from real training steps (forward,
backward, AdamW) on random tokens, uncompiled. Options with -- are this script's; the rest are the
same overrides as train.py.
"""
import argparse
import dataclasses
import json
import math
import sys
import warnings
from pathlib import Path

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402

from data.tokenizers import GPT2Tokenizer  # noqa: E402
from errors import UserError  # noqa: E402
from model.attention import BACKENDS  # noqa: E402
from model.config import padded_vocab  # noqa: E402
from training.cli import compose_config  # noqa: E402
from training.exits import ArgumentParser, exit_on_error  # noqa: E402
from training.fit import largest_batch, longest_sequence  # noqa: E402
from training.precision import apply_vram_budget, dtype_name, resolve_device, resolve_dtype  # noqa: E402


def parse_args(argv):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", help="comma-separated (default: attention= if given, else every backend)")
    p.add_argument("--budgets", help="comma-separated GiB budgets (default: trainer.vram_budget_gb or the whole GPU)")
    p.add_argument("--target-tokens", type=int, default=2**19, help="tokens per optimizer step to reach with grad_accum")
    p.add_argument("--max-len", type=int, default=131072, help="longest sequence to try")
    p.add_argument("--max-batch", type=int, default=512, help="largest micro-batch to try")
    p.add_argument("--out", help="also write the rows as JSON here")
    return p.parse_known_args(argv)


def main(argv=None) -> None:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = compose_config(overrides)
    device = resolve_device(cfg.trainer.device)
    if device.type != "cuda":
        raise UserError("scripts/fit.py measures GPU memory and needs a CUDA GPU (trainer.device=cuda)")
    dtype = resolve_dtype(cfg.trainer.dtype, device)
    chosen_attention = any(o.split("=")[0] in ("attention", "experiment") for o in overrides)
    backends = args.backends.split(",") if args.backends else ([cfg.attention.name] if chosen_attention else list(BACKENDS))
    total_gb = torch.cuda.get_device_properties(device).total_memory / 2**30
    budgets = [float(b) for b in args.budgets.split(",")] if args.budgets else [cfg.trainer.vram_budget_gb or total_gb]
    model_cfg = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or padded_vocab(GPT2Tokenizer.vocab_size), dropout=0.0)
    T = model_cfg.block_size
    print(f"# fit: model={model_cfg.name} ({model_cfg.n_layer}x{model_cfg.n_embd}), T={T}, {dtype_name(dtype)}, "
          f"activation_checkpointing={model_cfg.activation_checkpointing}, {torch.cuda.get_device_name(device)}, "
          f"torch {torch.__version__}")
    print("| budget GiB | backend | largest batch @T=%d | longest T @batch 1 | grad_accum for %d tokens |" % (T, args.target_tokens))
    print("|---|---|---|---|---|")
    rows = []
    for budget in budgets:
        apply_vram_budget(device, budget)
        for name in backends:
            attn = dataclasses.replace(cfg.attention, name=name)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                batch = largest_batch(model_cfg, attn, device, dtype, limit=args.max_batch)
                longest = longest_sequence(model_cfg, attn, device, dtype, limit=args.max_len)
            accum = math.ceil(args.target_tokens / (batch * T)) if batch else None
            rows.append({"budget_gb": budget, "backend": name, "block_size": T, "largest_batch": batch,
                         "longest_seq": longest, "grad_accum": accum})
            print(f"| {budget:g} | {name} | {batch} | {longest} | {accum if accum else 'n/a'} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                                              "dtype": dtype_name(dtype), "model": dataclasses.asdict(model_cfg),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    with exit_on_error(stopped="stopped; the rows printed so far are complete"):
        main()
