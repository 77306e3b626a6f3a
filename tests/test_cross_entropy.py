"""The softmax cross-entropy kernel (kernels/cross_entropy) against its PyTorch reference, and the
language-model loss that uses it.

Without CUDA the kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1) on
small shapes. The interpreter casts fp32 to bf16 by truncation, not round-to-nearest as the GPU
does; both stay within one bf16 step of the reference, which is what the tests allow.
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.cross_entropy import capped_logits, softmax_cross_entropy_, softmax_cross_entropy_ref, softmax_xent_launch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# Gradient tolerance (rtol, atol) per dtype: the kernel's exp2 and the reference's exp can differ in
# the last fp32 bit, which may round a 16-bit value one step apart (relative step: 2^-10 for fp16,
# 2^-7 at worst for bf16, whose significand has 8 bits). On CPU the interpreter truncates to bf16:
# also less than one step.
GRAD_TOL = {torch.float32: (0.0, 1e-6), torch.float16: (2 ** -10, 1e-6), torch.bfloat16: (2 ** -7, 1e-6)}


def run_kernel(logits, targets, softcap=None, **launch):
    grad = logits.clone()
    loss = softmax_xent_launch(grad, targets, softcap, **launch) if launch else softmax_cross_entropy_(grad, targets, softcap)
    return loss, grad


def random_case(n, V, dtype, scale=3.0, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = (scale * torch.randn(n, V, generator=gen, device=DEVICE)).to(dtype)
    targets = torch.randint(0, V, (n,), generator=gen, device=DEVICE)
    return logits, targets


def assert_matches_reference(logits, targets, softcap=None, **launch):
    """Loss and gradient against the reference; with a cap s, the kernel's tanh (from exp2, about 2^-24
    off near 0) is off by up to s * 2^-23 in a capped logit, and so in the loss and the gradient."""
    loss, grad = run_kernel(logits, targets, softcap, **launch)
    ref_loss, ref_grad = softmax_cross_entropy_ref(logits, targets, softcap)
    cap_atol = (softcap or 0.0) * 2 ** -23
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=max(2e-6, cap_atol))
    assert grad.dtype == logits.dtype
    rtol, atol = GRAD_TOL[logits.dtype]
    atol = max(atol, cap_atol)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, V", [(1, 1), (3, 5), (17, 127), (3, 1000), (2, 4099)])
def test_kernel_matches_the_reference(n, V, dtype):
    assert_matches_reference(*random_case(n, V, dtype, seed=n * V))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softcap", [15.0, 2.0, 40.0, 60.0])
def test_the_soft_capped_kernel_matches_the_reference(dtype, softcap):
    """model.logit_softcap inside the kernel: the loss of s * tanh(x / s) and its gradient with respect
    to the raw logits x, against the reference's autograd (logits up to 8x the cap of 2); caps up to
    FIXED_SHIFT_MAX_CAP sum exp(c - s), larger ones keep a running max."""
    assert_matches_reference(*random_case(17, 127, dtype, scale=5.0, seed=7), softcap=softcap)


def test_a_soft_cap_over_several_tiles_and_extreme_logits():
    logits, targets = random_case(3, 20000, torch.float32, scale=30.0)
    assert_matches_reference(logits, targets, softcap=15.0, block_v=4096, num_warps=8)
    extreme = torch.tensor([[1e4, -1e4, 0.0, 5.0], [-1e4] * 4, [30.0, 30.0, -30.0, 80.0]], device=DEVICE)
    y = torch.tensor([0, 2, 3], device=DEVICE)
    for cap in (15.0, 40.0, 100.0):  # 40: exp(-2 * 40) of every logit at -cap is still a normal float32
        loss, grad = run_kernel(extreme, y, cap)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        assert_matches_reference(extreme, y, softcap=cap)


def test_several_tiles_per_row_and_other_launch_shapes():
    logits, targets = random_case(3, 20000, torch.float32)
    for block_v, num_warps in ((4096, 8), (1024, 4), (16384, 16)):
        assert_matches_reference(logits, targets, block_v=block_v, num_warps=num_warps)


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0, 5.0], [-1e4, -1e4, -1e4, -1e4], [30.0, 30.0, -30.0, 80.0]],
                          device=DEVICE)
    targets = torch.tensor([0, 2, 3], device=DEVICE)  # row 0 and row 2: the target holds the max
    loss, grad = run_kernel(logits, targets)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert_matches_reference(logits, targets)


def test_rows_with_a_stride_are_read_and_written_in_place():
    wide, targets = random_case(4, 300, torch.float32)
    rows = wide[:, :200]  # row stride 300, unit stride along the vocabulary
    ref_loss, ref_grad = softmax_cross_entropy_ref(rows.clone(), targets % 200)
    before_tail = wide[:, 200:].clone()
    loss = softmax_cross_entropy_(rows, targets % 200)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(rows, ref_grad, rtol=0, atol=1e-6)
    assert torch.equal(wide[:, 200:], before_tail)


def test_autograd_refuses_a_saved_tensor_the_kernel_overwrote():
    """The op bumps the logits' version counter (kernels/ops.py), so a backward through a tensor
    the kernel wrote over raises instead of using the gradient in its place."""
    logits, targets = random_case(3, 5, torch.float32)
    x = logits.clone().requires_grad_()
    y = x.exp()  # saves y for its backward
    with torch.no_grad():
        softmax_cross_entropy_(y, targets)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("logits, targets, message", [
    (torch.zeros(4), torch.zeros(4, dtype=torch.long), "must be \\(n, V\\)"),
    (torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.long), "float32, float16 or bfloat16"),
    (torch.zeros(3, 2).t(), torch.zeros(2, dtype=torch.long), "contiguous along the vocabulary"),
    (torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), "targets must be \\(2,\\) int64"),
    (torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32), "targets must be \\(2,\\) int64"),
    (torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), "softcap must be positive or None; got 0.0"),
])
def test_bad_inputs_are_refused_with_what_was_expected(logits, targets, message):
    with pytest.raises(ValueError, match=message):
        softmax_cross_entropy_(logits, targets, 0.0 if "softcap" in message else None)


def loss_and_grads(loss_fn, h, w, y, autocast=False):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(h, w, y)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.fixture
def kernel_in_the_loss(monkeypatch):
    """On CPU the loss takes PyTorch's path; make it take the kernel's (interpreted) one."""
    import model.loss

    monkeypatch.setattr(model.loss, "fused_cross_entropy_available", lambda logits: logits.dtype != torch.float64)


def lm_case(seed=0, V=300):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    h = torch.randn(2, 24, 16, generator=gen, device=DEVICE)
    w = 0.5 * torch.randn(V, 16, generator=gen, device=DEVICE)
    return h, w, torch.randint(0, V, (2, 24), generator=gen, device=DEVICE)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_lm_loss_through_the_kernel_equals_cross_entropy_with_gradients(kernel_in_the_loss, softcap):
    from model.loss import lm_loss

    h, w, y = lm_case()
    got = loss_and_grads(lambda h, w, y: lm_loss(h, w, y, chunk=20, softcap=softcap), h, w, y)
    want = loss_and_grads(lambda h, w, y: F.cross_entropy(capped_logits(h @ w.T, softcap).view(-1, w.shape[0]), y.view(-1)),
                          h, w, y)
    for mine, ref in zip(got, want):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)


def test_the_pytorch_path_caps_like_the_kernel():
    """model/loss.py's own path (CPU, or no Triton): loss, gradients and the no-gradient evaluation of
    the capped logits, in float64 (the path is the same under torch.compile with a cap)."""
    from model.loss import lm_loss

    h, w, y = (t.double() if t.is_floating_point() else t for t in lm_case(seed=3))
    got = loss_and_grads(lambda h, w, y: lm_loss(h, w, y, chunk=20, softcap=2.0), h, w, y)
    want = loss_and_grads(lambda h, w, y: F.cross_entropy(capped_logits(h @ w.T, 2.0).view(-1, w.shape[0]), y.view(-1)),
                          h, w, y)
    for mine, ref in zip(got, want):
        torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(lm_loss(h, w, y, chunk=20, softcap=2.0), want[0], rtol=1e-10, atol=1e-12)


def test_lm_loss_through_the_kernel_compiles_without_graph_break(kernel_in_the_loss):
    from model.loss import lm_loss

    h, w, y = lm_case(seed=1)

    def loss_fn(h, w, y):
        return lm_loss(h, w, y, chunk=20)

    explained = torch._dynamo.explain(loss_fn)(h.clone().requires_grad_(), w.clone().requires_grad_(), y)
    assert explained.graph_break_count == 0, explained.break_reasons
    backend = "inductor" if CUDA else "aot_eager"  # inductor on CPU would spend ~20 s in g++
    compiled = loss_and_grads(torch.compile(loss_fn, fullgraph=True, backend=backend), h, w, y)
    eager = loss_and_grads(loss_fn, h, w, y)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("softcap", [None, 15.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt2_sized_chunk_on_the_gpu(dtype, softcap):
    assert_matches_reference(*random_case(4096, 50304, dtype, scale=2.0), softcap=softcap)


@needs_cuda
def test_the_loss_uses_the_kernel_on_the_gpu_and_matches_pytorch_under_autocast(monkeypatch):
    """Under bf16 autocast: the kernel path, eager and compiled, against the PyTorch path."""
    import model.loss
    from model.loss import lm_loss

    h, w, y = lm_case(seed=2, V=5000)
    calls = []
    real = model.loss.softmax_cross_entropy_
    monkeypatch.setattr(model.loss, "softmax_cross_entropy_", lambda *a: calls.append(1) or real(*a))
    fused = loss_and_grads(lambda h, w, y: lm_loss(h, w, y, chunk=20), h, w, y, autocast=True)
    assert calls
    compiled = loss_and_grads(torch.compile(lambda h, w, y: lm_loss(h, w, y, chunk=20), fullgraph=True), h, w, y,
                              autocast=True)
    for a, b in zip(compiled, fused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(model.loss, "fused_cross_entropy_available", lambda logits: False)
    plain = loss_and_grads(lambda h, w, y: lm_loss(h, w, y, chunk=20), h, w, y, autocast=True)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=1e-6)
    for mine, ref in zip(fused[1:], plain[1:]):
        assert ((mine - ref).norm() / ref.norm()).item() < 1e-3  # bf16 gradients, one rounding apart
