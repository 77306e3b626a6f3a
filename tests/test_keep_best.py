"""trainer.keep_best: checkpoints/best.pt follows the lowest validation loss, survives pruning and
resumes, and scripts/sample.py takes it. The validation losses are scripted (``evaluate`` replaced)."""
import importlib
import shutil

import pytest
import torch

from conftest import tiny_config
from errors import UserError
from training import loop
from training.checkpoint import Checkpointer, best_checkpoint, list_checkpoints, load_checkpoint
from training.config import validate
from training.loop import train


def scripted_evaluations(monkeypatch, val_losses):
    """Each evaluation of the loop returns the next of ``val_losses``; the list of those used."""
    remaining = list(val_losses)
    used = []
    monkeypatch.setattr(loop, "evaluate", lambda *args, **kwargs: used.append(remaining.pop(0)) or used[-1])
    return used


@pytest.fixture
def run(monkeypatch, data_cache):
    """run(run_dir, val_losses, **trainer): a 20-step tiny run evaluated and saved every 5 steps,
    every checkpoint kept, keep_best on; returns the validation losses the run used."""
    def run(run_dir, val_losses, **trainer):
        settings = dict(max_steps=20, eval_interval=5, ckpt_interval=5, keep_best=True)
        settings.update(trainer)
        used = scripted_evaluations(monkeypatch, val_losses)
        train(tiny_config(data_cache, **settings), run_dir)
        return used
    return run


def step_of(path):
    return load_checkpoint(path)["step"]


def test_best_is_written_when_the_validation_loss_improves_and_only_then(tmp_path, run):
    run(tmp_path, [3.0, 2.0, 2.5, 2.2])
    best = load_checkpoint(best_checkpoint(tmp_path))
    assert (best["step"], best["val_loss"], best["best_val_loss"]) == (10, 2.0, 2.0)
    step10 = load_checkpoint(tmp_path / "checkpoints" / "step_0000010.pt")
    assert all(torch.equal(best["model"][k], step10["model"][k]) for k in best["model"])
    assert [p.name for p in list_checkpoints(tmp_path)][-1] == "step_0000020.pt"  # best.pt is no step checkpoint
    assert load_checkpoint(tmp_path / "checkpoints" / "step_0000020.pt")["best_val_loss"] == 2.0


def test_best_is_never_pruned_and_not_written_without_keep_best(tmp_path, run):
    run(tmp_path / "kept", [3.0, 2.0, 2.5, 2.2], keep_checkpoints=1)
    assert [p.name for p in list_checkpoints(tmp_path / "kept")] == ["step_0000020.pt"]
    assert step_of(best_checkpoint(tmp_path / "kept")) == 10
    run(tmp_path / "off", [3.0, 2.0, 2.5, 2.2], keep_best=False)
    assert not best_checkpoint(tmp_path / "off").exists()
    assert load_checkpoint(tmp_path / "off" / "checkpoints" / "step_0000020.pt")["best_val_loss"] == 2.0


def test_a_non_finite_validation_loss_is_never_the_best(tmp_path):
    checkpointer = Checkpointer(tmp_path, 1, None, None, None, None, torch.device("cpu"), {}, None, {}, keep_best=True)
    for val_loss in (float("nan"), float("inf")):
        assert checkpointer.save_if_best(10, val_loss, {}) is None
    assert checkpointer.best_val_loss is None and not best_checkpoint(tmp_path).exists()


def test_a_resumed_run_resumes_the_newest_step_and_keeps_knowing_the_best(tmp_path, run):
    """Killed after step 15 (best at step 10, 2.0): the rerun resumes step 15, not best.pt, and its
    2.2 at step 20 does not replace the best; a run that forgot the best would write it."""
    full = tmp_path / "full"
    run(full, [3.0, 2.0, 2.5, 2.2])
    killed = tmp_path / "killed"
    shutil.copytree(full, killed)
    (killed / "checkpoints" / "step_0000020.pt").unlink()
    assert run(killed, [2.2]) == [2.2]  # one evaluation: resumed at step 15
    best = load_checkpoint(best_checkpoint(killed))
    assert (best["step"], best["val_loss"]) == (10, 2.0)
    assert load_checkpoint(killed / "checkpoints" / "step_0000020.pt")["best_val_loss"] == 2.0


def test_starting_over_removes_the_old_best(tmp_path, run):
    run(tmp_path, [3.0, 2.0, 2.5, 2.2])
    run(tmp_path, [4.0, 4.5, 4.6, 4.7], resume="none")
    assert step_of(best_checkpoint(tmp_path)) == 5


def sample_script():
    module = importlib.import_module("scripts.sample")
    return module


def test_sample_takes_the_best_checkpoint_of_a_run_folder_and_says_so(tmp_path, run, capsys):
    run(tmp_path / "best", [3.0, 2.0, 2.5, 2.2])
    run(tmp_path / "plain", [3.0, 2.0, 2.5, 2.2], keep_best=False)
    sample = sample_script()
    capsys.readouterr()
    for folder, used in ((tmp_path / "best", "checkpoints/best.pt (step 10, val loss 2.0000)"),
                         (tmp_path / "plain", "checkpoints/step_0000020.pt (step 20)"),
                         (tmp_path / "plain" / "checkpoints" / "step_0000010.pt", "step_0000010.pt (step 10)"),
                         (best_checkpoint(tmp_path / "best"), "checkpoints/best.pt (step 10, val loss 2.0000)")):
        sample.main([str(folder), "--tokens", "5", "--device", "cpu"])
        out = capsys.readouterr()
        assert out.err.strip().startswith("sampling from ") and out.err.strip().endswith(used), out.err
        assert out.out.count("---") == 1


def test_keep_best_under_fsdp_fails_in_one_line(data_cache):
    cfg = tiny_config(data_cache, keep_best=True, distributed="fsdp")
    with pytest.raises(UserError, match=r"^trainer.keep_best=true writes a whole-model best.pt, which "
                                        r"trainer.distributed=fsdp does not make; .*trainer.keep_best=false$"):
        validate(cfg)
    cfg.trainer.distributed = "ddp"
    validate(cfg)
