"""Attention dropout in the PyTorch backends (naive, hybrid, tiled, sdpa), on CPU, and in the model.

The mask a backend drew is read back exactly: with V the identity (D >= T) the output row of a
query is its row of dropped, rescaled probabilities. The same seed then reruns with real inputs,
and the result is held against a float64 reference that applies that very mask.

In the model (every backend of the table, flash under Triton's interpreter without a GPU): the
attention layer passes dropout_p in training only, so evaluation is deterministic, and a short run
with attention dropout trains.
"""
import dataclasses

import pytest
import torch

from conftest import check_a_short_run_learns, device_for, emulated, tiny_config
from errors import UserError
from model import GPT, ModelConfig
from model.attention import BACKENDS as TABLE, Attention, build_attention, hybrid, naive, sdpa, tiled
from model.config import AttentionConfig
from test_attention_backends import random_doc_ids, reference_probs
from training.config import validate

BACKENDS = {
    "naive": naive.attend,
    "hybrid-auto": hybrid.attend,
    "hybrid-7": lambda *a, **kw: hybrid.attend(*a, block_size=7, **kw),
    "tiled-8x8": lambda *a, **kw: tiled.attend(*a, block_q=8, block_k=8, **kw),
    "sdpa": sdpa.attend,
}
P = 0.3
# B, T, H, H_kv, window, documents; D = 32 >= T so that V can be the identity
CASES = [
    pytest.param(2, 24, 4, 2, None, False, id="B2-T24-H4-HKV2"),
    pytest.param(2, 29, 2, 1, 9, True, id="B2-T29-H2-HKV1-W9-docs"),
]
D = 32


def inputs(B, T, H, Hkv, docs, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen, dtype=dtype)
    k, v = (torch.randn(B, T, Hkv, D, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v, random_doc_ids(B, T, gen) if docs else None


def dropped_probs(attend, q, k, doc_ids, window, seed):
    """The probabilities (B, H, T, T) after ``attend``'s dropout under ``seed``, read with V = identity."""
    B, T, Hkv = k.shape[0], k.shape[1], k.shape[2]
    eye = torch.zeros(B, T, Hkv, D, dtype=q.dtype)
    eye[:, torch.arange(T), :, torch.arange(T)] = 1.0
    torch.manual_seed(seed)
    return attend(q, k, eye, doc_ids=doc_ids, window=window, dropout_p=P)[..., :T].transpose(1, 2)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("B,T,H,Hkv,window,docs", CASES)
def test_dropout_drops_only_visible_probabilities_and_rescales_the_rest(backend, B, T, H, Hkv, window, docs):
    q, k, _, doc_ids = inputs(B, T, H, Hkv, docs)
    probs = reference_probs(q, k, doc_ids, window)
    dropped = dropped_probs(BACKENDS[backend], q, k, doc_ids, window, seed=1)
    visible = probs > 0
    kept = (dropped != 0) & visible
    assert torch.equal(dropped[~visible], torch.zeros_like(dropped[~visible]))  # nothing masked comes back
    torch.testing.assert_close(dropped[kept], probs[kept] / (1 - P), atol=1e-12, rtol=1e-12)
    n = visible.sum().item()
    fraction = kept.sum().item() / n
    assert abs(fraction - (1 - P)) < 5 * (P * (1 - P) / n) ** 0.5, fraction  # binomial, 5 standard deviations


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("B,T,H,Hkv,window,docs", CASES)
def test_dropout_output_and_gradients_match_float64_with_the_same_mask(backend, B, T, H, Hkv, window, docs):
    q, k, v, doc_ids = inputs(B, T, H, Hkv, docs)
    dropped = dropped_probs(BACKENDS[backend], q, k, doc_ids, window, seed=2)
    keep = (dropped != 0).double() / (1 - P)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.manual_seed(2)
    out = BACKENDS[backend](q, k, v, doc_ids=doc_ids, window=window, dropout_p=P)
    ref = torch.einsum("bhqk,bkhd->bqhd", reference_probs(q, k, doc_ids, window) * keep,
                       v.repeat_interleave(H // Hkv, dim=2))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref, (q, k, v), grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_zero_dropout_is_bitwise_no_dropout_and_a_seed_repeats(backend):
    attend = BACKENDS[backend]
    q, k, v, _ = inputs(2, 24, 4, 2, docs=False, dtype=torch.float32)
    q.requires_grad_()
    plain = attend(q, k, v)
    zero = attend(q, k, v, dropout_p=0.0)
    assert torch.equal(plain, zero)
    assert torch.equal(*(torch.autograd.grad(o.sum(), q)[0] for o in (plain, zero)))

    def run(seed):
        torch.manual_seed(seed)
        o = attend(q, k, v, dropout_p=P)
        return o, torch.autograd.grad(o.sum(), q)[0]

    first, again, other = run(7), run(7), run(8)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_expectation_over_seeds_is_the_output_without_dropout(backend):
    """The mean over N seeds is within 5 standard errors of the no-dropout output at every element.

    An output element sums p_j v_j m_j / (1 - P) over keys j with independent m_j ~ Bernoulli(1 - P),
    so its variance is P / (1 - P) * sum_j p_j^2 v_j^2. (The 1 / (1 - P) scale itself is pinned
    exactly by the tests above.)
    """
    B, T, H, Hkv, n_seeds = 1, 16, 2, 1, 200
    q, k, v, _ = inputs(B, T, H, Hkv, docs=False)
    attend = BACKENDS[backend]
    mean = sum(_seeded(attend, q, k, v, seed) for seed in range(n_seeds)) / n_seeds
    probs = reference_probs(q, k)  # (B, H, T, T)
    variance = P / (1 - P) * torch.einsum("bhqk,bkhd->bqhd", probs**2, v.repeat_interleave(H // Hkv, dim=2) ** 2)
    z = (mean - attend(q, k, v)) / (variance / n_seeds).sqrt()
    assert z.abs().max() < 5, z.abs().max()


def _seeded(attend, q, k, v, seed):
    torch.manual_seed(seed)
    return attend(q, k, v, dropout_p=P)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_no_future_key_leaks_under_dropout(backend):
    """The output at position t has exactly zero gradient with respect to k and v after t."""
    q, k, v, _ = inputs(2, 24, 4, 2, docs=False, dtype=torch.float32)
    k, v = k.requires_grad_(), v.requires_grad_()
    torch.manual_seed(3)
    out = BACKENDS[backend](q, k, v, dropout_p=0.5)
    for t in (0, 5, 17):
        dk, dv = torch.autograd.grad(out[:, t].sum(), (k, v), retain_graph=True)
        assert torch.equal(dk[:, t + 1:], torch.zeros_like(dk[:, t + 1:]))
        assert torch.equal(dv[:, t + 1:], torch.zeros_like(dv[:, t + 1:]))
        assert dv[:, : t + 1].abs().sum() > 0


class RecordingAttention:
    """Stands in for a backend (plain and packed): answers zeros and records the options of each call."""

    def __init__(self):
        self.calls = []

    def attend(self, q, k, v, doc_ids=None, **options):
        self.calls.append(options)
        return torch.zeros_like(q)

    def packed(self, qkv, n_head, doc_ids=None, **options):
        self.calls.append(options)
        return qkv.new_zeros(*qkv.shape[:2], n_head, qkv.shape[3])


def small_gpt(attention, **model_kw) -> GPT:
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, **model_kw)
    return GPT(cfg, attention)


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("dropout, attention_dropout, passed", [
    (0.2, None, 0.2),  # model.dropout drops attention probabilities too
    (0.2, 0.05, 0.05),  # unless model.attention_dropout says otherwise
    (0.0, 0.3, 0.3),
    (0.2, 0.0, None),  # 0: the backend is called without the option
    (0.0, None, None),
])
def test_the_attention_receives_dropout_p_only_in_training(packed, dropout, attention_dropout, passed):
    recorder = RecordingAttention()
    attention = Attention("recording", recorder.attend, recorder.packed if packed else None)
    model = small_gpt(attention, dropout=dropout, attention_dropout=attention_dropout)
    x = torch.randint(0, 64, (2, 16))
    model(x, x)
    assert recorder.calls == [{"dropout_p": passed} if passed is not None else {}] * 2  # one call per layer
    recorder.calls.clear()
    model.eval()
    model(x, x)
    model.generate(x[:, :4], 2)
    assert recorder.calls == [{}] * 2 * 2  # evaluation and sampling's prefill never drop (its decode step reads the KV cache)


def built(name: str) -> Attention:
    attention, ran = build_attention(AttentionConfig(name=name, strict=True), torch.device(device_for(name)))
    assert ran == name
    return attention


@pytest.mark.parametrize("name", list(TABLE))
def test_evaluation_with_dropout_is_deterministic_and_equals_no_dropout(name):
    """Eval mode: the same loss twice, bitwise the loss of the same weights built without dropout;
    training mode with attention dropout only: the loss changes from call to call."""
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)).to(device_for(name))
    losses = {}
    for p in (0.0, 0.5):
        torch.manual_seed(0)
        model = small_gpt(built(name), dropout=0.0, attention_dropout=p).to(device_for(name))
        model.eval()
        with torch.no_grad():
            losses[p] = [model(x, x)[1] for _ in range(2)]
    assert torch.equal(losses[0.5][0], losses[0.5][1]) and torch.equal(losses[0.5][0], losses[0.0][0])
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(x, x)[1], model(x, x)[1])


@pytest.mark.parametrize("name", list(TABLE))
def test_a_run_with_attention_dropout_trains_with_every_backend(tmp_path, data_cache, name):
    """Only attention dropout (p = 0.3): every loss finite, and the loss falls. fp32 on CPU; flash
    there runs under Triton's interpreter (about 1.5 s a step), so for 8 steps of 2 sequences."""
    steps, batch, drop = (8, 2, 0.2) if emulated(name) else (30, 8, 0.3)
    check_a_short_run_learns(tmp_path, data_cache, name, steps, batch, drop, attention_dropout=0.3)


def test_attention_dropout_is_checked_against_the_backend_and_its_range(monkeypatch, data_cache):
    cfg = tiny_config(data_cache)
    cfg.model.attention_dropout = 1.0
    with pytest.raises(UserError, match=r"^model.attention_dropout=1.0 must be in \[0, 1\)"):
        validate(cfg)
    from model import attention

    table = dict(TABLE, plain=dataclasses.replace(TABLE["naive"], name="plain", dropout=False))
    monkeypatch.setattr(attention, "BACKENDS", table)
    cfg = tiny_config(data_cache)
    cfg.attention.name = "plain"
    with pytest.raises(UserError, match=r"^attention=plain cannot run with model.dropout=0.1 \(attention dropout\); "
                                        r"backends that can: naive, hybrid, tiled, sdpa, flash$"):
        validate(cfg)
    cfg.model.attention_dropout = 0.0  # dropout elsewhere only: any backend
    validate(cfg)
