"""The forget gate in the model (model.gate=forget) and in every attention backend, and model.pos=none.

Each backend with g is held against the float64 reference of gated attention
(kernels/flash_attention/reference.py: scores + c_i - c_j, c restarting at each document), outputs
and gradients with respect to q, k, v and g, with and without document ids; flash runs under
Triton's interpreter in fp32 without a GPU. In the model the same holds for the gate projection's
gradient. Then: the model trains with the gate on every backend, pos=none runs, a gated checkpoint
resumes and samples, and a misspelt gate fails with the valid choices.
"""
import dataclasses
import math

import pytest
import torch

from conftest import check_a_short_run_learns, emulated, tiny_config
from errors import UserError
from kernels.flash_attention.reference import attention_ref
from model import GPT, ModelConfig
from model.attention import BACKENDS as TABLE, Attention, build_attention, flash, naive
from model.attention.masks import cu_seqlens_from_doc_ids
from model.config import AttentionConfig, validate_model
from test_attention_backends import random_doc_ids
from test_attention_dropout import BACKENDS as PYTORCH_BACKENDS, RecordingAttention
from training.config import validate
from training.loop import train

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# B, T, H, H_kv, D, window, documents (H_kv < H: heads that share K/V keep their own gates)
CASES = [
    pytest.param(2, 29, 4, 2, 16, None, False, id="B2-T29-H4-HKV2"),
    pytest.param(2, 29, 4, 2, 16, None, True, id="B2-T29-H4-HKV2-docs"),
    pytest.param(1, 40, 2, 1, 16, 9, True, id="B1-T40-H2-HKV1-W9-docs"),
]


def gated_inputs(B, T, H, Hkv, D, docs, dtype=torch.float64, device="cpu", seed=0):
    """q, k, v, g (log gates in (-inf, 0), fp32 unless dtype is float64) and doc_ids or None."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen, dtype=dtype)
    k, v = (torch.randn(B, T, Hkv, D, generator=gen, dtype=dtype) for _ in range(2))
    g = torch.nn.functional.logsigmoid(2 * torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    g = g.to(torch.float64 if dtype == torch.float64 else torch.float32)
    doc_ids = random_doc_ids(B, T, gen) if docs else None
    move = (lambda x: None if x is None else x.to(device))
    return move(q), move(k), move(v), move(g), move(doc_ids)


def reference(q, k, v, g, doc_ids, window):
    """Float64 gated attention (B, T, H, D): documents as one packed row whose c restarts at each."""
    if doc_ids is None:
        return attention_ref(q, k, v, window_size=window, g=g)[0]
    B, T, H, D = q.shape
    cu_seqlens, _ = cu_seqlens_from_doc_ids(doc_ids)
    row = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g))
    *qkv, g_row = row
    return attention_ref(*qkv, window_size=window, cu_seqlens=cu_seqlens, g=g_row)[0].view(B, T, H, D)


def reference_attention() -> Attention:
    """The float64 reference as a model backend."""
    def attend(q, k, v, doc_ids=None, g=None):
        return reference(q, k, v, g, doc_ids, None).to(q.dtype)

    return Attention("reference", attend)


def outputs_and_grads(attend, q, k, v, g, doc_ids, window, grad_out):
    inputs = [x.detach().requires_grad_() for x in (q, k, v, g)]
    o = attend(*inputs[:3], doc_ids=doc_ids, window=window, g=inputs[3])
    return o, torch.autograd.grad(o, inputs, grad_out)


@pytest.mark.parametrize("backend", list(PYTORCH_BACKENDS))
@pytest.mark.parametrize("B,T,H,Hkv,D,window,docs", CASES)
def test_gated_backend_matches_float64_reference(backend, B, T, H, Hkv, D, window, docs):
    q, k, v, g, doc_ids = gated_inputs(B, T, H, Hkv, D, docs)
    grad_out = torch.randn(B, T, H, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want_o, want = outputs_and_grads(lambda *a, doc_ids, window, g: reference(*a, g, doc_ids, window),
                                     q, k, v, g, doc_ids, window, grad_out)
    got_o, got = outputs_and_grads(PYTORCH_BACKENDS[backend], q, k, v, g, doc_ids, window, grad_out)
    torch.testing.assert_close(got_o, want_o, atol=1e-10, rtol=1e-10)
    for name, a, b in zip(("dq", "dk", "dv", "dg"), got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("docs", [False, True], ids=["rows", "docs"])
def test_gated_flash_matches_float64_reference(packed, docs):
    """fp32 (the interpreter's dtype); the tolerance is 4x the fp32 naive backend's own error plus
    1e-5, naive being the plain implementation of the same math in the same dtype."""
    B, T, H, Hkv, D = 2, 24, 4, 2, 16
    q, k, v, g, doc_ids = gated_inputs(B, T, H, Hkv, D, docs, dtype=torch.float32, device=DEVICE)
    grad_out = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    if packed:
        def attend(q, k, v, doc_ids, window, g):
            return flash.attend_packed(torch.cat([q, k, v], dim=2), H, doc_ids=doc_ids, window=window, g=g)
    else:
        attend = flash.attend
    want_o, want = outputs_and_grads(lambda *a, doc_ids, window, g: reference(*(x.double() for x in (*a, g)), doc_ids, window),
                                     q, k, v, g, doc_ids, None, grad_out.double())
    low_o, low = outputs_and_grads(naive.attend, q, k, v, g, doc_ids, None, grad_out)
    got_o, got = outputs_and_grads(attend, q, k, v, g, doc_ids, None, grad_out)
    for name, a, lo, w in zip(("o", "dq", "dk", "dv", "dg"), (got_o, *got), (low_o, *low), (want_o, *want)):
        tolerance = 4 * (lo.double() - w).abs().max().item() + 1e-5
        assert (a.double() - w).abs().max().item() <= tolerance, name


def gated_gpt(attention, dtype=torch.float64, **model_kw) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=24, vocab_size=64, dropout=0.0,
                      gate="forget", **model_kw)
    return GPT(cfg, attention).to(dtype)


def loss_and_grads(model, x, doc_ids):
    _, loss = model(x, x, doc_ids)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(TABLE))
@pytest.mark.parametrize("docs", [False, True], ids=["rows", "docs"])
def test_model_with_gate_matches_the_reference_including_the_gate_projection(name, docs):
    """Same weights, one backend or the float64 reference inside: the loss and every gradient
    (the gate projection's weight and bias among them). float64, except flash: fp32 under the
    interpreter, against the fp32 naive model's own distance to the reference (times 4, plus 1e-6)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 64, (2, 24), generator=gen)
    doc_ids = random_doc_ids(2, 24, gen) if docs else None
    backend, _ = build_attention(AttentionConfig(name=name, strict=True), torch.device(DEVICE))
    if name != "flash":
        loss, grads = loss_and_grads(gated_gpt(backend), x, doc_ids)
        want_loss, want = loss_and_grads(gated_gpt(reference_attention()), x, doc_ids)
        torch.testing.assert_close(loss, want_loss, atol=1e-10, rtol=1e-10)
        assert grads["blocks.0.attn.gate_proj.weight"].abs().sum() > 0
        for key in want:
            torch.testing.assert_close(grads[key], want[key], atol=1e-10, rtol=1e-10, msg=key)
        return
    x, doc_ids = x.to(DEVICE), None if doc_ids is None else doc_ids.to(DEVICE)
    want_loss, want = loss_and_grads(gated_gpt(reference_attention()).to(DEVICE), x, doc_ids)
    naive_backend, _ = build_attention(AttentionConfig(name="naive"), torch.device(DEVICE))
    low_loss, low = loss_and_grads(gated_gpt(naive_backend, torch.float32).to(DEVICE), x, doc_ids)
    loss, grads = loss_and_grads(gated_gpt(backend, torch.float32).to(DEVICE), x, doc_ids)
    assert abs(loss.item() - want_loss.item()) <= 4 * abs(low_loss.item() - want_loss.item()) + 1e-6
    for key in ("blocks.0.attn.gate_proj.weight", "blocks.1.attn.gate_proj.bias", "blocks.0.attn.c_attn.weight"):
        tolerance = 4 * (low[key].double() - want[key]).abs().max().item() + 1e-6
        assert (grads[key].double() - want[key]).abs().max().item() <= tolerance, key


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_the_attention_receives_log_gates_in_training_evaluation_and_sampling(packed):
    """g: (B, T, n_head) float32, <= 0, in every mode (unlike dropout); the default init (bias
    model.gate_bias_init = 3, weight N(0, 0.02)) starts the gates near 1, around sigmoid(3) = 0.953."""
    recorder = RecordingAttention()
    model = gated_gpt(Attention("recording", recorder.attend, recorder.packed if packed else None), torch.float32)
    x = torch.randint(0, 64, (3, 24))
    model(x, x)
    model.eval()
    model.generate(x[:, :4], 1)
    assert len(recorder.calls) == 4  # two layers, two calls each
    for options in recorder.calls:
        assert set(options) == {"g"}
        g = options["g"]
        assert g.dtype == torch.float32 and g.shape[0] == 3 and g.shape[2] == 4 and (g <= 0).all()
        assert abs(g.exp().mean().item() - 0.953) < 0.01
    assert all(torch.equal(b.attn.gate_proj.bias, torch.full((4,), 3.0)) for b in model.blocks)


def test_gate_bias_init_sets_where_the_gates_start_and_must_be_finite():
    """model.gate_bias_init=0 is FoX's code (gates around 0.5); NaN is refused at the edge."""
    model = gated_gpt(build_attention(AttentionConfig(name="naive"), torch.device("cpu"))[0], gate_bias_init=0.0)
    assert all(torch.equal(b.attn.gate_proj.bias, torch.zeros(4, dtype=torch.float64)) for b in model.blocks)
    with pytest.raises(UserError, match="model.gate_bias_init=nan is not a finite number"):
        validate_model(ModelConfig(gate="forget", gate_bias_init=float("nan")))


def test_gate_none_and_pos_none_build_what_they_say():
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=64, pos="none",
                            dropout=0.0),
                build_attention(AttentionConfig(name="naive"), torch.device("cpu"))[0])
    assert model.wpe is None and model.blocks[0].attn.gate_proj is None
    # no position signal, no gate: a run of one token gives the same logits at every position
    logits, _ = model(torch.full((1, 8), 5))
    torch.testing.assert_close(logits[0], logits[0, :1].expand(8, -1))


def test_pos_none_with_the_gate_tells_positions_apart():
    model = gated_gpt(build_attention(AttentionConfig(name="naive"), torch.device("cpu"))[0], pos="none")
    with torch.no_grad():
        for block in model.blocks:
            block.attn.gate_proj.bias.fill_(-1.0)  # gates sigmoid(-1): recent keys weigh more than old ones
        x = torch.cat([torch.full((1, 12), 3), torch.full((1, 12), 7)], dim=1)
        logits, _ = model(x)
    assert not torch.allclose(logits[0, 13], logits[0, 23])


@pytest.mark.parametrize("name", list(TABLE))
def test_a_gated_run_without_positions_trains_with_every_backend(tmp_path, data_cache, name):
    """model.gate=forget, model.pos=none: every loss finite and the loss falls. fp32 on CPU; flash
    there runs under Triton's interpreter, so for 6 steps of 4 sequences."""
    steps, batch, drop = (6, 4, 0.2) if emulated(name) else (20, 8, 0.3)
    check_a_short_run_learns(tmp_path, data_cache, name, steps, batch, drop, gate="forget", pos="none")


def test_a_gated_checkpoint_resumes_and_samples(tmp_path, data_cache, capsys):
    from scripts import eval_length, sample

    cfg = tiny_config(data_cache, max_steps=4, ckpt_interval=4, eval_interval=4, eval_iters=1)
    cfg.model = dataclasses.replace(cfg.model, gate="forget", pos="rope")
    train(cfg, tmp_path)
    cfg.trainer.max_steps = 6
    train(cfg, tmp_path)
    assert "resuming from" in capsys.readouterr().out
    sample.main([str(tmp_path), "--tokens", "8", "--device", "cpu"])
    assert "---" in capsys.readouterr().out
    eval_length.main([str(tmp_path), "--factors", "1", "2", "--batches", "1", "--tokens", "64", "--device", "cpu"])
    row = capsys.readouterr().out.splitlines()[-1].split(" | ")
    assert row[1:4] == ["forget", "rope", "3"] and all(math.isfinite(float(x.strip(" |"))) for x in row[-2:]), row
    cfg.model.gate = "none"  # a gated checkpoint does not resume an ungated model
    with pytest.raises(UserError, match="was made with model.gate=forget but this run has model.gate=none"):
        train(cfg, tmp_path)


def test_the_length_test_says_why_learned_positions_stop_at_block_size():
    from scripts.eval_length import why_not

    learned = ModelConfig(block_size=32)
    assert why_not(learned, 32) == "" and why_not(dataclasses.replace(learned, pos="none"), 64) == ""
    assert why_not(learned, 64) == "n/a (learned positions: a table of 32 rows)"


def test_a_misspelt_gate_or_position_fails_with_the_valid_choices(data_cache):
    cfg = tiny_config(data_cache)
    cfg.model.gate = "forgett"
    with pytest.raises(UserError, match=r"^model.gate='forgett' is not one of none, forget$"):
        validate(cfg)
    cfg = tiny_config(data_cache)
    cfg.model.pos = "nope"
    with pytest.raises(UserError, match=r"^model.pos='nope' is not one of learned, rope, none$"):
        validate(cfg)


def test_context_parallelism_refuses_the_gate(data_cache):
    cfg = tiny_config(data_cache, distributed="ddp", context_parallel=2)
    cfg.model = dataclasses.replace(cfg.model, dropout=0.0, gate="forget")
    with pytest.raises(UserError, match=r"^model.gate=forget does not run under trainer.context_parallel=2"):
        validate(cfg)
