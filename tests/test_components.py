"""Unit tests of the loop's parts: schedules, optimizer groups, precision choice, MFU, checkpoints."""
import pytest
import torch

from errors import UserError
from model import GPT, ModelConfig
from model.attention import build_attention
from model.config import AttentionConfig
from training.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from training.config import OptimConfig
from training.metrics import ThroughputMeter, flops_per_token, peak_tflops
from training.optim import build_optimizer, lr_at
from training.precision import resolve_device, resolve_dtype


def tiny_gpt(**kw) -> GPT:
    attend, _ = build_attention(AttentionConfig(name="sdpa"), torch.device("cpu"))
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, **kw), attend)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_schedules_warm_up_then_end_where_they_should(schedule):
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule=schedule, decay_fraction=0.2)
    lrs = [lr_at(s, cfg, 100) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert max(lrs) == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(1.0 if schedule == "constant" else 0.1)
    if schedule == "wsd":
        assert lrs[79] == pytest.approx(1.0) and lrs[89] < 1.0


def test_weight_decay_only_on_matmul_weights():
    model = tiny_gpt(bias=True)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert any(p is model.wte.weight for p in decay["params"])  # tied to the LM head
    assert any(p is model.wpe.weight for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_tied_embeddings_and_scaled_residual_init():
    model = tiny_gpt()
    assert model.lm_head.weight is model.wte.weight
    std = model.blocks[0].attn.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / (2 * 2) ** 0.5, rel=0.25)


def test_gpt_generates_within_the_real_vocabulary():
    torch.manual_seed(0)
    model = tiny_gpt().eval()
    out = model.generate(torch.zeros(2, 1, dtype=torch.long), 30, top_k=10, vocab_limit=50)
    assert out.shape == (2, 31) and int(out.max()) < 50


@pytest.mark.parametrize("options", [dict(n_kv_head=1, pos="rope", mlp="swiglu", norm="rmsnorm"), dict(bias=True, dropout=0.1)])
def test_model_variants_train_a_step(options):
    model = tiny_gpt(**options)
    x = torch.randint(0, 64, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_device_and_dtype_choice_on_a_cpu_machine():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(UserError, match="trainer.dtype=fp16 needs a CUDA GPU"):
        resolve_dtype("fp16", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="trainer.device=cuda"):
            resolve_device("cuda")


def test_mfu_arithmetic_and_peak_table():
    cfg = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)
    assert flops_per_token(cfg, 124_000_000, 1024) == 6 * 124e6 + 12 * 12 * 768 * 1024
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), override=100.0) == 100.0
    meter = ThroughputMeter(torch.device("cpu"), flops_per_token=1e9, peak=1.0)
    meter.tick(1000)
    report = meter.report()
    assert report["tokens_per_s"] > 0 and report["mfu"] == pytest.approx(report["tokens_per_s"] * 1e9 / 1e12)


def test_checkpoints_are_atomic_pruned_and_a_damaged_newest_falls_back(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"step": step, "model": {"w": torch.ones(2) * step}}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000020.pt", "step_0000030.pt"]
    (tmp_path / "checkpoints" / ".step_0000040.pt.tmp").write_bytes(b"half a file")  # a killed save
    newest = list_checkpoints(tmp_path)[-1]
    newest.write_bytes(newest.read_bytes()[:100])  # damaged after the fact
    with pytest.warns(UserWarning, match="step_0000030.pt is corrupt"):
        path, state = latest_checkpoint(tmp_path)
    assert path.name == "step_0000020.pt" and state["step"] == 20
    with pytest.raises(UserError, match="is corrupt"):
        load_checkpoint(newest)


@pytest.mark.parametrize("threshold,start,step,want", [(37, 1, 1, 37), (1000, 1, 1, 512), (0, 1, 1, 0), (5000, 256, 256, 4864)])
def test_fit_search_finds_the_largest_passing_value(threshold, start, step, want):
    from training.fit import largest_passing

    tried = []
    fits = lambda n: tried.append(n) or n <= threshold
    assert largest_passing(fits, start, 512 if step == 1 else 131072, step) == want
    assert len(tried) < 25


def test_batch_size_auto_needs_a_gpu():
    from training.fit import auto_batch_size

    with pytest.raises(UserError, match="trainer.batch_size=auto"):
        auto_batch_size(ModelConfig(vocab_size=64), AttentionConfig(), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_loss_equals_cross_entropy_with_gradients(chunk):
    import torch.nn.functional as F

    from model.loss import lm_loss

    gen = torch.Generator().manual_seed(chunk)
    h = torch.randn(2, 30, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randint(0, 50, (2, 30), generator=gen)
    got = lm_loss(h, w, y, chunk)
    want = F.cross_entropy((h @ w.T).view(-1, 50), y.view(-1))
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.autograd.gradcheck(lambda h, w: lm_loss(h, w, y, chunk), (h, w))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused cross-entropy kernel's path needs a CUDA GPU"))])
@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_loss_without_gradients_computes_only_the_loss(chunk, device):
    """Under torch.no_grad (evaluation) the loss is the same, from one matmul per chunk instead of three."""
    from torch.utils.flop_counter import FlopCounterMode

    from model.loss import lm_loss

    gen = torch.Generator().manual_seed(chunk)
    h = torch.randn(2, 30, 8, generator=gen).to(device).requires_grad_()
    w = torch.randn(50, 8, generator=gen).to(device).requires_grad_()
    y = torch.randint(0, 50, (2, 30), generator=gen).to(device)
    with FlopCounterMode(display=False) as training:
        want = lm_loss(h, w, y, chunk)
    with torch.no_grad(), FlopCounterMode(display=False) as evaluating:
        got = lm_loss(h, w, y, chunk)
    assert torch.equal(got, want.detach()) and not got.requires_grad
    logits_flops = 2 * 60 * 8 * 50
    assert (training.get_total_flops(), evaluating.get_total_flops()) == (3 * logits_flops, logits_flops)


def test_model_compiles_with_no_graph_break():
    model = tiny_gpt(pos="rope")
    x = torch.randint(0, 64, (2, 16))
    explained = torch._dynamo.explain(model)(x, x)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_rotary_tables_are_made_once_kept_fp32_through_a_cast_and_not_saved():
    from model.gpt import rope_tables

    model = tiny_gpt(pos="rope").to(torch.bfloat16)
    cos, sin = rope_tables(torch.arange(16), 32 // 2)
    assert model.rotary.cos.dtype == torch.float32 and torch.equal(model.rotary.cos, cos)
    assert torch.equal(model.rotary.sin, sin)
    assert not any("rotary" in name for name in model.state_dict())
    positions = torch.tensor([3, 4, 5])
    assert torch.equal(model.rotary(positions, 3)[0], cos[3:6]) and torch.equal(model.rotary(None, 5)[1], sin[:5])
    x = torch.randint(0, 64, (2, 16))
    graph = torch.fx.symbolic_trace(model.rotary, concrete_args={"positions": None, "T": 16}).graph
    assert not {"cos", "sin"} & {str(n.target).split(".")[-1] for n in graph.nodes if n.op == "call_method"}
    assert model(x)[0].dtype == torch.bfloat16


def test_chunked_loss_under_bf16_autocast_matches_cross_entropy_of_bf16_logits():
    import torch.nn.functional as F

    from model.loss import lm_loss

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 40, 16, generator=gen, requires_grad=True)
    w = (0.5 * torch.randn(300, 16, generator=gen)).requires_grad_()
    y = torch.randint(0, 300, (3, 40), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lm_loss(h, w, y, chunk=50)
    got.backward()
    got_dh, got_dw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logits = (h.bfloat16() @ w.bfloat16().T).float()  # what the bf16 matmul gives, then fp32 softmax
    want = F.cross_entropy(logits.view(-1, 300), y.view(-1))
    want.backward()
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=1e-5)
    for mine, ref in ((got_dh, h.grad), (got_dw, w.grad)):
        assert ((mine - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_chunked_loss_compiled_equals_eager(autocast):
    from model.loss import lm_loss

    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 24, 16, generator=gen)
    w = torch.randn(100, 16, generator=gen)
    y = torch.randint(0, 100, (2, 24), generator=gen)

    def loss_and_grads(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(hh, ww, y, 20)
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    eager = loss_and_grads(lm_loss)
    compiled = loss_and_grads(torch.compile(lm_loss, fullgraph=True))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
