"""cProfile of back-to-back eager fwd+bwd calls of flash_attn: where the host time goes."""
import cProfile, io, pstats, sys, time, torch
sys.path.insert(0, ".")
from kernels import flash_attn
for shape in [(1, 2, 128, 64), (16, 12, 1024, 64)]:
    B, H, T, D = shape
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    step = lambda: torch.autograd.grad(flash_attn(q, k, v, causal=True), (q, k, v), do)
    for _ in range(20): step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(500): step()
    issued = time.perf_counter() - t
    torch.cuda.synchronize()
    print(shape, f"issue {issued/500*1e6:.1f} us/call, wall {(time.perf_counter()-t)/500*1e6:.1f}")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(500): step()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(35); st.sort_stats("cumulative").print_stats(40)
    print(s.getvalue())
