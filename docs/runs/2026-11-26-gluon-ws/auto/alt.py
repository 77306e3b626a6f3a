"""fwd+bwd ms of flash_attn kernel=auto and kernel=tl, alternating (do_bench, eager), and host ms per forward call."""
import time, torch, triton
from kernels.flash_attention import flash_attn
for B, H, T, D in ((16, 12, 1024, 64), (4, 12, 2048, 64), (8, 16, 2048, 128)):
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    def run(kernel):
        def f():
            o = flash_attn(q, k, v, kernel=kernel)
            torch.autograd.grad(o, (q, k, v), do)
        return f
    out = []
    for kernel in ("tl", "auto", "tl", "auto"):
        ms = triton.testing.do_bench(run(kernel), warmup=25, rep=100)
        with torch.no_grad():
            flash_attn(q, k, v, kernel=kernel); torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(100):
                flash_attn(q, k, v, kernel=kernel)
            host = (time.perf_counter() - t) * 10
            torch.cuda.synchronize()
        out.append(f"{kernel} {ms:.3f} ms (fwd host {host:.3f} ms)")
    print(f"{B},{H},{T},{D}: " + " | ".join(out), flush=True)
