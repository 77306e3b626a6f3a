"""naive, hybrid and sdpa agree with a float64 reference: outputs and gradients, GQA, windows, documents."""
import math

import pytest
import torch

from model.attention import build_attention
from model.attention.masks import cu_seqlens_from_doc_ids
from model.config import AttentionConfig

BACKENDS = ["naive", "hybrid", "sdpa"]


def reference(q, k, v, doc_ids=None, window=None):
    """Float64 attention with K/V repeated per query head and an explicit mask. Shapes as the backends."""
    q, k, v = (x.double() for x in (q, k, v))
    B, T, H, D = q.shape
    group = H // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    mask = (j <= i).expand(B, 1, T, T)
    if window is not None:
        mask = mask & (i - j < window)
    if doc_ids is not None:
        mask = mask & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,T,H,Hkv,D,window,docs", CASES)
def test_backend_matches_reference(backend, B, T, H, Hkv, D, window, docs):
    gen = torch.Generator().manual_seed(T * 31 + H)
    q = torch.randn(B, T, H, D, generator=gen, requires_grad=True)
    k = torch.randn(B, T, Hkv, D, generator=gen, requires_grad=True)
    v = torch.randn(B, T, Hkv, D, generator=gen, requires_grad=True)
    doc_ids = random_doc_ids(B, T, gen) if docs else None
    attend, name = build_attention(AttentionConfig(name=backend, block_size=32, window=window), torch.device("cpu"))
    assert name == backend

    out = attend(q, k, v, doc_ids=doc_ids)
    ref = reference(q, k, v, doc_ids, window)
    assert out.shape == (B, T, H, D)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)

    grad_out = torch.randn(B, T, H, D, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref, (q, k, v), grad_out.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("block_size", [1, 7, 64, 1000])
def test_hybrid_block_size_does_not_change_the_result(block_size):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 50, 2, 16, generator=gen) for _ in range(3))
    hybrid, _ = build_attention(AttentionConfig(name="hybrid", block_size=block_size), torch.device("cpu"))
    naive, _ = build_attention(AttentionConfig(name="naive"), torch.device("cpu"))
    torch.testing.assert_close(hybrid(q, k, v), naive(q, k, v), atol=1e-5, rtol=1e-5)


def test_strided_inputs_from_a_fused_projection():
    """The model hands views of one (B, T, H + 2 H_kv, D) tensor; no backend may assume contiguity."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 33, 4 + 2 * 2, 16, generator=gen)
    q, k, v = qkv.split([4, 2, 2], dim=2)
    ref = reference(q, k, v)
    for backend in BACKENDS:
        attend, _ = build_attention(AttentionConfig(name=backend, block_size=8), torch.device("cpu"))
        torch.testing.assert_close(attend(q, k, v).double(), ref, atol=2e-5, rtol=2e-5)


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
