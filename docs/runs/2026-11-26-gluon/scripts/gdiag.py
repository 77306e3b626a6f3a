"""Where the Gluon backward's time goes: bwd alone per variant, and its torch pieces (run from .base/gluon)."""
import importlib, torch
from kernels.flash_attention import flash_attn
def ms(fn, rep=20):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(rep): fn()
    b.record(); torch.cuda.synchronize(); return a.elapsed_time(b) / rep
for B, H, T, D in ((16, 12, 1024, 64), (4, 16, 4096, 128)):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    sc = D ** -0.5
    line = [f"{B},{H},{T},{D}"]
    for name in ("hopper", "hopper_noatomic", "hopper_s3"):
        m = importlib.import_module(f"kernels.flash_attention.{name}")
        o, lse = m.attn_fwd_sm90(q, k, v, sc, True)
        line.append(f"{name}: fwd {ms(lambda: m.attn_fwd_sm90(q, k, v, sc, True)):.3f} bwd {ms(lambda: m.attn_bwd_sm90(do, q, k, v, o, lse, sc, True)):.3f}")
    line.append(f"delta {ms(lambda: (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()):.3f} zeros {ms(lambda: torch.zeros((B, T, H, D), device='cuda', dtype=torch.float32)):.3f}")
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    def tl_fb():
        out = flash_attn(qq, kk, vv, causal=True, kernel="tl"); out.backward(do)
    line.append(f"tl fwd {ms(lambda: flash_attn(q, k, v, causal=True, kernel='tl')):.3f} fwd+bwd {ms(tl_fb):.3f}")
    print(" | ".join(line), flush=True)
