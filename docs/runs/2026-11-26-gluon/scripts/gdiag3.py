"""Host and GPU time per call of the Gluon forward (direct, and through flash_attn with grad) and the tl forward."""
import time, torch
from kernels.flash_attention import flash_attn, hopper
def host_and_gpu(fn, n=200):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    host = (time.perf_counter() - t) / n * 1e3
    torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            for _ in range(20): fn()
        g.replay(); torch.cuda.synchronize()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        gpu = a.elapsed_time(b) / 20
    except Exception as e:
        gpu = float("nan"); print("graph:", type(e).__name__, str(e)[:200])
    return host, gpu
for B, H, T, D in ((16, 12, 1024, 64), (4, 12, 2048, 64), (8, 16, 2048, 128), (4, 16, 4096, 128)):
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    sc = D ** -0.5
    res = {"gluon direct": host_and_gpu(lambda: hopper.attn_fwd_sm90(q, k, v, sc, True)),
           "gluon flash_attn": host_and_gpu(lambda: flash_attn(q, k, v, kernel="gluon")),
           "gluon flash_attn grad": host_and_gpu(lambda: flash_attn(qg, kg, vg, kernel="gluon")),
           "tl flash_attn": host_and_gpu(lambda: flash_attn(q, k, v, kernel="tl")),
           "tl flash_attn grad": host_and_gpu(lambda: flash_attn(qg, kg, vg, kernel="tl"))}
    print(f"{B},{H},{T},{D}: " + " | ".join(f"{n} host {h:.3f} gpu {g:.3f} ms" for n, (h, g) in res.items()), flush=True)
