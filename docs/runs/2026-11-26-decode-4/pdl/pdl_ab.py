"""A/B of the merge kernel's programmatic dependent launch: kernel cells (graph replays, rounds
interleaved, median) and GPT-2 generation tok/s (graph step, B=1 and 8) with it on and off."""
import statistics, sys
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from scripts.bench_decode import gpu_us, decode_inputs, gpt2_model, inference_model, timed, PROMPT, CONTEXT
from kernels.flash_decoding import decode_config, decode_launch
CUDA = torch.device("cuda")
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
cells = [(12, 12, 64, B, L) for B in (1, 4, 8, 16, 32) for L in (1024, 4096, 8192, 16384, 32768, 65536)]
cells += [(32, 8, 128, B, L) for B in (1, 8) for L in (1024, 4096, 8192, 16384, 32768, 65536)]
print("| H/H_kv/D | B | L | launch | no PDL µs | PDL µs | cuDNN µs | PDL vs cuDNN | PDL GB/s |")
print("|---|---|---|---|---|---|---|---|---|")
for H, H_kv, D, B, L in cells:
    q, k, v, lens = decode_inputs(B, L, H, H_kv, D)
    cfg = decode_config(B, H_kv, L, D, 2, CUDA)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=H != H_kv)
    fns = {"off": lambda: decode_launch(q, k, v, lens, None, D ** -0.5, 0, *cfg, pdl=False),
           "on": lambda: decode_launch(q, k, v, lens, None, D ** -0.5, 0, *cfg, pdl=True), "cudnn": cudnn}
    assert torch.equal(fns["off"]()[0], fns["on"]()[0])
    res = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            res[n].append(gpu_us(f)[0])
    med = {n: statistics.median(x) for n, x in res.items()}
    gb = 2 * B * L * H_kv * D * 2 / 1e9
    print(f"| {H}/{H_kv}/{D} | {B} | {L} | {'/'.join(map(str, cfg))} | {med['off']:.1f} | {med['on']:.1f} | "
          f"{med['cudnn']:.1f} | {med['cudnn'] / med['on']:.3f} | {gb / med['on'] * 1e3:.0f} |", flush=True)

from kernels.flash_decoding import kernel as K
model = inference_model(gpt2_model())
new = CONTEXT - PROMPT
print("\n| batch | PDL | tokens/s per sequence (3 runs) |\n|---|---|---|")
for batch in (1, 8):
    idx = torch.randint(0, 50257, (batch, PROMPT), device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    outs = {}
    for flag in (False, True, False, True):
        K.dependent_launch = lambda device, flag=flag: flag
        model.generate(idx, new, temperature=0, step="graph")
        rates = []
        for _ in range(3):
            out, s = timed(lambda: model.generate(idx, new, temperature=0, step="graph"))
            rates.append(new / s)
        outs[flag] = out
        print(f"| {batch} | {flag} | {', '.join(f'{r:.0f}' for r in rates)} |", flush=True)
    assert torch.equal(outs[False], outs[True])
