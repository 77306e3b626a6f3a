"""attention=flash inside the GPT: same loss and gradients as sdpa, documents included.

Without CUDA the kernel runs under Triton's interpreter (set before anything imports Triton), on
fp32 and tiny shapes.
"""
import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from model import GPT, ModelConfig  # noqa: E402
from model.attention import build_attention  # noqa: E402
from model.config import AttentionConfig  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def twin_models(**model_kw):
    """The same GPT weights behind the flash and the sdpa backend."""
    model_kw = {"dropout": 0.0, **model_kw}
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=48, vocab_size=128, **model_kw)
    models = {}
    for name in ("flash", "sdpa"):
        attend, actual = build_attention(AttentionConfig(name=name, strict=True), DEVICE)
        assert actual == name
        torch.manual_seed(0)
        models[name] = GPT(cfg, attend).to(DEVICE)
    return models


@pytest.mark.parametrize("model_kw,docs", [
    pytest.param({}, False, id="mha"),
    pytest.param({"n_kv_head": 2, "pos": "rope"}, False, id="gqa-rope"),
    pytest.param({}, True, id="documents"),
    pytest.param({"activation_checkpointing": True}, False, id="activation-checkpointing"),
])
def test_flash_backend_matches_sdpa_in_the_model(model_kw, docs):
    models = twin_models(**model_kw)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (2, 40), generator=gen).to(DEVICE)
    doc_ids = None
    if docs:
        doc_ids = torch.zeros(2, 40, dtype=torch.int32)
        doc_ids[0, 13:] = 1
        doc_ids[0, 30:] = 2
        doc_ids[1, 25:] = 1
        doc_ids = doc_ids.to(DEVICE)
    losses, grads = {}, {}
    for name, model in models.items():
        _, loss = model(x, x, doc_ids)
        loss.backward()
        losses[name] = loss.item()
        grads[name] = model.blocks[0].attn.c_attn.weight.grad
    assert losses["flash"] == pytest.approx(losses["sdpa"], rel=1e-4)
    torch.testing.assert_close(grads["flash"], grads["sdpa"], atol=1e-4, rtol=1e-3)



@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_activation_checkpointing_keeps_the_kernels_output_unless_told_to_recompute(monkeypatch, capfd, compiled,
                                                                                   recompute):
    """A checkpointed block's backward runs its ops again but the kernel's forward, whose o and lse are kept,
    in eager and compiled runs alike (left to itself, torch.compile kept it in torch 2.11 and ran it again in
    2.14); model.recompute_attention=true runs it again. The gradients are those of the model without
    checkpointing, and torch.compile's notice about in-place ops under a checkpoint policy is not printed."""
    from kernels.flash_attention import function

    calls = []
    attn_fwd = function.attn_fwd
    monkeypatch.setattr(function, "attn_fwd", lambda *a, **kw: calls.append(1) or attn_fwd(*a, **kw))
    plain = twin_models()["flash"]
    model = twin_models(activation_checkpointing=True, recompute_attention=recompute)["flash"]
    x = torch.randint(0, 128, (2, 40)).to(DEVICE)
    for m in (plain, torch.compile(model) if compiled else model):
        calls.clear()
        m(x, x)[1].backward()
    assert len(calls) == 2 * (2 if recompute else 1)  # two layers
    torch.testing.assert_close(model.blocks[0].attn.c_attn.weight.grad, plain.blocks[0].attn.c_attn.weight.grad)
    assert "context_fn" not in capfd.readouterr().err


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_activation_checkpointing_keeps_sdpa_kernels_output_unless_told_to_recompute(recompute):
    from torch.utils._python_dispatch import TorchDispatchMode

    from model.attention.sdpa import kept_ops

    calls, kernels = [], set(kept_ops())

    class CountKernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in kernels:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    model = twin_models(activation_checkpointing=True, recompute_attention=recompute)["sdpa"]
    x = torch.randint(0, 128, (2, 40)).to(DEVICE)
    with CountKernels():
        model(x, x)[1].backward()
    assert len(calls) == 2 * (2 if recompute else 1) and set(calls) <= kernels


def test_the_model_hands_flash_the_unsplit_projection_unless_rope_changes_q_and_k(monkeypatch):
    """Without RoPE the layer calls the packed kernel (one gradient for qkv, no concatenation)."""
    from model.attention import flash

    calls = []
    packed = flash.flash_attn_qkvpacked
    monkeypatch.setattr(flash, "flash_attn_qkvpacked", lambda *a, **kw: calls.append(a[0].shape) or packed(*a, **kw))
    x = torch.randint(0, 128, (2, 40)).to(DEVICE)
    for pos, expected in (("learned", [(2, 40, 12, 16)] * 2), ("rope", [])):
        calls.clear()
        twin_models(pos=pos)["flash"](x, x)
        assert calls == expected, pos  # per layer (2): 4 query + 4 key + 4 value heads of 16


@pytest.mark.parametrize("pos, kernel", [("learned", "flash_attn_qkvpacked"), ("rope", "flash_attn")])
def test_attention_dropout_reaches_the_kernel_in_training_only(monkeypatch, pos, kernel):
    """model.dropout reaches the packed kernel (and the plain one under RoPE) as dropout_p, in
    training; in evaluation the kernel runs without dropout."""
    from model.attention import flash

    seen = []
    original = getattr(flash, kernel)
    monkeypatch.setattr(flash, kernel, lambda *a, **kw: seen.append(kw["dropout_p"]) or original(*a, **kw))
    model = twin_models(pos=pos, dropout=0.2)["flash"]
    x = torch.randint(0, 128, (2, 40)).to(DEVICE)
    model(x, x)
    assert seen == [0.2, 0.2]
    seen.clear()
    model.eval()
    model(x, x)
    assert seen == [0.0, 0.0]


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["plain", "dropout"])
def test_flash_model_compiles_without_graph_break(dropout):
    """In training, with dropout on the attention (the packed kernel) and elsewhere too."""
    model = twin_models(dropout=dropout)["flash"]
    x = torch.randint(0, 128, (2, 40)).to(DEVICE)
    explained = torch._dynamo.explain(model)(x, x)
    assert explained.graph_break_count == 0, explained.break_reasons
