"""The Gluon forward: the first version (hopper) against the overlapped one (hopper_v2) at 128 and 64 keys a step."""
import importlib, torch
def ms(fn, rep=30):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(rep): fn()
    b.record(); torch.cuda.synchronize(); return a.elapsed_time(b) / rep
for B, H, T, D in ((16, 12, 1024, 64), (4, 12, 2048, 64), (8, 16, 2048, 128), (4, 16, 4096, 128)):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    sc = D ** -0.5
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    line = [f"{B},{H},{T},{D} sdpa {ms(lambda: torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)):.3f}"]
    for name in ("hopper", "hopper_v2"):
        m = importlib.import_module(f"kernels.flash_attention.{name}")
        for bn in (128, 64):
            o, _ = m.attn_fwd_sm90(q, k, v, sc, True, block_n=bn)
            err = (o.float() - ref.float()).abs().max().item()
            line.append(f"{name} bn{bn}: {ms(lambda: m.attn_fwd_sm90(q, k, v, sc, True, block_n=bn)):.3f} (err {err:.1e})")
    print(" | ".join(line), flush=True)
