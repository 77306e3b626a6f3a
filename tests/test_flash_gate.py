"""The forget gate g of the flash kernels (kernels/flash_attention/gate.py): what the reference
match in test_flash_kernel.py (cases with ``gate=``) does not show on its own.

* g = 0 is the plain kernel (bit for bit under the interpreter);
* dg agrees with central finite differences of the kernel's own output;
* the precision does not depend on |c|: a huge first gate cancels in every c_i - c_j, and the
  kernel's error stays that of the gate-free problem (an fp32 cumulative sum's does not);
* documents of a packed batch restart c, and dg at each document's first token is ~0;
* the reference's gate bias is the sum of g over j < l <= i;
* the scan kernels (c = cumsum(g) as a hi/lo pair, dg = reverse cumsum of dc per sequence) match
  float64 torch, across several steps of their loop and for strided g.

Without CUDA the kernels run under the Triton interpreter (set up by test_flash_kernel.py, whose
helpers these tests share).
"""

from __future__ import annotations

import pytest
import torch

from test_flash_kernel import CUDA, DEVICE, F16, F32, Case, flash_attn, make_gate, make_inputs, max_err
from kernels import flash_attn_qkvpacked
from kernels.flash_attention.gate import SCAN_BLOCK, gate_cumsum, gate_grad
from kernels.flash_attention.reference import attention_ref, gate_bias

ZERO_CASES = [
    Case(2, 40, 4, 2, 32, F32),
    Case(1, 77, 2, 1, 48, F16, window=9),
    Case(1, 200, 2, 1, 32, F32, cu=(0, 5, 70, 71, 150, 200), dropout=0.2),
    Case(2, 33, 2, 2, 16, F16, causal=False),
]


def _run(c: Case, g: torch.Tensor | None, seed: int = 0):
    """o, lse and the gradients (dq, dk, dv[, dg]) of one flash call on ``c``'s inputs."""
    q, k, v, do, cu = make_inputs(c, seed)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)] + ([g.detach().requires_grad_()] if g is not None else [])
    torch.manual_seed(seed)
    o, lse = flash_attn(*inputs[:3], causal=c.causal, window_size=c.window, cu_seqlens=cu, dropout_p=c.dropout,
                        return_lse=True, g=inputs[3] if g is not None else None)
    return o, lse, torch.autograd.grad((o * do).sum() + lse.sum(), inputs)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise under the interpreter; on a GPU the gated kernel's scale-and-subtract may be fused
    into a multiply-add where the plain one rounds twice (or the reverse): within the default
    tolerances of the dtype there."""
    if CUDA:
        torch.testing.assert_close(a, b)
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in ZERO_CASES])
def test_zero_gate_is_the_plain_kernel(case):
    """c = 0 adds exact zeros to every score: o, lse, dq, dk, dv equal those without a gate."""
    o, lse, grads = _run(case, None)
    o0, lse0, grads0 = _run(case, torch.zeros(case.B, case.T, case.H, device=DEVICE))
    for a, b in zip((o, lse, *grads), (o0, lse0, *grads0[:3])):
        _same(a, b)
    assert grads0[3].shape == (case.B, case.T, case.H) and torch.isfinite(grads0[3]).all()


@pytest.mark.parametrize("cu", [None, (0, 17, 18, 40)], ids=["batch", "varlen"])
def test_gate_gradient_matches_finite_differences(cu):
    """<dg, u> equals (L(g + eps u) - L(g - eps u)) / (2 eps) for L = <o, do> + sum(lse), fp32."""
    c = Case(1, 40, 2, 1, 16, F32, cu=cu, gate="strong")
    g = make_gate(c)
    u = torch.randn(g.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    _, _, grads = _run(c, g)
    do = make_inputs(c)[3]

    def loss(gate):
        o, lse = _run(c, gate)[:2]
        return ((o * do).sum() + lse.sum()).double().item()

    eps = 1e-2
    numeric = (loss(g + eps * u) - loss(g - eps * u)) / (2 * eps)
    analytic = (grads[3].double() * u.double()).sum().item()
    assert abs(numeric - analytic) <= 1e-3 * abs(analytic) + 1e-4, (numeric, analytic)


def _errors(c: Case, g: torch.Tensor, dtype=None) -> dict[str, float]:
    """Max errors of o, lse, dq, dk, dv, dg against the float64 reference: of the kernel, or of
    the reference run in ``dtype`` (its float32 c = cumsum(g)) when given."""
    q, k, v, do, cu = make_inputs(c)
    kw = dict(causal=c.causal, window_size=c.window, cu_seqlens=cu)

    def ref(compute_dtype):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v, g)]
        o, lse = attention_ref(*ins[:3], compute_dtype=compute_dtype, g=ins[3], **kw)
        return (o, lse, *torch.autograd.grad((o * do.to(o.dtype)).sum() + lse.sum(), ins))

    truth = ref(torch.float64)
    if dtype is None:
        o, lse, grads = _run(c, g)
        out = (o, lse, *grads)
    else:
        out = ref(dtype)
    return {name: max_err(a, b) for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "dg"), out, truth)}


@pytest.mark.parametrize("case", [
    pytest.param(Case(1, 512, 1, 1, 16, F32, gate="strong"), id="T512-strong"),
    pytest.param(Case(1, 200, 2, 1, 32, F32, cu=(0, 60, 61, 200), gate="fox"), id="varlen-fox"),
])
def test_precision_does_not_depend_on_the_size_of_c(case):
    """A first gate of -3e4 in each sequence (as if ~20,000 tokens of strong decay came before)
    cancels in every c_i - c_j, so the answer is unchanged, and so must the kernel's error be (c
    is kept in float64 as an fp32 hi/lo pair, each program relative to its own block). The same
    shift makes a float32 cumulative sum, the plain way, ~100x worse: the test can fail."""
    g = make_gate(case)
    starts = [0] if case.cu is None else list(case.cu[:-1])
    shifted = g.clone()
    shifted[:, starts] -= 3e4
    plain, shift = _errors(case, g), _errors(case, shifted)
    for name in plain:
        assert shift[name] <= 2 * plain[name] + 1e-7, (name, plain[name], shift[name])
    naive = _errors(case, shifted, dtype=torch.float32)
    assert all(naive[name] > 100 * shift[name] for name in ("o", "lse", "dq")), (naive, shift)


def test_documents_restart_the_gate_and_their_first_gate_has_no_gradient():
    """A packed batch equals its documents run one by one (c restarts at each document); dg at a
    document's first token is 0 (g_bos enters no c_i - c_j), up to rounding."""
    cu = (0, 30, 31, 77)
    c = Case(1, 77, 2, 1, 32, F32, cu=cu, gate="fox")
    q, k, v, do, _ = make_inputs(c)
    g = make_gate(c)
    o, lse, (dq, dk, dv, dg) = _run(c, g)
    for a, b in zip(cu[:-1], cu[1:]):
        part = [t[:, a:b].detach().requires_grad_() for t in (q, k, v, g)]
        o_d, lse_d = flash_attn(*part[:3], g=part[3], return_lse=True)
        grads_d = torch.autograd.grad((o_d * do[:, a:b]).sum() + lse_d.sum(), part)
        torch.testing.assert_close(o[:, a:b], o_d, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse[:, :, a:b], lse_d, rtol=0, atol=1e-6)
        for full, mine in zip((dq, dk, dv, dg), grads_d):
            torch.testing.assert_close(full[:, a:b], mine, rtol=0, atol=2e-5)
    assert dg[:, list(cu[:-1])].abs().max() <= 1e-5 * dg.abs().max()


def test_reference_gate_bias_is_the_sum_of_gates_between_key_and_query():
    g = torch.randn(1, 9, 2, dtype=torch.float64)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    bias = gate_bias(g, cu, torch.float64)
    doc = torch.bucketize(torch.arange(9), cu[1:], right=True)
    for i in range(9):
        for j in range(9):
            if doc[i] != doc[j]:
                continue  # masked: never meet
            lo, hi = min(i, j), max(i, j)
            between = g[0, lo + 1:hi + 1].sum(0)  # (2,): sum of g_l over lo < l <= hi
            torch.testing.assert_close(bias[0, :, i, j], between if i >= j else -between)


def test_gqa_heads_sharing_kv_keep_their_own_gates():
    """Two query heads of one kv head, one gated, one not: each is what it would be alone."""
    c = Case(1, 50, 2, 1, 32, F32, gate="strong")
    q, k, v, _, _ = make_inputs(c)
    g = make_gate(c)
    g[..., 1] = 0.0
    o = flash_attn(q, k, v, g=g)
    alone = [flash_attn(q[:, :, h:h + 1], k, v, g=g[..., h:h + 1].contiguous()) for h in range(2)]
    for h in range(2):
        torch.testing.assert_close(o[:, :, h:h + 1], alone[h], rtol=0, atol=1e-6)
    assert not torch.allclose(o[:, :, :1], flash_attn(q[:, :, :1], k, v), atol=1e-3)


def test_qkvpacked_rejects_a_gate_of_the_wrong_shape():
    qkv = torch.randn(1, 8, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"g must be None or float32 log forget gates of shape \(B, T, H\) = \(1, 8, 4\)"):
        flash_attn_qkvpacked(qkv, 4, g=torch.zeros(1, 8, 8, device=DEVICE))



SCAN_T = 2 * SCAN_BLOCK + 37  # three steps of the scan loop, the last one partial


def test_gate_cumsum_is_the_float64_cumulative_sum_as_a_hi_lo_pair():
    """hi + lo (summed in float64) is cumsum(g) * log2(e) to ~1e-16 relative, hi is its fp32
    rounding, for g of any strides (here a (B, T, H) view of a (B, H, T) tensor)."""
    g = -torch.rand(2, 3, SCAN_T, generator=torch.Generator().manual_seed(0)).to(DEVICE).transpose(1, 2)
    hi, lo = gate_cumsum(g)
    truth = torch.cumsum(g.double(), dim=1).mul(1.4426950408889634).transpose(1, 2)
    assert hi.shape == lo.shape == (2, 3, SCAN_T) and hi.is_contiguous()
    torch.testing.assert_close(hi.double(), truth, rtol=2 ** -24, atol=0)  # hi: the fp32 rounding of c
    err = (hi.double() + lo.double() - truth).abs().max().item()
    assert err <= 1e-14 * truth.abs().max().item(), err


@pytest.mark.parametrize("cu", [None, (0, 5, 6, SCAN_BLOCK + 100, SCAN_T)], ids=["batch", "varlen"])
def test_gate_grad_is_the_reverse_cumulative_sum_within_each_sequence(cu):
    """dg_t = sum of dc_s over s >= t of t's sequence, to fp32 rounding of the float64 sum."""
    B = 2 if cu is None else 1
    dc = torch.randn(B, 3, SCAN_T, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    dg = gate_grad(dc, cu_seqlens)
    truth = torch.empty(B, 3, SCAN_T, dtype=torch.float64, device=DEVICE)
    bounds = (0, SCAN_T) if cu is None else cu
    for a, b in zip(bounds[:-1], bounds[1:]):
        truth[..., a:b] = dc[..., a:b].double().flip(-1).cumsum(-1).flip(-1)
    assert dg.shape == (B, SCAN_T, 3) and dg.is_contiguous()
    # fp32 rounding of the float64 sum (the kernel's scan adds in another order: ~1e-16 apart)
    torch.testing.assert_close(dg.double(), truth.transpose(1, 2), rtol=2 ** -24, atol=1e-13)
