"""Throughput, model FLOP utilisation and peak memory: every number the loop reports about speed.

MFU = achieved model FLOP/s / the GPU's peak dense bf16/fp16 tensor-core FLOP/s. The model's FLOPs
per token follow the PaLM appendix: 6 N for the weight matmuls (forward + backward) plus
12 L d T for attention scores and their weighting (the full T x T product, the usual convention,
even though causal kernels skip half of it).

It also times a run's start (``StartupClock``): from the command to the first optimizer steps, phase
by phase, and what the loop spends evaluating and saving.
"""
import contextlib
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import torch

from model.config import ModelConfig

# Dense (no sparsity) bf16/fp16 tensor-core peak with fp32 accumulation, in TFLOP/s, from the
# vendors' datasheets and architecture whitepapers. Matched in order against the device name, so
# specific names come before their prefixes. Override with trainer.peak_tflops.
GPU_PEAK_TFLOPS = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("A6000", 155.0),
    ("V100", 125.0),
    ("T4", 65.0),
    ("RTX 5090", 209.5),
    ("RTX 5080", 112.6),
    ("RTX 5070 Ti", 87.9),
    ("RTX 5070", 61.7),
    ("RTX 5060 Ti", 47.4),
    ("RTX 4090", 165.2),
    ("RTX 4080 SUPER", 104.4),
    ("RTX 4080", 97.5),
    ("RTX 4070 Ti", 80.2),
    ("RTX 4070", 58.3),
    ("RTX 4060 Ti", 44.1),
    ("RTX 4060", 30.2),
    ("RTX 3090 Ti", 80.0),
    ("RTX 3090", 71.0),
    ("RTX 3080 Ti", 68.2),
    ("RTX 3080", 59.5),
    ("RTX 3070 Ti", 43.5),
    ("RTX 3070", 40.6),
    ("RTX 3060 Ti", 32.4),
    ("RTX 3060", 25.6),
    ("RTX 2080 Ti", 53.8),
    ("RTX 2080", 40.3),
    ("RTX 2070", 29.9),
    ("RTX 2060", 25.8),
)


def peak_tflops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """Peak TFLOP/s of ``device``: the override if given, the table's entry, or None (CPU, unknown GPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in GPU_PEAK_TFLOPS:
        if key.lower() in name.lower():
            return tflops
    return None


def flops_per_token(cfg: ModelConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 N + 12 L d T, N without the position table."""
    return 6.0 * n_params + 12.0 * cfg.n_layer * cfg.n_embd * seq_len


class ThroughputMeter:
    """Tokens/s, MFU and peak memory over the window since the last report.

    The loop calls ``tick(tokens)`` after every optimizer step and ``report()`` at log steps, after
    a value has been read from the device (which waits for the queued work), so wall time is real.
    """

    def __init__(self, device: torch.device, flops_per_token: float, peak: Optional[float]):
        self.device, self.flops_per_token, self.peak = device, flops_per_token, peak
        self.tokens = 0
        self.start = time.perf_counter()
        self._reset_memory()

    def _reset_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def tick(self, tokens: int) -> None:
        self.tokens += tokens

    @contextlib.contextmanager
    def paused(self):
        """Leave the time spent in the block (evaluation, checkpoints) out of the current window."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - started

    def report(self) -> dict:
        """{'tokens_per_s', 'mfu', 'peak_vram_mb'} for the window, then start a new window."""
        now = time.perf_counter()
        tokens_per_s = self.tokens / max(now - self.start, 1e-9)
        mfu = None
        if self.peak is not None:
            mfu = tokens_per_s * self.flops_per_token / (self.peak * 1e12)
        peak_mb = None
        if self.device.type == "cuda":
            peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        self.tokens, self.start = 0, now
        self._reset_memory()
        return {"tokens_per_s": tokens_per_s, "mfu": mfu, "peak_vram_mb": peak_mb}


def process_age_s() -> Optional[float]:
    """Seconds since this process started (the command, for `python train.py`), from Linux's /proc;
    None where there is no /proc."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted from field 3 after the name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def compile_cache_counts() -> Counter:
    """How often torch.compile looked for its work on disk in this process so far: Inductor's FX-graph
    cache and AOTAutograd's cache, each's hits, misses and bypasses (torch's own counters; empty where
    nothing was compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return Counter()
    counts = {**utils.counters["inductor"], **utils.counters["aot_autograd"]}
    return Counter({key: n for key, n in counts.items() if "cache" in key})


_imports_done_at: Optional[float] = None  # process age when train.py had imported everything (imports_done)


def imports_done() -> None:
    """Note that the program's imports are done (train.py, first thing it runs): the first run's clock
    reports them as the phase "imports" and what follows until ``train()`` as "config"."""
    global _imports_done_at
    _imports_done_at = process_age_s()


class StartupClock:
    """How long a run takes to get going: seconds from the process start to the loop's start and to the
    end of each of its first ``steps`` optimizer steps (the device waited for), from ``train()``'s call
    (a job of a multirun, whose process started earlier) to the end of the first step, and where those
    seconds went, phase by phase.

    ``phase(name)`` ends the phase ``name``, timed from the end of the one before (the clock's start for
    the first). The process's first clock starts with the phases before ``train()``: "imports" (from
    the command to ``imports_done``) and "config" (Hydra composing and checking the config); a later
    job of a multirun starts at its ``train()`` call. The loop's first steps are phases too: "step 1"
    (where compilation, autotuning and kernel builds happen), "step 2", ... ("step 3" is the one
    ``trainer.cuda_graph`` captures). On a GPU a phase ends once the device has done its work.

    Later, what the loop does besides its steps is timed as it comes (``timed``): the evaluations (the
    first compiles a graph of its own under trainer.compile) and the checkpoints. So are torch.compile's
    disk caches: the hits and misses since the clock started (``compile_cache_counts``), which show
    whether a second run found what the first compiled. ``record()`` holds what was measured so far.
    """

    def __init__(self, device: torch.device, steps: int = 5):
        global _imports_done_at
        self.device, self.steps = device, steps
        self.job_start = self.since = time.perf_counter()
        self.ages = []
        self.phases = {}
        self.loop_start_s = self.first_step_in_job_s = None
        self.time_in = {}  # {what: {"count", "seconds", "first_seconds"}} (timed)
        self.cache_counts = compile_cache_counts()
        age = process_age_s()
        if _imports_done_at is not None and age is not None:
            self.phases = {"imports": _imports_done_at, "config": age - _imports_done_at}
        _imports_done_at = None  # a later job of the same process starts at its train() call

    def phase(self, name: str) -> None:
        """End the phase ``name`` (once the device has done its work)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases[name] = now - self.since
        self.since = now

    def loop_started(self) -> None:
        self.phase("setup")
        self.loop_start_s = process_age_s()

    def step_done(self) -> bool:
        """Note the end of one of the first steps; True when it was the last one timed."""
        if len(self.ages) >= self.steps:
            return False
        self.phase(f"step {len(self.ages) + 1}")
        if not self.ages:
            self.first_step_in_job_s = time.perf_counter() - self.job_start
        self.ages.append(process_age_s())
        return len(self.ages) == self.steps

    @contextlib.contextmanager
    def timed(self, what: str):
        """Add the block's wall time to ``what`` ("evaluation", "checkpoint"); the block ends with the
        device done (it reads a result back, or writes what it read)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            totals = self.time_in.setdefault(what, {"count": 0, "seconds": 0.0, "first_seconds": seconds})
            totals["count"] += 1
            totals["seconds"] += seconds

    def summary(self) -> str:
        """The phases so far in one line: "imports 4.1 s, config 0.6 s, ..."."""
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())

    def record(self) -> dict:
        """{'loop_start_s', 'first_step_s', 'steps_done_s' (the first steps' ends), 'first_step_in_job_s',
        'startup_phases_s' ({phase: seconds}, in order), 'time_in' ({what: {'count', 'seconds', 'first_seconds'}}),
        'compile_caches' ({counter: count} since the start)}; process ages are None where they cannot be read."""
        return {"loop_start_s": self.loop_start_s, "first_step_s": self.ages[0] if self.ages else None,
                "steps_done_s": self.ages, "first_step_in_job_s": self.first_step_in_job_s,
                "startup_phases_s": {name: round(seconds, 3) for name, seconds in self.phases.items()},
                "time_in": self.time_in, "compile_caches": dict(compile_cache_counts() - self.cache_counts)}
