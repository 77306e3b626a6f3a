"""Profile a few training steps: where each step's time goes, by kind of work (``trainer.profile_steps=N``).

The loop calls ``before_step(step)`` and ``after_step(step)`` around every optimizer step (rank 0
only under torchrun). Ten steps after the run (re)starts, so compilation and warm-up stay out, it
records the next N steps with ``torch.profiler`` and writes ``profile.md`` in the run folder: wall
time per step, GPU kernel time per step, and that kernel time split into attention, matmul,
optimizer, communication, memory copies and everything else (norms, activations, the loss's
softmax), then the kernels that took longest. Kernel time well below wall time means the GPU
waited for the host. Where there is communication (NCCL kernels: DDP's all-reduce, the ring's
send/recv under context parallelism) it also says how much of it ran while other kernels ran, i.e.
was hidden under computation. The recorded steps run slower than the others (the profiler's own cost), and
so does that window's tokens/s record.

On CPU the same table is made from the CPU time of each operator.
"""
import time
from collections import defaultdict
from pathlib import Path
from typing import List, Optional, Tuple

import torch

WARMUP_STEPS = 10  # steps after the (re)start before recording: compilation, autotuning, allocator warm-up
# profile.md lists the longest kernels until they hold LISTED_SHARE of the time, MIN_LISTED to MAX_LISTED of them
LISTED_SHARE, MIN_LISTED, MAX_LISTED = 0.95, 20, 80

# Kind of work -> substrings of kernel (GPU) or operator (CPU) names, matched lowercase, first match wins.
CATEGORIES = (
    ("attention", ("attn", "flash", "fmha", "sdpa", "softmax_backward_data", "_efficient_attention",
                   "dot_do_o", "convert_dq")),  # cuDNN's backward helpers: delta = rowsum(dO * O), dQ cast
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "triton_tem", "aten::mm", "aten::addmm", "aten::bmm",
                "aten::matmul", "aten::linear")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("communication", ("nccl", "c10d", "allreduce", "all_reduce", "reduce_scatter", "allgather", "all_gather")),
    ("memory copies", ("memcpy", "memset", "aten::copy_", "aten::fill_", "aten::zero_")),
)
OTHER = "other (norms, activations, loss, elementwise)"


def category(name: str) -> str:
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(n in lowered for n in needles):
            return label
    return OTHER


class StepProfiler:
    """Records steps ``start + WARMUP_STEPS + 1 .. start + WARMUP_STEPS + n_steps`` and writes profile.md."""

    def __init__(self, run_dir: Path, n_steps: int, start_step: int, device: torch.device, max_steps: int):
        self.path = Path(run_dir) / "profile.md"
        self.device = device
        self.first = start_step + WARMUP_STEPS + 1
        self.last = min(self.first + n_steps - 1, max_steps)
        self.enabled = n_steps > 0 and self.first <= max_steps
        self.prof = None
        self.started = 0.0
        self.note = ""  # what of trainer.profile_steps this run cannot do, said at its start
        if n_steps and not self.enabled:
            self.note = (f"trainer.profile_steps={n_steps}: nothing is profiled, the run ends at step {max_steps} before "
                         f"step {self.first} ({WARMUP_STEPS} steps after it starts at step {start_step}); raise "
                         "trainer.max_steps to profile")
        elif n_steps and self.last - self.first + 1 < n_steps:
            self.note = (f"trainer.profile_steps={n_steps}: only steps {self.first}-{self.last} are profiled, the run "
                         f"ends at step {max_steps}")

    def before_step(self, step: int) -> None:
        if not self.enabled or step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()
        self.prof = profile(activities=activities)
        self.prof.start()
        self.started = time.perf_counter()

    def after_step(self, step: int) -> Optional[str]:
        """At the last recorded step: stop, write profile.md and return a one-line summary."""
        if self.prof is None or step != self.last:
            return None
        self._sync()
        wall_s = time.perf_counter() - self.started
        self.prof.stop()
        steps = self.last - self.first + 1
        times = self._times_us()
        hidden = hidden_communication_us(self.prof) if self.device.type == "cuda" else None
        self.prof = None
        self.path.write_text(report(times, wall_s, steps, self.device, (self.first, self.last), hidden))
        busy_ms = sum(times.values()) / steps / 1e3
        return f"profile of steps {self.first}-{self.last}: {wall_s / steps * 1e3:.1f} ms per step, " \
               f"{busy_ms:.1f} ms of {'GPU kernels' if self.device.type == 'cuda' else 'CPU operators'} -> {self.path}"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _times_us(self) -> dict:
        """Total microseconds per kernel (CUDA) or per operator's own CPU time (CPU) over the recorded steps."""
        if self.device.type == "cuda":
            return kernel_times_us(self.prof)
        return {event.key: event.self_cpu_time_total for event in self.prof.key_averages()
                if event.self_cpu_time_total > 0
                and not event.key.startswith(("ProfilerStep", "enumerate("))}


def kernel_times_us(prof) -> dict:
    """GPU microseconds per kernel name over everything ``prof`` (a finished torch.profiler) recorded.

    Named regions (``Optimizer.step#...``, ``record_function``) are left out: their time spans kernels
    that are counted already.
    """
    times = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type.name != "CUDA" or getattr(event, "is_user_annotation", False):
            continue
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us > 0:
            times[event.key] += us
    return dict(times)


def hidden_communication_us(prof) -> Tuple[float, float]:
    """(communication kernel time, the part of it during which another kernel ran), in microseconds
    over everything ``prof`` recorded (its CUDA kernels and their start and end times)."""
    communication, computation = [], []
    for event in prof.events():
        if event.device_type.name != "CUDA" or getattr(event, "is_user_annotation", False):
            continue
        span = (event.time_range.start, event.time_range.end)
        (communication if category(event.name) == "communication" else computation).append(span)
    return overlap_us(communication, computation)


def overlap_us(spans: List[tuple], cover: List[tuple]) -> Tuple[float, float]:
    """(total length of ``spans``, the length of their parts inside the union of ``cover``); (start, end) pairs."""
    merged = []
    for start, end in sorted(cover):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = sum(end - start for start, end in spans)
    covered = sum(max(0, min(end, c_end) - max(start, c_start)) for start, end in spans for c_start, c_end in merged)
    return total, covered


def report(times_us: dict, wall_s: float, steps: int, device: torch.device, window: tuple,
           communication: Optional[Tuple[float, float]] = None) -> str:
    """profile.md: per-step wall and busy time, the split by category, the longest kernels/operators, and
    ``communication`` = (communication kernel us, the part of it hidden under other kernels) when given."""
    unit = "GPU kernel" if device.type == "cuda" else "CPU operator"
    busy_us = sum(times_us.values())
    by_category = defaultdict(float)
    for name, us in times_us.items():
        by_category[category(name)] += us

    def per_step(us: float) -> float:
        return us / steps / 1e3  # milliseconds per step

    lines = [
        f"# Profile of steps {window[0]}-{window[1]} ({steps} steps, {device_name(device)}, torch {torch.__version__})",
        "",
        f"- wall time per step: {wall_s / steps * 1e3:.2f} ms",
        f"- {unit} time per step: {per_step(busy_us):.2f} ms"
        + (f" ({busy_us / 1e6 / wall_s:.0%} of the wall time; the rest the GPU waited or kernels overlapped)"
           if device.type == "cuda" else ""),
        "",
        f"| kind of work | ms per step | share of {unit} time |",
        "|---|---|---|",
    ]
    for label, us in sorted(by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {label} | {per_step(us):.2f} | {us / busy_us:.1%} |")
    if communication and communication[0] > 0:
        total, hidden = communication
        lines += ["", f"Communication kernels: {per_step(total):.2f} ms per step, {per_step(hidden):.2f} ms of it "
                      f"({hidden / total:.0%}) while other kernels ran (hidden under computation)."]
    longest = longest_first(times_us)
    lines += ["", f"Longest {unit}s, together {sum(us for _, us in longest) / busy_us:.0%} of the time:", "",
              f"| {unit} | kind | ms per step |", "|---|---|---|"]
    for name, us in longest:
        short = name.replace("|", "/")[:100]
        lines.append(f"| `{short}` | {category(name)} | {per_step(us):.3f} |")
    return "\n".join(lines) + "\n"


def longest_first(times_us: dict) -> List[tuple]:
    """(name, us) longest first, until they hold LISTED_SHARE of the time (MIN_LISTED to MAX_LISTED of them)."""
    ranked = sorted(times_us.items(), key=lambda kv: -kv[1])
    total, listed, covered = sum(times_us.values()), [], 0.0
    for name, us in ranked[:MAX_LISTED]:
        if len(listed) >= MIN_LISTED and covered >= LISTED_SHARE * total:
            break
        listed.append((name, us))
        covered += us
    return listed


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
