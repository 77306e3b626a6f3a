"""Generate text from a checkpoint or a Hugging Face folder.

    python scripts/sample.py outputs/tiny-sdpa-shakespeare --prompt "ROMEO:" --tokens 200
    python scripts/sample.py outputs/run/checkpoints/step_0000300.pt --temperature 0.7 --top-k 50
    python scripts/sample.py outputs/fsdp-run/checkpoints/step_0000300   # a sharded (FSDP) checkpoint
    python scripts/sample.py hf/gpt2-shakespeare --temperature 0        # a GPT-2 or Llama folder (export_hf.py)

A run folder means its best checkpoint (checkpoints/best.pt, kept with trainer.keep_best=true) when
it has one, else its newest; the checkpoint used is named on stderr, and checked before it is used
(training/checkpoint.py: validate_checkpoint). The tokenizer comes from the checkpoint itself, so it
samples from any folder without the corpus or its token cache (a checkpoint made before checkpoints
carried their tokenizer rebuilds it from the data settings saved in it). A Hugging Face folder
(config.json) is read as our model (training/pretrained.py), with its tokenizer if it is GPT-2 BPE
or a char tokenizer; with --temperature 0 the tokens are transformers' greedy ones. --tokens is at
most 100,000; a progress bar on stderr follows longer generations; Ctrl-C stops in one line.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from errors import UserError, check_finite, check_positive  # noqa: E402
from model import GPT  # noqa: E402
from training.exits import exit_on_error  # noqa: E402
from training.hf_folder import is_hf_folder  # noqa: E402
from training.precision import autocast, resolve_device, resolve_dtype  # noqa: E402
from training.pretrained import hf_model  # noqa: E402
from training.step import default_prompt  # noqa: E402
from training.trained_model import checkpoint_model, checkpoint_tokenizer, choose_checkpoint  # noqa: E402

MAX_TOKENS = 100_000  # per call: generation grows its output token by token (continue longer text with --prompt)
PROGRESS_MIN = 256  # generations longer than this show a progress bar (on a terminal)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a run folder (its best.pt, else its newest checkpoint), a checkpoint, "
                                       "or a Hugging Face folder")
    p.add_argument("--prompt", help="text to continue (default: a newline, or the first token of a vocabulary "
                                    "without one)")
    p.add_argument("--tokens", type=int, default=200, help=f"tokens to generate (at most {MAX_TOKENS:,})")
    p.add_argument("--samples", type=int, default=1, help="independent samples")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="autocast precision; auto: bf16 on a GPU that has it, fp32 on CPU")
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


def describe(path: Path, state: dict) -> str:
    val_loss = f", val loss {state['val_loss']:.4f}" if "val_loss" in state else ""
    return f"sampling from {path} (step {state['step']}{val_loss})"


def load_model(path: Path, device: torch.device):
    """(model, tokenizer) of a Hugging Face folder, or of the checkpoint a run folder or checkpoint means
    (checked before use); what is used is named on stderr."""
    if is_hf_folder(path):
        model, tokenizer, architecture = hf_model(path, device)
        print(f"sampling from {path} ({architecture})", file=sys.stderr)
        return model, tokenizer
    path, state = choose_checkpoint(path)
    model = checkpoint_model(path, state, device)
    print(describe(path, state), file=sys.stderr)
    return model, checkpoint_tokenizer(state)


def generate(model: GPT, idx: torch.Tensor, args, vocab_limit: int, device, dtype) -> torch.Tensor:
    """``args.tokens`` tokens after ``idx`` (samples, T), under a progress bar for long generations on a terminal."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    with tqdm(total=args.tokens, unit="token", file=sys.stderr, leave=False,
              disable=args.tokens <= PROGRESS_MIN or not sys.stderr.isatty()) as bar, autocast(device, dtype):
        return model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k,
                              vocab_limit=vocab_limit, generator=gen, on_token=bar.update)


def main(argv=None) -> None:
    args = parse_args(argv)
    check_args(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer = load_model(Path(args.checkpoint), device)
    prompt = encode_prompt(tokenizer, args.prompt)
    idx = torch.tensor([prompt] * args.samples, dtype=torch.long, device=device)
    out = generate(model, idx, args, tokenizer.vocab_size, device, dtype)
    for row in out.tolist():
        print(tokenizer.decode(row))
        print("---")


if __name__ == "__main__":
    with exit_on_error(stopped="sampling stopped; nothing was printed"):
        main()
