"""Throughput, model FLOP utilisation and peak memory: every number the loop reports about speed.

MFU = achieved model FLOP/s / the GPU's peak dense bf16/fp16 tensor-core FLOP/s. The model's FLOPs
per token follow the PaLM appendix: 6 N for the weight matmuls (forward + backward) plus
12 L d T for attention scores and their weighting (the full T x T product, the usual convention,
even though causal kernels skip half of it).

It also times a run's start (``StartupClock``): from the command to the first optimizer steps.
"""
import contextlib
import os
import time
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


class StartupClock:
    """How long a run takes to get going: seconds from the process start to the loop's start and to the
    end of each of its first ``steps`` optimizer steps (the device waited for), and from ``train()``'s
    call (a job of a multirun, whose process started earlier) to the end of the first step.

    Compilation, autotuning, kernel builds and CUDA-graph capture happen in these first steps; waiting
    for the device in them costs nothing measurable. ``record()`` holds what was measured so far.
    """

    def __init__(self, device: torch.device, steps: int = 5):
        self.device, self.steps = device, steps
        self.job_start = time.perf_counter()
        self.ages = []
        self.loop_start_s = self.first_step_in_job_s = None

    def loop_started(self) -> None:
        self.loop_start_s = process_age_s()

    def step_done(self) -> bool:
        """Note the end of one of the first steps; True when it was the last one timed."""
        if len(self.ages) >= self.steps:
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self.ages:
            self.first_step_in_job_s = time.perf_counter() - self.job_start
        self.ages.append(process_age_s())
        return len(self.ages) == self.steps

    def record(self) -> dict:
        """{'loop_start_s', 'first_step_s', 'steps_done_s' (the first steps' ends), 'first_step_in_job_s'};
        process ages are None where they cannot be read."""
        return {"loop_start_s": self.loop_start_s, "first_step_s": self.ages[0] if self.ages else None,
                "steps_done_s": self.ages, "first_step_in_job_s": self.first_step_in_job_s}
