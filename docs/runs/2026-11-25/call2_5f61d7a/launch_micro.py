"""Host microseconds per launch of an empty 45-argument Triton kernel, by launch path."""
import time, torch, triton, triton.language as tl
from triton import knobs

@triton.jit
def empty(P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12,
          a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
          a20, a21, a22, a23, a24, a25, f0, f1, f2,
          C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr):
    pass

def per_call_us(fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    el = time.perf_counter() - t
    torch.cuda.synchronize()
    return el / n * 1e6

x = torch.empty(1 << 20, device="cuda")
ptrs = [x] * 13
ints = [1024 * (i + 1) for i in range(26)]
floats = [0.5, 1.5, 2.5]
kw = {f"P{i}": p for i, p in enumerate(ptrs)}
kw.update({f"a{i}": v for i, v in enumerate(ints)}); kw.update({f"f{i}": v for i, v in enumerate(floats)})
kw.update(C0=64, C1=128, C2=True)
grid = (4, 2, 2)
ck = empty[grid](**kw)
rest = ints + floats + [64, 128, True]
bound = ck[grid]
ck._init_handles()
dev = torch.cuda.current_device()
get_stream = torch._C._cuda_getCurrentRawStream
run, fn_handle, pm = ck.run, ck.function, ck.packed_metadata
res = {}
res["jit[grid](**kw)"] = per_call_us(lambda: empty[grid](**kw))
res["ck[grid](*args) (bound once)"] = per_call_us(lambda: bound(*ptrs, *rest))
res["ck[grid] then call"] = per_call_us(lambda: ck[grid](*ptrs, *rest))
res["ck.run direct, stream each call"] = per_call_us(lambda: run(4, 2, 2, get_stream(dev), fn_handle, pm, None, None, None, *ptrs, *rest))
s = get_stream(dev)
res["ck.run direct, stream cached"] = per_call_us(lambda: run(4, 2, 2, s, fn_handle, pm, None, None, None, *ptrs, *rest))
ptr_ints = [p.data_ptr() for p in ptrs]
res["ck.run direct, int pointers"] = per_call_us(lambda: run(4, 2, 2, s, fn_handle, pm, None, None, None, *ptr_ints, *rest))
res["torch.empty_like x1"] = per_call_us(lambda: torch.empty_like(x))
res["get_stream"] = per_call_us(lambda: get_stream(dev))
res["torch.cuda.current_device"] = per_call_us(lambda: torch.cuda.current_device())

class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.new_empty(a.shape)
    @staticmethod
    def backward(ctx, g):
        return g
a = torch.empty(16, device="cuda", requires_grad=True)
g = torch.empty(16, device="cuda")
res["autograd.Function apply+backward(g)"] = per_call_us(lambda: F.apply(a).backward(g), 1000)
res["sdpa-like C++ op fwd+bwd (a*2).backward"] = per_call_us(lambda: (a * 2).backward(g), 1000)
import platform, os
print("cpu:", platform.processor(), os.cpu_count(), open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0])
for k, v in res.items():
    print(f"| {k} | {v:.1f} |")
