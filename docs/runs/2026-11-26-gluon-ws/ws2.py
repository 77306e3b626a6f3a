"""Warp-specialised Gluon forward (ws=True) against the first Gluon forward, the tl kernel and cuDNN:
float64 checks, then GPU time per call from CUDA-graph replays (20 calls a replay, median of 5)."""
import statistics, sys, time, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from kernels.flash_attention import flash_attn, hopper
from kernels.flash_attention.reference import attention_ref

def err(a, b): return (a.double() - b.double()).abs().max().item()
fails = 0
for B, T, H, H_kv, D in ((2, 256, 4, 4, 64), (1, 1000, 4, 2, 128), (3, 77, 6, 2, 64), (1, 2049, 2, 1, 128),
                         (2, 130, 8, 8, 128), (1, 4096, 2, 2, 128)):
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (True, False):
            q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=dtype) for h in (H, H_kv, H_kv))
            o, lse = hopper.attn_fwd_sm90(q, k, v, D ** -0.5, causal, ws=True, pingpong=True)
            o64, lse64 = attention_ref(q, k, v, causal=causal, softmax_scale=D ** -0.5, compute_dtype=torch.float64)
            olo, lselo = attention_ref(q, k, v, causal=causal, softmax_scale=D ** -0.5, compute_dtype=None)
            eo, el = err(o, o64), err(lse, lse64)
            bo, bl = 2 * err(olo, o64) + 1e-3, 2 * err(lselo, lse64) + 1e-3
            ok = eo <= bo and el <= bl and torch.isfinite(o).all().item()
            fails += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {B},{T},{H},{H_kv},{D} {dtype} causal={causal}: o {eo:.2e} (<= {bo:.2e}) lse {el:.2e}", flush=True)
print("checks failed:", fails, flush=True)

def gpu_ms(fn, calls=20, reps=5):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls): fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / calls)
    return statistics.median(out)

print("\n| B,H,T,D | causal | ws ms | ws+pp ms | ws+pp 3 stages ms | tl ms | cuDNN ms | best/cuDNN | best TFLOP/s |\n|---|---|---|---|---|---|---|---|---|")
for B, H, T, D, causal in ((16, 12, 1024, 64, True), (4, 12, 2048, 64, True), (8, 16, 2048, 128, True),
                           (4, 16, 4096, 128, True), (2, 16, 8192, 128, True), (1, 16, 16384, 128, True),
                           (8, 16, 2048, 128, False)):
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    sc = D ** -0.5
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    t = {}
    for rnd in range(3):
        for name, fn in (("ws", lambda: hopper.attn_fwd_sm90(q, k, v, sc, causal, ws=True)),
                         ("pp", lambda: hopper.attn_fwd_sm90(q, k, v, sc, causal, ws=True, pingpong=True)),
                         ("pp3", lambda: hopper.attn_fwd_sm90(q, k, v, sc, causal, stages=3, ws=True, pingpong=True)),
                         ("tl", lambda: flash_attn(q, k, v, causal=causal, kernel="tl")),
                         ("cudnn", cudnn)):
            try:
                t.setdefault(name, []).append(gpu_ms(fn))
            except Exception as e:
                print(name, "failed:", str(e).splitlines()[0][:150], flush=True); t.setdefault(name, []).append(float("inf"))
    m = {n: min(x) for n, x in t.items()}
    best = min(m["ws"], m["pp"], m["pp3"])
    flops = 4 * B * H * T * T * D / (2 if causal else 1)
    print(f"| {B},{H},{T},{D} | {causal} | {m['ws']:.3f} | {m['pp']:.3f} | {m['pp3']:.3f} | {m['tl']:.3f} | {m['cudnn']:.3f} | "
          f"{m['cudnn'] / best:.2f} | {flops / best / 1e9:.0f} |", flush=True)
