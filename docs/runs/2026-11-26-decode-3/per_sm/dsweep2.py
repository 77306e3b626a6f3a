"""Batch 1 of GPT-2's heads: the launch before (22 splits, 128 keys where long) against 33 splits of 64 keys."""
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from scripts.bench_decode import gpu_us, decode_inputs
from kernels.flash_decoding import decode_launch, DecodeConfig
for B, L in ((1, 4096), (1, 16384), (1, 32768), (1, 65536), (2, 16384), (4, 4096), (4, 16384)):
    q, k, v, lens = decode_inputs(B, L, 12, 12, 64)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh)
    line = [f"B{B} L{L}: cudnn {gpu_us(cudnn)[0]:.1f}"]
    for c in (DecodeConfig(22, 128, 4, 3), DecodeConfig(22, 64, 4, 3), DecodeConfig(33, 64, 4, 3), DecodeConfig(33, 128, 4, 3),
              DecodeConfig(5, 128, 4, 3), DecodeConfig(8, 64, 4, 3), DecodeConfig(16, 64, 4, 3), DecodeConfig(11, 128, 4, 3)):
        line.append(f"{'/'.join(map(str, c))} {gpu_us(lambda: decode_launch(q, k, v, lens, None, 0.125, 0, *c))[0]:.1f}")
    print(" | ".join(line), flush=True)
