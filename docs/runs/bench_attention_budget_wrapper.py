"""Run scripts/bench_attention.py unchanged except for one bug: with --vram-budget-gb it passes
torch.device("cuda") (no index) to torch.cuda.set_per_process_memory_fraction, which torch 2.11
rejects (ValueError). This gives the call the current device index instead."""
import runpy, sys
import torch

_set = torch.cuda.set_per_process_memory_fraction
def set_fraction(fraction, device=None):
    if isinstance(device, torch.device) and device.index is None:
        device = torch.cuda.current_device()
    return _set(fraction, device)
torch.cuda.set_per_process_memory_fraction = set_fraction
sys.argv = ["scripts/bench_attention.py", *sys.argv[1:]]
runpy.run_path("scripts/bench_attention.py", run_name="__main__")
