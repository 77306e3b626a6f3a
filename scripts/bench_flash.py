"""Benchmark nanoflash's Triton flash attention against PyTorch SDPA (FlashAttention-2 and cuDNN).

Causal bf16 attention at fixed (B, H, T, D) shapes; for each shape and implementation: median
forward and forward+backward time (``triton.testing.do_bench``) and TFLOP/s, counting causal
forward flops as 2*B*H*T^2*D and forward+backward as 3.5x that. Before timing, the outputs and
gradients of each implementation are checked against ours.

    python scripts/bench_flash.py --out OUTDIR    # writes bench.json and bench.md to OUTDIR

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_common import (ANCHORS, causal_flops, command_line, environment, first_line,  # noqa: E402
                                  forced_sdpa, graph_median_ms, median_ms, relative_error, require_cuda, tflops)

CUDA = torch.device("cuda")


def bench_shape(B, H, T, D, dtype, impls, warmup, rep, graphs):
    g = torch.Generator(device="cuda").manual_seed(0)
    # Each implementation gets its native contiguous layout: ours (B, T, H, D), SDPA (B, H, T, D).
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=dtype, generator=g)
                   for _ in range(4))
    inputs = {}
    for name, (fn, layout) in impls.items():
        if layout == "bthd":
            inputs[name] = [t.clone().requires_grad_() for t in (q, k, v)] + [do]
        else:
            inputs[name] = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
            inputs[name].append(do.transpose(1, 2).contiguous())

    row = {"B": B, "H": H, "T": T, "D": D}
    ref_o = ref_g = None
    for name, (fn, layout) in impls.items():
        qq, kk, vv, dd = inputs[name]
        try:
            o = fn(qq, kk, vv)
            gr = torch.autograd.grad(o, (qq, kk, vv), dd)
        except Exception as e:  # backend unavailable for this shape/device
            row[name] = {"error": first_line(e, 120)}
            continue
        if layout != "bthd":
            o = o.transpose(1, 2)
            gr = [x.transpose(1, 2) for x in gr]
        res = {}
        if ref_o is None:
            ref_o, ref_g = o.detach(), [x.detach() for x in gr]
        else:
            res["rel_err_vs_ours"] = {
                "o": relative_error(o, ref_o),
                **{n: relative_error(a, b) for n, a, b in zip(("dq", "dk", "dv"), gr, ref_g)},
            }
            bad = {n: e for n, e in res["rel_err_vs_ours"].items() if not e < 2e-2}
            res["agrees"] = not bad
        del o, gr

        def fwd():
            return fn(qq, kk, vv)

        def fwd_bwd():
            out = fn(qq, kk, vv)
            out.backward(dd)

        fwd_flops, fwd_bwd_flops = causal_flops(B, H, T, D, False), causal_flops(B, H, T, D, True)
        t_f = median_ms(fwd, CUDA, warmup, rep)
        t_fb = median_ms(fwd_bwd, CUDA, warmup, rep, grad_to_none=[qq, kk, vv])
        res.update(fwd_ms=t_f, fwd_bwd_ms=t_fb,
                   fwd_tflops=tflops(fwd_flops, t_f), fwd_bwd_tflops=tflops(fwd_bwd_flops, t_fb))
        if graphs:  # replayed CUDA graphs: GPU time without Python/launch overhead
            try:
                g_f = graph_median_ms(fwd, rep)
                g_fb = graph_median_ms(fwd_bwd, rep, grad_to_none=[qq, kk, vv])
                res.update(graph_fwd_ms=g_f, graph_fwd_bwd_ms=g_fb,
                           graph_fwd_tflops=tflops(fwd_flops, g_f), graph_fwd_bwd_tflops=tflops(fwd_bwd_flops, g_fb))
            except Exception as e:
                res["graph_error"] = first_line(e, 120)
        row[name] = res
    del inputs
    torch.cuda.empty_cache()
    return row


def chosen_configs() -> dict:
    """The config each autotuned kernel picked, per autotune key."""
    from kernels.flash_attention import backward, forward

    out = {}
    for kernel in (forward.FWD, backward.DKDV, backward.DQ):
        out[kernel.kind] = {str(k): str(v) for k, v in getattr(kernel.tuned, "cache", {}).items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for bench.json and bench.md")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    ap.add_argument("--graphs", action="store_true",
                    help="also time replays of captured CUDA graphs (no launch overhead)")
    ap.add_argument("--shapes", default=None, help="e.g. '16,12,1024,64;4,12,2048,64'")
    args = ap.parse_args()
    require_cuda("bench_flash.py", "times our kernel against SDPA's CUDA kernels",
                 "scripts/bench_attention.py --device cpu runs every backend")

    from kernels import flash_attn
    from kernels.flash_attention import launch

    shapes = ANCHORS if not args.shapes else [
        tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    impls = {
        "nanoflash": (lambda q, k, v: flash_attn(q, k, v, causal=True), "bthd"),
        "sdpa_fa2": (forced_sdpa("FLASH_ATTENTION"), "bhtd"),
        "sdpa_cudnn": (forced_sdpa("CUDNN_ATTENTION"), "bhtd"),
    }
    meta = {
        **environment(CUDA),
        "dtype": "bfloat16",
        "causal": True,
        "autotune": launch.AUTOTUNE,
        "command": command_line("bench_flash.py"),
    }
    rows = []
    for (B, H, T, D) in shapes:
        row = bench_shape(B, H, T, D, torch.bfloat16, impls, args.warmup, args.rep, args.graphs)
        rows.append(row)
        print(json.dumps(row), flush=True)

    md = [f"device: {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | "
          f"{meta['date']} | commit {meta['commit']} | bf16 causal, TFLOP/s (median time)", "",
          f"`{meta['command']}`", "",
          "| B | H | T | D | fwd ours | fwd FA2 | fwd cuDNN | fwd+bwd ours | fwd+bwd FA2 | "
          "fwd+bwd cuDNN | fwd+bwd ours/FA2 | agrees |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r, key):
        return f"{r[key]:.0f}" if isinstance(r, dict) and key in r else "n/a"

    for r in rows:
        ours, fa2, cud = r.get("nanoflash", {}), r.get("sdpa_fa2", {}), r.get("sdpa_cudnn", {})
        speed = (f"{ours['fwd_bwd_tflops'] / fa2['fwd_bwd_tflops']:.2f}x"
                 if "fwd_bwd_tflops" in ours and "fwd_bwd_tflops" in fa2 else "n/a")
        agrees = all(x.get("agrees", True) for x in (fa2, cud))
        md.append(f"| {r['B']} | {r['H']} | {r['T']} | {r['D']} | {cell(ours, 'fwd_tflops')} | "
                  f"{cell(fa2, 'fwd_tflops')} | {cell(cud, 'fwd_tflops')} | "
                  f"{cell(ours, 'fwd_bwd_tflops')} | {cell(fa2, 'fwd_bwd_tflops')} | "
                  f"{cell(cud, 'fwd_bwd_tflops')} | {speed} | {'yes' if agrees else 'NO'} |")
    meta["chosen_configs"] = chosen_configs()
    for name, cfgs in meta["chosen_configs"].items():
        for key, cfg in cfgs.items():
            print(f"autotuned {name} {key}: {cfg}")
    if args.graphs:
        md += ["", "Same, timed as replayed CUDA graphs (GPU time without Python/launch "
               "overhead):", "",
               "| B | H | T | D | fwd ours | fwd FA2 | fwd cuDNN | fwd+bwd ours | fwd+bwd FA2 | "
               "fwd+bwd cuDNN | fwd+bwd ours/FA2 |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ours, fa2, cud = (r.get(n, {}) for n in ("nanoflash", "sdpa_fa2", "sdpa_cudnn"))
            speed = (f"{ours['graph_fwd_bwd_tflops'] / fa2['graph_fwd_bwd_tflops']:.2f}x"
                     if "graph_fwd_bwd_tflops" in ours and "graph_fwd_bwd_tflops" in fa2
                     else "n/a")
            md.append(f"| {r['B']} | {r['H']} | {r['T']} | {r['D']} | "
                      f"{cell(ours, 'graph_fwd_tflops')} | {cell(fa2, 'graph_fwd_tflops')} | "
                      f"{cell(cud, 'graph_fwd_tflops')} | {cell(ours, 'graph_fwd_bwd_tflops')} | "
                      f"{cell(fa2, 'graph_fwd_bwd_tflops')} | {cell(cud, 'graph_fwd_bwd_tflops')} "
                      f"| {speed} |")
    table = "\n".join(md)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "bench.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
