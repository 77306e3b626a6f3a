"""A/B: the split kernel + merge kernel against the split kernel merging in its last program (fused),
and cuDNN, at the kernel table's cells; rounds interleaved, median of rounds. Also first-call times."""
import contextlib, statistics, sys, time
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from scripts.bench_decode import gpu_us, decode_inputs
from kernels.flash_decoding import decode_config, decode_launch
CUDA = torch.device("cuda")
cells = [(12, 12, 64, B, L) for B in (1, 4, 8, 16, 32) for L in (1024, 4096, 8192, 16384, 32768, 65536)]
cells += [(32, 8, 128, B, L) for B in (1, 8) for L in (1024, 4096, 8192, 16384, 32768, 65536)]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
print("| H/H_kv/D | B | L | launch | split+merge µs | fused µs | cuDNN µs | fused/cudnn | fused GB/s |")
print("|---|---|---|---|---|---|---|---|---|")
for H, H_kv, D, B, L in cells:
    q, k, v, lens = decode_inputs(B, L, H, H_kv, D)
    cfg = decode_config(B, H_kv, L, D, 2, CUDA)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    fns = {
        "unfused": lambda: decode_launch(q, k, v, lens, None, D ** -0.5, 0, *cfg, fused_merge=False),
        "fused": lambda: decode_launch(q, k, v, lens, None, D ** -0.5, 0, *cfg, fused_merge=True),
    }
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=H != H_kv)
    fns["cudnn"] = cudnn
    a = fns["unfused"]()[0]; b = fns["fused"]()[0]
    assert torch.equal(a, b), (H, B, L, (a.float() - b.float()).abs().max())
    res = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            res[n].append(gpu_us(f)[0])
    med = {n: statistics.median(x) for n, x in res.items()}
    gb = 2 * B * L * H_kv * D * 2 / 1e9
    print(f"| {H}/{H_kv}/{D} | {B} | {L} | {'/'.join(map(str, cfg))} | {med['unfused']:.1f} | {med['fused']:.1f} | "
          f"{med['cudnn']:.1f} | {med['cudnn'] / med['fused']:.3f} | {gb / med['fused'] * 1e3:.0f} |", flush=True)
