"""Micro-benchmark every attention backend: time, TFLOP/s and memory over shapes, OOM included.

    python -m scripts.bench_attention --preset anchors --out bench/anchors      # the six anchor shapes
    python -m scripts.bench_attention --preset anchors --backends flash,sdpa-fa2,sdpa-cudnn --graphs --out bench/flash
                                 # our kernel against SDPA's kernels, eager and as replayed CUDA graphs
    python -m scripts.bench_attention --preset sweep --modes fwd+bwd --out bench/sweep   # T 512..32768, B*T=32768
    python -m scripts.bench_attention --preset seed001 --out bench/seed001   # naive / tiled / hybrid, compile time
    python -m scripts.bench_attention --B 1 --H 12 --D 64 --T 2048,8192,32768,131072 --vram-budget-gb 8
    python -m scripts.bench_attention --device cpu --dtype fp32 --B 1 --H 2 --D 16 --T 64,128   # anywhere
    python -m scripts.bench_attention --from-json bench/anchors/results.json   # tables and plots again

Backends: naive, hybrid, sdpa (PyTorch's own choice of kernel), flash (ours) and, on CUDA where the
installed PyTorch has them, SDPA forced to one kernel (sdpa-fa2, sdpa-cudnn, sdpa-efficient) and
compiled FlexAttention with a causal block mask (flex). On request (--backends, or the seed001
preset): tiled (seed 001's "vanilla" flash in PyTorch: slow) and hybrid@N (hybrid with N-row query
blocks instead of its own rule, to tune that rule). A backend that cannot run here is "n/a"
with the reason; one that runs out of memory at a shape is "OOM" there and the sweep goes on.

Per point: median time (triton.testing.do_bench on CUDA, a perf_counter median of 5 calls on CPU;
with --graphs also the call captured once as a CUDA graph and replayed: the GPU's own time),
TFLOP/s with causal flops (forward 2*B*H*T^2*D, forward+backward 3.5x that) and peak memory above
the inputs (CUDA only; null on CPU), measured after a warm-up call so compilation and autotuning
buffers are not counted.

Before timing, every backend is checked on the first shape against a float32 reference (output,
and dq, dk, dv when fwd+bwd is measured); a backend off by more than the dtype's tolerance stops
the script with exit status 1. --vram-budget-gb caps this process' GPU memory like a smaller card
(torch.cuda.set_per_process_memory_fraction) and is refused on CPU (exit status 2).

--compile NAMES (the seed001 preset: naive,hybrid) also times torch.compile of those backends at
the first shape, forward+backward: the first call (compilation) in seconds, then ms and peak MB.

Prints a progress table and, at the end, one table per mode with a column per backend (TFLOP/s,
ms and peak MB); with --out writes results.json (rows and the environment), results.csv,
summary.md (those tables) and bench_<mode>.png (time, TFLOP/s and memory against T, log scales).
Needs torch (and triton for flash and CUDA timing); matplotlib only for the plots.
"""
import argparse
import csv
import functools
import gc
import json
import re
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model.attention import BACKENDS, build_attention, hybrid, tiled, unavailable_reason  # noqa: E402
from model.config import AttentionConfig  # noqa: E402
from scripts.bench_common import (ANCHORS, SDPA_KERNELS, causal_flops, command_line, environment, fail,  # noqa: E402
                                  first_line, forced_sdpa, graph_median_ms, median_ms, relative_error, tflops)
from training.exits import ArgumentParser, exit_on_error  # noqa: E402
from training.precision import DTYPES, apply_vram_budget  # noqa: E402

SWEEP_TOKENS = 32768
SWEEP = [(SWEEP_TOKENS // T, 12, T, 64) for T in (512, 1024, 2048, 4096, 8192, 16384, 32768)]
ON_REQUEST = ("tiled", "hybrid@N")  # slow or tuning variants: only when --backends (or seed001) names them
OURS = tuple(name for name in BACKENDS if name not in ON_REQUEST)  # the model's backends (model/attention)
ALL_BACKENDS = (*OURS, *SDPA_KERNELS, "flex")
# Seed 001's table (naive / tiled / hybrid), hybrid's two target shapes first; hybrid@N beside
# hybrid's own block rule, to tune it; compile time of naive and hybrid at the first shape.
SEED001 = [(4, 12, 2048, 64), (1, 12, 2048, 64), (4, 12, 1024, 64), (4, 12, 512, 64)]
SEED001_BACKENDS = ("naive", "tiled", "hybrid", "hybrid@64", "hybrid@128", "hybrid@512", "sdpa")
SEED001_COMPILE = ("naive", "hybrid")
MODES = ("fwd", "fwd+bwd")
# Largest relative L2 error ||x - ref|| / ||ref|| against the float32 reference. A bf16 result is
# off by about 4e-3 from rounding alone; fp32 on CUDA allows TF32 tensor-core matmuls (Triton's
# default for fp32 dots).
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 2e-2, torch.float32: 1e-4}
TOLERANCE_FP32_CUDA = 5e-3
RATIOS = {"flash / FA2": ("flash", "sdpa-fa2"), "flash / cuDNN": ("flash", "sdpa-cudnn")}


# --- backends -------------------------------------------------------------------------------------

def flex_attention_fn():
    """Compiled FlexAttention with a causal block mask (one mask per T). Same shapes as above.
    Compiled for static shapes, as a model at one T is: left to Dynamo's automatic dynamic shapes,
    the second T recompiles a shape-generic kernel that ran 20-25 % slower at D=128 on the H100."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    for limit in ("recompile_limit", "cache_size_limit"):  # one compile per shape and mode at most
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def attend(q, k, v):
        T = q.shape[1]
        if T not in masks:
            masks[T] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=q.device)
        o = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=masks[T],
                     enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)

    return attend


def known(name: str) -> bool:
    return name in ALL_BACKENDS or name == "tiled" or re.fullmatch(r"hybrid@[1-9][0-9]*", name) is not None


def ours(name: str) -> bool:
    return name in OURS or name == "tiled" or name.startswith("hybrid@")


def blockwise(name: str):
    """tiled, hybrid (its own block rule) or hybrid@N (N-row query blocks), called directly: through
    build_attention hybrid would take AttentionConfig's block_size (64 rows)."""
    if name == "tiled":
        return tiled.attend
    return functools.partial(hybrid.attend, block_size=int(name[len("hybrid@"):]) if "@" in name else None)


def backends(device: torch.device, names) -> dict:
    """{name: attend(q, k, v) -> o, or a string saying why it cannot run here}."""
    found = {}
    for name in names:
        if name == "tiled" or name.startswith("hybrid"):
            found[name] = blockwise(name)
        elif name in OURS and unavailable_reason(name, device):
            found[name] = unavailable_reason(name, device)
        elif name in OURS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found[name], _ = build_attention(AttentionConfig(name=name), device)
        elif device.type != "cuda":
            found[name] = "needs a CUDA GPU"
        elif name == "flex":
            try:
                found[name] = flex_attention_fn()
            except (ImportError, AttributeError) as err:
                found[name] = f"this PyTorch has no FlexAttention ({err})"
        else:
            try:
                found[name] = forced_sdpa(SDPA_KERNELS[name], heads_first=False)  # q: (B, T, H, D)
            except (ImportError, AttributeError) as err:
                found[name] = f"this PyTorch cannot force it ({err})"
    return found


# --- measuring ------------------------------------------------------------------------------------

def make_inputs(B, H, Hkv, T, D, dtype, device, grad):
    """q: (B, T, H, D), k and v: (B, T, Hkv, D), standard normal, the same for every backend."""
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn((B, T, h, D), generator=gen, device=device, dtype=dtype).requires_grad_(grad)
            for h in (H, Hkv, Hkv)]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def measure(attend, shape, Hkv, mode, dtype, device, graphs: bool = False) -> dict:
    """{ms, tflops, peak_mb, status: ok|OOM}, and with ``graphs`` {graph_ms, graph_tflops}: the call
    captured once as a CUDA graph and replayed (the GPU's time, no host work; None where the backend
    cannot be captured). Any other error propagates."""
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
        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = median_ms(step, device)
        flops = causal_flops(B, H, T, D, backward=mode == "fwd+bwd")
        result = {"ms": ms, "tflops": tflops(flops, ms), "peak_mb": peak, "status": "ok"}
        if graphs:
            graph_ms = replayed_ms(step)
            result.update(graph_ms=graph_ms, graph_tflops=graph_ms and tflops(flops, graph_ms))
        return result
    except torch.OutOfMemoryError:
        return {"ms": None, "tflops": None, "peak_mb": None, "status": "OOM"}
    finally:
        free_memory()


def replayed_ms(step):
    """Median ms of ``step`` captured as a CUDA graph and replayed, or None where it cannot be captured."""
    try:
        return graph_median_ms(step)
    except Exception as err:  # e.g. a backend that syncs with the host
        print(f"# no CUDA graph: {first_line(err)}")
        return None


def compile_time(attend, shape, Hkv, dtype, device) -> dict:
    """torch.compile(attend) at ``shape``, forward+backward: {compile_s: the first call, which
    compiles} and then measure()'s {ms, tflops, peak_mb, status} of the compiled function."""
    B, H, T, D = shape
    torch._dynamo.reset()
    compiled = torch.compile(attend)
    free_memory()
    start = time.perf_counter()
    try:
        q, k, v = make_inputs(B, H, Hkv, T, D, dtype, device, grad=True)
        torch.autograd.grad(compiled(q, k, v), (q, k, v), torch.randn_like(q))
        if device.type == "cuda":
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        return {"compile_s": time.perf_counter() - start, "ms": None, "tflops": None, "peak_mb": None, "status": "OOM"}
    seconds = time.perf_counter() - start
    del q, k, v
    return {"compile_s": seconds, **measure(compiled, shape, Hkv, "fwd+bwd", dtype, device)}


def compile_line(name, shape, result) -> str:
    return (f"# compiled {name} at (B,H,T,D)={tuple(shape)}, fwd+bwd: first call {result['compile_s']:.1f} s, "
            f"then {fmt(result['ms'])} ms, peak {fmt(result['peak_mb'], 'peak_mb')} MB ({result['status']})")


# --- correctness ----------------------------------------------------------------------------------

def reference(q, k, v):
    """Causal attention in float32 through SDPA's math kernel; k, v repeated for GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    G = q.shape[2] // k.shape[2]
    qh, kh, vh = (x.float().transpose(1, 2) for x in (q, k, v))
    kh, vh = kh.repeat_interleave(G, dim=1), vh.repeat_interleave(G, dim=1)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)


def outputs(attend, q, k, v, grad_out, grads: bool) -> dict:
    """{"o": ...} and, with grads, {"dq", "dk", "dv"} for attend at these inputs."""
    q, k, v = (x.detach().requires_grad_(grads) for x in (q, k, v))
    o = attend(q, k, v)
    found = {"o": o.detach()}
    if grads:
        found.update(zip(("dq", "dk", "dv"), torch.autograd.grad(o, (q, k, v), grad_out.to(o.dtype))))
    return found


def check_backends(found: dict, shape, Hkv, dtype, device, grads: bool) -> dict:
    """Compare every runnable backend with the float32 reference at ``shape``.

    Returns {name: {"o": err, "dq": err, ...}}. Optional backends (forced SDPA kernels, flex) that
    raise here become "n/a" in ``found``; ours raise. Exits with status 1 when one is off.
    """
    B, H, T, D = shape
    tol = TOLERANCE_FP32_CUDA if dtype == torch.float32 and device.type == "cuda" else TOLERANCE[dtype]
    try:
        q, k, v = make_inputs(B, H, Hkv, T, D, dtype, device, grad=False)
        grad_out = torch.randn_like(q)
        ref = outputs(reference, q, k, v, grad_out.float(), grads)
    except torch.OutOfMemoryError:
        print(f"# correctness check skipped: the float32 reference does not fit at (B,H,T,D)={shape}")
        return {}
    errors, wrong = {}, []
    for name, attend in found.items():
        if not callable(attend):
            continue
        try:
            got = outputs(attend, q, k, v, grad_out, grads)
        except torch.OutOfMemoryError:
            print(f"# {name}: correctness check skipped (OOM at the first shape)")
            continue
        except Exception as err:
            if ours(name):
                raise
            found[name] = f"fails at the first shape ({first_line(err)})"
            continue
        errors[name] = {key: relative_error(got[key], ref[key]) for key in ref}
        wrong += [f"{name} {key} relative error {err:.2e}" for key, err in errors[name].items() if not err <= tol]
        del got
    free_memory()
    if wrong:
        fail(f"backends disagree with the float32 reference at (B,H,T,D)={shape}, Hkv={Hkv}, tolerance {tol:g}: "
             + "; ".join(wrong), status=1)
    worst = {name: max(e.values()) for name, e in errors.items()}
    print(f"# checked against float32 at (B,H,T,D)={shape} ({'o, dq, dk, dv' if grads else 'o'}; tolerance {tol:g}): "
          + ", ".join(f"{name} {err:.1e}" for name, err in worst.items()))
    return errors


# --- output ---------------------------------------------------------------------------------------

def fmt(value, key="ms") -> str:
    if value is None:
        return "n/a"
    return f"{value:.0f}" if key == "peak_mb" and value >= 10 else f"{value:.3g}"


def cell(row, key) -> str:
    return fmt(row.get(key), key) if row["status"] == "ok" else row["status"]


def header(meta) -> str:
    return (f"# {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}, causal"
            + (f", budget {meta['budget_gb']:g} GiB" if meta.get("budget_gb") else "") + f", {meta['date']}"
            + (f", commit {meta['commit']}" if meta.get("commit") else ""))


def pivot(rows, mode, key) -> str:
    """One line per shape, one column per backend (and our ratios when both sides ran)."""
    names = list(dict.fromkeys(r["backend"] for r in rows))
    ratios = {label: pair for label, pair in RATIOS.items() if key.endswith("tflops") and set(pair) <= set(names)}
    shapes = list(dict.fromkeys((r["B"], r["H"], r["Hkv"], r["T"], r["D"]) for r in rows if r["mode"] == mode))
    lines = ["| B | H | H_kv | T | D | " + " | ".join(names + list(ratios)) + " |", "|---" * (5 + len(names) + len(ratios)) + "|"]
    for shape in shapes:
        at = {r["backend"]: r for r in rows if r["mode"] == mode and (r["B"], r["H"], r["Hkv"], r["T"], r["D"]) == shape}
        cells = [cell(at[n], key) if n in at else "" for n in names]
        for a, b in ratios.values():
            ok = a in at and b in at and at[a]["status"] == at[b]["status"] == "ok" and at[a].get(key) and at[b].get(key)
            cells.append(f"{at[a][key] / at[b][key]:.2f}x" if ok else "")
        lines.append("| " + " | ".join(map(str, shape)) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows, meta) -> str:
    parts = [header(meta), f"# command: {meta['command']}"]
    parts += [f"# {name}: n/a ({reason})" for name, reason in meta["unavailable"].items()]
    parts += [compile_line(name, result["shape"], result) for name, result in meta.get("compile", {}).items()]
    titles = {"tflops": "TFLOP/s (causal)", "ms": "median ms", "peak_mb": "peak MB above inputs",
              "graph_tflops": "TFLOP/s as replayed CUDA graphs (GPU time, no host work)",
              "graph_ms": "median ms as replayed CUDA graphs"}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for key, title in titles.items():
            if key not in ("ms", "tflops") and all(r.get(key) is None for r in rows):
                continue
            parts.append(f"\n## {mode}: {title}\n\n" + pivot(rows, mode, key))
    return "\n".join(parts) + "\n"


def write_results(rows, meta, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["mode", "B", "H", "Hkv", "T", "D", "backend", "ms", "tflops", "peak_mb", "status",
                                               "graph_ms", "graph_tflops"], restval="")
        writer.writeheader()
        writer.writerows(rows)


def plot(rows, meta, out: Path) -> None:
    """bench_<mode>.png: time, TFLOP/s and peak memory against T (or against the shape when T repeats)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for mode in dict.fromkeys(r["mode"] for r in rows):
        at_mode = [r for r in rows if r["mode"] == mode]
        shapes = list(dict.fromkeys((r["B"], r["H"], r["T"], r["D"]) for r in at_mode))
        by_T = len({s[2] for s in shapes}) == len(shapes)
        x_of = (lambda r: r["T"]) if by_T else (lambda r: shapes.index((r["B"], r["H"], r["T"], r["D"])))
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for i, name in enumerate(dict.fromkeys(r["backend"] for r in at_mode)):
            color = f"C{i}"
            ok = [r for r in at_mode if r["backend"] == name and r["status"] == "ok"]
            for ax, key in zip(axes, ("ms", "tflops", "peak_mb")):
                pts = [r for r in ok if r[key] is not None]
                if pts:
                    ax.plot([x_of(r) for r in pts], [r[key] for r in pts], marker="o", ms=3, color=color, label=name)
            ooms = [x_of(r) for r in at_mode if r["backend"] == name and r["status"] == "OOM"]
            for ax in axes:
                for j, x in enumerate(ooms):
                    ax.plot([x], [0.95 - 0.05 * i], marker="x", color=color, transform=ax.get_xaxis_transform(),
                            label=f"{name}: OOM" if ax is axes[0] and j == 0 else None)
        titles = ("median time (ms)", "TFLOP/s (causal)", "peak memory above inputs (MB)")
        for ax, title in zip(axes, titles):
            if ax.lines:
                ax.set_yscale("log")
            else:
                ax.text(0.5, 0.5, "not measured (CUDA only)", ha="center", transform=ax.transAxes)
            ax.set_title(f"{title}, {mode}", fontsize=10)
            if by_T:
                ax.set_xscale("log", base=2)
                ax.set_xlabel("T")
            else:
                ax.set_xticks(range(len(shapes)))
                ax.set_xticklabels([f"{B}x{H}x{T}x{D}" for B, H, T, D in shapes], rotation=30, fontsize=7)
                ax.set_xlabel("B x H x T x D")
            ax.grid(True, which="major", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(header(meta).lstrip("# "), fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"bench_{mode.replace('+', '_')}.png", dpi=80)
        plt.close(fig)


def write_all(rows, meta, out: Path) -> None:
    write_results(rows, meta, out)
    (out / "summary.md").write_text(summary(rows, meta))
    try:
        plot(rows, meta, out)
    except ImportError as err:
        print(f"# plots skipped: {err} (run again with --from-json {out / 'results.json'} where matplotlib is)")


# --- command line ---------------------------------------------------------------------------------

def parse_args(argv):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["anchors", "sweep", "seed001"],
                   help="anchors: the six (B,H,T,D) anchor shapes; sweep: T 512..32768 at B*T=32768, H=12, D=64; "
                        "seed001: (4|1, 12, 2048, 64) and (4, 12, 512|1024, 64) with naive, tiled, hybrid, hybrid@N "
                        "and sdpa, and the compile time of naive and hybrid (all override --B/--H/--T/--D)")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--H", type=int, default=12)
    p.add_argument("--Hkv", type=int, help="key/value heads (default: H; must divide H)")
    p.add_argument("--T", default="1024,2048,4096", help="comma-separated sequence lengths")
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
    p.add_argument("--backends", help=f"comma-separated from {', '.join(ALL_BACKENDS + ON_REQUEST)} "
                                      "(default: the preset's, else all but those on request)")
    p.add_argument("--compile", help="comma-separated backends to time under torch.compile at the first shape "
                                     "(default: the seed001 preset's naive,hybrid, else none)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--graphs", action="store_true", help="also time each point as a replayed CUDA graph (CUDA only)")
    p.add_argument("--vram-budget-gb", type=float, help="cap this process' GPU memory at N GiB (CUDA only)")
    p.add_argument("--out", help="folder for results.json, results.csv, summary.md and bench_<mode>.png")
    p.add_argument("--from-json", help="write the tables and plots of an earlier results.json (to --out or its folder)")
    return p.parse_args(argv)


def shapes_from(args):
    if args.preset == "anchors":
        return ANCHORS
    if args.preset == "sweep":
        return SWEEP
    if args.preset == "seed001":
        return SEED001
    try:
        shapes = [(args.B, args.H, int(t), args.D) for t in args.T.split(",")]
    except ValueError:
        fail(f"--T {args.T!r} must be comma-separated integers, e.g. --T 1024,2048")
    if min(min(shape) for shape in shapes) <= 0:
        fail(f"--B {args.B} --H {args.H} --T {args.T} --D {args.D}: every size must be a positive integer")
    return shapes


def load_results(path: str) -> dict:
    """An earlier run's results.json ({"rows", "meta"}); one line when it is missing or not one."""
    if not Path(path).is_file():
        fail(f"--from-json {path}: no such file; give the results.json an earlier run with --out wrote")
    try:
        saved = json.loads(Path(path).read_text())
    except ValueError as err:
        fail(f"--from-json {path} is not valid JSON ({first_line(err)})")
    if not (isinstance(saved, dict) and isinstance(saved.get("rows"), list) and isinstance(saved.get("meta"), dict)):
        fail(f"--from-json {path} is not a results.json of this script (no rows and meta)")
    return saved


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.from_json:
        saved = load_results(args.from_json)
        out = Path(args.out or Path(args.from_json).parent)
        write_all(saved["rows"], saved["meta"], out)
        print(summary(saved["rows"], saved["meta"]))
        return
    modes = args.modes.split(",")
    seed001 = args.preset == "seed001"
    names = args.backends.split(",") if args.backends else list(SEED001_BACKENDS if seed001 else ALL_BACKENDS)
    to_compile = args.compile.split(",") if args.compile else list(SEED001_COMPILE if seed001 else ())
    for bad in [m for m in modes if m not in MODES] + [n for n in names + to_compile if not known(n)]:
        fail(f"{bad!r} is not a mode or backend; modes: {', '.join(MODES)}; "
             f"backends: {', '.join(ALL_BACKENDS + ON_REQUEST)} (N: rows per query block)")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but PyTorch sees no CUDA GPU; use --device cpu")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if args.graphs and device.type != "cuda":
        fail("--graphs replays CUDA graphs and needs a CUDA GPU (this run is on CPU)")
    if args.vram_budget_gb is not None and device.type != "cuda":
        fail("--vram-budget-gb caps GPU memory and needs a CUDA GPU (this run is on CPU)")
    shapes = shapes_from(args)
    if args.Hkv is not None and (args.Hkv <= 0 or any(H % args.Hkv for _, H, _, _ in shapes)):
        fail(f"--Hkv {args.Hkv} must divide the number of query heads")
    apply_vram_budget(device, args.vram_budget_gb)
    dtype = DTYPES[args.dtype]
    found = backends(device, names)
    meta = {**environment(device), "dtype": args.dtype, "budget_gb": args.vram_budget_gb,
            "command": command_line("bench_attention.py", argv)}
    print(header(meta))
    check = check_backends(found, shapes[0], args.Hkv or shapes[0][1], dtype, device, grads="fwd+bwd" in modes)
    meta["unavailable"] = {name: reason for name, reason in found.items() if not callable(reason)}
    meta["check"] = check
    for name, reason in meta["unavailable"].items():
        print(f"# {name}: n/a ({reason})")
    print("| mode | B | H | H_kv | T | D | backend | ms | TFLOP/s | peak MB |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for mode in modes:
        for B, H, T, D in shapes:
            for name, attend in found.items():
                if not callable(attend):
                    continue
                try:
                    result = measure(attend, (B, H, T, D), args.Hkv or H, mode, dtype, device, args.graphs)
                except Exception as err:  # a forced SDPA kernel or flex that does not take this shape
                    if ours(name):
                        raise
                    print(f"# {name} at {mode} (B,H,T,D)={(B, H, T, D)}: n/a ({first_line(err)})")
                    result = {"ms": None, "tflops": None, "peak_mb": None, "status": "n/a"}
                row = {"mode": mode, "B": B, "H": H, "Hkv": args.Hkv or H, "T": T, "D": D, "backend": name, **result}
                rows.append(row)
                print(f"| {mode} | {B} | {H} | {row['Hkv']} | {T} | {D} | {name} | "
                      + " | ".join(cell(row, k) for k in ("ms", "tflops", "peak_mb")) + " |", flush=True)
                if args.out:  # after every point, so an interrupted run keeps what it measured
                    write_results(rows, meta, Path(args.out))
    meta["compile"] = {}
    for name, attend in backends(device, to_compile).items():
        if callable(attend):
            result = compile_time(attend, shapes[0], args.Hkv or shapes[0][1], dtype, device)
            meta["compile"][name] = {"shape": shapes[0], **result}
            print(compile_line(name, shapes[0], meta["compile"][name]), flush=True)
    print("\n" + summary(rows, meta))
    if args.out and rows:
        write_all(rows, meta, Path(args.out))
        print(f"# wrote results.json, results.csv, summary.md and bench_*.png to {args.out}")


if __name__ == "__main__":
    with exit_on_error(stopped="stopped; the rows measured so far are in --out"):
        main()
