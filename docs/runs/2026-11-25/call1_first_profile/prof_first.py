"""Where the first fwd+bwd call's seconds go: cold (empty Triton cache) and warm, under cProfile."""
import cProfile, io, json, os, pstats, subprocess, sys, tempfile, time

CHILD = r'''
import cProfile, io, pstats, sys, time, json
t0 = time.perf_counter()
import torch, triton
sys.path.insert(0, ".")
from kernels import flash_attn
from kernels.flash_attention import launch
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
t_init = time.perf_counter() - t0
launch.LAUNCHER.cache_dir = None if sys.argv[3] == "none" else sys.argv[3]
B, H, T, D = map(int, sys.argv[1].split(","))
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
torch.cuda.synchronize()
pr = cProfile.Profile()
t0 = time.perf_counter()
pr.enable()
o = flash_attn(q, k, v, causal=True)
torch.cuda.synchronize()
t_fwd = time.perf_counter() - t0
o.backward(do)
torch.cuda.synchronize()
pr.disable()
t_all = time.perf_counter() - t0
t0 = time.perf_counter()
o = flash_attn(q, k, v, causal=True); o.backward(do); torch.cuda.synchronize()
t_second = time.perf_counter() - t0
s = io.StringIO()
st = pstats.Stats(pr, stream=s); st.sort_stats("cumulative").print_stats(45)
st.sort_stats("tottime").print_stats(25)
print(json.dumps({"import_s": t_import, "cuda_init_s": t_init, "fwd_s": t_fwd, "fwd_bwd_s": t_all, "second_s": t_second}))
print(s.getvalue())
'''

def main():
    out = os.environ.get("OUT", "/tmp")
    shapes = sys.argv[1:] or ["4,16,4096,128", "16,12,1024,64"]
    for shape in shapes:
        tc = tempfile.mkdtemp(prefix="tc-")
        tune = tempfile.mkdtemp(prefix="tune-")
        for run in ("cold", "warm", "warm2"):
            env = dict(os.environ, TRITON_CACHE_DIR=tc)
            start = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", CHILD, shape, run, tune], env=env, capture_output=True, text=True)
            wall = time.perf_counter() - start
            name = f"{out}/first_{shape.replace(',', '_')}_{run}.txt"
            with open(name, "w") as f:
                f.write(f"process wall {wall:.2f}s rc {p.returncode}\n{p.stdout}\n--- stderr\n{p.stderr[-5000:]}")
            print(shape, run, f"wall {wall:.2f}", p.stdout.splitlines()[0] if p.stdout else p.stderr[-800:], flush=True)

main()
