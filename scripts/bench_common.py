"""What the benchmark scripts share: the anchor shapes, the causal FLOP count, SDPA forced to one
kernel, timing, the environment a number was measured in, and one-line errors.

Used by bench_attention.py, bench_flash.py, bench_cross_entropy.py and profile_flash.py, so the
same shape, FLOP count and timing mean the same thing in every table of docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent

# The six (B, H, T, D) shapes every attention benchmark reports: GPT-2's D=64 at T 1024 and 2048,
# then D=128 from T 2048 to 16384 at a fixed 32,768 tokens (the first one at 16,384).
ANCHORS = [(16, 12, 1024, 64), (4, 12, 2048, 64), (8, 16, 2048, 128), (4, 16, 4096, 128), (2, 16, 8192, 128),
           (1, 16, 16384, 128)]

# bench_attention's backend name -> the torch.nn.attention.SDPBackend member it forces.
SDPA_KERNELS = {"sdpa-fa2": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION"}

BACKWARD_FLOPS_FACTOR = 3.5  # forward + backward = 2.5 forward matmuls more than the forward's 2 (FA2's count)


def fail(message: str, status: int = 2) -> None:
    """Print ``error: message`` on stderr and exit with ``status`` (2: a usage error, 1: a wrong result)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


def require_cuda(script: str, what: str, instead: str) -> None:
    """Exit with status 2 and one line when PyTorch sees no CUDA GPU.

    script: the file name; what: what it measures on the GPU; instead: what to run on CPU.
    """
    if not torch.cuda.is_available():
        fail(f"{script} {what} and needs a CUDA GPU; on CPU {instead}")


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """``"B,H,T,D;B,H,T,D"`` as (B, H, T, D) tuples: an argparse ``type``, so a wrong value is one
    usage line (exit status 2) before anything runs."""
    shapes = []
    for part in filter(None, text.split(";")):
        try:
            shape = tuple(int(x) for x in part.split(","))
        except ValueError:
            shape = ()
        if len(shape) != 4 or min(shape) < 1:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not B,H,T,D (four positive integers); shapes are separated by ';', "
                "e.g. '16,12,1024,64;4,12,2048,64'")
        shapes.append(shape)
    if not shapes:
        raise argparse.ArgumentTypeError("no B,H,T,D shape given, e.g. '16,12,1024,64;4,12,2048,64'")
    return shapes


def first_line(err: Exception, width: int = 200) -> str:
    """``Type: first line of the message``, cut to ``width`` characters."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:width]


# --- FLOPs and errors -----------------------------------------------------------------------------

def causal_flops(B: int, H: int, T: int, D: int, backward: bool) -> float:
    """Matmul FLOPs of causal attention: half of 4·B·H·T²·D forward, 3.5× that with the backward."""
    forward = 2.0 * B * H * T * T * D
    return forward * BACKWARD_FLOPS_FACTOR if backward else forward


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||, both in float32."""
    ref = ref.float()
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# --- SDPA forced to one kernel --------------------------------------------------------------------

def forced_sdpa(kernel: str, heads_first: bool = True, dropout_p: float = 0.0):
    """Causal SDPA restricted to one of its kernels, e.g. ``forced_sdpa("FLASH_ATTENTION")``.

    heads_first: q (B, H, T, D), k and v (B, H_kv, T, D); otherwise (B, T, H, D), passed to SDPA as
    transposed views. dropout_p: SDPA's attention dropout. Raises AttributeError or ImportError where
    this PyTorch cannot force ``kernel``.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, kernel)

    def attend(q, k, v):
        if not heads_first:
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                               enable_gqa=q.shape[1] != k.shape[1])
        return o if heads_first else o.transpose(1, 2)

    return attend


# --- timing ---------------------------------------------------------------------------------------

def median_ms(fn, device: torch.device, warmup: int = 25, rep: int = 100, grad_to_none=None) -> float:
    """Median milliseconds of fn(): ``triton.testing.do_bench`` on CUDA (L2 flushed before each call,
    ``warmup`` and ``rep`` in ms), the median of 5 ``perf_counter`` calls elsewhere."""
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_median_ms(fn, rep: int = 100, grad_to_none=None) -> float:
    """Median milliseconds of fn() captured once as a CUDA graph and replayed: the GPU's time, no host work."""
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=rep, grad_to_none=grad_to_none, return_mode="median")


# --- where a number was measured ------------------------------------------------------------------

def commit() -> str:
    """``NANOFLASH_COMMIT`` when set (a copy of the tree on a GPU box, whose own git data may be stale:
    the commit the copy was made from), else the checkout's short commit, with ``+changes`` when the
    tree differs from it, else ``unknown``."""
    if os.environ.get("NANOFLASH_COMMIT"):
        return os.environ["NANOFLASH_COMMIT"]

    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode:
            return "unknown"
        changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if changed else "")


def environment(device: torch.device) -> dict:
    """{device, torch, triton, commit, date}: what every table of numbers is labelled with."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton_version, "commit": commit(),
            "date": datetime.date.today().isoformat()}


def command_line(script: str, argv=None) -> str:
    """The command that ran, as it would be typed from the repository root."""
    return f"python -m scripts.{script.removesuffix('.py')} " + " ".join(sys.argv[1:] if argv is None else argv)
