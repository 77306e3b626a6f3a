"""Where the time of one flash-attention call goes: host time per piece, GPU time per kernel.

    python -m scripts.profile_flash --out OUTDIR      # writes profile.json and profile.md
    python -m scripts.profile_flash --compare . ../base --out OUTDIR   # host.json and host.md

1. Host time (microseconds of CPU per call) of each piece of our forward+backward, measured at a
   tiny shape where the GPU work is negligible, so back-to-back calls are limited by the host:
   allocations, the launch functions, the ops, the public function (plain, packed QKV, dropout),
   the autograd round trip (of a Python Function, and of one built-in op: what any backend pays on
   this host), the floor (the round trip with our allocations and three ``kernel[grid](...)``
   launches of an empty kernel), next to SDPA's FlashAttention-2 and cuDNN.
   The same forward+backward with plain launches (``kernel[grid]`` every call, no replayed
   binaries: ``kernels/flash_attention/launch.py``) is measured beside it.
2. At the given shapes, per call: the host's time to issue back-to-back calls, their wall time (no
   L2 flush), wall time with ``triton.testing.do_bench`` (L2 flushed before each call, as the
   benchmarks do), and the GPU time of each kernel from ``torch.profiler``. Wall time far above
   the kernels' sum, and equal to the time to issue, means the call is host-bound.

``--compare TREE [TREE ...]``: the host time of one eager forward+backward through the public
functions (plain, dropout 0.1, packed qkv; SDPA beside them) at ``--host-shape``, measured with
each source tree's own kernels (this checkout is "."; another, e.g. a worktree of an earlier
commit, by its path), and for a tree that replays launches also with plain launches. Each
measurement runs in a process of its own (``--host-child``), in turn, ``--rounds`` times; the table
gives the median of the rounds and each round.

Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402
import triton  # noqa: E402

from scripts.bench_common import ANCHORS, ROOT, environment, forced_sdpa, median_ms, parse_shapes, require_cuda  # noqa: E402
from training import profiling as training_profiling  # noqa: E402
from training.exits import ArgumentParser, exit_on_error  # noqa: E402

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


@contextlib.contextmanager
def plain_launches():
    """Every launch of the tile kernels through ``kernel[grid]``, none replayed, inside the block."""
    from kernels.flash_attention import backward, forward

    replays = [tuner.replay for tuner in (forward.FWD, backward.DQ, backward.DKDV)]
    was = [replay.on for replay in replays]
    for replay in replays:
        replay.on = False
    try:
        yield
    finally:
        for replay, on in zip(replays, was):
            replay.on = on


def public_steps(B: int, H: int, T: int, D: int, dtype) -> dict:
    """{name: one eager forward+backward} through the public functions (the same in every tree
    since the op rewrite) and SDPA: what ``--compare`` times in each tree."""
    from kernels.flash_attention import flash_attn, flash_attn_qkvpacked

    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=dtype) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qkv = torch.randn(B, T, 3 * H, D, device="cuda", dtype=dtype, requires_grad=True)
    qh, kh, vh, doh = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    qh, kh, vh = (x.requires_grad_() for x in (qh, kh, vh))

    def fwd_bwd(dropout_p=0.0):
        return lambda: torch.autograd.grad(flash_attn(qg, kg, vg, dropout_p=dropout_p), (qg, kg, vg), do)

    return {"flash_attn fwd+bwd": fwd_bwd(), "flash_attn fwd+bwd, dropout 0.1": fwd_bwd(0.1),
            "flash_attn_qkvpacked fwd+bwd": lambda: torch.autograd.grad(flash_attn_qkvpacked(qkv, H), qkv, do),
            "sdpa FA2 fwd+bwd": sdpa_step("FLASH_ATTENTION", qh, kh, vh, doh),
            "sdpa cuDNN fwd+bwd": sdpa_step("CUDNN_ATTENTION", qh, kh, vh, doh)}


def host_pieces(B: int, H: int, T: int, D: int, dtype) -> dict:
    """Host microseconds per call of each piece, at a shape small enough to be host-bound."""
    from kernels.flash_attention import flash_attn
    from kernels.flash_attention.backward import attn_bwd
    from kernels.flash_attention.forward import attn_fwd
    from kernels.flash_attention.function import flash_attn_fwd, op_options

    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=dtype) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    scale = D ** -0.5
    o, lse = attn_fwd(q, k, v, scale, True)
    public = public_steps(B, H, T, D, dtype)
    pieces = {
        "torch.empty x4": lambda: [torch.empty_like(q) for _ in range(4)],
        "autograd round trip (launches nothing)": lambda: torch.autograd.grad(_Identity.apply(qg), qg, do),
        "autograd round trip of one built-in op (q * 2)": lambda: torch.autograd.grad(qg * 2, qg, do),
        "floor: round trip, our allocations, 3 empty launches": launch_floor_step(qg, kg, vg, do),
        "attn_fwd (launch function)": lambda: attn_fwd(q, k, v, scale, True),
        "attn_bwd (launch functions)": lambda: attn_bwd(do, q, k, v, o, lse, scale, True),
        "nanoflash::flash_attn_fwd (op)": lambda: flash_attn_fwd(q, k, v, None, None, None,
                                                                 op_options(0, 0, scale, True, 0, 0.0)),
        "flash_attn, no grad": lambda: flash_attn(q, k, v),
        **public,
    }
    times = {name: per_call_us(fn) for name, fn in pieces.items()}
    with plain_launches():
        times["flash_attn fwd+bwd, plain launches"] = per_call_us(public["flash_attn fwd+bwd"])
    return times


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
    from kernels.flash_attention import flash_attn

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


def host_child(tree: Path, plain: bool, shape: list[int]) -> dict:
    """``--host-child``: {step: us per call} of :func:`public_steps` with ``tree``'s kernels (and
    with ``plain``, plain launches), each step warmed up first (compilation, tuning)."""
    sys.path.insert(0, str(tree))
    B, H, T, D = shape
    steps = public_steps(B, H, T, D, torch.bfloat16)
    with plain_launches() if plain else contextlib.nullcontext():
        return {name: per_call_us(fn) for name, fn in steps.items()}


def replays(tree: Path) -> bool:
    """Whether ``tree``'s kernels replay launches (so can be measured with plain launches too)."""
    path = tree / "kernels" / "flash_attention" / "launch.py"
    return path.exists() and "class Replay" in path.read_text()


def compare_host(trees: list[Path], rounds: int, shape: list[int]) -> dict:
    """``--compare``: {variant: {step: [us per round]}}, each measurement a process of its own, the
    variants in turn in every round (so a drift of the machine touches all alike)."""
    variants = [(str(tree), tree.resolve(), False) for tree in trees]
    variants += [(f"{tree}, plain launches", tree.resolve(), True) for tree in trees if replays(tree)]
    found: dict = {label: {} for label, _, _ in variants}
    for _ in range(rounds):
        for label, tree, plain in variants:
            cmd = [sys.executable, "-m", "scripts.profile_flash", "--host-child", str(tree), "--host-shape",
                   *map(str, shape)] + (["--plain"] if plain else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                raise RuntimeError(f"profile_flash.py --host-child {tree} failed:\n{proc.stderr[-3000:]}")
            for step, us in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                found[label].setdefault(step, []).append(us)
    return found


def compare_markdown(report: dict) -> str:
    found = report["host_compare"]
    steps = list(next(iter(found.values())))
    lines = [f"# profile_flash --compare ({report['device']}, torch {report['torch']}, triton {report['triton']}, "
             f"{report['date']}, commit {report['commit']})", "",
             f"Host microseconds per eager forward+backward at (B, H, T, D) = {tuple(report['host_shape'])}, bf16: "
             f"median of {report['rounds']} rounds (each round: its own process per tree, median of 5 x 300 calls).",
             "", "| tree | " + " | ".join(steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for label, times in found.items():
        cells = [f"{statistics.median(times[s]):.0f} ({', '.join(f'{t:.0f}' for t in times[s])})" for s in steps]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for profile.json and profile.md (with --compare: host.json, host.md)")
    p.add_argument("--host-shape", type=int, nargs=4, default=[1, 2, 128, 64], metavar=("B", "H", "T", "D"))
    p.add_argument("--shapes", type=parse_shapes, default=SHAPES, help='"B,H,T,D;B,H,T,D" (default: the two D=64 anchors and (64,12,512,64))')
    p.add_argument("--compare", type=Path, nargs="+", metavar="TREE",
                   help="time the public functions' host path in each source tree (this one: .)")
    p.add_argument("--rounds", type=int, default=3, help="--compare: measurements per tree, in turn")
    p.add_argument("--host-child", type=Path, metavar="TREE", help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    require_cuda("profile_flash.py", "measures CUDA launches and kernels",
                 "scripts/bench_attention.py --device cpu runs every backend")
    if args.host_child:
        print(json.dumps(host_child(args.host_child, args.plain, args.host_shape)))
        return
    if args.out is None:
        p.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        report = {**environment(CUDA), "host_shape": args.host_shape, "rounds": args.rounds,
                  "host_compare": compare_host(args.compare, args.rounds, args.host_shape)}
        (args.out / "host.json").write_text(json.dumps(report, indent=1))
        text = compare_markdown(report)
        (args.out / "host.md").write_text(text)
        print(text)
        return
    dtype = torch.bfloat16
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
