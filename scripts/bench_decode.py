"""Decode speed: GPT-2 124M generation with our KV cache against the alternatives, and the
flash-decoding kernel (kernels/flash_decoding) alone against SDPA.

    python -m scripts.bench_decode --out OUTDIR                        # all three parts
    python -m scripts.bench_decode --out OUTDIR --parts kernel,sweep   # some of them

``generate``: GPT-2 124M (configs/model/gpt2.yaml, randomly initialised: a step's time does not
depend on the weights) generating greedily from a 16-token prompt to 1024 tokens (1008 new), at
batch 1 and 8. "Ours" is the model scripts/sample.py runs: built by training/trained_model.py's
``plain_model`` with its weights in bf16, no autocast. Rows:
- ours, cached, with each decode step mode of model/generate.py: ``graph`` (``auto``'s choice on a
  GPU), ``compile`` (torch.compile, reduce-overhead), ``eager``;
- ours, cached, graph step, fp32 weights under bf16 autocast (the sample at the end of training);
- ours, cached, graph step, with SDPA attending over the static cache (rows past the length
  masked, as a captured step must: the length lives on the device) in place of our kernel;
- ours, uncached (the whole context again for every token), stopped after ``--time-cap`` seconds:
  its tokens/s are over the tokens it made by then, the shortest contexts;
- transformers' GPT2LMHeadModel with the same weights in bf16, ``generate`` with its static cache,
  compiled (as generate does on a GPU by default); skipped, with the reason, where transformers
  does not import.
Each is called once with the same length before it is timed (the cache's capacity picks the decode
kernel's launch, so a shorter first call would leave a compilation in the timed one); of the compiled
ones that first call, compilation included, is reported as "first call s". "same tokens" counts the new tokens equal to ours (graph step)
before the first difference (bf16 rounding differs between implementations).

``kernel``: one new query against caches of 1k to 64k tokens, bf16, GPT-2's heads (H = H_kv = 12,
D = 64) and a GQA shape (H = 32, H_kv = 8, D = 128), each at batch 1 to 32: our kernel
(its default launch: splits / keys per step / warps / stages, kernels/flash_decoding/launch.py) and
SDPA on the same keys (q (B, H, 1, D), the cache (B, H_kv, L, D) as a view), SDPA as it picks (the
CUDA kernels it launched are named) and forced to each of FlashAttention-2, cuDNN and
memory-efficient. Microseconds per call replayed from a CUDA graph (the GPU's time; our eager
call's too), and GB/s of K and V read (2 * B * L * H_kv * D * 2 bytes), against the HBM's ~3.35
TB/s on an H100 and ~4.8 TB/s on an H200. Each call reads its own copy of the cache, taken in turn
("copies": enough to hold twice the GPU's L2 together), as a model's layers read theirs, so every
cache comes from HBM; ``--l2-warm`` reads one cache in every call instead (from L2 where it fits,
under ~50 MB on an H100).

``sweep``: the split kernel's keys per step, warps, pipeline stages and number of splits around
the default launch, and round 1's launch (64 keys, 4 warps, 3 stages, splits for 2 programs per SM
rounded up), at caches of 1k and 32k, batch 1 and 8, for both head shapes, each cache read as in
``kernel``. A cell that could not be measured names the error.

Writes generate.md/.json, kernel.md/.csv, sweep.md/.csv and env.json to --out. About 4 minutes on
an H100. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import sys
import time
from pathlib import Path
from unittest import mock

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts.bench_common import (ROOT, command_line, environment, first_line, graph_median_ms, median_ms,  # noqa: E402
                                  require_cuda)
from training.exits import ArgumentParser  # noqa: E402

CUDA = torch.device("cuda")
PARTS = ("generate", "kernel", "sweep")
PROMPT, CONTEXT = 16, 1024
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
BATCHES = (1, 4, 8, 16, 32)
HEADS = ((12, 12, 64), (32, 8, 128))  # (H, H_kv, D): GPT-2's, and a GQA shape
SDPA_FORCED = {"FA2": "FLASH_ATTENTION", "cuDNN": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def timed(fn) -> tuple[object, float]:
    """(fn(), wall seconds), the GPU synchronised before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


# --- generate -------------------------------------------------------------------------------------

def gpt2_model():
    """GPT-2 124M on the GPU as configs/model/gpt2.yaml shapes it, randomly initialised, fp32 (a trained
    checkpoint's weights), sdpa prefill."""
    import yaml

    from model import GPT, ModelConfig
    from model.attention import build_attention
    from model.config import AttentionConfig, padded_vocab

    shape = yaml.safe_load((ROOT / "configs" / "model" / "gpt2.yaml").read_text())
    cfg = ModelConfig(**shape, vocab_size=padded_vocab(50257))
    attention, _ = build_attention(AttentionConfig(name="sdpa"), CUDA)
    torch.manual_seed(0)
    with CUDA:
        return GPT(cfg, attention).eval()


def inference_model(model, dtype: torch.dtype = torch.bfloat16):
    """``model``'s weights in the model scripts/sample.py builds (training/trained_model.py), in ``dtype``."""
    from training.trained_model import plain_model

    inference = plain_model(model.cfg, CUDA, dtype=dtype)
    inference.load_state_dict(model.state_dict())
    return inference


def hf_gpt2(model, device: torch.device = CUDA, dtype: torch.dtype = torch.bfloat16):
    """transformers' GPT2LMHeadModel holding ``model``'s weights (its Conv1D weights transposed; biases
    our model does not have are zero), in ``dtype`` on ``device``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.cfg
    config = GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
                        n_head=c.n_head, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True)
    hf = GPT2LMHeadModel(config)
    ours = model.state_dict()
    state = {}
    for key, like in hf.state_dict().items():
        name = key.removeprefix("transformer.")
        name = "blocks." + name[2:] if name.startswith("h.") else name
        weight = ours.get(name)
        if weight is None and key.endswith(".bias"):
            weight = torch.zeros_like(like)
        elif weight is None:
            raise KeyError(f"no weight of ours for transformers' {key}")
        conv1d = name.startswith("blocks.") and weight.dim() == 2  # transformers' Conv1D: (in, out)
        state[key] = weight.t() if conv1d else weight
    hf.load_state_dict(state)
    return hf.to(device, dtype).eval()


def sdpa_over_cache(q, k_cache, v_cache, cache_seqlens, window_size=None, gate_cache=None, num_splits=None):
    """``flash_decode``'s place taken by SDPA: q (B, Tq, H, D) against every row of the static cache,
    rows at or past each sequence's length masked (no window, no gate, one new query)."""
    keys = torch.arange(k_cache.shape[1], device=q.device)
    mask = (keys[None, :] < cache_seqlens[:, None].long())[:, None, None, :]  # (B, 1, 1, T_max)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                       attn_mask=mask, enable_gqa=q.shape[2] != k_cache.shape[2])
    return o.transpose(1, 2)


def uncached_rate(model, idx, new: int, cap_s: float) -> tuple[int, float]:
    """(tokens made per sequence, seconds) of uncached greedy generation, in calls of 32 tokens, until
    ``new`` tokens or ``cap_s`` seconds."""
    made, spent = 0, 0.0
    while made < new and spent < cap_s:
        n = min(32, new - made)
        idx, seconds = timed(lambda: model.generate(idx, n, temperature=0, use_cache=False))
        made, spent = made + n, spent + seconds
    return made, spent


def same_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """New tokens equal in every row before the first difference."""
    differ = (a[:, PROMPT:] != b[:, PROMPT:]).any(dim=0).nonzero()
    return int(differ[0]) if len(differ) else a.shape[1] - PROMPT


def measure(batch: int, name: str, run, new: int, compiled: bool, reference=None,
            patch=contextlib.nullcontext) -> tuple[dict, torch.Tensor]:
    """(row, output) of ``run(new)`` (greedy tokens (B, PROMPT + new)) timed after one warm-up call of the
    same length: the cache's capacity picks the decode kernel's launch, so a shorter warm-up would leave
    its compilation in the timed call (of ``compiled`` runs that first call's time is reported). A run
    that fails gives a row that says why, and no output."""
    try:
        with patch():
            _, first = timed(lambda: run(new))
            out, seconds = timed(lambda: run(new))
    except Exception as err:
        row = dict(batch=batch, name=f"{name}: failed ({first_line(err)})", tokens=0, seconds=None,
                   first_call_s=None, same_tokens=None)
        print(row_line(row), flush=True)
        return row, None
    row = dict(batch=batch, name=name, tokens=new, seconds=seconds, first_call_s=first if compiled else None,
               same_tokens=same_prefix(out, reference if reference is not None else out))
    print(row_line(row), flush=True)
    return row, out


def generate_rows(batches, cap_s: float) -> list[dict]:
    from model import kv_cache

    trained = gpt2_model()  # fp32 weights, as a checkpoint holds them
    model = inference_model(trained)  # bf16 weights, as scripts/sample.py runs them
    new = CONTEXT - PROMPT
    rows = []
    for batch in batches:
        idx = torch.randint(0, 50257, (batch, PROMPT), device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))

        def ours(step, weights=model, dtype=None):
            def run(n):
                with torch.autocast("cuda", dtype) if dtype else contextlib.nullcontext():
                    return weights.generate(idx, n, temperature=0, step=step)
            return run

        row, reference = measure(batch, "ours, cached, graph step", ours("graph"), new, compiled=False)
        rows.append(row)
        for name, run, compiled, patch in (
                ("ours, cached, compile step", ours("compile"), True, contextlib.nullcontext),
                ("ours, cached, eager step", ours("eager"), False, contextlib.nullcontext),
                ("ours, cached, graph step, fp32 weights under bf16 autocast", ours("graph", trained, torch.bfloat16),
                 False, contextlib.nullcontext),
                ("ours, cached, graph step, SDPA over the static cache", ours("graph"), False,
                 lambda: mock.patch.object(kv_cache, "flash_decode", sdpa_over_cache))):
            rows.append(measure(batch, name, run, new, compiled, reference, patch)[0])
        made, seconds = uncached_rate(model, idx, new, cap_s)
        rows.append(dict(batch=batch, name=f"ours, uncached (stopped after {cap_s:g} s)", tokens=made, seconds=seconds,
                         first_call_s=None, same_tokens=None))
        print(row_line(rows[-1]), flush=True)
        rows += transformers_rows(trained, idx, new, reference)
    return rows


def transformers_rows(model, idx, new: int, reference) -> list[dict]:
    """transformers' generate with its static cache on the same weights in bf16, compiled (its default on a
    GPU); or one row saying why not."""
    batch = idx.shape[0]
    try:
        import transformers

        hf = hf_gpt2(model)
    except Exception as err:  # not installed, or an API this version lacks
        row = dict(batch=batch, name=f"transformers: skipped ({first_line(err)})", tokens=0, seconds=None,
                   first_call_s=None, same_tokens=None)
        print(row_line(row), flush=True)
        return [row]

    def run(n):
        return hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, cache_implementation="static")

    name = f"transformers {transformers.__version__}, static cache, compiled"
    return [measure(batch, name, run, new, True, reference)[0]]


def row_line(r: dict) -> str:
    rate = f"{r['tokens'] / r['seconds']:.0f}" if r["seconds"] else "-"
    total = f"{r['batch'] * r['tokens'] / r['seconds']:.0f}" if r["seconds"] else "-"
    first = f"{r['first_call_s']:.2f}" if r["first_call_s"] is not None else "-"
    same = "-" if r["same_tokens"] is None else str(r["same_tokens"])
    seconds = f"{r['seconds']:.2f}" if r["seconds"] else "-"
    return f"| {r['batch']} | {r['name']} | {r['tokens']} | {seconds} | {rate} | {total} | {first} | {same} |"


GENERATE_HEAD = ["| batch | implementation | new tokens per sequence | s | tokens/s per sequence | tokens/s, all sequences | "
                 "first call s | same tokens as ours (graph) |", "|---|---|---|---|---|---|---|---|"]


# --- kernel ---------------------------------------------------------------------------------------

def launched_kernels(fn) -> str:
    """The CUDA kernels one call of ``fn`` launches, by name (cut to 70 characters), ';'-separated."""
    from torch.profiler import ProfilerActivity, profile

    from training.profiling import kernel_times_us

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return "; ".join(name[:70] for name in kernel_times_us(prof))


def gpu_us(fn) -> tuple[float, str]:
    """(microseconds per call of fn replayed from a CUDA graph, ""), or (NaN, the error's first line)
    where it cannot run or be captured. A CUDA error that leaves the context unusable is raised."""
    try:
        torch.cuda.synchronize()  # inputs made on the default stream are ready before the timing's own stream
        fn()  # a kernel that cannot run here fails now, not inside a capture
        return graph_median_ms(fn, rep=30) * 1e3, ""
    except Exception as err:
        check_context()
        return float("nan"), first_line(err, 120)


def check_context() -> None:
    """Raise when the CUDA context is broken (a kernel faulted): every later measurement would fail too."""
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device=CUDA).item()
    except Exception as err:
        raise SystemExit(f"error: the CUDA context is unusable ({first_line(err)}); the measurements stop here") from err


def kernel_rows(lengths, batches, l2_warm: bool) -> tuple[list[dict], dict]:
    """One row per (H, H_kv, D, B, L) (``kernel_row``); and the CUDA kernels SDPA launched as it
    picks, at the first length of each (H, H_kv, D, B)."""
    rows, picked = [], {}
    for H, H_kv, D in HEADS:
        for B in batches:
            for L in lengths:
                row, sdpa_kernels = kernel_row(H, H_kv, D, B, L, l2_warm, name_sdpa=L == lengths[0])
                if sdpa_kernels:
                    picked[(H, H_kv, D, B)] = sdpa_kernels
                rows.append(row)
                print(kernel_line(row), flush=True)
    return rows, picked


def decode_inputs(B: int, L: int, H: int, H_kv: int, D: int, l2_warm: bool):
    """q (B, 1, H, D); caches, a list of (k, v) pairs, each (B, L, H_kv, D) bf16 (``cache_copies`` of
    them); lengths (B,) int32 = L: full caches."""
    q = torch.randn(B, 1, H, D, device=CUDA, dtype=torch.bfloat16)
    copies = cache_copies(cache_bytes(B, L, H_kv, D), l2_warm)
    caches = [tuple(torch.randn(B, L, H_kv, D, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
              for _ in range(copies)]
    return q, caches, torch.full((B,), L, dtype=torch.int32, device=CUDA)


def cache_bytes(B: int, L: int, H_kv: int, D: int) -> int:
    """Bytes of one bf16 cache: K and V, (B, L, H_kv, D) each."""
    return 2 * B * L * H_kv * D * 2


def cache_copies(nbytes: int, l2_warm: bool) -> int:
    """How many copies of a cache the timed calls take in turn: enough to hold twice the GPU's L2
    together, as a model's layers do, so that every call reads its cache from HBM; one with
    ``l2_warm`` (then each replay reads the cache the last one read, from L2 where it fits: caches
    under ~50 MB on an H100)."""
    if l2_warm:
        return 1
    return max(1, math.ceil(2 * torch.cuda.get_device_properties(CUDA).L2_cache_size / nbytes))


def per_call_us(call, caches) -> tuple[float, str]:
    """(microseconds of one ``call(k, v)``: all the copies in turn, replayed from a CUDA graph, over
    their number; "") or (NaN, the error's first line), as ``gpu_us``."""
    us, error = gpu_us(lambda: [call(k, v) for k, v in caches])
    return us / len(caches), error


def launch_name(config) -> str:
    """splits/keys per step/warps/stages."""
    return "/".join(map(str, config))


def kernel_row(H: int, H_kv: int, D: int, B: int, L: int, l2_warm: bool, name_sdpa: bool) -> tuple[dict, str]:
    """Our kernel and each SDPA, one new query against a full cache of L keys, in microseconds (each
    call on its own copy of the cache: ``cache_copies``); and, with ``name_sdpa``, the kernels SDPA
    launched as it picks."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.flash_decoding import decode_config, flash_decode

    q, caches, lengths = decode_inputs(B, L, H, H_kv, D, l2_warm)
    qh = q.transpose(1, 2)

    def ours(k, v):
        return flash_decode(q, k, v, lengths)

    def sdpa(kernel=None):
        def run(k, v):
            with sdpa_kernel(getattr(SDPBackend, kernel)) if kernel else contextlib.nullcontext():
                return F.scaled_dot_product_attention(qh, k.transpose(1, 2), v.transpose(1, 2), enable_gqa=H != H_kv)
        return run

    eager_us = median_ms(lambda: [ours(k, v) for k, v in caches], CUDA) * 1e3 / len(caches)
    row = dict(H=H, H_kv=H_kv, D=D, B=B, L=L, launch=launch_name(decode_config(B, H_kv, L, D, 2, CUDA)),
               copies=len(caches), gb=cache_bytes(B, L, H_kv, D) / 1e9, ours_us=per_call_us(ours, caches)[0],
               ours_eager_us=eager_us, sdpa_us=per_call_us(sdpa(), caches)[0])
    row.update({f"{name}_us": per_call_us(sdpa(kernel), caches)[0] for name, kernel in SDPA_FORCED.items()})
    return row, launched_kernels(lambda: sdpa()(*caches[0])) if name_sdpa else ""


def kernel_line(r: dict) -> str:
    def cell(us):
        return "n/a" if us != us else f"{us:.1f} ({r['gb'] / (us * 1e-6):.0f})"

    sdpa = [cell(r[f"{name}_us"]) for name in SDPA_FORCED]
    return (f"| {r['H']}/{r['H_kv']}/{r['D']} | {r['B']} | {r['L']} | {r['copies']} | {r['launch']} | {cell(r['ours_us'])} | "
            f"{r['ours_eager_us']:.1f} | {cell(r['sdpa_us'])} | " + " | ".join(sdpa) + " |")


KERNEL_HEAD = ["| H/H_kv/D | B | cache L | copies | launch (splits/keys per step/warps/stages) | ours µs (GB/s) | ours eager µs | "
               "SDPA µs (GB/s) | " + " | ".join(f"SDPA {name} µs (GB/s)" for name in SDPA_FORCED) + " |",
               "|---|---|---|---|---|---|---|---|" + "---|" * len(SDPA_FORCED)]


# --- sweep ----------------------------------------------------------------------------------------

SWEEP_LENGTHS = (1024, 32768)
SWEEP_BATCHES = (1, 8)


def round1_launch(B: int, H_kv: int, L: int, D: int):
    """Round 1's launch (the 2026-11-25 measurements): 64 keys per step (32 past D = 128), 4 warps, 3
    stages, splits for 2 programs per SM rounded up, at most one per step of keys and 128."""
    from kernels.flash_decoding import DecodeConfig
    from kernels.gpu import gpu_resources

    block_n = 64 if D <= 128 else 32
    splits = max(1, min(-(-2 * gpu_resources(CUDA).sms // (B * H_kv)), -(-L // block_n), 128))
    return DecodeConfig(splits, block_n, 4, 3)


def sweep_settings(default, round1) -> list:
    """The default launch, round 1's, and settings around the default: keys per step with 3 and 4 stages,
    2 warps (8 were the slowest everywhere in round 1), 5 stages, and the split count (halved, less
    and more by half, doubled)."""
    from kernels.flash_decoding.launch import MAX_SPLITS

    settings = [default, round1]
    settings += [default._replace(block_n=bn, num_stages=st) for bn in (32, 64, 128) for st in (3, 4)]
    settings += [default._replace(num_warps=2), default._replace(num_stages=5)]
    splits = (max(1, min(MAX_SPLITS, round(default.num_splits * f))) for f in (0.5, 0.75, 1.5, 2))
    settings += [default._replace(num_splits=s) for s in splits]
    return list(dict.fromkeys(settings))  # each once, in order


def sweep_rows(batches, lengths, l2_warm: bool) -> list[dict]:
    """One row per launch setting (``sweep_settings``) of each head shape, batch and cache length."""
    return [row for H, H_kv, D in HEADS for B in batches for L in lengths for row in sweep_case(H, H_kv, D, B, L, l2_warm)]


def sweep_case(H: int, H_kv: int, D: int, B: int, L: int, l2_warm: bool) -> list[dict]:
    """µs and GB/s of each launch setting at one shape, batch and full cache of L keys."""
    from kernels.flash_decoding import decode_config, decode_launch

    q, caches, seqlens = decode_inputs(B, L, H, H_kv, D, l2_warm)
    default, round1 = decode_config(B, H_kv, L, D, 2, CUDA), round1_launch(B, H_kv, L, D)
    rows = []
    for config in sweep_settings(default, round1):
        us, error = per_call_us(lambda k, v: decode_launch(q, k, v, seqlens, None, D ** -0.5, 0, *config), caches)
        tag = " (default)" if config == default else " (round 1)" if config == round1 else ""
        rows.append(dict(H=H, H_kv=H_kv, D=D, B=B, L=L, launch=launch_name(config) + tag, us=us,
                         gb_s=cache_bytes(B, L, H_kv, D) / 1e9 / (us * 1e-6), error=error))
        print(sweep_line(rows[-1]), flush=True)
    return rows


def sweep_line(r: dict) -> str:
    measured = f"{r['us']:.1f} | {r['gb_s']:.0f}" if r["us"] == r["us"] else f"n/a: {r['error']} | n/a"
    return f"| {r['H']}/{r['H_kv']}/{r['D']} | {r['B']} | {r['L']} | {r['launch']} | {measured} |"


SWEEP_HEAD = ["| H/H_kv/D | B | cache L | splits/keys per step/warps/stages | µs | GB/s |", "|---|---|---|---|---|---|"]


# --- main -----------------------------------------------------------------------------------------

def parse_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def sizes(text: str) -> list[int]:
    """A comma-separated list of positive whole numbers (batch sizes, cache lengths)."""
    values = parse_list(text)
    if not values or not all(v.isdigit() and int(v) > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive whole numbers, e.g. 1,8")
    return [int(v) for v in values]


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the tables and raw results")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--batches", type=sizes, default="1,8", help="generate: batch sizes")
    parser.add_argument("--kernel-batches", type=sizes, default=",".join(map(str, BATCHES)), help="kernel: batch sizes")
    parser.add_argument("--lengths", type=sizes, default=",".join(map(str, LENGTHS)), help="kernel: cache lengths")
    parser.add_argument("--sweep-batches", type=sizes, default=",".join(map(str, SWEEP_BATCHES)), help="sweep: batch sizes")
    parser.add_argument("--sweep-lengths", type=sizes, default=",".join(map(str, SWEEP_LENGTHS)), help="sweep: cache lengths")
    parser.add_argument("--l2-warm", action="store_true",
                        help="kernel, sweep: every call reads one cache, from L2 where it fits (default: copies in turn, from HBM)")
    parser.add_argument("--time-cap", type=float, default=5.0, help="generate: seconds the uncached run may take")
    args = parser.parse_args()
    parts = parse_list(args.parts)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: {', '.join(unknown)} is not one of {', '.join(PARTS)}")
    require_cuda("bench_decode.py", "times generation and the decode kernel",
                 "the kernel's tests run under the interpreter (python -m pytest tests/test_flash_decoding.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(CUDA)
    (args.out / "env.json").write_text(json.dumps(dict(env, command=command_line("bench_decode.py")), indent=1) + "\n")
    title = (f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}, commit {env['commit']}; "
             f"`{command_line('bench_decode.py')}`")
    if "generate" in parts:
        print("\n".join(GENERATE_HEAD), flush=True)
        rows = generate_rows(args.batches, args.time_cap)
        write(args.out / "generate", f"# Generation, GPT-2 124M, {PROMPT} -> {CONTEXT} tokens: {title}", GENERATE_HEAD,
              [row_line(r) for r in rows], rows)
    if "kernel" in parts:
        print("\n".join(KERNEL_HEAD), flush=True)
        rows, picked = kernel_rows(args.lengths, args.kernel_batches, args.l2_warm)
        notes = [f"- SDPA's kernels at H/H_kv/D {h}/{hk}/{d}, B {b}: {names}" for (h, hk, d, b), names in picked.items()]
        write(args.out / "kernel", f"# Decode kernel, one new query, bf16: {title}", KERNEL_HEAD,
              [kernel_line(r) for r in rows] + [""] + notes, rows)
    if "sweep" in parts:
        print("\n".join(SWEEP_HEAD), flush=True)
        rows = sweep_rows(args.sweep_batches, args.sweep_lengths, args.l2_warm)
        write(args.out / "sweep", f"# Split-kernel launch settings, one new query, bf16: {title}", SWEEP_HEAD,
              [sweep_line(r) for r in rows], rows)


def write(stem: Path, title: str, head: list[str], lines: list[str], rows) -> None:
    """stem.md (the table) and, with rows, stem.json or stem.csv beside it."""
    stem.with_suffix(".md").write_text("\n".join([title, "", *head, *lines]) + "\n")
    if rows and "L" in rows[0]:
        with open(stem.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif rows:
        stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
