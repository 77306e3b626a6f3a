"""Seconds of the first decode call in a fresh process (Triton cache as the environment sets it)."""
import sys, time
t0 = time.perf_counter()
import torch
from kernels.flash_decoding import decode_launch, decode_config
t1 = time.perf_counter()
fused = sys.argv[1] == "fused"
q = torch.randn(1, 1, 12, 64, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 1024, 12, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lens = torch.full((1,), 300, dtype=torch.int32, device="cuda"); torch.cuda.synchronize()
cfg = decode_config(1, 12, 1024, 64, 2, torch.device("cuda"))
t2 = time.perf_counter()
decode_launch(q, k, v, lens, None, 0.125, 0, *cfg, fused_merge=fused); torch.cuda.synchronize()
t3 = time.perf_counter()
decode_launch(q, k, v, lens, None, 0.125, 0, *cfg, fused_merge=fused); torch.cuda.synchronize()
t4 = time.perf_counter()
print(f"{sys.argv[1]}: imports {t1-t0:.2f} s, first call {t3-t2:.3f} s, second {1e3*(t4-t3):.2f} ms, launch {cfg}")
