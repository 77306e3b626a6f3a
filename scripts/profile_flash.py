"""Where the time of one flash-attention call goes: host time per piece, GPU time per kernel.

    python scripts/profile_flash.py --out OUTDIR      # writes profile.json and profile.md

1. Host time (microseconds of CPU per call) of each piece of our forward+backward, measured at a
   tiny shape where the GPU work is negligible, so back-to-back calls are limited by the host:
   allocations, the launch functions, the ops, the public function (plain, packed QKV, dropout),
   the autograd round trip (of a Python Function, and of one built-in op: what any backend pays on
   this host), the floor (the round trip with our allocations and three ``kernel[grid](...)``
   launches of an empty kernel), next to SDPA's FlashAttention-2 and cuDNN.
2. At the given shapes, per call: the host's time to issue back-to-back calls, their wall time (no
   L2 flush), wall time with ``triton.testing.do_bench`` (L2 flushed before each call, as the
   benchmarks do), and the GPU time of each kernel from ``torch.profiler``. Wall time far above
   the kernels' sum, and equal to the time to issue, means the call is host-bound.

Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.flash_attention import flash_attn, flash_attn_qkvpacked  # noqa: E402
from kernels.flash_attention.backward import attn_bwd  # noqa: E402
from kernels.flash_attention.forward import attn_fwd  # noqa: E402
from kernels.flash_attention.function import flash_attn_fwd  # noqa: E402
from scripts.bench_common import ANCHORS, environment, forced_sdpa, median_ms, parse_shapes, require_cuda  # noqa: E402
from training import profiling as training_profiling  # noqa: E402
from training.exits import exit_on_error  # noqa: E402

CUDA = torch.device("cuda")
SHAPES = [*ANCHORS[:2], (64, 12, 512, 64)]  # (B, H, T, D): the two D=64 anchors and a shorter one


def enqueue_and_wall_us(fn, calls: int = 300) -> tuple[float, float]:
    """Microseconds per call of ``calls`` back-to-back calls (median of 5 rounds): the host's time to
    issue them (before the closing synchronize) and the wall time until the GPU is done. Equal
    figures mean the host sets the pace: the GPU waits for each launch."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        rounds.append(((issued - start) / calls * 1e6, (time.perf_counter() - start) / calls * 1e6))
    return sorted(rounds, key=lambda r: r[1])[2]


def per_call_us(fn, calls: int = 300) -> float:
    """Median wall microseconds per call of back-to-back calls (:func:`enqueue_and_wall_us`)."""
    return enqueue_and_wall_us(fn, calls)[1]


def sdpa_step(kernel: str, q, k, v, do):
    """Forward and backward of SDPA forced to ``kernel`` (an SDPBackend name); q, k, v, do: (B, H, T, D)."""
    attend = forced_sdpa(kernel)

    def step():
        torch.autograd.grad(attend(q, k, v), (q, k, v), do)

    return step


class _Identity(torch.autograd.Function):
    """The autograd round trip alone: a Python Function that launches nothing."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


@triton.jit
def _launch_only(X):
    """Does nothing: launching it costs only host time."""


class _LaunchFloor(torch.autograd.Function):
    """The floor of any Triton attention behind an autograd.Function: the round trip, the
    allocations our forward and backward make (o, lse; dq, dk, dv, delta) and three launches of an
    empty kernel (one forward, two backward) through ``kernel[grid](...)``, as ours launch."""

    @staticmethod
    def forward(ctx, q, k, v, launch):
        ctx.launch = launch
        ctx.save_for_backward(q, k, v)
        o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
        launch(o)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = q.new_empty(q.shape[:3], dtype=torch.float32)
        ctx.launch(delta)
        ctx.launch(dq)
        return dq, dk, dv, None


def launch_floor_step(q, k, v, do):
    """One forward+backward of :class:`_LaunchFloor`; q, k, v require grad."""
    launch = _launch_only[(1, 1, 1)]

    def step():
        torch.autograd.grad(_LaunchFloor.apply(q, k, v, launch), (q, k, v), do)

    return step


def host_pieces(B: int, H: int, T: int, D: int, dtype) -> dict:
    """Host microseconds per call of each piece, at a shape small enough to be host-bound."""
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=dtype) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    scale = D ** -0.5
    o, lse = attn_fwd(q, k, v, scale, True)
    qkv = torch.randn(B, T, 3 * H, D, device="cuda", dtype=dtype, requires_grad=True)
    qh, kh, vh, doh = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    qh, kh, vh = (x.requires_grad_() for x in (qh, kh, vh))

    def fwd_bwd(dropout_p=0.0):
        torch.autograd.grad(flash_attn(qg, kg, vg, dropout_p=dropout_p), (qg, kg, vg), do)

    pieces = {
        "torch.empty x4": lambda: [torch.empty_like(q) for _ in range(4)],
        "autograd round trip (launches nothing)": lambda: torch.autograd.grad(_Identity.apply(qg), qg, do),
        "autograd round trip of one built-in op (q * 2)": lambda: torch.autograd.grad(qg * 2, qg, do),
        "floor: round trip, our allocations, 3 empty launches": launch_floor_step(qg, kg, vg, do),
        "attn_fwd (launch function)": lambda: attn_fwd(q, k, v, scale, True),
        "attn_bwd (launch functions)": lambda: attn_bwd(do, q, k, v, o, lse, scale, True),
        "nanoflash::flash_attn_fwd (op)": lambda: flash_attn_fwd(q, k, v, None, None, None, 0, 0, scale, True, 0, 0.0),
        "flash_attn, no grad": lambda: flash_attn(q, k, v),
        "flash_attn fwd+bwd": fwd_bwd,
        "flash_attn fwd+bwd, dropout 0.1": lambda: fwd_bwd(0.1),
        "flash_attn_qkvpacked fwd+bwd": lambda: torch.autograd.grad(flash_attn_qkvpacked(qkv, H), qkv, do),
        "sdpa FA2 fwd+bwd": sdpa_step("FLASH_ATTENTION", qh, kh, vh, doh),
        "sdpa cuDNN fwd+bwd": sdpa_step("CUDNN_ATTENTION", qh, kh, vh, doh),
    }
    return {name: per_call_us(fn) for name, fn in pieces.items()}


def kernel_times_us(step, iters: int = 20) -> dict:
    """GPU microseconds per call of each kernel ``step`` launches (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return {name[:80]: us / iters for name, us in training_profiling.kernel_times_us(prof).items()}


def shape_profile(B: int, H: int, T: int, D: int, dtype) -> dict:
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=dtype) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qh, kh, vh, doh = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    qh, kh, vh = (x.requires_grad_() for x in (qh, kh, vh))

    gate = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda") + 3.0).requires_grad_()

    def ours():
        torch.autograd.grad(flash_attn(qg, kg, vg), (qg, kg, vg), do)

    def ours_gated():
        torch.autograd.grad(flash_attn(qg, kg, vg, g=gate), (qg, kg, vg, gate), do)

    steps = {"flash": ours, "flash, forget gate": ours_gated, "sdpa-fa2": sdpa_step("FLASH_ATTENTION", qh, kh, vh, doh),
             "sdpa-cudnn": sdpa_step("CUDNN_ATTENTION", qh, kh, vh, doh)}
    result = {}
    for name, step in steps.items():
        try:
            kernels = kernel_times_us(step)
        except Exception as err:  # a profiler that does not report per-kernel times here
            kernels = {f"profiler failed: {type(err).__name__}: {err}"[:80]: 0.0}
        enqueue_us, back_to_back_us = enqueue_and_wall_us(step, calls=50)
        result[name] = {
            "enqueue_us": enqueue_us,
            "back_to_back_us": back_to_back_us,
            "do_bench_us": median_ms(step, CUDA) * 1e3,
            "kernels_us": kernels,
            "kernels_sum_us": sum(kernels.values()),
        }
    return result


def markdown(report: dict) -> str:
    lines = [f"# profile_flash ({report['device']}, torch {report['torch']}, triton {report['triton']}, "
             f"{report['date']}, commit {report['commit']})", "",
             f"## Host time per call at (B, H, T, D) = {tuple(report['host_shape'])}, bf16 (microseconds)", "",
             "| piece | us per call |", "|---|---|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in report["host"].items()]
    for shape, found in report["shapes"].items():
        lines += ["", f"## {shape}, bf16, forward+backward", "",
                  "| backend | host us to issue | back-to-back us | do_bench us (L2 flushed) | sum of kernels us | kernels |",
                  "|---|---|---|---|---|---|"]
        for name, r in found.items():
            kernels = "; ".join(f"{k} {v:.0f}" for k, v in sorted(r["kernels_us"].items(), key=lambda kv: -kv[1]))
            lines.append(f"| {name} | {r['enqueue_us']:.0f} | {r['back_to_back_us']:.0f} | {r['do_bench_us']:.0f} "
                         f"| {r['kernels_sum_us']:.0f} | {kernels} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for profile.json and profile.md")
    p.add_argument("--host-shape", type=int, nargs=4, default=[1, 2, 128, 64], metavar=("B", "H", "T", "D"))
    p.add_argument("--shapes", type=parse_shapes, default=SHAPES, help='"B,H,T,D;B,H,T,D" (default: the two D=64 anchors and (64,12,512,64))')
    args = p.parse_args(argv)
    require_cuda("profile_flash.py", "measures CUDA launches and kernels",
                 "scripts/bench_attention.py --device cpu runs every backend")
    dtype = torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    report = {**environment(CUDA), "host_shape": args.host_shape, "host": host_pieces(*args.host_shape, dtype), "shapes": {}}
    for shape in args.shapes:  # written after each part, so a failure later keeps what was measured
        write(report, args.out)
        report["shapes"][str(shape)] = shape_profile(*shape, dtype)
    print(write(report, args.out))


def write(report: dict, out: Path) -> str:
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out / "profile.md").write_text(text)
    return text


if __name__ == "__main__":
    with exit_on_error(stopped="stopped"):
        main()
