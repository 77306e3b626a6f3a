"""Generate text from a checkpoint.

    python scripts/sample.py outputs/tiny-sdpa-shakespeare --prompt "ROMEO:" --tokens 200
    python scripts/sample.py outputs/run/checkpoints/step_0000300.pt --temperature 0.7 --top-k 50
    python scripts/sample.py outputs/fsdp-run/checkpoints/step_0000300   # a sharded (FSDP) checkpoint

A run folder means its best checkpoint (checkpoints/best.pt, kept with trainer.keep_best=true) when
it has one, else its newest; the checkpoint used is named on stderr. The tokenizer comes from the
checkpoint itself, so it samples from any folder without the corpus or its token cache (a checkpoint
made before checkpoints carried their tokenizer rebuilds it from the data settings saved in it).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from data.config import DataConfig  # noqa: E402
from data.prepare import prepare  # noqa: E402
from data.tokenizers import load_tokenizer  # noqa: E402
from errors import UserError, check_finite, check_positive  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from model.attention import build_attention  # noqa: E402
from model.config import AttentionConfig  # noqa: E402
from training.checkpoint import (NAME, best_checkpoint, latest_checkpoint, load_checkpoint,  # noqa: E402
                                 load_into_plain_model, saved_vocab_size)
from training.cli import fail  # noqa: E402
from training.precision import autocast, resolve_device, resolve_dtype  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a run folder (its best.pt, else its newest checkpoint) or a checkpoint file")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--samples", type=int, default=1, help="independent samples")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    for option, value in (("--samples", args.samples), ("--top-k", args.top_k)):
        check_positive(option, value, kind="integer")
    check_positive("--tokens", args.tokens, allow_zero=True)
    check_finite("--temperature", args.temperature)


def checkpoint_tokenizer(state: dict):
    """The tokenizer a checkpoint carries, or for an older one that of the data settings saved in it."""
    if "tokenizer" in state:
        return load_tokenizer(state["tokenizer"])
    return load_tokenizer(prepare(DataConfig(**state["config"]["data"])).manifest)


def encode_prompt(tokenizer, prompt: str) -> list:
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as err:  # the char tokenizer knows only its corpus' characters
        missing = next(c for c in prompt if c not in tokenizer.index)
        raise UserError(f"--prompt has the character {missing!r}, which the char vocabulary of this checkpoint lacks; "
                        f"use only these: {tokenizer.chars!r}") from err
    if not ids:
        raise UserError("--prompt encodes to no tokens; give some text")
    return ids


def load_state(path: Path):
    """(checkpoint path, its state): the checkpoint named, or of a run folder its best.pt when it has
    one, else its newest checkpoint."""
    if NAME.match(path.name) or path.is_file():
        return path, load_checkpoint(path)
    if best_checkpoint(path).is_file():
        return best_checkpoint(path), load_checkpoint(best_checkpoint(path))
    found, state = latest_checkpoint(path)
    if state is None:
        raise UserError(f"{path} holds no checkpoint; give a run folder with checkpoints/ or a checkpoint")
    return found, state


def describe(path: Path, state: dict) -> str:
    val_loss = f", val loss {state['val_loss']:.4f}" if "val_loss" in state else ""
    return f"sampling from {path} (step {state['step']}{val_loss})"


def main(argv=None) -> None:
    args = parse_args(argv)
    check_args(args)
    path, state = load_state(Path(args.checkpoint))
    print(describe(path, state), file=sys.stderr)
    config = state["config"]
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    tokenizer = checkpoint_tokenizer(state)
    model_cfg = ModelConfig(**config["model"])
    model_cfg.vocab_size = saved_vocab_size(state)
    model_cfg.dropout = 0.0
    attend, _ = build_attention(AttentionConfig(name="sdpa", window=config["attention"].get("window")), device)
    with device:  # built where it runs: no initialisation on the CPU and copy
        model = GPT(model_cfg, attend).eval()
    load_into_plain_model(path, state, model)
    prompt = encode_prompt(tokenizer, args.prompt)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([prompt] * args.samples, dtype=torch.long, device=device)
    with autocast(device, dtype):
        out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k,
                             vocab_limit=tokenizer.vocab_size, generator=gen)
    for row in out.tolist():
        print(tokenizer.decode(row))
        print("---")


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        fail(str(err))
