"""Generate text from a checkpoint.

    python scripts/sample.py outputs/tiny-sdpa-shakespeare --prompt "ROMEO:" --tokens 200
    python scripts/sample.py outputs/run/checkpoints/step_0000300.pt --temperature 0.7 --top-k 50
    python scripts/sample.py outputs/fsdp-run/checkpoints/step_0000300   # a sharded (FSDP) checkpoint

A run folder means its best checkpoint (checkpoints/best.pt, kept with trainer.keep_best=true) when
it has one, else its newest; the checkpoint used is named on stderr, and checked before it is used
(training/checkpoint.py: validate_checkpoint). The tokenizer comes from the checkpoint itself, so it
samples from any folder without the corpus or its token cache (a checkpoint made before checkpoints
carried their tokenizer rebuilds it from the data settings saved in it). --tokens is at most
100,000; a progress bar on stderr follows longer generations; Ctrl-C stops in one line.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from data.config import DataConfig  # noqa: E402
from data.prepare import prepare  # noqa: E402
from data.tokenizers import load_tokenizer  # noqa: E402
from errors import UserError, check_finite, check_positive  # noqa: E402
from model import GPT  # noqa: E402
from model.attention import build_attention  # noqa: E402
from model.config import AttentionConfig  # noqa: E402

from training.checkpoint import (NAME, best_checkpoint, latest_checkpoint, load_checkpoint,  # noqa: E402
                                 load_into_plain_model, validate_checkpoint)
from training.exits import exit_on_error  # noqa: E402
from training.precision import autocast, resolve_device, resolve_dtype  # noqa: E402
from training.step import default_prompt  # noqa: E402

MAX_TOKENS = 100_000  # per call: generation grows its output token by token (continue longer text with --prompt)
PROGRESS_CHUNK = 256  # tokens generated between two updates of the progress bar


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a run folder (its best.pt, else its newest checkpoint) or a checkpoint file")
    p.add_argument("--prompt", help="text to continue (default: a newline, or the first token of a vocabulary "
                                    "without one)")
    p.add_argument("--tokens", type=int, default=200, help=f"tokens to generate (at most {MAX_TOKENS:,})")
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
    if args.tokens > MAX_TOKENS:
        raise UserError(f"--tokens={args.tokens} is more than {MAX_TOKENS:,}; generate longer text in several calls, "
                        "each continuing the last with --prompt")
    check_finite("--temperature", args.temperature)
    if not 0 <= args.seed < 2**64:
        raise UserError(f"--seed={args.seed} must be in [0, 2**64)")


def checkpoint_tokenizer(state: dict):
    """The tokenizer a checkpoint carries, or for an older one that of the data settings saved in it."""
    if "tokenizer" in state:
        return load_tokenizer(state["tokenizer"])
    return load_tokenizer(prepare(DataConfig(**state["config"]["data"])).manifest)


def encode_prompt(tokenizer, prompt) -> list:
    if prompt is None:
        return default_prompt(tokenizer)
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


def load_model(path: Path, state: dict, device: torch.device) -> GPT:
    """The checkpoint's model for generation (sdpa attention, no dropout), its weights checked first."""
    model_cfg = validate_checkpoint(path, state)
    model_cfg.dropout = 0.0
    window = state["config"].get("attention", {}).get("window")
    attend, _ = build_attention(AttentionConfig(name="sdpa", window=window), device)
    model = GPT(model_cfg, attend).to(device).eval()
    validate_checkpoint(path, state, model)
    load_into_plain_model(path, state, model)
    return model


def generate(model: GPT, idx: torch.Tensor, args, vocab_limit: int, device, dtype) -> torch.Tensor:
    """``args.tokens`` tokens after ``idx`` (samples, T), PROGRESS_CHUNK at a time under a progress bar
    (on a terminal, for long generations)."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    done = 0
    with tqdm(total=args.tokens, unit="token", file=sys.stderr, leave=False,
              disable=args.tokens <= PROGRESS_CHUNK or not sys.stderr.isatty()) as bar:
        while done < args.tokens:
            n = min(PROGRESS_CHUNK, args.tokens - done)
            with autocast(device, dtype):
                idx = model.generate(idx, n, temperature=args.temperature, top_k=args.top_k, vocab_limit=vocab_limit,
                                     generator=gen)
            done += n
            bar.update(n)
    return idx


def main(argv=None) -> None:
    args = parse_args(argv)
    check_args(args)
    path, state = load_state(Path(args.checkpoint))
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    model = load_model(path, state, device)
    print(describe(path, state), file=sys.stderr)
    tokenizer = checkpoint_tokenizer(state)
    prompt = encode_prompt(tokenizer, args.prompt)
    idx = torch.tensor([prompt] * args.samples, dtype=torch.long, device=device)
    out = generate(model, idx, args, tokenizer.vocab_size, device, dtype)
    for row in out.tolist():
        print(tokenizer.decode(row))
        print("---")


if __name__ == "__main__":
    with exit_on_error(stopped="sampling stopped; nothing was printed"):
        main()
