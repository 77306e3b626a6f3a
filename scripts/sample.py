"""Generate text from a checkpoint or a Hugging Face folder.

    python -m scripts.sample outputs/tiny-sdpa-shakespeare --prompt "ROMEO:" --tokens 200
    python -m scripts.sample outputs/run/checkpoints/step_0000300.pt --temperature 0.7 --top-k 50
    python -m scripts.sample outputs/fsdp-run/checkpoints/step_0000300   # a sharded (FSDP) checkpoint
    python -m scripts.sample hf/gpt2-shakespeare --temperature 0        # a GPT-2 or Llama folder (export_hf.py)

A run folder means its best checkpoint (checkpoints/best.pt, kept with trainer.keep_best=true) when
it has one, else its newest; the checkpoint used is named on stderr, and checked before it is used
(training/checkpoint.py: validate_checkpoint). The tokenizer comes from the checkpoint itself, so it
samples from any folder without the corpus or its token cache (a checkpoint made before checkpoints
carried their tokenizer rebuilds it from the data settings saved in it). A Hugging Face folder
(config.json) is read as our model (training/pretrained.py), with its tokenizer if it is GPT-2 BPE
or a char tokenizer; with --temperature 0 the tokens are transformers' greedy ones. --tokens is at
most 100,000; a progress bar on stderr follows longer generations; Ctrl-C stops in one line.

The model holds its weights in --dtype and runs without autocast (training/trained_model.py): auto
is bf16 on a GPU that has it, fp16 on other GPUs, fp32 on CPU; with --dtype fp32 greedy tokens are
transformers' fp32 ones (scripts/check_export.py checks it). --samples N from one prompt prefill it
once. --timings prints on stderr the seconds of each phase, from the process start to the last token
(the GPU waited for at each): imports, reading the checkpoint, building and checking the model,
loading its weights, the tokenizer, the first token (the prefill), the first two decode steps (with
the CUDA-graph step: the eager step that builds or loads the decode kernels, then the capture), the
other steps, the output.
"""
import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Optional

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from data.tokenizers import default_prompt  # noqa: E402
from errors import UserError, check_finite, check_positive  # noqa: E402
from kernels.triton_start import start_triton_setup  # noqa: E402
from model import GPT  # noqa: E402
from training.exits import ArgumentParser, exit_on_error  # noqa: E402
from training.hf_folder import is_hf_folder  # noqa: E402
from training.metrics import process_age_s  # noqa: E402
from training.precision import resolve_device, resolve_dtype  # noqa: E402
from training.trained_model import checkpoint_model, checkpoint_tokenizer, choose_checkpoint  # noqa: E402

MAX_TOKENS = 100_000  # per call: generation grows its output token by token (continue longer text with --prompt)
PROGRESS_MIN = 256  # generations longer than this show a progress bar (on a terminal)


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
                   help="the weights' precision; auto: bf16 on a GPU that has it, else fp16 on a GPU, fp32 on CPU")
    p.add_argument("--timings", action="store_true", help="print the seconds of each phase on stderr")
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


class Phases:
    """--timings: the seconds each phase of the command took, one stderr line as it ends (the GPU's work
    waited for); the first line is the process' age, its start and imports. Without --timings, silent."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self.last = time.perf_counter()
        if enabled:
            self.say("start and imports", process_age_s())

    def done(self, phase: str) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.say(phase, now - self.last)
        self.last = now

    def finished(self) -> None:
        if self.enabled:
            self.say("total, from the process start", process_age_s())

    @staticmethod
    def say(phase: str, seconds: Optional[float]) -> None:
        print(f"timings: {phase}: " + ("n/a" if seconds is None else f"{seconds:.2f} s"), file=sys.stderr)


def describe(path: Path, state: dict) -> str:
    val_loss = f", val loss {state['val_loss']:.4f}" if "val_loss" in state else ""
    return f"sampling from {path} (step {state['step']}{val_loss})"


def load_model(path: Path, device: torch.device, dtype: torch.dtype = torch.float32,
               phases: Optional[Phases] = None):
    """(model with its weights in ``dtype``, tokenizer) of a Hugging Face folder, or of the checkpoint a run
    folder or checkpoint means (checked before use); what is used is named on stderr."""
    phases = phases or Phases(False, device)
    if is_hf_folder(path):
        from training.pretrained import hf_model  # transformers' folders only

        model, tokenizer, architecture = hf_model(path, device, dtype)
        phases.done("the Hugging Face folder read, its model built")
        print(f"sampling from {path} ({architecture})", file=sys.stderr)
        return model, tokenizer
    path, state = choose_checkpoint(path)
    phases.done("checkpoint chosen and mapped")
    model = checkpoint_model(path, state, device, dtype, on_phase=phases.done)
    print(describe(path, state), file=sys.stderr)
    return model, checkpoint_tokenizer(state)


def token_clock(phases: Phases, total: int, update: Callable[[int], object]) -> Callable[[int], object]:
    """generate's ``on_token``: ``update`` (the progress bar's); with --timings it also ends a phase at
    tokens 1, 2, 3 and ``total``."""
    if not phases.enabled:
        return update
    names = {1: "token 1 (the prefill)", 2: "token 2 (decode step 1)", 3: "token 3 (decode step 2)"}
    if total > 3:
        names[total] = f"tokens 4-{total} (decode steps 3-{total - 1})"
    made = 0

    def on_token(n: int) -> None:
        nonlocal made
        update(n)
        made += n
        if made in names:
            phases.done(names[made])
    return on_token


def generate(model: GPT, idx: torch.Tensor, args, vocab_limit: int, device,
             phases: Optional[Phases] = None) -> torch.Tensor:
    """``args.tokens`` tokens after ``idx`` (samples, T), under a progress bar for long generations on a
    terminal; with --timings (``phases``) the first tokens and the rest timed."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    with tqdm(total=args.tokens, unit="token", file=sys.stderr, leave=False,
              disable=args.tokens <= PROGRESS_MIN or not sys.stderr.isatty()) as bar:
        on_token = token_clock(phases or Phases(False, device), args.tokens, bar.update)
        return model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k,
                              vocab_limit=vocab_limit, generator=gen, on_token=on_token)


def main(argv=None) -> None:
    args = parse_args(argv)
    check_args(args)
    device = resolve_device(args.device)
    phases = Phases(args.timings, device)
    if device.type == "cuda":
        start_triton_setup()  # while the checkpoint loads and the prefill runs, not in decode step 1
    dtype = resolve_dtype(args.dtype, device)
    torch.zeros(1, device=device)  # the CUDA context, made here to be timed on its own
    phases.done("device ready")
    model, tokenizer = load_model(Path(args.checkpoint), device, dtype, phases)
    prompt = encode_prompt(tokenizer, args.prompt)
    idx = torch.tensor([prompt] * args.samples, dtype=torch.long, device=device)
    phases.done("tokenizer and prompt")
    out = generate(model, idx, args, tokenizer.vocab_size, device, phases)
    for row in out.tolist():
        print(tokenizer.decode(row))
        print("---")
    phases.done("output decoded and printed")
    phases.finished()


if __name__ == "__main__":
    with exit_on_error(stopped="sampling stopped; nothing was printed"):
        main()
