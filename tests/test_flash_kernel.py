"""Tests of the Triton flash-attention kernel (kernels/flash_attention) against reference.py.

Ground truth is the float64 reference. The tolerance comes from a reference run in the inputs'
own precision (FlashAttention's method): the kernel's max error must be at most ``FWD_FACTOR`` (o,
lse) or ``BWD_FACTOR`` (dq, dk, dv, and dg with a forget gate) times that reference's max error,
plus a small atol. The backward's gradients may also carry one term the reference does not have:
FlashAttention's backward takes delta_i = sum_d dO_id O_id from o as stored, rounded to the inputs'
dtype, where autograd's softmax backward never reads o. A deviation e_i of delta_i adds exactly
-e_i * d lse_i / d(q, k, g) to (dq, dk, dg) (dS_ij gains -P_ij e_i, P the un-dropped softmax), so
the bound of dq, dk and dg adds that term, computed in float64 from the kernel's own o
(:func:`delta_term`). It matters where the reference's error is ~0 while delta's rounding is not:
T = 1 with dropout (dq = dk = 0 exactly, o = v / (1 - p) rounded).

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set below before
Triton is imported) on a small fp32/fp16 subset (bf16 ``tl.dot`` is wrong in the interpreter).
The full matrix (``CUDA_CASES``) runs only on a GPU.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels import flash_attn, flash_attn_qkvpacked, flash_attn_unavailable  # noqa: E402
from kernels.flash_attention import configs, flash_dropout_mask, forward, tuning  # noqa: E402
from kernels.flash_attention.backward import attn_bwd  # noqa: E402
from kernels.flash_attention.dropout import draw_dropout_rng  # noqa: E402
from kernels.flash_attention.reference import attention_ref  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
FWD_FACTOR, BWD_FACTOR = 2.0, 3.0
ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}
DT_NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

if not CUDA and type(forward._attn_fwd_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "kernels were imported before TRITON_INTERPRET=1 was set (no CUDA here); run this module "
        "on its own or export TRITON_INTERPRET=1",
        allow_module_level=True,
    )

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    HKV: int
    D: int
    dtype: torch.dtype
    causal: bool = True
    window: int | None = None
    cu: tuple[int, ...] | None = None  # cumulative document lengths (varlen); needs B == 1
    strided: bool = False  # q, k, v are slices of one packed (B, T, H + 2 HKV, D) buffer
    scale: float | None = None
    offset: int = 0  # q, k, v, do start this many elements into their buffers (pointers not 16-byte aligned)
    dropout: float = 0.0
    gate: str | None = None  # a key of GATES: log forget gates g (B, T, H) float32

    @property
    def id(self) -> str:
        s = f"B{self.B}-T{self.T}-H{self.H}-HKV{self.HKV}-D{self.D}-{DT_NAME[self.dtype]}"
        if not self.causal:
            s += "-full"
        if self.window is not None:
            s += f"-W{self.window}"
        if self.cu is not None:
            s += f"-varlen{len(self.cu) - 1}"
        if self.strided:
            s += "-strided"
        if self.scale is not None:
            s += f"-scale{self.scale}"
        if self.offset:
            s += f"-offset{self.offset}"
        if self.dropout:
            s += f"-dropout{self.dropout}"
        if self.gate:
            s += f"-gate{self.gate}"
        return s


# Log forget gates (B, T, H) from standard normal draws z: "fox" as the Forgetting Transformer
# starts (f = sigmoid(z + 3) ~ 0.95), "strong" decay (f ~ 0.3: c falls by ~1.5 a token), "signed"
# gates of both signs (the kernel must not assume g <= 0).
GATES = {
    "fox": lambda z: torch.nn.functional.logsigmoid(z + 3.0),
    "strong": lambda z: torch.nn.functional.logsigmoid(2.0 * z - 1.0),
    "signed": lambda z: 0.5 * z,
}


def make_gate(c: Case, seed: int = 0) -> torch.Tensor | None:
    """g for ``c`` (None without a gate); a non-contiguous view when ``c.strided``."""
    if c.gate is None:
        return None
    z = torch.randn(c.B, c.T, c.H + c.strided, generator=torch.Generator().manual_seed(seed + 1))
    return GATES[c.gate](z).to(DEVICE)[..., :c.H]


def make_inputs(c: Case, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        flat = torch.randn(math.prod(shape) + c.offset, generator=g).to(DEVICE, c.dtype)
        return flat[c.offset:].view(shape)

    if c.strided:
        buf = randn(c.B, c.T, c.H + 2 * c.HKV, c.D)
        q, k, v = buf.split([c.H, c.HKV, c.HKV], dim=2)
    else:
        q, k, v = randn(c.B, c.T, c.H, c.D), randn(c.B, c.T, c.HKV, c.D), randn(c.B, c.T, c.HKV, c.D)
    do = randn(c.B, c.T, c.H, c.D)
    cu = None if c.cu is None else torch.tensor(c.cu, dtype=torch.int32, device=DEVICE)
    return q, k, v, do, cu


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def kernel_dropout_mask(c: Case, seed: int, cu) -> torch.Tensor | None:
    """The keep-mask a flash call makes right after ``torch.manual_seed(seed)`` (None: no dropout):
    the call draws its RNG state first thing, as this does."""
    if not c.dropout:
        return None
    torch.manual_seed(seed)
    mask = flash_dropout_mask(draw_dropout_rng(torch.device(DEVICE)), c.B, c.H, c.T, c.dropout, cu)
    torch.manual_seed(seed)
    return mask


def delta_term(o: torch.Tensor, o64: torch.Tensor, do: torch.Tensor, ref_lse) -> list[float]:
    """Max |e_i * d lse_i / dx| for x = q, k (and g), e_i = sum_d dO_id (o_id - o64_id): what the
    backward's delta from the kernel's stored o adds to dq, dk (and dg), to first order. ``ref_lse``
    () -> (lse64 (B, H, T), inputs): a fresh float64 reference forward."""
    lse64, ins = ref_lse()
    e = (do.double() * (o.double() - o64.double())).sum(-1).transpose(1, 2)  # (B, H, T)
    grads = torch.autograd.grad(lse64, ins, e, allow_unused=True)
    return [0.0 if gr is None else gr.abs().max().item() for gr in grads]


def run_launch_functions(c: Case, q, k, v, do, cu, gate, tiles: dict):
    """o, lse and the gradients of ``c`` from the launch functions with the configs ``tiles``
    ({"fwd", "dq", "dkdv"} -> TileConfig) instead of the tuners' picks; the dropout RNG state is
    drawn first thing, as the public function draws it."""
    rng = draw_dropout_rng(q.device) if c.dropout else None
    scale = c.scale if c.scale is not None else c.D ** -0.5
    longest = max(b - a for a, b in zip(c.cu, c.cu[1:])) if c.cu else 0
    options = (scale, c.causal, c.window or 0, cu, longest)
    o, lse = forward.attn_fwd(q, k, v, *options, rng, c.dropout, gate, tiles=tiles)
    dq, dk, dv, dg = attn_bwd(do, q, k, v, o, lse, *options, None, rng, c.dropout, gate, tiles=tiles)
    return o, lse, [dq, dk, dv] + ([] if gate is None else [dg])


def check_case(c: Case, seed: int = 0, tiles: dict | None = None, kernel: str = "auto") -> None:
    """o, lse, dq, dk, dv (and dg) of ``c`` against the float64 reference (with the kernel's own
    dropout mask), within the error of the reference run in the inputs' precision (module
    docstring). Through the public function (its ``kernel`` argument), or with ``tiles`` the launch
    functions with those configs."""
    q, k, v, do, cu = make_inputs(c, seed)
    gate = make_gate(c, seed)
    kw = dict(causal=c.causal, softmax_scale=c.scale, window_size=c.window, cu_seqlens=cu)

    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    gated = [] if gate is None else [gate.detach().requires_grad_()]
    if c.strided:
        assert not inputs[0].is_contiguous() and all(not t.is_contiguous() for t in gated)
    mask = kernel_dropout_mask(c, seed, cu)
    if tiles is None:
        o, lse = flash_attn(*inputs, return_lse=True, dropout_p=c.dropout, g=gated[0] if gated else None,
                            kernel=kernel, **kw)
        grads = torch.autograd.grad(o, inputs + gated, do)
    else:
        o, lse, grads = run_launch_functions(c, q, k, v, do, cu, gate, tiles)
    assert o.dtype == c.dtype and o.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (c.B, c.H, c.T)

    def ref(dtype):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        g_ref = [t.detach().clone().requires_grad_() for t in gated]
        o_r, lse_r = attention_ref(*ins, compute_dtype=dtype, dropout_mask=mask, dropout_p=c.dropout,
                                   g=g_ref[0] if g_ref else None, **kw)
        g_r = torch.autograd.grad(o_r, ins + g_ref, do.to(o_r.dtype))
        return o_r, lse_r, g_r

    def ref_lse():
        ins = [t.detach().clone().double().requires_grad_() for t in (q, k, *gated)]
        lse_r = attention_ref(ins[0], ins[1], v, compute_dtype=torch.float64, dropout_mask=mask,
                              dropout_p=c.dropout, g=ins[2] if gated else None, **kw)[1]
        return lse_r, ins

    o64, lse64, g64 = ref(torch.float64)
    olp, lselp, glp = ref(None)  # the inputs' own precision
    delta_q, delta_k, *delta_g = delta_term(o, o64, do, ref_lse)
    delta = {"dq": delta_q, "dk": delta_k, "dg": delta_g[0] if delta_g else 0.0}

    failures = []
    for name, out, truth, lowp, factor in (
        ("o", o, o64, olp, FWD_FACTOR),
        ("lse", lse, lse64, lselp, FWD_FACTOR),
        *((name, grads[i], g64[i], glp[i], BWD_FACTOR) for i, name in enumerate(("dq", "dk", "dv", "dg")[:len(grads)])),
    ):
        assert out.shape == truth.shape, name
        if not torch.isfinite(out).all():
            failures.append(f"{name}: non-finite values")
            continue
        err, base, extra = max_err(out, truth), max_err(lowp, truth), delta.get(name, 0.0)
        bound = factor * base + extra + ATOL[c.dtype]
        if err > bound:
            failures.append(f"{name}: max err {err:.3e} > {factor} x {base:.3e} + {extra:.3e} + {ATOL[c.dtype]}")
    assert not failures, f"{c.id}: " + "; ".join(failures)


# ---------------------------------------------------------------------------------------------
# CPU (interpreter) subset: fp32 / fp16, T <= 200. Also runs on CUDA.
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DOCS = (0, 5, 70, 71, 150, 200)  # includes a 1-token document and ragged lengths
CPU_CASES = [
    Case(1, 1, 2, 1, 32, F32),
    Case(2, 1, 4, 2, 64, F16, dropout=0.1),  # dq = dk = 0 in exact arithmetic; not with delta from the rounded o
    Case(2, 17, 4, 2, 16, F32),
    Case(1, 64, 2, 2, 64, F16),
    Case(1, 127, 4, 1, 80, F32),
    Case(1, 128, 2, 1, 96, F16),
    Case(1, 200, 2, 2, 128, F32),
    Case(1, 100, 2, 1, 256, F16),
    Case(2, 65, 2, 1, 64, F16, causal=False),
    Case(1, 200, 2, 1, 32, F32, window=37),
    Case(1, 130, 2, 2, 32, F16, window=1),
    Case(1, 90, 2, 1, 32, F32, window=500),
    Case(1, 200, 4, 2, 32, F32, cu=DOCS),
    Case(1, 200, 2, 1, 32, F16, cu=DOCS, window=20),
    Case(1, 200, 2, 2, 32, F32, cu=DOCS, causal=False),
    Case(2, 100, 4, 2, 32, F16, strided=True),
    Case(1, 77, 2, 1, 48, F32, scale=0.3),
    Case(1, 50, 2, 1, 32, F16, offset=3),
    Case(2, 40, 4, 2, 32, F32, dropout=0.3),
    Case(1, 77, 2, 1, 48, F16, dropout=0.1),
    Case(1, 130, 2, 2, 32, F32, window=20, dropout=0.2),
    Case(1, 200, 2, 1, 32, F16, cu=DOCS, dropout=0.25),
    Case(2, 65, 2, 1, 64, F32, causal=False, dropout=0.5),
    Case(2, 50, 4, 2, 32, F16, strided=True, dropout=0.3),
    Case(2, 17, 4, 2, 16, F32, gate="fox"),
    Case(1, 127, 4, 1, 80, F32, gate="strong"),
    Case(1, 128, 2, 1, 96, F16, gate="fox"),
    Case(1, 100, 2, 2, 48, F32, gate="signed"),
    Case(2, 65, 2, 1, 64, F16, causal=False, gate="signed"),
    Case(1, 200, 2, 1, 32, F32, window=37, gate="strong"),
    Case(1, 200, 4, 2, 32, F32, cu=DOCS, gate="fox"),
    Case(1, 200, 2, 1, 32, F16, cu=DOCS, window=20, gate="strong"),
    Case(2, 100, 4, 2, 32, F16, strided=True, gate="fox"),
    Case(2, 40, 4, 2, 32, F32, dropout=0.3, gate="fox"),
    Case(1, 200, 2, 1, 32, F16, cu=DOCS, dropout=0.25, gate="strong"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES])
def test_flash_matches_reference(case):
    check_case(case)


# ---------------------------------------------------------------------------------------------
# Full matrix: CUDA only.
def _cuda_cases() -> list[Case]:
    cases = []
    for T in (1, 17, 64, 127, 128, 200, 1000):  # every T x D, both 16-bit dtypes
        for D in (16, 32, 64, 80, 96, 128, 256):
            for dt in (F16, BF16):
                cases.append(Case(2, T, 4, 2, D, dt))
    for H, HKV in ((1, 1), (2, 1), (2, 2), (4, 1), (4, 4)):
        for T in (128, 1000):
            cases.append(Case(2, T, H, HKV, 64, BF16))
    for T in (17, 200, 1000):
        for D in (32, 80, 128):
            cases.append(Case(1, T, 4, 2, D, F32))
    for W in (1, 16, 100, 4096):
        for T in (200, 1000):
            for D, dt in ((64, BF16), (128, F16)):
                cases.append(Case(2, T, 4, 2, D, dt, window=W))
    docs = [(0, 1000), (0, 1, 2, 500, 1000), (0, 300, 301, 999, 1000), (0, 17, 145, 600, 1000)]
    for cu in docs:
        for D, dt in ((64, BF16), (128, F16), (96, BF16)):
            cases.append(Case(1, 1000, 4, 2, D, dt, cu=cu))
        cases.append(Case(1, 1000, 4, 1, 64, BF16, cu=cu, window=64))
        cases.append(Case(1, 1000, 4, 2, 64, F16, cu=cu, causal=False))
    for T in (1, 17, 200, 1000):
        for D in (64, 96):
            cases.append(Case(2, T, 4, 2, D, BF16, causal=False))
    for T in (127, 1000):
        for D in (64, 80, 128):
            cases.append(Case(2, T, 4, 2, D, BF16, strided=True))
            cases.append(Case(2, T, 4, 2, D, F16, offset=1))
    for T in (1, 17, 200, 1000):  # dropout
        for D in (64, 128):
            for dt in (F16, BF16):
                cases.append(Case(2, T, 4, 2, D, dt, dropout=0.1))
    cases += [Case(1, 1000, 4, 1, 64, BF16, window=100, dropout=0.2),
              Case(1, 1000, 4, 2, 128, F16, cu=docs[2], dropout=0.1),
              Case(1, 1000, 4, 2, 64, BF16, cu=docs[3], window=64, dropout=0.3),
              Case(2, 1000, 4, 2, 96, BF16, causal=False, dropout=0.1),
              Case(2, 1000, 4, 2, 64, BF16, strided=True, dropout=0.1),
              Case(1, 200, 4, 2, 80, F32, dropout=0.25)]
    for T in (1, 17, 200, 1000):  # forget gate
        for D in (64, 80, 128):
            for dt, gate in ((F16, "fox"), (BF16, "strong")):
                cases.append(Case(2, T, 4, 2, D, dt, gate=gate))
    for H, HKV in ((2, 1), (4, 4), (8, 2)):
        cases.append(Case(2, 1000, H, HKV, 64, BF16, gate="fox"))
    for cu in docs:
        cases.append(Case(1, 1000, 4, 2, 64, BF16, cu=cu, gate="strong"))
        cases.append(Case(1, 1000, 4, 1, 128, F16, cu=cu, window=64, gate="fox"))
    cases += [Case(1, 1000, 4, 2, 64, BF16, window=W, gate=gate) for W in (1, 16, 100) for gate in ("fox", "strong")]
    cases += [Case(2, 1000, 4, 2, 96, BF16, causal=False, gate="signed"),
              Case(2, 1000, 4, 2, 64, BF16, strided=True, gate="fox"),
              Case(2, 1000, 4, 2, 80, F16, offset=1, gate="fox"),
              Case(2, 1000, 4, 2, 64, BF16, dropout=0.1, gate="fox"),
              Case(1, 1000, 4, 2, 128, F16, cu=docs[3], window=64, dropout=0.2, gate="strong"),
              Case(1, 1000, 4, 2, 64, F32, gate="strong"),
              Case(1, 200, 4, 2, 80, F32, gate="signed"),
              Case(2, 1000, 4, 2, 256, BF16, gate="fox")]
    return cases


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in _cuda_cases()])
def test_flash_matches_reference_cuda(case):
    check_case(case)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dropout,gate", [(0.0, None), (0.1, None), (0.0, "fox")], ids=["plain", "dropout", "gate"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [1000, 2048])
def test_tuned_path_cuda(T, D, dropout, gate):
    """Where a kernel has two candidates (D=128 on Hopper), the timed pick is correct too."""
    check_case(Case(2, T, 8, 2, D, BF16, dropout=dropout, gate=gate))


def test_host_integer_helpers_match_triton():
    import triton

    assert all(tuning.next_power_of_2(n) == triton.next_power_of_2(n) for n in range(1, 5000))
    assert all(tuning.ceil_div(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in (1, 16, 64, 128))


@gpu
@pytest.mark.gpu
def test_transposed_layout_cuda():
    """(B, H, T, D) tensors viewed as (B, T, H, D): arbitrary T/H strides, no copy."""
    q, k, v = (torch.randn(2, 4, 300, 64, device=DEVICE, dtype=BF16).transpose(1, 2)
               for _ in range(3))
    o = flash_attn(q, k, v)
    o_ref, _ = attention_ref(q, k, v)
    o_lp, _ = attention_ref(q, k, v, compute_dtype=None)
    assert max_err(o, o_ref) <= FWD_FACTOR * max_err(o_lp, o_ref) + ATOL[BF16]


# ---------------------------------------------------------------------------------------------
# Behaviour beyond numerics.
def _small(dtype=F32, T=40, H=4, HKV=2, D=32, requires_grad=False):
    g = torch.Generator(device="cpu").manual_seed(1)
    mk = lambda h: torch.randn(1, T, h, D, generator=g).to(DEVICE, dtype).requires_grad_(
        requires_grad)
    return mk(H), mk(HKV), mk(HKV)


def test_the_kernel_is_available_where_these_tests_run():
    assert flash_attn_unavailable(DEVICE) == ""
    assert kernels.flash_attn is flash_attn


def test_backward_is_deterministic():
    q, k, v = _small(requires_grad=True)
    do = torch.randn_like(q)
    runs = [torch.autograd.grad(flash_attn(q, k, v), (q, k, v), do) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_gradients_flow_through_a_tiny_layer():
    """fp32 end-to-end: x -> qkv projection -> flash_attn -> projection -> loss; every parameter
    gets a finite non-zero gradient equal to the reference path's."""
    torch.manual_seed(0)
    C, H, HKV, D, T = 64, 4, 2, 16, 24
    x = torch.randn(2, T, C, device=DEVICE)
    w_qkv = torch.nn.Parameter(torch.randn(C, (H + 2 * HKV) * D, device=DEVICE) * C ** -0.5)
    w_o = torch.nn.Parameter(torch.randn(H * D, C, device=DEVICE) * (H * D) ** -0.5)

    def loss_fn(attn):
        q, k, v = (x @ w_qkv).view(2, T, H + 2 * HKV, D).split([H, HKV, HKV], dim=2)
        y = attn(q, k, v).reshape(2, T, H * D) @ w_o
        return y.square().mean()

    loss = loss_fn(flash_attn)
    g = torch.autograd.grad(loss, (w_qkv, w_o))
    loss_ref = loss_fn(lambda q, k, v: attention_ref(q, k, v, compute_dtype=F32)[0])
    g_ref = torch.autograd.grad(loss_ref, (w_qkv, w_o))
    assert torch.allclose(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, g_ref):
        assert torch.isfinite(a).all() and a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_lse_gradient():
    """lse is differentiable: d(sum lse)/dq matches the reference."""
    q, k, v = _small(requires_grad=True)
    _, lse = flash_attn(q, k, v, return_lse=True)
    gq = torch.autograd.grad(lse.sum(), q)[0]
    qr = q.detach().double().requires_grad_()
    _, lse_r = attention_ref(qr, k.detach().double(), v.detach().double())
    gq_r = torch.autograd.grad(lse_r.sum(), qr)[0]
    assert max_err(gq, gq_r) < 1e-5


def _compiled_and_eager(f, *inputs):
    """(output, gradients) of ``torch.compile(f, fullgraph=True)`` and of eager ``f``, each run
    right after ``torch.manual_seed(0)``. Under Inductor the RNG ops fall back to eager's
    (``fallback_random``), so both draw the same dropout mask."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    backend = "inductor" if CUDA else "aot_eager"  # inductor on CPU would spend ~20 s in g++
    results = []
    with inductor_config.patch(fallback_random=True):
        for fn in (torch.compile(f, fullgraph=True, backend=backend), f):
            torch.manual_seed(0)
            out = fn(*inputs)
            results.append((out, torch.autograd.grad(out, inputs)))
    return results


COMPILE_CASES = [pytest.param(0.0, False, id="plain"), pytest.param(0.2, False, id="dropout"),
                 pytest.param(0.0, True, id="gate"), pytest.param(0.2, True, id="dropout-gate")]


def _gate_logits(T: int, H: int) -> torch.Tensor:
    """(1, T, H) float32 logits z of forget gates f = sigmoid(z) (g = logsigmoid(z)), needing grad."""
    return (torch.randn(1, T, H, generator=torch.Generator().manual_seed(6)) + 2.0).to(DEVICE).requires_grad_()


@pytest.mark.parametrize("dropout_p,gated", COMPILE_CASES)
def test_torch_compile_fullgraph_no_graph_break(dropout_p, gated):
    q, k, v = _small(requires_grad=True)
    inputs = (q, k, v, _gate_logits(q.shape[1], q.shape[2])) if gated else (q, k, v)

    def f(q, k, v, z=None):
        g = None if z is None else torch.nn.functional.logsigmoid(z)
        return flash_attn(q * 2.0, k, v, window_size=16, dropout_p=dropout_p, g=g).float().square().sum()

    explain = torch._dynamo.explain(f)(*inputs)
    assert explain.graph_break_count == 0, explain.break_reasons
    (out, g), (out_e, g_e) = _compiled_and_eager(f, *inputs)
    torch.testing.assert_close(out, out_e)
    assert len(g) == len(inputs)
    for a, b in zip(g, g_e):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("lse_used", [False, True], ids=["o", "o-and-lse"])
def test_a_compiled_backward_gets_an_lse_gradient_only_where_lse_is_used(lse_used):
    """Traced by torch.compile, the backward op's dlse is None unless the caller took lse: a graph once
    passed zeros for the lse nobody used (the tl kernels then read it, and the Hopper backward,
    which takes no dlse, never ran under compile)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    dlse_args = []

    def backward_compiler(gm, _):
        dlse_args.extend(n.args[6] for n in gm.graph.nodes if n.target is torch.ops.nanoflash.flash_attn_bwd.default)
        return make_boxed_func(gm.forward)

    def f(q, k, v):
        if lse_used:
            o, lse = flash_attn(q * 2.0, k, v, return_lse=True)
            return o.float().square().sum() + lse.sum()
        return flash_attn(q * 2.0, k, v).float().square().sum()

    inputs = _small(requires_grad=True)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward_compiler)
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    grads = torch.autograd.grad(compiled(*inputs), inputs)
    assert len(dlse_args) == 1 and (dlse_args[0] is not None) == lse_used
    for a, b in zip(grads, torch.autograd.grad(f(*inputs), inputs)):
        torch.testing.assert_close(a, b)


def _op_calls(fn, *inputs) -> dict[str, int]:
    """{op: calls} of the nanoflash ops in one forward + backward of ``fn`` (torch.profiler records
    every call that goes through the dispatcher, eager or from a compiled graph)."""
    with torch.profiler.profile() as prof:
        torch.autograd.grad(fn(*inputs), inputs)
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("nanoflash::")}


@pytest.mark.parametrize("packed", [False, True], ids=["qkv", "packed"])
def test_eager_and_compiled_calls_go_through_the_same_ops(packed):
    """One host path: an eager call and a compiled graph both call nanoflash::flash_attn_fwd and
    nanoflash::flash_attn_bwd once per forward + backward (no bypass of the op in eager)."""
    if packed:
        inputs = (torch.randn(1, 40, 6, 32, generator=torch.Generator().manual_seed(7)).to(DEVICE).requires_grad_(),)

        def f(qkv):
            return flash_attn_qkvpacked(qkv * 2.0, 2).float().square().sum()
    else:
        inputs = _small(requires_grad=True)

        def f(q, k, v):
            return flash_attn(q * 2.0, k, v).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    torch.autograd.grad(compiled(*inputs), inputs)  # compile outside the count
    want = {"nanoflash::flash_attn_fwd": 1, "nanoflash::flash_attn_bwd": 1}
    assert _op_calls(f, *inputs) == want
    assert _op_calls(compiled, *inputs) == want


PACKED_CASES = [
    pytest.param(dict(B=2, T=40, H=4, HKV=4, D=32), {}, id="mha"),
    pytest.param(dict(B=1, T=70, H=4, HKV=2, D=16), dict(window_size=9), id="gqa-window"),
    pytest.param(dict(B=1, T=77, H=2, HKV=1, D=32), dict(cu=[0, 30, 31, 77]), id="gqa-varlen"),
    pytest.param(dict(B=1, T=33, H=2, HKV=2, D=32, dtype=torch.float16), dict(causal=False), id="fp16-full"),
    pytest.param(dict(B=1, T=70, H=4, HKV=2, D=16), dict(window_size=9, dropout_p=0.2), id="gqa-window-dropout"),
    pytest.param(dict(B=1, T=77, H=2, HKV=1, D=32), dict(cu=[0, 30, 31, 77], dropout_p=0.3), id="gqa-varlen-dropout"),
    pytest.param(dict(B=2, T=40, H=4, HKV=2, D=32), dict(gate=True), id="gqa-gate"),
    pytest.param(dict(B=1, T=77, H=2, HKV=1, D=32), dict(cu=[0, 30, 31, 77], gate=True), id="gqa-varlen-gate"),
    pytest.param(dict(B=1, T=70, H=4, HKV=2, D=16), dict(window_size=9, dropout_p=0.2, gate=True),
                 id="gqa-window-dropout-gate"),
]


@pytest.mark.parametrize("shape,kw", PACKED_CASES)
def test_qkvpacked_equals_flash_attn_on_the_split_tensors(shape, kw):
    """Same kernels on views: o, lse and the gradient (dq, dk, dv side by side) agree exactly (with
    dropout: the same mask for the same seed; with a gate: dg too)."""
    B, T, H, HKV, D = (shape[n] for n in ("B", "T", "H", "HKV", "D"))
    dtype = shape.get("dtype", F32)
    kw = dict(kw)
    if "cu" in kw:
        kw["cu_seqlens"] = torch.tensor(kw.pop("cu"), dtype=torch.int32, device=DEVICE)
    gated = [torch.nn.functional.logsigmoid(_gate_logits(T, H)).detach().repeat(B, 1, 1).requires_grad_()
             ] if kw.pop("gate", False) else []
    kw["g"] = gated[0] if gated else None
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, T, H + 2 * HKV, D, generator=g).to(DEVICE, dtype).requires_grad_()
    do = torch.randn(B, T, H, D, generator=g).to(DEVICE, dtype)
    torch.manual_seed(5)
    o, lse = flash_attn_qkvpacked(qkv, H, return_lse=True, **kw)
    dqkv, *dg = torch.autograd.grad((o * do).sum() + lse.sum(), [qkv] + gated)
    q, k, v = (t.detach().requires_grad_() for t in qkv.detach().split([H, HKV, HKV], dim=2))
    torch.manual_seed(5)
    o2, lse2 = flash_attn(q, k, v, return_lse=True, **kw)
    grads = torch.autograd.grad((o2 * do).sum() + lse2.sum(), [q, k, v] + gated)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    assert dqkv.shape == qkv.shape and torch.equal(dqkv, torch.cat(grads[:3], dim=2))
    assert len(dg) == len(gated) and all(torch.equal(a, b) for a, b in zip(dg, grads[3:]))


@pytest.mark.parametrize("dropout_p,gated", COMPILE_CASES)
def test_qkvpacked_compiles_without_graph_break(dropout_p, gated):
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(1, 40, 8, 32, generator=g).to(DEVICE).requires_grad_()
    inputs = (qkv, _gate_logits(40, 4)) if gated else (qkv,)

    def f(qkv, z=None):
        g = None if z is None else torch.nn.functional.logsigmoid(z)
        return flash_attn_qkvpacked(qkv * 2.0, 4, dropout_p=dropout_p, g=g).float().square().sum()

    explain = torch._dynamo.explain(f)(*inputs)
    assert explain.graph_break_count == 0, explain.break_reasons
    (out, grads), (out_e, grads_eager) = _compiled_and_eager(f, *inputs)
    torch.testing.assert_close(out, out_e)
    assert len(grads) == len(inputs)
    for a, b in zip(grads, grads_eager):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("heads,n_head", [(8, 5), (8, 8), (8, 0), (7, 4)])
def test_qkvpacked_rejects_a_heads_axis_that_does_not_split(heads, n_head):
    qkv = torch.randn(1, 8, heads, 32, device=DEVICE)
    with pytest.raises(ValueError, match="heads axis"):
        flash_attn_qkvpacked(qkv, n_head)


# ---------------------------------------------------------------------------------------------
# Dropout: the mask's statistics and what it may not change (the reference match is in CPU_CASES
# and _cuda_cases).
def _dropout_run(q, k, v, do, seed, dropout_p=0.3, **kw):
    """o and (dq, dk, dv) of one flash call right after ``torch.manual_seed(seed)``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    torch.manual_seed(seed)
    o = flash_attn(q, k, v, dropout_p=dropout_p, **kw)
    return o, torch.autograd.grad(o, (q, k, v), do)


def test_dropout_same_seed_repeats_bitwise_and_another_seed_differs():
    q, k, v = _small()
    do = torch.randn_like(q)
    o1, g1 = _dropout_run(q, k, v, do, seed=1)
    o2, g2 = _dropout_run(q, k, v, do, seed=1)
    o3, g3 = _dropout_run(q, k, v, do, seed=2)
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert not torch.equal(o1, o3) and not any(torch.equal(a, b) for a, b in zip(g1, g3))


def test_dropout_zero_runs_the_plain_kernel_and_draws_nothing():
    q, k, v = _small()
    do = torch.randn_like(q)
    torch.manual_seed(3)
    before = torch.rand(4)  # what the generator gives next, had nothing drawn from it
    plain = _dropout_run(q, k, v, do, seed=3, dropout_p=0.0)
    assert torch.equal(torch.rand(4), before)
    o, g = _dropout_run(q, k, v, do, seed=4, dropout_p=0.0)
    default = flash_attn(q, k, v)
    assert torch.equal(plain[0], o) and torch.equal(o, default)
    assert all(torch.equal(a, b) for a, b in zip(plain[1], g))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_keeps_one_minus_p_independently(p):
    """The kept fraction is 1 - p within 5 standard errors, in each of the eight 16-bit slices of
    a Philox call (key j takes slice j % 8: a half of a word), and neighbouring keys (two halves
    of one word, or of two words) agree as often as independent draws do."""
    B, H, T = 2, 3, 128
    torch.manual_seed(0)
    keep = flash_dropout_mask(draw_dropout_rng(torch.device(DEVICE)), B, H, T, p).cpu()
    n = keep.numel()

    def near(fraction, expected, count):
        return abs(fraction - expected) < 5 * math.sqrt(expected * (1 - expected) / count)

    assert near(keep.float().mean().item(), 1 - p, n)
    for part in range(8):
        assert near(keep[..., part::8].float().mean().item(), 1 - p, n // 8), part
    agree = p * p + (1 - p) * (1 - p)
    for first in range(2):  # pairs (2u, 2u + 1): halves of one word; (2u + 1, 2u + 2): of two
        pairs = (keep[..., first:-1:2] == keep[..., first + 1::2]).float()
        assert near(pairs.mean().item(), agree, pairs.numel()), first
    planes = keep.reshape(B * H, T, T)
    assert all(not torch.equal(planes[i], planes[j]) for i in range(B * H) for j in range(i))
    assert not torch.equal(keep[..., 1:, :], keep[..., :-1, :])  # rows differ too


@pytest.mark.parametrize("cu", [None, (0, 5, 70, 71, 150, 200)], ids=["batch", "varlen"])
def test_dropout_mask_does_not_depend_on_tile_sizes(cu):
    """The kernels tile differently (and autotune); each must regenerate the same bits."""
    B, T = (2, 100) if cu is None else (1, cu[-1])
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    rng = torch.tensor([1234567, 89], dtype=torch.int64, device=DEVICE)
    masks = [flash_dropout_mask(rng, B, 2, T, 0.4, cu_t, block_m=bm, block_n=bn)
             for bm, bn in ((16, 16), (32, 64), (64, 16))]
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])
    if cu is not None:  # nothing across documents
        doc = torch.bucketize(torch.arange(T), torch.tensor(cu[1:]), right=True)
        assert not masks[0][..., doc[:, None] != doc[None, :]].any()


def test_dropout_never_lets_a_future_key_in():
    """Causal attention under dropout: keys after a query change neither its output nor, through
    it, their own gradients."""
    q, k, v = _small(T=40)
    t0 = 17
    do = torch.randn_like(q)
    do[:, t0 + 1:] = 0  # only the outputs of queries <= t0 matter
    k2, v2 = k.clone(), v.clone()
    k2[:, t0 + 1:] += 3.0
    v2[:, t0 + 1:] -= 2.0
    o, (dq, dk, dv) = _dropout_run(q, k, v, do, seed=7)
    o2, _ = _dropout_run(q, k2, v2, do, seed=7)
    assert torch.equal(o[:, :t0 + 1], o2[:, :t0 + 1])
    assert not dk[:, t0 + 1:].any() and not dv[:, t0 + 1:].any()
    assert dk[:, :t0 + 1].any() and dv[:, :t0 + 1].any()


def test_dropout_under_activation_checkpointing_recomputes_the_same_mask():
    """torch.utils.checkpoint restores the generator's state before recomputing, so the recomputed
    forward draws the same RNG state and the gradients are those of the plain call."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = _small()
    do = torch.randn_like(q)
    o, grads = _dropout_run(q, k, v, do, seed=11)
    qc, kc, vc = (t.detach().requires_grad_() for t in (q, k, v))
    torch.manual_seed(11)
    oc = checkpoint(lambda *x: flash_attn(*x, dropout_p=0.3), qc, kc, vc, use_reentrant=False)
    grads_c = torch.autograd.grad(oc, (qc, kc, vc), do)
    assert torch.equal(o, oc) and all(torch.equal(a, b) for a, b in zip(grads, grads_c))


def test_reference_dropout_without_a_mask_draws_bernoulli_from_torch():
    q, k, v = (t.double() for t in _small(T=12, H=2, HKV=2, D=16))
    torch.manual_seed(2)
    o, lse = attention_ref(q, k, v, dropout_p=0.4)
    torch.manual_seed(2)
    keep = torch.rand(1, 2, 12, 12, device=q.device) >= 0.4
    o_mask, lse_mask = attention_ref(q, k, v, dropout_mask=keep, dropout_p=0.4)
    o_plain, lse_plain = attention_ref(q, k, v)
    assert torch.equal(o, o_mask) and not torch.allclose(o, o_plain)
    assert torch.equal(lse, lse_plain) and torch.equal(lse_mask, lse_plain)


def test_dropout_output_is_unbiased():
    """Over many independent masks (batch rows and seeds), the mean output equals the
    no-dropout output: each element within 5 standard errors, the error computed from the
    probabilities P: Var(o_id) = p / (1 - p) * sum_j P_ij^2 v_jd^2 per call."""
    p, copies, seeds, T, H, D = 0.3, 32, 4, 24, 2, 16
    q1, k1, v1 = _small(T=T, H=H, HKV=H, D=D)
    q, k, v = (t.expand(copies, -1, -1, -1) for t in (q1, k1, v1))
    total = torch.zeros(T, H, D, dtype=torch.float64)
    for seed in range(seeds):
        torch.manual_seed(seed)
        total += flash_attn(q, k, v, dropout_p=p).double().sum(0).cpu()
    mean = total / (copies * seeds)
    plain = flash_attn(q1, k1, v1)[0].double().cpu()
    qd, kd, vd = (t[0].double().cpu() for t in (q1, k1, v1))  # (T, H, D)
    scores = torch.einsum("ihd,jhd->hij", qd, kd) / math.sqrt(D)
    P = torch.softmax(scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")), -1)
    var = p / (1 - p) * torch.einsum("hij,jhd->ihd", P.square(), vd.square())
    z = (mean - plain) / (var / (copies * seeds)).sqrt()
    assert z.abs().max() < 5, z.abs().max()
    biased = (mean * (1 - p) - plain) / (var / (copies * seeds)).sqrt()  # without the 1 / (1 - p)
    assert biased.abs().max() > 5


def _bad_inputs():
    q = torch.randn(1, 8, 4, 32, device=DEVICE)
    k = torch.randn(1, 8, 2, 32, device=DEVICE)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    yield "3-D", (q[0], k, k), {}, "must be 4-D"
    yield "int dtype", (q.long(), k.long(), k.long()), {}, "not supported"
    yield "mixed dtype", (q, k.half(), k), {}, "share a dtype"
    yield "heads", (q, torch.randn(1, 8, 3, 32, device=DEVICE),
                    torch.randn(1, 8, 3, 32, device=DEVICE)), {}, "multiple of kv heads"
    yield "kv shape", (q, k, k[:, :, :1]), {}, "shapes differ"
    yield "T mismatch", (q, k[:, :4], k[:, :4]), {}, "does not match"
    yield "D small", (q[..., :8], k[..., :8], k[..., :8]), {}, "head dim 8 out of range"
    yield "D big", (torch.randn(1, 2, 1, 320, device=DEVICE),) * 3, {}, "out of range"
    yield "window 0", (q, k, k), {"window_size": 0}, "window_size must be"
    yield "window noncausal", (q, k, k), {"window_size": 4, "causal": False}, "causal=True"
    yield "cu dtype", (q, k, k), {"cu_seqlens": cu.long()}, "int32"
    yield "cu batch", (q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                       k.expand(2, -1, -1, -1)), {"cu_seqlens": cu}, "batch 1"
    yield "cu end", (q, k, k), {"cu_seqlens": cu[:2]}, "end at the packed length"
    yield "cu order", (q, k, k), {"cu_seqlens": torch.tensor([0, 5, 3, 8], dtype=torch.int32,
                                                            device=DEVICE)}, "non-decreasing"
    for p in (-0.1, 1.0, 1.5, float("nan"), "0.1", True):
        yield f"dropout {p!r}", (q, k, k), {"dropout_p": p}, r"dropout_p must be a float in \[0, 1\)"
    g = torch.zeros(1, 8, 4, device=DEVICE)
    for name, bad in (("shape", g[:, :, :2]), ("T", g[:, :4]), ("dtype", g.double()),
                      ("list", g.tolist()), ("batch", g.expand(2, -1, -1))):
        yield f"g {name}", (q, k, k), {"g": bad}, r"g must be None or float32 log forget gates of shape \(B, T, H\)"
    if CUDA:
        yield "device", (q.cpu(), k.cpu(), k.cpu()), {}, "CUDA device"
        yield "g device", (q, k, k), {"g": g.cpu()}, "g must be None or float32"


@pytest.mark.parametrize("args,kwargs,match",
                         [pytest.param(a, kw, m, id=name) for name, a, kw, m in _bad_inputs()])
def test_input_validation(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        flash_attn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Consumer-card (low shared memory) path.
@pytest.mark.parametrize("budget", [configs.SMEM_CONSUMER, configs.SMEM_TURING],
                         ids=["100KB", "64KB"])
@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
def test_configs_fit_small_shared_memory(kind, budget):
    """Every config selected for a small card fits its shared memory, for every head dim."""
    for family in ("hopper", "ampere", "consumer"):
        for D in (16, 32, 64, 80, 96, 128, 256):
            block_d = max(16, 1 << (D - 1).bit_length())
            for elem in (2, 4):
                if budget == configs.SMEM_TURING and elem == 4 and D > 128:
                    continue  # fp32 at D=256 on a 64 KB card is out of scope
                cands = configs.candidate_configs(kind, family)
                kept = configs.filter_configs(kind, cands, budget, block_d, elem)
                assert kept, (kind, family, D, elem)
                for cfg in kept:
                    used = configs.smem_estimate(kind, cfg, block_d, elem)
                    assert used <= budget, (kind, family, D, elem, cfg, used)
                # Dropping configs that do not fit must leave the card a real choice.
                big = [c for c in cands
                       if configs.smem_estimate(kind, c, block_d, elem) > budget]
                assert not set(big) & set(kept)


def test_consumer_default_config_runs():
    """Launch with the consumer card's default configs (as on a ~100 KB RTX card) and check
    numerics: the low-shared-memory path is exercised on whatever machine runs the suite."""
    D = 128
    chosen = {kind: configs.filter_configs(kind, configs.candidate_configs(kind, "consumer"),
                                           configs.SMEM_CONSUMER, D, 2)[0]
              for kind in ("fwd", "dkdv", "dq")}
    check_case(Case(1, 70, 2, 1, D, F16), tiles=chosen)


def test_query_tiles_taller_than_key_tiles_in_the_backward():
    """dK/dV and dQ with BLOCK_M > BLOCK_N and the reverse (the diagonal ranges differ)."""
    tiles = {"fwd": configs.TileConfig(16, 32, 4, 1), "dkdv": configs.TileConfig(32, 16, 4, 1),
             "dq": configs.TileConfig(16, 32, 4, 1)}
    check_case(Case(2, 77, 2, 1, 32, torch.float32), tiles=tiles)
    check_case(Case(1, 70, 2, 2, 16, torch.float32, window=9), tiles=tiles)
    check_case(Case(2, 77, 2, 1, 32, torch.float32, dropout=0.3), tiles=tiles)
    check_case(Case(2, 77, 2, 1, 32, torch.float32, gate="strong"), tiles=tiles)
    check_case(Case(1, 70, 2, 2, 16, torch.float32, window=9, gate="fox"), tiles=tiles)


HOPPER_CANDIDATES = sorted({(kind, cfg) for kind in ("fwd", "dkdv", "dq")
                            for cfg in configs.candidate_configs(kind, "hopper")},
                           key=lambda kc: (kc[0], str(kc[1])))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind,cfg", HOPPER_CANDIDATES,
                         ids=[f"{k}-{c.BLOCK_M}x{c.BLOCK_N}-w{c.num_warps}-s{c.num_stages}"
                              for k, c in HOPPER_CANDIDATES])
@pytest.mark.parametrize("dropout,gate", [(0.0, None), (0.1, None), (0.0, "fox")], ids=["plain", "dropout", "gate"])
def test_every_hopper_candidate_config_is_correct_cuda(kind, cfg, dropout, gate):
    """Whatever the autotuner picks is right: each candidate, alone, at D=64 and D=128. With
    dropout or a gate a candidate may not fit the card (the autotuner skips those); every one that
    runs must be right, and the first fitting one (what runs without tuning) must run."""
    from triton.runtime.errors import OutOfResources

    for D in (64, 128):
        kept = configs.filter_configs(kind, configs.candidate_configs(kind, "hopper"),
                                      configs.SMEM_HOPPER, D, 2)
        if cfg not in kept:
            continue  # pruned at this head dim, never launched there
        hopper = configs.describe_device(torch.cuda.current_device()).as_family("hopper")
        chosen = {k: configs.shortlist(k, hopper, 2, D)[0] for k in ("fwd", "dkdv", "dq")}
        chosen[kind] = cfg
        try:
            check_case(Case(2, 300, 4, 2, D, BF16, dropout=dropout, gate=gate), tiles=chosen)
        except OutOfResources:
            if not (dropout or gate) or cfg == kept[0]:
                raise


@gpu
@pytest.mark.gpu
def test_dropout_under_cuda_graph_capture_draws_fresh_bits_each_replay_cuda():
    """A captured step replays with a new RNG state each time (torch's CUDA generator advances its
    offset on every replay) and computes exactly what an eager call with that state computes; the
    public function, captured, also changes its output from replay to replay."""
    from kernels.flash_attention.function import FlashAttnFunction, op_options

    q, k, v, do, _ = make_inputs(Case(2, 300, 4, 2, 64, BF16))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def attend(rng):
        o = FlashAttnFunction.apply(q, k, v, None, rng, None, op_options(0, 0, 64 ** -0.5, True, 0, 0.1), False)
        return o, torch.autograd.grad(o, (q, k, v), do)

    def step():
        rng = draw_dropout_rng(q.device)
        return rng, *attend(rng), flash_attn(q, k, v, dropout_p=0.1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        rng, o, grads, o_public = static
        replays.append((rng.clone(), o.clone(), [g.clone() for g in grads], o_public.clone()))
    (rng1, o1, _, public1), (rng2, o2, _, public2) = replays
    assert not torch.equal(rng1, rng2) and not torch.equal(o1, o2) and not torch.equal(public1, public2)
    for rng, o, grads, _ in replays:
        o_eager, grads_eager = attend(rng)
        assert torch.equal(o, o_eager)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_eager))
