"""Context parallelism on one GPU: what the ring path costs at N=1, and the per-rank memory model.

    python -m scripts.bench_context_parallel model=gpt2 attention=flash --lengths 8192,16384 --paths plain,ring
    python -m scripts.bench_context_parallel model=gpt2 attention=flash model.activation_checkpointing=true \\
        --lengths 4096,8192,16384,32768 --out bench/cp-memory
    python -m scripts.bench_context_parallel model=gpt2 model.activation_checkpointing=true --memory-model

Per (T, path): training steps of the model at batch 1 on random tokens (forward, backward, AdamW,
autocast in trainer.dtype as train.py does; --warmup steps first, then --steps timed): ms per step,
tokens/s and peak memory (CUDA). Paths: ``plain`` is what a run with trainer.context_parallel=1
calls (the backend itself; flash through its packed variant); ``ring`` is the same backend as the
step of ring attention over a ring of one rank (model/attention/ring.py without a group: no
communication), i.e. what N=1 would cost if it went through the ring.

The memory model (docs/CONTEXT_PARALLEL.md), per rank at batch 1 with N ranks per sequence:

    peak(T, N) = 16 P(T) + C + (a + r [N > 1] + k [N = 1]) d T / N

16 P(T): fp32 weights, gradients and AdamW's two moments of P(T) parameters (learned positions add
T d of them); a d T / N: the activations of the rank's T / N tokens, a bytes per token and unit of
width; r: the ring's own buffers in one layer's backward (key/value shards in flight, fp32 dq and
dk/dv accumulators); k: under activation checkpointing without the ring, the attention output each
layer keeps (flash and sdpa; model.recompute_attention=true keeps none); C: what does not grow with T
(the loss's chunk of logits). Given two or more
``plain`` rows, a and C are fitted to them (least squares) and the model is printed against each
measured row; the table of T = 32k..256k and N = 1, 2, 4, 8 then uses the fitted a. --memory-model
prints that table from the defaults below, without a GPU. Options with -- are this script's; the
rest are train.py's overrides.
"""
import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402

from data.tokenizers import GPT2Tokenizer  # noqa: E402
from errors import UserError  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from model.attention import build_attention, ring_attention_of  # noqa: E402
from model.config import AttentionConfig, padded_vocab  # noqa: E402
from training.cli import compose_config  # noqa: E402
from training.exits import ArgumentParser, exit_on_error  # noqa: E402
from training.config import OptimConfig  # noqa: E402
from training.fit import free_memory  # noqa: E402
from training.optim import build_optimizer  # noqa: E402
from training.precision import autocast, dtype_name, resolve_device, resolve_dtype  # noqa: E402

GIB = 2**30
# Bytes per token and unit of width (d) of a GPT-2-like block stack under bf16 autocast, counted from
# what autograd keeps: per layer the fp32 residual (4) and, without checkpointing, its bf16 copies for
# the matmuls (2 + 2), qkv (6), the attention output (2), the MLP's hidden before and after GELU (8 + 8).
# The head adds the embeddings' fp32 sum and the loss's hidden-state gradient (16). With activation
# checkpointing only the residual stays per layer (and, without the ring, KEPT_ATTENTION), and one block
# is recomputed (36) with its gradients (about 30) at a time.
SAVED_PER_LAYER, HEAD, RECOMPUTED_BLOCK = 36, 16, 66
KEPT_ATTENTION = 2  # checkpointing, no ring: each layer keeps its attention kernel's bf16 output (model/gpt.py)
RING = 40  # the ring's backward buffers of one layer: kv shard + arriving one (8), fp32 dq (4),
#            fp32 dk/dv accumulator + arriving one (16), the step's outputs and the copies of a 2:1 block (12)
MODEL_LENGTHS = (32768, 65536, 131072, 262144)
MODEL_RANKS = (1, 2, 4, 8)


def parse_args(argv):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="8192,16384", help="comma-separated sequence lengths T (batch 1)")
    p.add_argument("--paths", default="plain,ring", help="plain, ring or both")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing (compilation, autotuning)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the ring stays eager)")
    p.add_argument("--memory-model", action="store_true", help="only print the model's table (no GPU needed)")
    p.add_argument("--out", help="also write results.json and summary.md here")
    return p.parse_known_args(argv)


def parameters(cfg: ModelConfig) -> int:
    """P: the model's parameter count at cfg.block_size (counted on the meta device: nothing allocated)."""
    attention, _ = build_attention(AttentionConfig(name="naive"), torch.device("meta"))
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg, attention).parameters())


def default_per_token(cfg: ModelConfig) -> int:
    """a: activation bytes per token and unit of width (the counts above)."""
    if cfg.activation_checkpointing:
        return 4 * cfg.n_layer + HEAD + RECOMPUTED_BLOCK
    return SAVED_PER_LAYER * cfg.n_layer + HEAD


def per_rank_extra(cfg: ModelConfig, n: int) -> int:
    """r [N > 1] + k [N = 1]: the ring's buffers, or without the ring what checkpointing keeps of attention."""
    if n > 1:
        return RING
    return KEPT_ATTENTION * cfg.n_layer if cfg.activation_checkpointing and not cfg.recompute_attention else 0


def model_peak(cfg: ModelConfig, T: int, n: int, per_token: float, fixed: float) -> float:
    """peak(T, N) in bytes: 16 P(T) + C + (a + r [N > 1] + k [N = 1]) d T / N."""
    static = 16 * parameters(dataclasses.replace(cfg, block_size=T))
    return static + fixed + (per_token + per_rank_extra(cfg, n)) * cfg.n_embd * T / n


def fit_memory(cfg: ModelConfig, rows) -> tuple:
    """(a, C) by least squares over measured rows (N = 1): peak - 16 P(T) - k d T = a d T + C."""
    xs = [cfg.n_embd * r["T"] for r in rows]
    ys = [r["peak_gib"] * GIB - 16 * parameters(dataclasses.replace(cfg, block_size=r["T"]))
          - per_rank_extra(cfg, 1) * cfg.n_embd * r["T"] for r in rows]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return slope, mean_y - slope * mean_x


def model_table(cfg: ModelConfig, per_token: float, fixed: float, source: str) -> str:
    """Per-rank peak and its activation part at T = 32k..256k against N (markdown)."""
    lines = [f"## Memory model: per-rank GiB at batch 1, {cfg.name} ({cfg.n_layer} x {cfg.n_embd}, "
             f"pos={cfg.pos}), activation_checkpointing={cfg.activation_checkpointing}; a = {per_token:.1f} "
             f"({source}), C = {fixed / GIB:.2f} GiB, r = {RING}",
             "",
             "| T | " + " | ".join(f"N={n}: peak (activations)" for n in MODEL_RANKS) + " |",
             "|---|" + "---|" * len(MODEL_RANKS)]
    for T in MODEL_LENGTHS:
        cells = []
        for n in MODEL_RANKS:
            activations = (per_token + per_rank_extra(cfg, n)) * cfg.n_embd * T / n
            cells.append(f"{model_peak(cfg, T, n, per_token, fixed) / GIB:.1f} ({activations / GIB:.1f})")
        lines.append(f"| {T:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def measure(cfg: ModelConfig, attention, device, dtype, steps: int, warmup: int, compile: bool) -> dict:
    """Training steps at batch 1, T = cfg.block_size: ms per step, tokens/s, peak GiB (CUDA), last loss."""
    free_memory()
    torch.manual_seed(0)  # every path starts from the same weights
    model = GPT(cfg, attention).to(device)
    optimizer = build_optimizer(model, OptimConfig(), device)
    forward = torch.compile(model) if compile else model
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.block_size + 1), device=device,
                           generator=torch.Generator(device).manual_seed(0))

    def step():
        with autocast(device, dtype):
            _, loss = forward(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    cuda = device.type == "cuda"
    try:
        for _ in range(warmup):
            step()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        for _ in range(steps):
            loss = step()
        if cuda:
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - started) / steps
        result = {"status": "ok", "ms_per_step": seconds * 1e3, "tokens_per_s": cfg.block_size / seconds,
                  "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None, "loss": loss.item()}
    except torch.OutOfMemoryError:
        result = {"status": "OOM"}
    del model, optimizer, forward
    free_memory()
    return result


def attention_for(path: str, cfg, device):
    """(the attention a path runs, its name): the backend itself, or its ring step over a ring of one."""
    attention, name = build_attention(cfg.attention, device)
    return (attention if path == "plain" else ring_attention_of(name, None)), name


def row_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"| {r['T']:,} | {r['path']} | {r['status']} | | | |"
    peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a"
    return (f"| {r['T']:,} | {r['path']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {peak} | "
            f"{r['loss']:.4f} |")


def main(argv=None) -> None:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = compose_config(overrides)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or padded_vocab(GPT2Tokenizer.vocab_size),
                                    dropout=0.0)
    if args.memory_model:
        print(model_table(model_cfg, default_per_token(model_cfg), 0.0, "counted, not measured"))
        return
    device = resolve_device(cfg.trainer.device)
    dtype = resolve_dtype(cfg.trainer.dtype, device)
    paths = args.paths.split(",")
    if not set(paths) <= {"plain", "ring"}:
        raise UserError(f"--paths={args.paths}: choose plain, ring or plain,ring")
    header = (f"# {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
              f"model={model_cfg.name} attention={cfg.attention.name} {dtype_name(dtype)}, batch 1, "
              f"activation_checkpointing={model_cfg.activation_checkpointing}, compile={args.compile}, "
              f"{args.steps} steps timed after {args.warmup}")
    lines = [header, "", "| T | path | ms/step | tokens/s | peak GiB | loss |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    rows = []
    for T in (int(t) for t in args.lengths.split(",")):
        cfg_T = dataclasses.replace(model_cfg, block_size=T)
        for path in paths:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # flash falling back to sdpa off CUDA
                attention, backend = attention_for(path, cfg, device)
            row = {"T": T, "path": path, "backend": backend,
                   **measure(cfg_T, attention, device, dtype, args.steps, args.warmup, args.compile)}
            rows.append(row)
            lines.append(row_line(row))
            print(lines[-1], flush=True)
    measured = [r for r in rows if r["path"] == "plain" and r["status"] == "ok" and r["peak_gib"] is not None]
    if len({r["T"] for r in measured}) >= 2:
        per_token, fixed = fit_memory(model_cfg, measured)
        check = ["", f"## Memory model fitted to the plain rows: a = {per_token:.1f} bytes per token and unit of "
                     f"width (counted: {default_per_token(model_cfg)}), C = {fixed / GIB:.2f} GiB", "",
                 "| T | measured GiB | model GiB |", "|---|---|---|"]
        check += [f"| {r['T']:,} | {r['peak_gib']:.2f} | {model_peak(model_cfg, r['T'], 1, per_token, fixed) / GIB:.2f} |"
                  for r in measured]
        check += ["", model_table(model_cfg, per_token, fixed, "fitted")]
        lines += check
        print("\n".join(check), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"meta": header, "model": dataclasses.asdict(model_cfg),
                                                       "rows": rows}, indent=1))
        (out / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    with exit_on_error(stopped="stopped"):
        main()
