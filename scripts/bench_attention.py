"""Micro-benchmark every attention backend: time, TFLOP/s and memory over shapes, OOM included.

    python scripts/bench_attention.py --preset anchors --out bench/          # the six anchor shapes
    python scripts/bench_attention.py --preset sweep --modes fwd+bwd --out bench/   # T 512..32768 at B*T=32768
    python scripts/bench_attention.py --B 1 --H 12 --D 64 --T 1024,4096,16384 --vram-budget-gb 8
    python scripts/bench_attention.py --device cpu --dtype fp32 --B 1 --H 2 --D 16 --T 64,128   # anywhere

Backends: naive, hybrid, sdpa, flash (ours) and, on CUDA where PyTorch has them, SDPA forced to
each of its kernels (sdpa-fa2, sdpa-cudnn, sdpa-efficient) and FlexAttention (flex, compiled, causal
block mask). Per point: median time (triton.testing.do_bench on CUDA, a perf_counter median on
CPU), TFLOP/s with causal flops (forward 2*B*H*T^2*D, forward+backward 3.5x), and peak memory
above the inputs. A backend that runs out of memory is recorded as OOM; one that cannot run here
is "n/a" with the reason. Before timing, every backend is checked against sdpa on the first shape.
Writes results.csv, results.json and plots (time, TFLOP/s, memory vs T) under --out.
"""
import argparse
import csv
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model.attention import build_attention  # noqa: E402
from model.config import AttentionConfig  # noqa: E402
from training.cli import fail  # noqa: E402
from training.fit import apply_vram_budget, free_memory  # noqa: E402
from training.precision import DTYPES  # noqa: E402

ANCHORS = [(16, 12, 1024, 64), (4, 12, 2048, 64), (8, 16, 2048, 128), (4, 16, 4096, 128), (2, 16, 8192, 128), (1, 16, 16384, 128)]
SWEEP = [(32768 // T, 12, T, 64) for T in (512, 1024, 2048, 4096, 8192, 16384, 32768)]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def forced_sdpa(backend_name: str):
    """SDPA restricted to one of its kernels. q, k, v: (B, T, H, D)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def attend(q, k, v):
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)

    return attend


def flex_attention_fn():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    masks = {}

    def attend(q, k, v):
        T = q.shape[1]
        if T not in masks:
            masks[T] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=q.device)
        o = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=masks[T],
                     enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)

    return attend


def backends(device: torch.device, names):
    """{name: attend fn or the reason it cannot run here}."""
    found = {}
    for name in names:
        if name in ("naive", "hybrid", "sdpa", "flash"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                attend, actual = build_attention(AttentionConfig(name=name), device)
            found[name] = attend if actual == name else f"runs as {actual} here (no CUDA GPU or Triton)"
        elif device.type != "cuda":
            found[name] = "needs a CUDA GPU"
        elif name == "flex":
            try:
                found[name] = flex_attention_fn()
            except ImportError as err:
                found[name] = f"FlexAttention missing in this PyTorch ({err})"
        else:
            kernel = {"sdpa-fa2": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION"}[name]
            found[name] = forced_sdpa(kernel)
    return found


def causal_flops(B, H, T, D, mode) -> float:
    return 2.0 * B * H * T * T * D * (3.5 if mode == "fwd+bwd" else 1.0)


def make_inputs(B, H, Hkv, T, D, dtype, device, grad):
    gen = torch.Generator(device=device).manual_seed(0)
    shape = lambda h: (B, T, h, D)
    return [torch.randn(shape(h), generator=gen, device=device, dtype=dtype).requires_grad_(grad) for h in (H, Hkv, Hkv)]


def timed(fn, device) -> float:
    """Median milliseconds of fn()."""
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(attend, shape, Hkv, mode, dtype, device) -> dict:
    B, H, T, D = shape
    free_memory()
    try:
        q, k, v = make_inputs(B, H, Hkv, T, D, dtype, device, grad=mode == "fwd+bwd")
        grad_out = torch.randn_like(q)

        def step():
            o = attend(q, k, v)
            if mode == "fwd+bwd":
                torch.autograd.grad(o, (q, k, v), grad_out)

        step()  # warm-up: compilation and autotuning (whose timing buffers are not the backend's memory)
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None
        ms = timed(step, device)
        return {"ms": ms, "tflops": causal_flops(B, H, T, D, mode) / (ms * 1e-3) / 1e12, "peak_mb": peak, "status": "ok"}
    except torch.OutOfMemoryError:
        return {"ms": None, "tflops": None, "peak_mb": None, "status": "OOM"}
    finally:
        free_memory()


def check_against_sdpa(found, shape, Hkv, dtype, device) -> None:
    B, H, T, D = shape
    q, k, v = make_inputs(B, H, Hkv, T, D, dtype, device, grad=False)
    ref = found["sdpa"](q, k, v) if callable(found.get("sdpa")) else None
    if ref is None:
        return
    for name, attend in found.items():
        if callable(attend):
            out = attend(q, k, v).float()
            err = ((out - ref.float()).norm() / ref.float().norm()).item()
            if not err < TOLERANCE[dtype]:
                fail(f"{name} disagrees with sdpa at (B,H,T,D)={shape}: relative error {err:.2e}")


def plot(rows, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for mode in sorted({r["mode"] for r in rows}):
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for name in dict.fromkeys(r["backend"] for r in rows):
            pts = [r for r in rows if r["backend"] == name and r["mode"] == mode and r["status"] == "ok"]
            for ax, key in zip(axes, ("ms", "tflops", "peak_mb")):
                if any(p[key] is not None for p in pts):
                    ax.plot([p["T"] for p in pts], [p[key] for p in pts], marker="o", label=name)
            ooms = [r for r in rows if r["backend"] == name and r["mode"] == mode and r["status"] == "OOM"]
            if ooms:
                axes[0].axvline(min(r["T"] for r in ooms), linestyle="--", linewidth=0.8, color="grey")
        for ax, title in zip(axes, ("time (ms)", "TFLOP/s", "peak memory above inputs (MB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T")
            ax.set_title(f"{title}, {mode}")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"bench_{mode.replace('+', '_')}.png", dpi=90)
        plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["anchors", "sweep"], help="shape set (else --B/--H/--T/--D)")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--H", type=int, default=12)
    p.add_argument("--Hkv", type=int, help="key/value heads (default: H)")
    p.add_argument("--T", default="1024,2048,4096", help="comma-separated sequence lengths")
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--backends", default="naive,hybrid,sdpa,flash,sdpa-fa2,sdpa-cudnn,sdpa-efficient,flex")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--vram-budget-gb", type=float, help="cap GPU memory like a smaller card (CUDA only)")
    p.add_argument("--out", help="folder for results.csv, results.json and PNG plots")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no CUDA GPU is visible")
    if args.vram_budget_gb and device.type != "cuda":
        fail("--vram-budget-gb caps GPU memory and needs a CUDA GPU")
    apply_vram_budget(device, args.vram_budget_gb)
    dtype = DTYPES[args.dtype]
    shapes = ANCHORS if args.preset == "anchors" else SWEEP if args.preset == "sweep" else [
        (args.B, args.H, int(t), args.D) for t in args.T.split(",")]
    found = backends(device, args.backends.split(","))
    import triton  # noqa: F401 (versions for the header)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {gpu}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}, causal"
          + (f", budget {args.vram_budget_gb:g} GiB" if args.vram_budget_gb else ""))
    for name, reason in found.items():
        if not callable(reason):
            print(f"# {name}: n/a ({reason})")
    check_against_sdpa(found, shapes[0], args.Hkv or shapes[0][1], dtype, device)
    print("| mode | B | H | T | D | backend | ms | TFLOP/s | peak MB |\n|---|---|---|---|---|---|---|---|---|")
    rows = []
    for mode in args.modes.split(","):
        for shape in shapes:
            for name, attend in found.items():
                if not callable(attend):
                    continue
                result = measure(attend, shape, args.Hkv or shape[1], mode, dtype, device)
                row = {"mode": mode, "B": shape[0], "H": shape[1], "T": shape[2], "D": shape[3], "backend": name, **result}
                rows.append(row)
                cells = [f"{row[k]:.3f}" if row[k] is not None else row["status"] for k in ("ms",)]
                cells += [f"{row[k]:.4g}" if row[k] is not None else ("n/a" if row["status"] == "ok" else row["status"]) for k in ("tflops", "peak_mb")]
                print(f"| {mode} | {shape[0]} | {shape[1]} | {shape[2]} | {shape[3]} | {name} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"device": gpu, "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
                "budget_gb": args.vram_budget_gb, "command": " ".join(sys.argv)}
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        with open(out / "results.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, out)


if __name__ == "__main__":
    main()
