"""Every backend of the table agrees with a float64 reference: outputs and gradients, GQA, windows,
documents (each where its row says it computes them), on the devices the row lists (flash on a GPU;
its emulated CPU runs are test_flash_kernel.py's)."""
import math

import pytest
import torch

from conftest import backend_params, device_for
from model.attention import BACKENDS, build_attention, hybrid, naive, tiled
from model.attention.masks import cu_seqlens_from_doc_ids
from model.config import AttentionConfig


def reference_probs(q, k, doc_ids=None, window=None):
    """Float64 attention probabilities (B, H, T, T) with K repeated per query head and an explicit mask."""
    q, k = q.double(), k.double()
    B, T, H, D = q.shape
    k = k.repeat_interleave(H // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    mask = (j <= i).expand(B, 1, T, T)
    if window is not None:
        mask = mask & (i - j < window)
    if doc_ids is not None:
        mask = mask & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def reference(q, k, v, doc_ids=None, window=None):
    """Float64 attention, shapes as the backends: q (B, T, H, D), k and v (B, T, H_kv, D)."""
    v = v.double().repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhqk,bkhd->bqhd", reference_probs(q, k, doc_ids, window), v)


def random_doc_ids(B, T, gen):
    """Non-decreasing document index per row with a few random boundaries."""
    starts = torch.rand(B, T, generator=gen) < 0.08
    starts[:, 0] = False
    return starts.cumsum(dim=1).to(torch.int32)


CASES = [
    # B, T, H, H_kv, D, window, documents
    pytest.param(2, 1, 2, 2, 16, None, False, id="B2-T1-H2-HKV2-D16"),
    pytest.param(2, 17, 4, 4, 32, None, False, id="B2-T17-H4-HKV4-D32"),
    pytest.param(1, 64, 4, 2, 16, None, False, id="B1-T64-H4-HKV2-D16"),
    pytest.param(2, 100, 4, 1, 24, None, False, id="B2-T100-H4-HKV1-D24"),
    pytest.param(2, 130, 2, 2, 16, 20, False, id="B2-T130-H2-HKV2-D16-W20"),
    pytest.param(2, 90, 4, 2, 16, None, True, id="B2-T90-H4-HKV2-D16-docs"),
    pytest.param(1, 75, 2, 1, 16, 9, True, id="B1-T75-H2-HKV1-D16-W9-docs"),
]


@pytest.mark.parametrize("backend", backend_params(emulated_too=False))
@pytest.mark.parametrize("B,T,H,Hkv,D,window,docs", CASES)
def test_backend_matches_reference(backend, B, T, H, Hkv, D, window, docs):
    row = BACKENDS[backend]
    if (window and not row.window) or (docs and not row.documents):
        pytest.skip(f"{backend}'s row says it does not compute this")
    gen = torch.Generator().manual_seed(T * 31 + H)
    q, k, v = (torch.randn(B, T, h, D, generator=gen) for h in (H, Hkv, Hkv))
    doc_ids = random_doc_ids(B, T, gen) if docs else None
    grad_out = torch.randn(B, T, H, D, generator=gen)
    device = torch.device(device_for(backend))
    attend, name = build_attention(AttentionConfig(name=backend, block_size=32, window=window, strict=True), device)
    assert name == backend

    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, doc_ids=None if doc_ids is None else doc_ids.to(device))
    ref = reference(q, k, v, doc_ids, window)
    assert out.shape == (B, T, H, D)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-5, rtol=2e-5)

    got = torch.autograd.grad(out, leaves, grad_out.to(device))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference(*leaves, doc_ids, window), leaves, grad_out.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w.double(), atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("block_size", [1, 7, 64, 1000])
def test_hybrid_block_size_does_not_change_the_result(block_size):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 50, 2, 16, generator=gen) for _ in range(3))
    hybrid, _ = build_attention(AttentionConfig(name="hybrid", block_size=block_size), torch.device("cpu"))
    naive, _ = build_attention(AttentionConfig(name="naive"), torch.device("cpu"))
    torch.testing.assert_close(hybrid(q, k, v), naive(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", backend_params(emulated_too=False))
def test_strided_inputs_from_a_fused_projection(backend):
    """The model hands views of one (B, T, H + 2 H_kv, D) tensor; no backend may assume contiguity."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 33, 4 + 2 * 2, 16, generator=gen)
    ref = reference(*qkv.split([4, 2, 2], dim=2))
    device = torch.device(device_for(backend))
    attend, _ = build_attention(AttentionConfig(name=backend, block_size=8, strict=True), device)
    q, k, v = qkv.to(device).split([4, 2, 2], dim=2)
    torch.testing.assert_close(attend(q, k, v).double().cpu(), ref, atol=2e-5, rtol=2e-5)


def test_cu_seqlens_from_doc_ids_ends_documents_at_rows_too():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    cu_seqlens, max_seqlen = cu_seqlens_from_doc_ids(doc_ids)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 5, 6, 7, 12]
    assert max_seqlen == 5
    assert cu_seqlens_from_doc_ids(torch.zeros(2, 4, dtype=torch.int32))[0].tolist() == [0, 4, 8]


def test_flash_falls_back_to_sdpa_with_one_warning_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.warns(UserWarning, match="attention=flash cannot run"):
        _, name = build_attention(AttentionConfig(name="flash"), torch.device("cpu"))
    assert name == "sdpa"


def test_flash_strict_fails_clearly_on_cpu(monkeypatch):
    from errors import UserError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match="attention.strict"):
        build_attention(AttentionConfig(name="flash", strict=True), torch.device("cpu"))


# --- the blockwise backends called directly: hybrid (any block rule) and tiled ---------------------

BLOCKWISE = {
    "hybrid-auto": lambda *a, **kw: hybrid.attend(*a, **kw),
    "hybrid-7": lambda *a, **kw: hybrid.attend(*a, block_size=7, **kw),
    "tiled-16x8": lambda *a, **kw: tiled.attend(*a, block_q=16, block_k=8, **kw),
    "tiled-13x32": lambda *a, **kw: tiled.attend(*a, block_q=13, block_k=32, **kw),
}
TOLERANCE = {torch.float32: 5e-5, torch.float64: 1e-10}


@pytest.fixture
def small_hybrid_budget(monkeypatch):
    """A budget so small that hybrid's own rule cuts these short sequences into unequal blocks."""
    monkeypatch.setattr(hybrid, "SCORE_BUDGET_BYTES", 4096)


@pytest.mark.usefixtures("small_hybrid_budget")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("backend", list(BLOCKWISE))
@pytest.mark.parametrize("B,T,H,Hkv,D,window,docs", CASES)
def test_blockwise_backend_matches_reference(backend, B, T, H, Hkv, D, window, docs, dtype):
    gen = torch.Generator().manual_seed(T * 37 + H)
    q = torch.randn(B, T, H, D, generator=gen, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, T, Hkv, D, generator=gen, dtype=dtype, requires_grad=True) for _ in range(2))
    doc_ids = random_doc_ids(B, T, gen) if docs else None

    out = BLOCKWISE[backend](q, k, v, doc_ids=doc_ids, window=window)
    ref = reference(q, k, v, doc_ids, window)
    assert out.shape == (B, T, H, D) and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)

    grad_out = torch.randn(B, T, H, D, generator=gen, dtype=dtype)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref, (q, k, v), grad_out.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["hybrid-auto", "tiled-16x8"])
def test_blockwise_backends_in_bf16_are_as_close_as_naive(backend):
    """In bf16 (CPU) the error against float64 stays within twice naive's own: the low-precision reference."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 70, h, 32, generator=gen).bfloat16().requires_grad_() for h in (4, 2, 2))
    grad_out = torch.randn(2, 70, 4, 32, generator=gen).bfloat16()
    ref = reference(q, k, v, window=40)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), grad_out.double()))

    def errors(attend):
        out = attend(q, k, v, window=40)
        got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
        return [((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want)]

    for err, naive_err in zip(errors(BLOCKWISE[backend]), errors(naive.attend)):
        assert err <= 2 * naive_err + 1e-6, (err, naive_err)


def test_blockwise_backends_take_strided_inputs():
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 33, 4 + 2 * 2, 16, generator=gen)
    q, k, v = qkv.split([4, 2, 2], dim=2)
    for attend in BLOCKWISE.values():
        torch.testing.assert_close(attend(q, k, v).double(), reference(q, k, v), atol=2e-5, rtol=2e-5)


def spans_are_a_partition(spans, T):
    return spans[0][0] == 0 and spans[-1][1] == T and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("T,block_size,expected", [
    (1, 64, [(0, 1)]),  # T smaller than a block
    (10, 64, [(0, 10)]),
    (100, 32, [(0, 32), (32, 64), (64, 96), (96, 100)]),  # T not a multiple: the last block is short
    (64, 64, [(0, 64)]),
    (5, 1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
])
def test_forced_block_size(T, block_size, expected):
    assert hybrid.query_blocks(T, heads=48, itemsize=2, block_size=block_size) == expected


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200, 1000, 2048, 4099, 8192])
@pytest.mark.parametrize("heads,itemsize,window", [(48, 2, None), (12, 2, None), (192, 4, None), (12, 2, 512),
                                                   (1536, 2, 128)])
def test_auto_blocks_fit_the_budget(T, heads, itemsize, window):
    spans = hybrid.query_blocks(T, heads, itemsize, window)
    assert spans_are_a_partition(spans, T)

    def fits(rows, end):
        keys = min(end, rows + (window or end) - 1)
        return heads * rows * keys * itemsize <= hybrid.SCORE_BUDGET_BYTES

    (start, end), later = spans[0], spans[1:]
    rows = end - start  # the first block: the rest, within the budget or holding under MIN_ROWS extra rows
    assert fits(rows, end) or fits(rows - hybrid.MIN_ROWS, end) or rows < 2 * hybrid.MIN_ROWS
    for start, end in later:  # the others: whole multiples, at least MIN_ROWS, within the budget unless at MIN_ROWS
        rows = end - start
        assert rows % hybrid.ROW_MULTIPLE == 0 and rows >= hybrid.MIN_ROWS
        assert rows == hybrid.MIN_ROWS or fits(rows, end)


def test_auto_blocks_documented_examples():
    assert len(hybrid.query_blocks(2048, heads=48, itemsize=2)) == 8
    assert hybrid.query_blocks(2048, heads=48, itemsize=2)[-1] == (1888, 2048)
    assert hybrid.query_blocks(2048, heads=12, itemsize=2) == [(0, 368), (368, 1376), (1376, 2048)]
    assert hybrid.query_blocks(256, heads=32 * 6, itemsize=2) == [(0, 256)]  # model=small: one block
    # Equal areas: far fewer blocks than equal heights at the last block's height, for the same peak.
    spans = hybrid.query_blocks(8192, heads=12, itemsize=2)
    last_rows = spans[-1][1] - spans[-1][0]
    assert len(spans) < 0.6 * 8192 / last_rows


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def peak_mb_of_fwd_bwd(attend, B, H, T, D, dtype=torch.bfloat16):
    """Peak CUDA memory (MB) above the inputs of one forward+backward at q, k, v: (B, T, H, D)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=gen, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out)  # warm-up: cuBLAS workspaces are not the backend's
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("B", [1, 4])
def test_hybrid_needs_less_than_half_of_naives_memory_on_the_gpu(B):
    """Issue 17's memory target at (B, 12, 2048, 64), bf16, forward+backward."""
    hybrid_mb = peak_mb_of_fwd_bwd(hybrid.attend, B, 12, 2048, 64)
    naive_mb = peak_mb_of_fwd_bwd(naive.attend, B, 12, 2048, 64)
    assert hybrid_mb * 2 <= naive_mb, (hybrid_mb, naive_mb)


@pytest.mark.gpu
@needs_cuda
def test_hybrid_keeps_its_softmax_in_bf16_under_cuda_autocast():
    """CUDA autocast runs a softmax without an explicit dtype in fp32: that would triple what autograd keeps."""
    plain = peak_mb_of_fwd_bwd(hybrid.attend, 2, 12, 1024, 64)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        autocast = peak_mb_of_fwd_bwd(hybrid.attend, 2, 12, 1024, 64)
    assert autocast <= 1.05 * plain, (autocast, plain)
