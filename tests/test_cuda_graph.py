"""trainer.cuda_graph: clipping inside the fused step, the captured step's pieces, and (on a GPU)
captured runs that match uncaptured ones step for step."""
import dataclasses
import json

import pytest
import torch

from conftest import RECIPE, tiny_config
from errors import UserError
from training.checkpoint import list_checkpoints, load_checkpoint
from training.config import validate
from training.cuda_graph import StaticBatches, use_cuda_graph
from training.loop import train
from training.optim import clip_in_step, make_capturable, plain_state_dict, set_lr

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def two_layer_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def backward_once(net: torch.nn.Module, scale: float) -> None:
    torch.manual_seed(1)
    (net(torch.randn(5, 8)).square().sum() * scale).backward()


@pytest.mark.parametrize("scale", [1e-3, 1e3])  # below and above the clipping threshold
def test_clipping_inside_the_fused_step_equals_clip_grad_norm_then_step(scale):
    plain, folded = two_layer_net(), two_layer_net()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    opt_folded = torch.optim.AdamW(folded.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        backward_once(plain, scale)
        backward_once(folded, scale)
        norm_plain = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        norm_folded = clip_in_step(opt_folded, folded.parameters(), 1.0)
        opt_plain.step()
        opt_folded.step()
        opt_plain.zero_grad(set_to_none=True)
        opt_folded.zero_grad(set_to_none=True)
        # Two reductions of the same squares (get_total_norm, clip_grad_norm_'s own): equal to fp32
        # rounding, not bit for bit, which no PyTorch release promises (torch 2.14.1 differs by 1 ulp).
        torch.testing.assert_close(norm_folded, norm_plain, rtol=1e-6, atol=0)
    for a, b in zip(plain.parameters(), folded.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_no_clipping_leaves_the_step_unscaled():
    net = two_layer_net()
    opt = torch.optim.AdamW(net.parameters(), fused=True)
    backward_once(net, 1e3)
    norm = clip_in_step(opt, net.parameters(), float("inf"))
    assert opt.grad_scale is None and norm > 1.0


def test_a_captured_optimizer_saves_like_an_uncaptured_one():
    opt = torch.optim.AdamW(two_layer_net().parameters(), lr=3e-4, fused=True)
    make_capturable(opt)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and opt.param_groups[0]["capturable"]
    set_lr(opt, 1e-3)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(1e-3)  # in place: a graph reads it
    saved = plain_state_dict(opt)
    assert saved["param_groups"][0]["lr"] == pytest.approx(1e-3) and not saved["param_groups"][0]["capturable"]
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # the live groups are untouched


def test_static_batches_cycle_and_refill_in_place():
    buffers = [(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), None) for _ in range(2)]
    static = StaticBatches(buffers)
    fresh = iter([(torch.full((2, 3), i), torch.full((2, 3), -i), None) for i in (1, 2)])

    class Loader:
        def next_batch(self):
            return next(fresh)

    static.refill(Loader())
    drawn = [static.next_batch() for _ in range(3)]
    assert [int(x[0, 0]) for x, _, _ in drawn] == [1, 2, 1]
    assert drawn[0][0] is buffers[0][0] and int(buffers[1][1][0, 0]) == -2


@pytest.mark.parametrize("device, dtype, distributed, document_mask, needle", [
    ("cpu", torch.float32, "none", False, "needs a CUDA GPU"),
    ("cuda", torch.float16, "none", False, "trainer.dtype=bf16"),
    ("cuda", torch.bfloat16, "ddp", False, "trainer.distributed=ddp"),
    ("cuda", torch.bfloat16, "none", True, "data.document_mask=true"),
])
def test_what_cannot_be_captured_is_refused_with_the_way_out(device, dtype, distributed, document_mask, needle, capsys):
    settings = (torch.device(device), dtype, distributed, document_mask)
    with pytest.raises(UserError, match="trainer.cuda_graph=true cannot be used here") as refused:
        use_cuda_graph(True, *settings)
    assert needle in str(refused.value) and "trainer.cuda_graph=false" in str(refused.value)
    assert use_cuda_graph("auto", *settings) is False  # auto: uncaptured, and on a GPU says why
    assert (needle in capsys.readouterr().out) == (device == "cuda")
    assert use_cuda_graph(False, *settings) is False


def test_auto_is_the_default_and_says_nothing_on_a_cpu(tmp_path, data_cache, capsys):
    """On a GPU every run is captured where it can be; on a CPU the default runs as before, silently."""
    from training.config import TrainerConfig

    assert TrainerConfig().cuda_graph == "auto"
    train(tiny_config(data_cache, max_steps=2, eval_interval=2, eval_iters=1, log_interval=1), tmp_path)
    assert "cuda_graph" not in capsys.readouterr().out


def test_a_capturable_run_is_captured_when_asked_or_on_auto():
    for setting in (True, "auto"):
        assert use_cuda_graph(setting, torch.device("cuda"), torch.bfloat16, "none", False) is True


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_cuda_graph_takes_true_false_or_auto(data_cache, value):
    cfg = tiny_config(data_cache, cuda_graph=value)
    with pytest.raises(UserError, match="trainer.cuda_graph=.* must be true, false or auto"):
        validate(cfg)


def test_a_cpu_run_with_cuda_graph_stops_before_training(tmp_path, data_cache):
    with pytest.raises(UserError, match="needs a CUDA GPU and this run uses cpu"):
        train(tiny_config(data_cache, cuda_graph=True), tmp_path)
    assert not list_checkpoints(tmp_path)


def loss_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in map(json.loads, lines) if "loss" in r]


def gpu_config(data_cache, **trainer):
    settings = dict(device="cuda", dtype="bf16", max_steps=12, log_interval=1, grad_accum=2, ckpt_interval=6)
    settings.update(trainer)
    cfg = tiny_config(data_cache, **settings)
    cfg.model.dropout = 0.0  # the same numbers with and without the graph
    return cfg


@pytest.fixture
def deterministic():
    """PyTorch's and Inductor's deterministic kernels for the test. Otherwise, compiled, Inductor adds
    index_put's accumulations (the embeddings' gradients) with atomics, and two uncaptured runs of one
    configuration part by up to 1.4e-3 relative within 12 steps (the recipe with Muon; H200, 2026-11-28,
    docs/runs/2026-11-28-gpu-tests-h200/). warn_only: cuDNN's and memory-efficient attention's backward
    run as they do, with a warning."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def assert_same_records(captured, plain, rel=1e-5):
    assert [r[0] for r in captured] == [r[0] for r in plain]
    for (step, *values), (_, *expected) in zip(captured, plain):
        assert values == pytest.approx(expected, rel=rel), f"step {step}"


@CUDA
@pytest.mark.filterwarnings("ignore:.*attention defaults to a non-deterministic algorithm")
@pytest.mark.parametrize("dtype, compile_, attention, recipe, checkpointing", [
    ("bf16", False, "sdpa", False, False), ("fp32", False, "sdpa", False, False), ("bf16", True, "flash", False, False),
    ("bf16", False, "sdpa", True, False), ("bf16", True, "flash", True, False), ("bf16", "blocks", "flash", True, False),
    ("bf16", False, "flash", False, True), ("bf16", True, "sdpa", False, True),
])
def test_a_captured_run_matches_the_uncaptured_one_step_for_step(tmp_path, data_cache, deterministic, dtype, compile_,
                                                                   attention, recipe, checkpointing):
    """Twelve steps through warm-up (the learning rate changes every step) with two micro-batches a
    step: every loss, learning rate and gradient norm equals the uncaptured run's, with the kernels
    deterministic (bitwise equal in every case on the H200). A replay reading a stale batch or learning
    rate is off by far more. With ``recipe``: every switch of docs/RECIPE.md and optim=muon (its learning
    rate a device tensor, Newton-Schulz batched in bf16, clipping and the skip flag on the device). With
    ``checkpointing``: activation checkpointing, whose policy keeps the attention kernels' output."""
    runs = {}
    for captured in (False, True):
        cfg = gpu_config(data_cache, dtype=dtype, compile=compile_, cuda_graph=captured)
        cfg.attention.name = attention
        cfg.model.activation_checkpointing = checkpointing
        if recipe:
            cfg.model = dataclasses.replace(cfg.model, **RECIPE)
            cfg.optim.name = "muon"
        train(cfg, tmp_path / str(captured))
        runs[captured] = loss_records(tmp_path / str(captured))
    assert_same_records(runs[True], runs[False])


@CUDA
def test_a_captured_checkpoint_resumes_without_the_graph(tmp_path, data_cache):
    train(gpu_config(data_cache, cuda_graph=True), tmp_path / "captured")
    step6 = load_checkpoint(tmp_path / "captured" / "checkpoints" / "step_0000006.pt")
    assert all(isinstance(g["lr"], float) and not g["capturable"] for g in step6["optimizer"]["param_groups"])
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "checkpoints" / "step_0000006.pt").write_bytes(
        (tmp_path / "captured" / "checkpoints" / "step_0000006.pt").read_bytes())
    train(gpu_config(data_cache), resumed)
    assert_same_records(loss_records(resumed), loss_records(tmp_path / "captured")[6:])


@CUDA
@pytest.mark.parametrize("attention, compile_", [("sdpa", False), ("flash", False), ("flash", True)])
def test_a_captured_run_with_dropout_learns(tmp_path, data_cache, attention, compile_):
    """Compiled with flash, as experiment=shakespeare_char runs (Inductor's own dropout bits and the
    kernel's, both drawn inside the captured step)."""
    cfg = gpu_config(data_cache, cuda_graph=True, compile=compile_, max_steps=60, log_interval=10)
    cfg.model.dropout = 0.1  # the attention probabilities too
    cfg.attention.name, cfg.attention.strict = attention, True
    train(cfg, tmp_path)
    records = loss_records(tmp_path)
    assert records[-1][1] < records[0][1] - 0.5


@CUDA
def test_a_captured_run_with_attention_dropout_draws_fresh_bits_at_every_replay(tmp_path, data_cache, deterministic):
    """flash with attention dropout only: the kernel draws its seed with a device RNG op inside the
    step, so each replay advances torch's generator exactly as an eager step does, and the captured
    run equals the uncaptured one step for step. A replay that reused the captured step's dropout
    mask would be off by far more than rounding from the first replayed step on."""
    runs = {}
    for captured in (False, True):
        cfg = gpu_config(data_cache, cuda_graph=captured)
        cfg.model.attention_dropout = 0.3
        cfg.attention.name, cfg.attention.strict = "flash", True
        train(cfg, tmp_path / str(captured))
        runs[captured] = loss_records(tmp_path / str(captured))
    assert_same_records(runs[True], runs[False])


@CUDA
def test_muon_in_fp16_learns_under_the_grad_scaler(tmp_path, data_cache):
    cfg = gpu_config(data_cache, dtype="fp16", max_steps=40, log_interval=10)
    cfg.model = dataclasses.replace(cfg.model, **RECIPE)
    cfg.optim.name = "muon"
    train(cfg, tmp_path)
    records = loss_records(tmp_path)
    assert records[-1][1] < records[0][1] - 0.5
