"""Context parallelism (trainer.context_parallel=N) on CPU with gloo: every sequence sharded over N ranks.

- The model on its zigzag shards with ring attention over 2 processes equals the model on the whole
  sequences in one process: the loss (mean over ranks) and every weight gradient (mean over ranks,
  as DDP/FSDP take it), learned positions and RoPE, eager and compiled (fp64, 1e-12).
- Training under torchrun: cp=2 on 2 ranks (naive, sdpa) and dp=2 x cp=2 on 4 ranks (FSDP) give the
  losses of one process with the same global batch (fp32, 1e-5); a checkpoint saved under context
  parallelism resumes with it and without it on the same curve. (flash's ring step is checked over
  gloo in test_ring_attention.py.)
- Each combination the ring cannot run is refused when the config is checked, naming the option (train.py's
  one line for it: test_errors.py).
"""
import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, run_env, tiny_config
from errors import UserError
from gloo import on_gloo_ranks
from model import GPT, ModelConfig
from model.attention import build_attention
from model.config import AttentionConfig
from test_distributed import FORKED, TORCHRUN, assert_same_curve, command, records, run
from training.config import validate
from training.context_parallel import SequenceShard

FORKED_4 = [*FORKED[:-1], "--nproc_per_node=4"]
MOVING = ["optim.warmup_steps=2", "optim.lr=3e-3", "optim.schedule=constant"]  # a curve that moves at once, whatever max_steps
CP2 = ["trainer.distributed=ddp", "trainer.context_parallel=2"]


def test_a_shard_is_the_zigzag_tokens_with_their_positions():
    x = torch.arange(16).view(2, 8)
    xs, ys, positions = SequenceShard(1, 2)(x, x + 100)
    assert positions.tolist() == [2, 3, 4, 5]
    assert torch.equal(xs, x[:, 2:6]) and torch.equal(ys, x[:, 2:6] + 100)
    assert SequenceShard()(x, x)[2] is None  # one rank: the whole sequence, the model's own positions


# ---------------------------------------------------------------------------------------------
# The model over 2 gloo processes against one process

MODEL_CASES = [("learned", "naive", False), ("rope", "sdpa", False), ("rope", "naive", True)]


def case_id(pos, backend, compiled):
    return f"{pos}-{backend}" + ("-compiled" if compiled else "")


def _model_errors(pos, backend, compiled, group, rank, n):
    """Max errors of the sharded model's loss and weight gradients against the whole-sequence model."""
    cfg = ModelConfig(name="t", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16, vocab_size=64,
                      dropout=0.0, pos=pos)
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    whole = GPT(cfg, build_attention(AttentionConfig(name=backend), cpu)[0]).double()
    sharded = GPT(cfg, build_attention(AttentionConfig(name=backend), cpu, context=group)[0]).double()
    sharded.load_state_dict(whole.state_dict())
    x, y = torch.randint(0, 64, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    _, loss = whole(x, y)
    loss.backward()
    forward = torch.compile(sharded, backend="aot_eager") if compiled else sharded
    xs, ys, positions = SequenceShard(rank, n)(x, y)
    _, shard_loss = forward(xs, ys, None, positions)
    shard_loss.backward()
    mean_loss = shard_loss.detach().clone()
    dist.all_reduce(mean_loss, group=group)
    grad_errors = []
    for (name, p), q in zip(whole.named_parameters(), sharded.parameters()):
        dist.all_reduce(q.grad, group=group)
        grad_errors.append((q.grad / n - p.grad).abs().max().item())
    return {"loss": abs(mean_loss.item() / n - loss.item()), "grads": max(grad_errors)}


def _model_results(rank, world):
    return {case_id(*case): _model_errors(*case, dist.group.WORLD, rank, world) for case in MODEL_CASES}


@pytest.fixture(scope="module")
def model_results(tmp_path_factory):
    return on_gloo_ranks(_model_results, 2, tmp_path_factory.mktemp("cp-model"))


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(*c)) for c in MODEL_CASES])
def test_the_model_on_zigzag_shards_equals_the_model_on_whole_sequences(model_results, case):
    errors = model_results[case_id(*case)]
    assert errors["loss"] < 1e-12 and errors["grads"] < 1e-12, errors


# ---------------------------------------------------------------------------------------------
# Training under torchrun

def test_cp2_trains_like_one_process_and_its_checkpoint_resumes_with_and_without_it(tmp_path, data_cache):
    cp, cp_then_one, single = tmp_path / "cp", tmp_path / "cp-then-one", tmp_path / "single"
    extra = [*MOVING, "model.pos=rope", "trainer.batch_size=4"]
    run(FORKED, cp, data_cache, *CP2, *extra, "trainer.max_steps=12")
    shutil.copytree(cp, cp_then_one)
    proc = run(FORKED, cp, data_cache, *CP2, *extra, "trainer.max_steps=18")
    assert proc.stdout.count("resuming from") == 1
    assert "over 2 ranks (1 data parallel x 2 context parallel" in proc.stdout
    proc = run([sys.executable], cp_then_one, data_cache, *extra, "trainer.max_steps=18")
    assert f"resuming from {cp_then_one / 'checkpoints' / 'step_0000012.pt'}" in proc.stdout
    run([sys.executable], single, data_cache, *extra, "trainer.max_steps=18")
    assert_same_curve(records(cp), records(single))
    assert_same_curve(records(cp_then_one), records(single))


def test_cp2_with_naive_attention_and_learned_positions_trains_like_one_process(tmp_path, data_cache):
    extra = [*MOVING, "attention=naive", "trainer.batch_size=2", "trainer.grad_accum=1", "trainer.max_steps=4",
             "trainer.log_interval=1"]
    run(FORKED, tmp_path / "cp", data_cache, *CP2, *extra)
    run([sys.executable], tmp_path / "single", data_cache, *extra)
    assert_same_curve(records(tmp_path / "cp"), records(tmp_path / "single"))


def test_dp2_by_cp2_on_four_ranks_under_fsdp_trains_like_one_process(tmp_path, data_cache):
    extra = [*MOVING, "trainer.max_steps=6"]
    proc = run(FORKED_4, tmp_path / "mesh", data_cache, "trainer.distributed=fsdp", "trainer.context_parallel=2",
               "trainer.batch_size=2", *extra)
    assert "8 sequences = 256 tokens/step over 4 ranks (2 data parallel x 2 context parallel" in proc.stdout
    run([sys.executable], tmp_path / "single", data_cache, "trainer.batch_size=4", *extra)
    assert_same_curve(records(tmp_path / "mesh"), records(tmp_path / "single"))


# ---------------------------------------------------------------------------------------------
# What the ring cannot run

def change(section, **values):
    """A change of the config: ``values`` set in its ``section`` (trainer, attention, data)."""
    return lambda cfg: [setattr(getattr(cfg, section), key, value) for key, value in values.items()]


REFUSED = [
    pytest.param(change("trainer", distributed="none"), "trainer.context_parallel=2 runs under torchrun with "
                 "trainer.distributed=ddp or fsdp: torchrun --nproc_per_node=2 train.py trainer.distributed=ddp "
                 "trainer.context_parallel=2 ...", id="no-torchrun"),
    pytest.param(change("attention", name="hybrid"), "attention=hybrid does not run under context parallelism (ring "
                 "attention); use attention=naive, sdpa or flash (or trainer.context_parallel=1)", id="hybrid"),
    pytest.param(change("attention", name="tiled"), "attention=tiled does not run under context parallelism",
                 id="tiled"),
    pytest.param(change("attention", window=8), "attention.window=8 does not run under trainer.context_parallel=2 "
                 "(ring attention is plain causal); drop attention.window", id="window"),
    pytest.param(change("data", name="shakespeare", tokenizer="gpt2", document_mask=True), "data.document_mask=true "
                 "does not run under trainer.context_parallel=2 (ring attention has no document boundaries yet)",
                 id="document-mask"),
    pytest.param(change("trainer", context_parallel=3), "model.block_size=32 is not divisible by 6 (2 x "
                 "trainer.context_parallel=3: each sequence is cut into 6 equal chunks); use model.block_size=30",
                 id="length"),
    pytest.param(change("trainer", batch_size="auto"), "trainer.batch_size=auto measures one process and does not "
                 "run under trainer.context_parallel=2", id="auto-batch"),
    pytest.param(change("trainer", context_parallel=0), "trainer.context_parallel=0 must be a positive integer",
                 id="zero"),
    pytest.param(change("model", attention_dropout=0.1), "attention dropout (0.1) does not run under "
                 "trainer.context_parallel=2 (ring attention has no dropout yet); set model.attention_dropout=0",
                 id="attention-dropout"),
]


@pytest.mark.parametrize("make_wrong,message", REFUSED)
def test_what_the_ring_cannot_run_is_refused_when_the_config_is_checked(data_cache, make_wrong, message):
    cfg = tiny_config(data_cache, distributed="ddp", context_parallel=2)
    cfg.model.attention_dropout = 0.0
    validate(cfg)
    make_wrong(cfg)
    with pytest.raises(UserError) as err:
        validate(cfg)
    assert str(err.value).startswith(message)


def test_a_context_parallel_size_that_does_not_divide_the_world_says_so(tmp_path, data_cache):
    proc = subprocess.run(command(TORCHRUN, tmp_path, data_cache, "trainer.distributed=ddp",
                                  "trainer.context_parallel=4"), cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "error: trainer.context_parallel=4 does not divide the 2 ranks; start a multiple of 4 ranks" in proc.stderr


# ---------------------------------------------------------------------------------------------
# scripts/bench_context_parallel.py (its GPU numbers come from the H100; here the plumbing)

def load_bench():
    import importlib

    module = importlib.import_module("scripts.bench_context_parallel")
    return module


def test_bench_runs_the_plain_and_the_ring_path_to_the_same_losses(tmp_path, capsys):
    bench = load_bench()
    bench.main(["model=tiny", "trainer.device=cpu", "trainer.dtype=fp32", "--lengths", "32,64", "--steps", "2",
                "--warmup", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["T"], r["path"], r["status"]) for r in rows] == [(T, p, "ok") for T in (32, 64) for p in ("plain", "ring")]
    for plain, ring in zip(rows[::2], rows[1::2]):
        assert ring["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert "| 64 | ring |" in capsys.readouterr().out


@pytest.mark.parametrize("checkpointing, kept", [(False, 0), (True, 2 * 2)], ids=["plain", "checkpointing"])
def test_the_memory_model_fit_recovers_its_own_constants(checkpointing, kept):
    """Under checkpointing one rank (no ring) keeps each layer's attention output too: 2 bytes a layer."""
    bench = load_bench()
    cfg = ModelConfig(name="t", n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=128,
                      activation_checkpointing=checkpointing)
    rows = [{"T": T, "peak_gib": bench.model_peak(cfg, T, 1, 75.0, 3e8) / bench.GIB} for T in (1024, 2048, 4096)]
    a, c = bench.fit_memory(cfg, rows)
    assert a == pytest.approx(75.0) and c == pytest.approx(3e8)
    static = 16 * bench.parameters(dataclasses.replace(cfg, block_size=4096))
    assert bench.model_peak(cfg, 4096, 1, 75.0, 0.0) - static == pytest.approx((75 + kept) * 32 * 4096)
    assert bench.model_peak(cfg, 4096, 2, 75.0, 0.0) - static == pytest.approx((75 + bench.RING) * 32 * 4096 / 2)
