"""Backward alone, GPU ms per call from CUDA-graph replays: the tl backward, the Hopper backward (tl dQ +
warp-specialised Gluon dK/dV) at 64- and 32-row query steps, the atomic Gluon backward; float64 checks first."""
import statistics, torch
from kernels.flash_attention import hopper
from kernels.flash_attention.backward import attn_bwd
from kernels.flash_attention.reference import attention_ref

def err(a, b): return (a.double() - b.double()).abs().max().item()
fails = 0
for B, T, H, H_kv, D in ((2, 256, 4, 4, 64), (1, 1000, 4, 2, 128), (3, 77, 6, 2, 64), (1, 2049, 2, 1, 128),
                         (2, 130, 8, 8, 128)):
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (True, False):
            q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=dtype) for h in (H, H_kv, H_kv))
            do = torch.randn(B, T, H, D, device="cuda", dtype=dtype)
            sc = D ** -0.5
            o, lse = hopper.attn_fwd_sm90(q, k, v, sc, causal)
            def ref(cd):
                ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                o_r, _ = attention_ref(*ins, causal=causal, softmax_scale=sc, compute_dtype=cd)
                return torch.autograd.grad(o_r, ins, do.to(o_r.dtype))
            truth, low = ref(torch.float64), ref(None)
            for bm in (64, 32):
                grads = hopper.attn_bwd_sm90(do, q, k, v, o, lse, sc, causal, block_m=bm)
                msg = []
                for name, g, t, l in zip(("dq", "dk", "dv"), grads, truth, low):
                    e, bound = err(g, t), 3 * err(l, t) + (1e-3 if dtype == torch.bfloat16 else 1e-4)
                    if not (e <= bound and torch.isfinite(g).all()):
                        msg.append(f"{name} {e:.2e} > {bound:.2e}")
                fails += bool(msg)
                print(f"{'FAIL' if msg else 'ok  '} bm={bm} {B},{T},{H},{H_kv},{D} {dtype} causal={causal} {'; '.join(msg)}", flush=True)
print("checks failed:", fails, flush=True)

def gpu_ms(fn, calls=10, reps=5):
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

print("\n| B,H,T,D | tl bwd ms | tl dQ only ms | hopper bwd (64) ms | hopper bwd (32) ms | gluon atomic ms | best vs tl |\n|---|---|---|---|---|---|---|")
for B, H, T, D in ((16, 12, 1024, 64), (4, 12, 2048, 64), (8, 16, 2048, 128), (4, 16, 4096, 128), (2, 16, 8192, 128),
                   (1, 16, 16384, 128)):
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    sc = D ** -0.5
    o, lse = hopper.attn_fwd_sm90(q, k, v, sc, True)
    fns = {"tl": lambda: attn_bwd(do, q, k, v, o, lse, sc, True),
           "dq": lambda: attn_bwd(do, q, k, v, o, lse, sc, True, dkdv_launch=lambda *a: None),
           "h64": lambda: hopper.attn_bwd_sm90(do, q, k, v, o, lse, sc, True, block_m=64),
           "h32": lambda: hopper.attn_bwd_sm90(do, q, k, v, o, lse, sc, True, block_m=32),
           "atomic": lambda: hopper.attn_bwd_sm90_atomic(do, q, k, v, o, lse, sc, True)}
    t = {}
    for rnd in range(2):
        for n, f in fns.items():
            try:
                t.setdefault(n, []).append(gpu_ms(f))
            except Exception as e:
                print(n, "failed:", str(e).splitlines()[0][:150], flush=True); t.setdefault(n, []).append(float("inf"))
    m = {n: min(x) for n, x in t.items()}
    print(f"| {B},{H},{T},{D} | {m['tl']:.3f} | {m['dq']:.3f} | {m['h64']:.3f} | {m['h32']:.3f} | {m['atomic']:.3f} | "
          f"{m['tl'] / min(m['h64'], m['h32']):.2f}x |", flush=True)
