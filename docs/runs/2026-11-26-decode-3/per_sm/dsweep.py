"""A focused grid of the decode launch at small batches, with cuDNN's one-query SDPA beside it (one process)."""
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from scripts.bench_decode import gpu_us, decode_inputs
from kernels.flash_decoding import decode_launch, decode_config, DecodeConfig
CUDA = torch.device("cuda")
for H, H_kv, D, B in ((12, 12, 64, 1), (12, 12, 64, 2), (12, 12, 64, 4), (32, 8, 128, 4)):
    for L in (8192, 32768):
        q, k, v, lens = decode_inputs(B, L, H, H_kv, D)
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=H != H_kv)
        ref, _ = gpu_us(cudnn)
        default = decode_config(B, H_kv, L, D, 2, CUDA)
        rows = []
        base = B * H_kv
        for splits in sorted({max(1, round(f * 264 / base)) for f in (0.6, 0.8, 1.0, 1.2, 1.5, 2.0)}):
            for bn in (64, 128):
                for w in (4, 8):
                    for st in (3, 4):
                        if D == 128 and bn == 128 and st == 4:
                            continue
                        c = DecodeConfig(splits, bn, w, st)
                        us, err = gpu_us(lambda: decode_launch(q, k, v, lens, None, D ** -0.5, 0, *c))
                        rows.append((us, c))
        rows.sort(key=lambda r: r[0])
        d_us = next((u for u, c in rows if c == default), float("nan"))
        print(f"{H}/{H_kv}/{D} B{B} L{L}: cudnn {ref:.1f} | default {'/'.join(map(str, default))} {d_us:.1f} | best: "
              + ", ".join(f"{'/'.join(map(str, c))} {u:.1f}" for u, c in rows[:6]), flush=True)
