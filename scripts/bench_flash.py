"""Measurements of our flash kernel that no other backend shares: the cost of attention dropout
(``--dropout P``), the first call at a new shape (``--first-call``), the cost of the forget gate
(``--gate``) and the Hopper kernels in Gluon against the ``tl`` kernels (``--hopper``), one per run. Our kernel's speed against SDPA's kernels at the same shapes is
``scripts/bench_attention.py --preset anchors --backends flash,sdpa-fa2,sdpa-cudnn [--graphs]``.

Times are medians of ``triton.testing.do_bench``; TFLOP/s count causal forward flops as 2*B*H*T^2*D
and forward+backward as 3.5x that.

``--dropout P`` measures the cost of attention dropout: ours and SDPA's
FlashAttention-2, each at dropout_p=0 and dropout_p=P, forward and forward+backward, eager, and
the ratio of the two times; plus the wall time of our first call (compilation and autotuning) at
the first shape, without and then with dropout (run with a fresh ``TRITON_CACHE_DIR`` for a cold
figure). Writes dropout.json and dropout.md.

    python -m scripts.bench_flash --dropout 0.1 --out OUTDIR

``--first-call`` measures what a user waits for at a new shape: for a few new (dtype, D)
pairs at a small T, the wall seconds of the first forward+backward call, in a new process with an
empty Triton cache and an empty nanoflash tuning cache (compilation, and tuning where the shape
has more than one candidate config), then again in another new process with both caches kept
(targets: <= 10 s in fp16/bf16 and <= 15 s in fp32 cold, no tuning warm); with ``--shapes``, at
those shapes in bf16 instead. Writes first_call.json and first_call.md; about two minutes on an
H100.

    python -m scripts.bench_flash --first-call --out OUTDIR

``--gate`` measures the cost of the forget gate g (log-decay, ``flash_attn(..., g=g)``):
ours with g, ours without, and flash-linear-attention's ``parallel_attn`` with the same g (when
the package ``fla`` imports; else one line says it is missing), forward and forward+backward
(g's gradient included), eager; g = logsigmoid(z + 3) with z standard normal, float32 (B, T, H),
gates near 1 as the Forgetting Transformer starts. Before timing, FLA's o, dq, dk, dv, dg are
compared with ours. Writes gate.json, gate.md and gate.csv.

    python -m scripts.bench_flash --gate --out OUTDIR

``--hopper`` times forward and forward+backward, causal, bf16, eager, through ``flash_attn`` with
``kernel="gluon"`` (the Gluon kernels for sm90, ``kernels/flash_attention/hopper.py``),
``kernel="auto"`` (what a model runs: the Gluon forward where it is the faster one, the tl backward)
and ``kernel="tl"``, and SDPA's cuDNN kernel, with the largest difference between the Gluon and tl
kernels' o, dq, dk, dv. Writes hopper.json and hopper.md; needs an H100/H200.

    python -m scripts.bench_flash --hopper --out OUTDIR

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402

from scripts.bench_common import (ANCHORS, ROOT, causal_flops, command_line, environment, fail, first_line,  # noqa: E402
                                  forced_sdpa, median_ms, parse_shapes, relative_error, require_cuda,
                                  tflops)
from training.exits import ArgumentParser, exit_on_error  # noqa: E402

CUDA = torch.device("cuda")


def calls(fn, q, k, v, do):
    """The forward call and the forward+backward call of ``fn`` on these inputs."""

    def fwd():
        return fn(q, k, v)

    def fwd_bwd():
        fn(q, k, v).backward(do)

    return fwd, fwd_bwd


def rates(shape, fwd_ms: float, fwd_bwd_ms: float) -> dict:
    """fwd_ms, fwd_bwd_ms and their causal TFLOP/s at ``shape`` (B, H, T, D)."""
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
            "fwd_tflops": tflops(causal_flops(*shape, backward=False), fwd_ms),
            "fwd_bwd_tflops": tflops(causal_flops(*shape, backward=True), fwd_bwd_ms)}


def time_calls(fn, q, k, v, do, shape, warmup, rep, more_grads=()) -> dict:
    """Median eager milliseconds and TFLOP/s of ``fn``'s forward and forward+backward (whose gradients
    of q, k, v and of ``more_grads``, tensors ``fn`` uses, are reset between calls)."""
    fwd, fwd_bwd = calls(fn, q, k, v, do)
    return rates(shape, median_ms(fwd, CUDA, warmup, rep),
                 median_ms(fwd_bwd, CUDA, warmup, rep, grad_to_none=[q, k, v, *more_grads]))


def dropout_inputs(B, H, T, D, dtype):
    """(ours, SDPA's): q, k, v (requiring grad) and do, in (B, T, H, D) and (B, H, T, D)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    ours = [t.clone().requires_grad_() for t in (q, k, v)] + [do]
    sdpa = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)] + [do.transpose(1, 2).contiguous()]
    return ours, sdpa


def first_call_seconds(fn, q, k, v, do) -> float:
    """Wall seconds of one synchronised forward+backward (the first: compilation and tuning)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(q, k, v).backward(do)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_dropout(shapes, dropout_p: float, warmup: int, rep: int) -> tuple[list[dict], dict]:
    """Per shape: eager times of ours and FA2 at dropout 0 and ``dropout_p``; first-call seconds."""
    from kernels import flash_attn

    def ours(p):
        return lambda q, k, v: flash_attn(q, k, v, causal=True, dropout_p=p)

    impls = {("nanoflash", 0.0): (ours(0.0), 0), ("nanoflash", dropout_p): (ours(dropout_p), 0),
             ("sdpa_fa2", 0.0): (forced_sdpa("FLASH_ATTENTION"), 1),
             ("sdpa_fa2", dropout_p): (forced_sdpa("FLASH_ATTENTION", dropout_p=dropout_p), 1)}
    inputs = dropout_inputs(*shapes[0], torch.bfloat16)[0]
    first = {f"p={p}": first_call_seconds(impls[("nanoflash", p)][0], *inputs) for p in (0.0, dropout_p)}
    first["shape"] = shapes[0]
    rows = []
    for shape in shapes:
        inputs = dropout_inputs(*shape, torch.bfloat16)
        row = {"B": shape[0], "H": shape[1], "T": shape[2], "D": shape[3]}
        for (name, p), (fn, layout) in impls.items():
            try:
                row[f"{name} p={p}"] = time_calls(fn, *inputs[layout], shape, warmup, rep)
            except Exception as e:  # a backend without dropout here
                row[f"{name} p={p}"] = {"error": first_line(e, 120)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows, first


def table_header(meta: dict, what: str) -> list[str]:
    """A table's first lines: where it was measured (device, versions, date, commit), what it holds, the command."""
    return [f"device: {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | {meta['date']} | "
            f"commit {meta['commit']} | {what}", "", f"`{meta['command']}`", ""]


def dropout_table(rows: list[dict], first: dict, dropout_p: float, meta: dict) -> str:
    md = [*table_header(meta, f"bf16 causal, eager, median ms (do_bench); cost = time at p={dropout_p} / time at p=0"),
          f"| B | H | T | D | fwd ours p=0 | fwd ours p={dropout_p} | cost | fwd+bwd ours p=0 | "
          f"fwd+bwd ours p={dropout_p} | cost | fwd+bwd FA2 p=0 | fwd+bwd FA2 p={dropout_p} | cost |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(r, key):
        return f"{r[key]:.3f}" if key in r else "n/a"

    def cost(a, b, key):
        return f"{b[key] / a[key]:.3f}x" if key in a and key in b else "n/a"

    for r in rows:
        o0, o1 = r["nanoflash p=0.0"], r[f"nanoflash p={dropout_p}"]
        f0, f1 = r["sdpa_fa2 p=0.0"], r[f"sdpa_fa2 p={dropout_p}"]
        md.append(f"| {r['B']} | {r['H']} | {r['T']} | {r['D']} | {ms(o0, 'fwd_ms')} | {ms(o1, 'fwd_ms')} | "
                  f"{cost(o0, o1, 'fwd_ms')} | {ms(o0, 'fwd_bwd_ms')} | {ms(o1, 'fwd_bwd_ms')} | "
                  f"{cost(o0, o1, 'fwd_bwd_ms')} | {ms(f0, 'fwd_bwd_ms')} | {ms(f1, 'fwd_bwd_ms')} | "
                  f"{cost(f0, f1, 'fwd_bwd_ms')} |")
    md += ["", f"First forward+backward call of ours at {tuple(first['shape'])} (compilation and autotuning, "
           f"seconds): p=0 {first['p=0.0']:.1f}, then p={dropout_p} {first[f'p={dropout_p}']:.1f}"]
    return "\n".join(md)


FIRST_CALL_SHAPES = [  # (dtype, B, H, T, D): new (dtype, head dim) pairs at a small T
    ("bf16", 2, 8, 512, 64),
    ("bf16", 2, 8, 512, 128),
    ("fp32", 2, 8, 512, 64),
    ("fp32", 2, 8, 512, 32),
    ("fp16", 2, 8, 512, 80),
]
FIRST_CALL_TARGET_S = {"bf16": 10.0, "fp16": 10.0, "fp32": 15.0}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def first_backward_seconds() -> float:
    """Wall seconds of this process's first autograd backward, of a one-element product: what
    torch imports and sets up on its first backward, whatever the backend."""
    x = torch.ones(1, device="cuda", requires_grad=True)
    start = time.perf_counter()
    (x * 2).backward(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def first_call_child(shape: list, tune_cache: str) -> dict:
    """In this (new) process: seconds of the first forward+backward at ``shape`` (dtype, B, H, T, D),
    the seconds spent tuning inside it and the configs launched. Tuning picks go to ``tune_cache``.
    Before the clock starts: CUDA and Triton's driver utilities (any Triton kernel needs them), and
    torch's first backward of the process, which imports ``torch.fx.experimental.symbolic_shapes``
    and with it sympy (any backend's first backward pays it; 2.4-3.5 s on the H100 image, whose
    sympy has no compiled bytecode). Its seconds are reported as ``torch_first_backward_s``."""
    import triton

    from kernels import flash_attn
    from kernels.flash_attention import backward, forward

    triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    torch_first_backward_s = first_backward_seconds()

    tuners = (forward.FWD, backward.DQ, backward.DKDV)
    tunes = []
    for tuner in tuners:
        tuner.cache_dir = Path(tune_cache)
        tuner.timer = timed(tuner.timer, tunes)
    dtype, B, H, T, D = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=DTYPES[dtype], generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    seconds = first_call_seconds(lambda q, k, v: flash_attn(q, k, v, causal=True), q, k, v, do)
    return {"first_call_s": seconds, "tuning_s": sum(tunes), "tunes": len(tunes),
            "torch_first_backward_s": torch_first_backward_s,
            "configs": {t.kind: str(cfg) for t in tuners for cfg in t.picks.values()}}


def timed(timer, seconds: list):
    """``timer`` that appends the seconds of each call to ``seconds``."""
    def run(*args):
        start = time.perf_counter()
        timings = timer(*args)
        seconds.append(time.perf_counter() - start)
        return timings

    return run


def first_call_in_a_new_process(shape: tuple, triton_cache: Path, tune_cache: Path) -> dict:
    """:func:`first_call_child` in a new Python process with ``TRITON_CACHE_DIR=triton_cache``; its
    result plus the process's wall seconds and the notices it printed."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(triton_cache)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_flash", "--first-call-child",
                           json.dumps([list(shape), str(tune_cache)])], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"first call at {shape} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    result["notices"] = [line for line in proc.stderr.splitlines() if line.startswith("nanoflash:")]
    return result


def bench_first_calls(shapes: list[tuple], folder: Path) -> list[dict]:
    """Per shape: the first call in a new process with empty caches ("cold"), then in another new
    process with the caches the first one filled ("warm")."""
    rows = []
    for i, shape in enumerate(shapes):
        triton_cache, tune_cache = folder / f"shape{i}" / "triton", folder / f"shape{i}" / "nanoflash"
        row = {"shape": list(shape)}
        for run in ("cold", "warm"):
            row[run] = first_call_in_a_new_process(shape, triton_cache, tune_cache)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def first_call_table(rows: list[dict], meta: dict) -> str:
    """Markdown: seconds of each shape's first call, cold and warm, against the targets."""
    md = [*table_header(meta, "causal forward+backward, the first call in a new process (seconds)"),
          "| dtype | B | H | T | D | cold: first call | cold: tuning (tunes) | warm: first call | warm: tuning | "
          "target (cold) | met | torch's first backward, before the clock (cold / warm) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        dtype, B, H, T, D = row["shape"]
        cold, warm = row["cold"], row["warm"]
        target = FIRST_CALL_TARGET_S[dtype]
        met = cold["first_call_s"] <= target and warm["tunes"] == 0
        md.append(f"| {dtype} | {B} | {H} | {T} | {D} | {cold['first_call_s']:.1f} | {cold['tuning_s']:.1f} "
                  f"({cold['tunes']}) | {warm['first_call_s']:.2f} | {warm['tuning_s']:.1f} | {target:.0f} | "
                  f"{'yes' if met else 'NO'} | {cold['torch_first_backward_s']:.1f} / "
                  f"{warm['torch_first_backward_s']:.1f} |")
    md += ["", "Configs launched (cold run), and what the cold runs printed:", ""]
    for row in rows:
        md.append(f"- {row['shape']}: " + "; ".join(f"{kind} {cfg}" for kind, cfg in row["cold"]["configs"].items()))
        md += [f"  - `{line}`" for line in row["cold"]["notices"]]
    return "\n".join(md)


def load_fla():
    """(flash-linear-attention's parallel_attn, its version), or (None, why it is missing)."""
    try:
        import fla
        from fla.ops.attn.parallel import parallel_attn
    except Exception as e:  # not installed, or broken against this torch/triton
        return None, first_line(e, 160)
    return parallel_attn, getattr(fla, "__version__", "?")


def gate_inputs(B, H, T, D, dtype):
    """q, k, v (B, T, H, D) requiring grad, do, and g (B, T, H) float32 requiring grad."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    z = torch.randn(B, T, H, device="cuda", generator=g)
    gate = torch.nn.functional.logsigmoid(z + 3.0).requires_grad_()
    return [t.requires_grad_() for t in (q, k, v)], do, gate


def gate_agreement(ours, theirs, q, k, v, do, gate) -> dict:
    """Relative errors of ``theirs`` against ``ours`` (o, dq, dk, dv, dg) on one call each."""
    results = []
    for fn in (ours, theirs):
        o = fn(q, k, v)
        results.append((o.detach(), *torch.autograd.grad(o, (q, k, v, gate), do)))
    return {name: relative_error(b, a) for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), *results)}


def bench_gate(shapes, warmup: int, rep: int) -> tuple[list[dict], str]:
    """Per shape: eager times of ours with and without the gate, and of FLA's parallel_attn with it."""
    from kernels import flash_attn

    parallel_attn, fla_version = load_fla()
    rows = []
    for shape in shapes:
        (q, k, v), do, gate = gate_inputs(*shape, torch.bfloat16)
        scale = shape[3] ** -0.5
        impls = {"ours": lambda q, k, v: flash_attn(q, k, v, causal=True, g=gate),
                 "ours_no_gate": lambda q, k, v: flash_attn(q, k, v, causal=True)}
        if parallel_attn is not None:
            impls["fla"] = lambda q, k, v: parallel_attn(q, k, v, g=gate, scale=scale)
        row = {"B": shape[0], "H": shape[1], "T": shape[2], "D": shape[3]}
        for name, fn in impls.items():
            try:
                if name == "fla":
                    row["fla_rel_err"] = gate_agreement(impls["ours"], fn, q, k, v, do, gate)
                row[name] = time_calls(fn, q, k, v, do, shape, warmup, rep, more_grads=[gate])
            except Exception as e:  # FLA failing at this shape or with this triton
                row[name] = {"error": first_line(e, 120)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, do, gate
        torch.cuda.empty_cache()
    fla_line = (f"flash-linear-attention {fla_version}: fla.ops.attn.parallel.parallel_attn(q, k, v, g=g, scale=D**-0.5)"
                if parallel_attn is not None else f"flash-linear-attention: missing ({fla_version})")
    return rows, fla_line


GATE_COLUMNS = ["B", "H", "T", "D", "ours_fwd_ms", "ours_fwd_bwd_ms", "no_gate_fwd_ms", "no_gate_fwd_bwd_ms",
                "fla_fwd_ms", "fla_fwd_bwd_ms", "gate_cost_fwd", "gate_cost_fwd_bwd", "fla_over_ours_fwd",
                "fla_over_ours_fwd_bwd", "fla_agrees"]


def gate_records(rows: list[dict]) -> list[dict]:
    """One flat record per shape (GATE_COLUMNS): times in ms, ratios, None where not measured."""

    def ms(r, name, key):
        return r.get(name, {}).get(key)

    def ratio(a, b):
        return a / b if a is not None and b is not None else None

    records = []
    for r in rows:
        rec = {n: r[n] for n in ("B", "H", "T", "D")}
        for name, col in (("ours", "ours"), ("ours_no_gate", "no_gate"), ("fla", "fla")):
            rec[f"{col}_fwd_ms"], rec[f"{col}_fwd_bwd_ms"] = ms(r, name, "fwd_ms"), ms(r, name, "fwd_bwd_ms")
        for mode in ("fwd", "fwd_bwd"):
            rec[f"gate_cost_{mode}"] = ratio(rec[f"ours_{mode}_ms"], rec[f"no_gate_{mode}_ms"])
            rec[f"fla_over_ours_{mode}"] = ratio(rec[f"fla_{mode}_ms"], rec[f"ours_{mode}_ms"])
        errs = r.get("fla_rel_err")
        rec["fla_agrees"] = None if errs is None else all(e < 2e-2 for e in errs.values())
        records.append({c: rec[c] for c in GATE_COLUMNS})
    return records


def gate_table(records: list[dict], fla_line: str, meta: dict) -> str:
    """Markdown: per shape, the times of ours with and without g and of FLA's, and their ratios."""
    md = [*table_header(meta, "bf16 causal, eager, median ms (do_bench); "
                              "g float32 (B, T, H) = logsigmoid(N(0,1) + 3)"), fla_line, "",
          "| B | H | T | D | ours fwd | ours fwd+bwd | no-gate fwd | no-gate fwd+bwd | FLA fwd | FLA fwd+bwd | "
          "gate cost fwd | gate cost fwd+bwd | FLA/ours fwd | FLA/ours fwd+bwd | FLA agrees |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(x, fmt):
        return "n/a" if x is None else (("yes" if x else "NO") if isinstance(x, bool) else fmt.format(x))

    for rec in records:
        md.append("| " + " | ".join(
            [str(rec[n]) for n in ("B", "H", "T", "D")]
            + [cell(rec[c], "{:.3f}") for c in GATE_COLUMNS[4:10]]
            + [cell(rec[c], "{:.3f}x") for c in GATE_COLUMNS[10:14]] + [cell(rec["fla_agrees"], "")]) + " |")
    return "\n".join(md)


def chosen_configs() -> dict:
    """The config each kernel's tuner picked, per tuning key."""
    from kernels.flash_attention import backward, forward

    return {t.kind: {str(key): str(cfg) for key, cfg in t.picks.items()} for t in (forward.FWD, backward.DQ, backward.DKDV)}


def bench_hopper(shapes, warmup: int, rep: int) -> list[dict]:
    """Per shape: forward and forward+backward ms and TFLOP/s of flash_attn with kernel="gluon",
    "auto" and "tl", and cuDNN's; the largest difference between the gluon and tl kernels' o, dq, dk, dv."""
    from kernels.flash_attention import flash_attn, hopper

    cudnn = forced_sdpa("CUDNN_ATTENTION", heads_first=False)
    rows = []
    for B, H, T, D in shapes:
        q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        why = hopper.unsupported(q, k, v, 0, None, 0.0, None)
        if why:
            fail(f"--hopper at {(B, H, T, D)}: the Hopper kernels {why}")
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        calls = {"gluon": lambda q, k, v: flash_attn(q, k, v, kernel="gluon"),
                 "auto": lambda q, k, v: flash_attn(q, k, v, kernel="auto"),
                 "tl": lambda q, k, v: flash_attn(q, k, v, kernel="tl"), "cudnn": cudnn}
        outputs = {}
        for name in ("gluon", "auto", "tl"):  # each choice's kernels compiled and tuned before any timing
            o = calls[name](q, k, v)
            outputs[name] = (o, *torch.autograd.grad(o, (q, k, v), do))
        difference = max((a.float() - b.float()).abs().max().item() for a, b in zip(outputs["gluon"], outputs["tl"]))
        row = {"shape": [B, H, T, D], "max_diff_vs_tl": difference}
        for name, fn in calls.items():
            row[name] = time_calls(fn, q, k, v, do, (B, H, T, D), warmup, rep)
        rows.append(row)
    return rows


def hopper_table(rows: list[dict], meta: dict) -> str:
    names = ("gluon", "auto", "tl", "cudnn")
    lines = table_header(meta, "Hopper kernels (Gluon) against the tl kernels and cuDNN, causal bf16, eager") + [
        "| B, H, T, D | pass | gluon ms | auto ms | tl ms | cuDNN ms | gluon TFLOP/s | auto TFLOP/s | tl TFLOP/s "
        "| cuDNN TFLOP/s | gluon / cuDNN | auto / cuDNN | max diff vs tl |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for label, key in (("fwd", "fwd"), ("fwd+bwd", "fwd_bwd")):
            g, a, t, c = (r[name][f"{key}_ms"] for name in names)
            rates = " | ".join(f"{r[name][f'{key}_tflops']:.0f}" for name in names)
            lines.append(f"| {', '.join(map(str, r['shape']))} | {label} | {g:.3f} | {a:.3f} | {t:.3f} | {c:.3f} | "
                         f"{rates} | {c / g:.2f}x | {c / a:.2f}x | {r['max_diff_vs_tl']:.2e} |")
    return "\n".join(lines)


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for dropout.*, first_call.* or gate.* (json, md; gate.csv)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    ap.add_argument("--shapes", type=parse_shapes, default=None, help="B,H,T,D;B,H,T,D (default: the six anchors)")
    ap.add_argument("--dropout", type=float, default=None, metavar="P",
                    help="measure the cost of attention dropout P (0 < P < 1) against none")
    ap.add_argument("--first-call", action="store_true",
                    help="time the first call at new shapes in new processes, cold and warm caches")
    ap.add_argument("--first-call-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--gate", action="store_true",
                    help="measure the cost of the forget gate g against none, beside flash-linear-attention")
    ap.add_argument("--hopper", action="store_true",
                    help="time the Hopper kernels in Gluon against the tl kernels and cuDNN (H100/H200)")
    args = ap.parse_args()
    if args.first_call_child is not None:  # one measurement of --first-call, in its own process
        print(json.dumps(first_call_child(*json.loads(args.first_call_child))))
        return
    modes = [name for name, on in (("--dropout", args.dropout is not None), ("--first-call", args.first_call),
                                   ("--gate", args.gate), ("--hopper", args.hopper)) if on]
    if len(modes) > 1:
        fail(f"{' and '.join(modes)} are separate measurements: pass one of them")
    if not modes:
        fail("pass one of --dropout P, --first-call, --gate, --hopper; our kernel against SDPA's kernels is "
             "scripts/bench_attention.py --preset anchors --backends flash,sdpa-fa2,sdpa-cudnn [--graphs]")
    if args.dropout is not None and not 0 < args.dropout < 1:
        fail(f"--dropout must be in (0, 1), got {args.dropout}")
    require_cuda("bench_flash.py", "times our kernel against SDPA's CUDA kernels",
                 "scripts/bench_attention.py --device cpu runs every backend")

    shapes = args.shapes or ANCHORS
    meta = {
        **environment(CUDA),
        "dtype": "bfloat16",
        "causal": True,
        "command": command_line("bench_flash.py"),
    }
    if args.first_call:
        with tempfile.TemporaryDirectory(prefix="nanoflash-first-call-") as folder:
            first_shapes = [("bf16", *shape) for shape in args.shapes] if args.shapes else FIRST_CALL_SHAPES
            rows = bench_first_calls(first_shapes, Path(folder))
        meta.update(chosen_configs={}, dtype="per shape", shapes="dtype, B, H, T, D")
        emit(args.out, "first_call", meta, rows, first_call_table(rows, meta))
        return
    if args.gate:
        rows, meta["fla"] = bench_gate(shapes, args.warmup, args.rep)
        meta["chosen_configs"] = chosen_configs()
        records = gate_records(rows)
        emit(args.out, "gate", meta, rows, gate_table(records, meta["fla"], meta), records)
        return
    if args.hopper:
        rows = bench_hopper(shapes, args.warmup, args.rep)
        meta["chosen_configs"] = chosen_configs()
        emit(args.out, "hopper", meta, rows, hopper_table(rows, meta))
        return
    if args.dropout is not None:
        rows, meta["first_call_s"] = bench_dropout(shapes, args.dropout, args.warmup, args.rep)
        meta["chosen_configs"] = chosen_configs()
        emit(args.out, "dropout", meta, rows, dropout_table(rows, meta["first_call_s"], args.dropout, meta))


def emit(out: str | None, stem: str, meta: dict, rows: list[dict], table: str,
         records: list[dict] | None = None) -> None:
    """Print the autotuner's picks and ``table``; with ``out``, write <stem>.json and <stem>.md there
    (and <stem>.csv of ``records``, flat dicts, when given)."""
    for name, cfgs in meta["chosen_configs"].items():
        for key, cfg in cfgs.items():
            print(f"autotuned {name} {key}: {cfg}")
    print(table)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (folder / f"{stem}.md").write_text(table + "\n")
        if records:
            with open(folder / f"{stem}.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(records[0]))
                writer.writeheader()
                writer.writerows(records)


if __name__ == "__main__":
    with exit_on_error(stopped="stopped"):
        main()
