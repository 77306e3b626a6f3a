"""Non-finite numbers: refused in every float option, never saved in a checkpoint, never a crash of
the logger, and a stop that names a checkpoint from which a lower learning rate trains on."""
import dataclasses
import math
import re

import pytest
import torch

from conftest import tiny_config
from errors import UserError
from training import loop
from training.checkpoint import list_checkpoints, load_checkpoint
from training.config import TrainConfig, validate
from training.errors import TrainingStopped


def float_options(node=TrainConfig, prefix=""):
    """Every option of the schema that holds floats (float, Optional[float], List[float]), dotted."""
    for f in dataclasses.fields(node):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from float_options(type(default), f"{prefix}{f.name}.")
        elif float in (f.type, *getattr(f.type, "__args__", ())):
            yield f"{prefix}{f.name}"


FLOAT_OPTIONS = sorted(float_options())


def test_the_walk_finds_the_float_options():
    assert {"optim.lr", "optim.min_lr", "optim.weight_decay", "optim.eps", "optim.betas", "optim.decay_fraction",
            "model.dropout", "trainer.grad_clip", "trainer.peak_tflops", "trainer.vram_budget_gb",
            "data.val_fraction"} <= set(FLOAT_OPTIONS)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("option", FLOAT_OPTIONS)
def test_every_float_option_refuses_nan_and_infinity(data_cache, option, bad):
    """A new float option cannot skip the check: this walks the schema, not a list."""
    cfg = tiny_config(data_cache)
    group, key = option.split(".")
    value = [bad, 0.95] if isinstance(getattr(getattr(cfg, group), key), list) else bad
    setattr(getattr(cfg, group), key, value)
    with pytest.raises(UserError, match=re.escape(option)):
        validate(cfg)


def test_a_non_finite_model_is_never_saved(tmp_path, data_cache):
    """optim.min_lr=nan once passed validation: with no warm-up the first step's learning rate is NaN;
    its loss and gradient are finite, its update makes every weight NaN, and that model was saved as
    "the last good checkpoint"."""
    cfg = tiny_config(data_cache, max_steps=10, ckpt_interval=1, log_interval=1, max_bad_steps=3)
    cfg.optim.min_lr, cfg.optim.warmup_steps = float("nan"), 0  # loop.train does not validate: on purpose
    with pytest.raises(TrainingStopped, match="not finite"):
        loop.train(cfg, tmp_path)
    assert list_checkpoints(tmp_path) == []


def test_the_save_checks_the_optimizer_state_too(tmp_path, data_cache):
    """Finite weights with a non-finite optimizer moment: no file is written."""
    from training.errors import NonFiniteState
    from training.run import setup_run
    from training import distributed

    cfg = tiny_config(data_cache, max_steps=2)
    run = setup_run(cfg, tmp_path, distributed.Ranks(), torch.device("cpu"))
    run.step(run.train_loader)
    state = next(iter(run.optimizer.state.values()))
    state["exp_avg_sq"][0] = float("inf")
    with pytest.raises(NonFiniteState, match="step 1"):
        run.checkpointer.save(1, run.train_loader.state_dict())
    assert list_checkpoints(tmp_path) == []
    state["exp_avg_sq"][0] = 0.0
    assert run.checkpointer.save(1, run.train_loader.state_dict()).name == "step_0000001.pt"


def test_a_nan_validation_loss_ends_in_the_documented_stop(tmp_path, data_cache):
    """optim.lr=1e6: the loss turns NaN at step 2 and the evaluation at step 5 gives NaN, which the
    logger once could not format (TypeError, exit 1, nothing saved)."""
    cfg = tiny_config(data_cache, max_steps=30, eval_interval=5, log_interval=1, ckpt_interval=100)
    cfg.optim.lr, cfg.optim.warmup_steps = 1e6, 0
    with pytest.raises(TrainingStopped, match="not finite for 5 steps in a row"):
        loop.train(cfg, tmp_path)
    evals = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert evals == [evals[0]] and '"val_loss": null' in evals[0]


def good_checkpoint_in(message: str):
    found = re.search(r"the last good checkpoint is (\S+\.pt)", message)
    return found.group(1) if found else None


def losses(run_dir):
    """The training losses of metrics.jsonl (NaN is written as null)."""
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_the_named_checkpoint_resumes_into_a_finite_run_with_a_lower_lr(tmp_path, data_cache):
    """Sixty good steps (loss ~3.3), then optim.lr=1e6: step 61's loss is still in range but its update
    blows the weights up (finite, so step 61 is saved), step 62's loss is ~1e10 and its gradient NaN.
    The stop once named step 61, whose weights diverge again at any learning rate. It must name step
    60, the newest checkpoint whose weights still gave a loss in its recent range, and resuming it as
    the message says, with a lower learning rate, must train on with finite losses."""
    cfg = tiny_config(data_cache, max_steps=60, ckpt_interval=1, log_interval=1, eval_interval=1000)
    cfg.optim.lr = cfg.optim.min_lr = 1e-2
    loop.train(cfg, tmp_path)
    cfg.trainer.max_steps, cfg.optim.lr, cfg.optim.warmup_steps = 90, 1e6, 0
    with pytest.raises(TrainingStopped) as stopped:
        loop.train(cfg, tmp_path)
    good = good_checkpoint_in(str(stopped.value))
    assert good is not None and good.endswith("step_0000060.pt"), str(stopped.value)
    assert f"trainer.resume={good}" in str(stopped.value) and "optim.lr" in str(stopped.value)

    cfg.trainer.max_steps, cfg.trainer.resume, cfg.optim.lr, cfg.optim.min_lr = 80, good, 3e-3, 3e-4
    summary = loop.train(cfg, tmp_path)
    assert summary["step"] == 80 and summary["loss"] < 3.6
    assert all(loss is not None and math.isfinite(loss) for loss in losses(tmp_path))
    weights = load_checkpoint(list_checkpoints(tmp_path)[-1])["model"]
    assert all(torch.isfinite(w).all() and w.abs().max() < 100 for w in weights.values())


def test_when_no_checkpoint_predates_the_divergence_the_advice_is_to_start_over(tmp_path, data_cache):
    """optim.lr=1e6 from step 1: step 1's checkpoint holds weights of ~1e6 (finite); it is not good,
    and starting over as advised with a lower learning rate trains."""
    cfg = tiny_config(data_cache, max_steps=30, ckpt_interval=1, log_interval=1)
    cfg.optim.lr, cfg.optim.warmup_steps = 1e6, 0
    with pytest.raises(TrainingStopped) as stopped:
        loop.train(cfg, tmp_path)
    assert good_checkpoint_in(str(stopped.value)) is None
    assert "trainer.resume=none" in str(stopped.value), str(stopped.value)
    cfg.trainer.max_steps, cfg.trainer.resume, cfg.optim.lr, cfg.optim.warmup_steps = 10, "none", 3e-3, 5
    summary = loop.train(cfg, tmp_path)
    assert summary["step"] == 10 and all(math.isfinite(loss) for loss in losses(tmp_path))
