"""What a CUDA GPU offers the kernels' launches: SMs, shared memory per program and memory bandwidth,
from Triton's device properties (read once per device)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


class GpuResources(NamedTuple):
    sms: int
    smem: int  # shared memory one program may use, bytes
    hbm_bytes_per_s: float  # the memory's peak bandwidth


@functools.lru_cache(maxsize=None)
def gpu_resources(device: torch.device) -> GpuResources:
    """SMs, shared memory per program and memory bandwidth of CUDA ``device``."""
    import triton

    index = device.index if device.index is not None else torch.cuda.current_device()
    return resources_of(triton.runtime.driver.active.utils.get_device_properties(index))


def resources_of(props: dict) -> GpuResources:
    """GpuResources from Triton's device properties; the bandwidth from the memory clock (kHz), double
    data rate, and bus width (bits): 3.35 TB/s on an H100 SXM."""
    bandwidth = 2 * props["mem_clock_rate"] * 1e3 * props["mem_bus_width"] / 8
    return GpuResources(props["multiprocessor_count"], int(props["max_shared_mem"]), bandwidth)
