"""Benchmark the softmax cross-entropy kernel (kernels/cross_entropy) against the PyTorch code it
replaces in model/loss.py, compiled and eager.

For each (n, V, dtype): the median time (``triton.testing.do_bench``) of turning n rows of logits
into row losses and the gradient softmax - onehot, and the rate at which that moves bytes, counted
as one read and one write of the logits (the least any implementation must move). The kernel
overwrites its input, so each timed call first copies a fresh chunk into the buffer; that copy is
timed alone and subtracted. Our kernel runs over a sweep of tile widths and warps; the table marks
the launcher's defaults, and adds them with a soft-cap (model.logit_softcap) of 15.

    python -m scripts.bench_cross_entropy [--out bench_cross_entropy.md]

Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402

from scripts.bench_common import command_line, environment, median_ms, require_cuda  # noqa: E402
from training.exits import ArgumentParser, exit_on_error  # noqa: E402

CUDA = torch.device("cuda")
CASES = [(4096, 50304, torch.bfloat16), (12288, 50304, torch.bfloat16), (4096, 50304, torch.float16)]
SOFTCAP = 15.0  # experiment=speedrun_char's cap
SWEEP = [(block_v, warps) for block_v in (2048, 4096, 8192, 16384) for warps in (4, 8, 16, 32)
         if block_v // (32 * warps) >= 4]  # at least 4 elements a thread


def time_ms(fn, refill, fresh) -> float:
    """Median ms of fn() on a freshly refilled buffer, minus the refill's own time."""
    def both():
        refill.copy_(fresh)
        fn()

    return median_ms(both, CUDA) - median_ms(lambda: refill.copy_(fresh), CUDA)


def bench_case(n: int, V: int, dtype: torch.dtype) -> list[tuple[str, float]]:
    from kernels.cross_entropy import softmax_xent_launch
    from kernels.cross_entropy.kernel import BLOCK_V, NUM_WARPS
    from model.loss import cross_entropy_and_grad

    gen = torch.Generator(device="cuda").manual_seed(0)
    fresh = (2.0 * torch.randn(n, V, device="cuda", generator=gen)).to(dtype)
    targets = torch.randint(0, V, (n,), device="cuda", generator=gen)
    buf = torch.empty_like(fresh)
    compiled = torch.compile(cross_entropy_and_grad)
    rows = []
    for block_v, warps in SWEEP:
        ms = time_ms(lambda: softmax_xent_launch(buf, targets, block_v=block_v, num_warps=warps), buf, fresh)
        default = " (default)" if (block_v, warps) == (BLOCK_V, NUM_WARPS) else ""
        rows.append((f"kernel BLOCK_V={block_v}, {warps} warps{default}", ms))
    rows.append((f"kernel defaults, soft-cap {SOFTCAP} (model.logit_softcap)",
                 time_ms(lambda: softmax_xent_launch(buf, targets, SOFTCAP), buf, fresh)))
    rows.append(("PyTorch, torch.compile", time_ms(lambda: compiled(buf, targets, torch.float32), buf, fresh)))
    rows.append(("PyTorch, eager", time_ms(lambda: cross_entropy_and_grad(buf, targets, torch.float32), buf, fresh)))
    return rows


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    args = parser.parse_args()
    require_cuda("bench_cross_entropy.py", "times the Triton kernel",
                 "the kernel's tests run under the interpreter (python -m pytest tests/test_cross_entropy.py)")
    env = environment(CUDA)
    lines = [f"# Softmax cross-entropy: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
             f"{env['date']}, commit {env['commit']}", "", f"`{command_line('bench_cross_entropy.py')}`", "",
             "| n × V, dtype | implementation | ms | GB/s (read + write of the logits) |", "|---|---|---|---|"]
    for n, V, dtype in CASES:
        moved = 2 * n * V * (torch.finfo(dtype).bits // 8)
        for name, ms in bench_case(n, V, dtype):
            lines.append(f"| {n} × {V}, {str(dtype).removeprefix('torch.')} | {name} | {ms:.3f} | {moved / ms / 1e6:.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    with exit_on_error(stopped="stopped"):
        main()
