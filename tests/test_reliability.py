"""Fault injection: kills, interrupted saves, signals, non-finite losses, out-of-memory, damaged files.

What a user may rely on: a run never loses more than the steps since its last checkpoint, never
picks up a half-written checkpoint, and resumes to exactly the numbers an uninterrupted run gives
(CPU, fp32).
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_env, tiny_config
from errors import UserError
import training.run
import training.step
from training import loop
from training.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from training.exits import exit_on_error
from training.errors import OutOfMemory, TrainingStopped

VOLATILE = ("tokens_per_s", "elapsed_s")


def metrics(run_dir: Path):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE} for line in lines]


def train_cmd(run_dir: Path, cache: str, max_steps: int = 60, extra=()):
    return [sys.executable, "train.py", "model=tiny", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
            "model.block_size=32", "model.dropout=0.1", "data=shakespeare_char", f"data.cache_dir={cache}",
            "trainer.device=cpu", "trainer.dtype=fp32", f"trainer.max_steps={max_steps}", "trainer.batch_size=4",
            "trainer.log_interval=5", "trainer.eval_interval=20", "trainer.eval_iters=2", "trainer.ckpt_interval=5",
            "trainer.keep_checkpoints=3", "trainer.sample_tokens=0", "logger.progress=false",
            f"hydra.run.dir={run_dir}", *extra]


def start(cmd):
    return subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(run_dir: Path, at_least: int, proc, timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = [int(p.stem.split("_")[1]) for p in list_checkpoints(run_dir)]
        if steps and max(steps) >= at_least:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {at_least}: {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint at step {at_least} within {timeout}s")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_cache):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    proc = subprocess.run(train_cmd(run_dir, data_cache), cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return run_dir


def test_sigkill_at_random_steps_then_resume_matches_the_uninterrupted_run(tmp_path, data_cache, reference_run):
    rng = random.Random(0)
    run_dir = tmp_path / "run"
    for kill_after in sorted(rng.sample(range(5, 40, 5), 3)):  # random checkpoints, well before the end (60)
        proc = start(train_cmd(run_dir, data_cache))
        wait_for_checkpoint(run_dir, kill_after, proc)
        time.sleep(rng.uniform(0.0, 0.02))  # somewhere inside the next steps
        assert proc.poll() is None, "the run finished before the kill: nothing was tested"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert max(int(p.stem.split("_")[1]) for p in list_checkpoints(run_dir)) < 60
    proc = subprocess.run(train_cmd(run_dir, data_cache), cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "resuming from" in proc.stdout
    final = lambda d: load_checkpoint(d / "checkpoints" / "step_0000060.pt")["model"]
    a, b = final(run_dir), final(reference_run)
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    resumed, uninterrupted = metrics(run_dir), metrics(reference_run)
    records = [(x, y) for x, y in zip(resumed, uninterrupted) if x != y]
    assert len(resumed) == len(uninterrupted) and not records and not differing, (
        f"{len(records)} of {len(uninterrupted)} records differ (resumed, uninterrupted): {records[:4]}; "
        f"final weights differ in {differing[:6]}")


def test_sigterm_saves_at_the_step_boundary_and_the_resumed_run_is_exact(tmp_path, data_cache, reference_run):
    run_dir = tmp_path / "run"
    proc = start(train_cmd(run_dir, data_cache, extra=["trainer.ckpt_interval=1000"]))
    while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "SIGTERM: saving a checkpoint after this step" in err and "start the same command again to resume" in err
    saved = list_checkpoints(run_dir)
    assert len(saved) == 1
    resumed = subprocess.run(train_cmd(run_dir, data_cache, extra=["trainer.ckpt_interval=1000"]), cwd=REPO,
                             env=run_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert metrics(run_dir) == metrics(reference_run)


def test_a_second_ctrl_c_exits_at_once(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    slow_steps = ["model.n_embd=256", "model.n_head=4", "model.n_layer=4", "model.block_size=128", "trainer.batch_size=32"]
    proc = start(train_cmd(run_dir, data_cache, max_steps=100000, extra=slow_steps))
    # A first record means the loop runs and its handler is installed; the file alone exists earlier,
    # and a SIGINT then takes the "interrupted outside the training steps" exit instead.
    while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    # Two signals that arrive before Python runs the handler count as one: wait for the first to land.
    while "saving a checkpoint after this step" not in (line := proc.stderr.readline()):
        assert line, "the run ended before it saw the first SIGINT"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert "SIGINT again: exiting now" in err and "stopped after step" not in err


SAVE_LOOP = """
import sys, torch
from training.checkpoint import save_checkpoint
step = 0
while True:
    step += 1
    save_checkpoint(sys.argv[1], step, {"step": step, "model": {"w": torch.full((200_000,), float(step))}}, keep=2)
"""


SECOND_SIGNAL_IN_CODE_THAT_REPLACES_EXCEPTIONS = """
import os, signal
from training.signals import StopRequest
with StopRequest():
    os.kill(os.getpid(), signal.SIGINT)  # the first signal: a checkpoint is due
    try:
        os.kill(os.getpid(), signal.SIGINT)  # the second lands inside library code...
    except BaseException as err:  # ...that fails while cleaning up, as torch.save's zip writer did
        raise RuntimeError("unexpected pos 5529280 vs 5529168") from err
print("the second signal did not stop the process")
"""


def test_a_second_signal_exits_with_its_status_even_inside_code_that_replaces_exceptions():
    """A second Ctrl-C that landed inside torch.save (writing the checkpoint the first one asked
    for) raised SystemExit there; the zip writer then failed while closing, and the run ended with
    that RuntimeError's traceback and status 1. The second signal must end the process with 130."""
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL_IN_CODE_THAT_REPLACES_EXCEPTIONS], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert "SIGINT again: exiting now without saving" in proc.stderr
    assert "Traceback" not in proc.stderr and "did not stop" not in proc.stdout


def test_sigkill_during_saves_never_leaves_a_damaged_latest_checkpoint(tmp_path):
    rng = random.Random(1)
    for trial in range(3):
        run_dir = tmp_path / f"t{trial}"
        proc = subprocess.Popen([sys.executable, "-c", SAVE_LOOP, str(run_dir)], cwd=REPO, env=run_env())
        while not list_checkpoints(run_dir):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.5))
        proc.kill()
        proc.wait()
        path, state = latest_checkpoint(run_dir)
        assert state["step"] == int(path.stem.split("_")[1])
        assert torch.equal(state["model"]["w"], torch.full((200_000,), float(state["step"])))


@pytest.mark.parametrize("trial", range(20))
def test_a_save_interrupted_at_any_point_keeps_the_previous_checkpoint(tmp_path, monkeypatch, trial):
    """Break the writer at a random point: inside torch.save, at fsync, or at the rename."""
    save_checkpoint(tmp_path, 1, {"step": 1, "model": {"w": torch.ones(1000)}}, keep=2)
    rng = random.Random(trial)
    where = rng.choice(["torch.save", "os.fsync", "os.replace"])
    real_save = torch.save

    def partial_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(rng.randrange(1, f.tell()))
        raise KeyboardInterrupt("killed while writing")

    def broken(*args, **kwargs):
        raise KeyboardInterrupt(f"killed at {where}")

    if where == "torch.save":
        monkeypatch.setattr(torch, "save", partial_save)
    else:
        monkeypatch.setattr(os, where.split(".")[1], broken)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, {"step": 2, "model": {"w": torch.full((1000,), 2.0)}}, keep=2)
    monkeypatch.undo()
    path, state = latest_checkpoint(tmp_path)
    assert state["step"] == 1 and path.name == "step_0000001.pt"


def test_non_finite_losses_stop_the_run_without_saving_a_nan_model(tmp_path, data_cache, monkeypatch):
    from model.gpt import GPT

    real_forward = GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, doc_ids=None, positions=None):
        logits, loss = real_forward(self, idx, targets, doc_ids, positions)
        if self.training and targets is not None:
            calls["n"] += 1
            if calls["n"] > 6:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    cfg = tiny_config(data_cache, max_steps=30, log_interval=1, ckpt_interval=1, max_bad_steps=3, keep_checkpoints=50)
    # Step 7's loss is computed with step 6's weights, so step 6 is saved but not named good: the
    # newest checkpoint whose weights gave an in-range loss is step 5 (training/health.py).
    with pytest.raises(TrainingStopped, match="not finite for 3 steps in a row.*the last good checkpoint is .*step_0000005.pt"):
        loop.train(cfg, tmp_path)
    saved = list_checkpoints(tmp_path)
    assert saved[-1].name == "step_0000006.pt"
    for path in saved:
        assert all(torch.isfinite(t).all() for t in load_checkpoint(path)["model"].values())


def test_out_of_memory_saves_the_last_finished_step_and_advises(tmp_path, data_cache, monkeypatch, capsys):
    real_step = training.step.train_step
    calls = {"n": 0}

    def step_then_oom(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(training.run, "train_step", step_then_oom)  # what setup_run binds into the run's step
    cfg = tiny_config(data_cache, max_steps=20, ckpt_interval=100)
    with pytest.raises(SystemExit) as exited, exit_on_error():
        loop.train(cfg, tmp_path)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    for hint in ("out of GPU memory at step 7", "step 6 is saved", "trainer.batch_size", "trainer.grad_accum",
                 "attention=flash", "model.activation_checkpointing=true"):
        assert hint in err
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000006.pt"]


def test_a_damaged_newest_checkpoint_is_named_and_the_run_resumes_from_the_one_before(tmp_path, data_cache):
    cfg = tiny_config(data_cache, max_steps=20, ckpt_interval=5)
    loop.train(cfg, tmp_path)
    newest = list_checkpoints(tmp_path)[-1]
    newest.write_bytes(newest.read_bytes()[:1000])
    cfg.trainer.max_steps = 25
    with pytest.warns(UserWarning, match=r"step_0000020.pt is corrupt.*falling back"):
        summary = loop.train(cfg, tmp_path)
    assert summary["step"] == 25


def test_checkpoints_never_unpickle_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    path = tmp_path / "evil.pt"
    torch.save({"step": 1, "model": Evil()}, path)
    with pytest.raises(UserError, match="is corrupt or not a nanoflash checkpoint"):
        load_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


def test_config_strings_are_data_not_code(tmp_path, data_cache):
    marker = tmp_path / "pwned"
    payload = f'__import__("os").system("touch {marker}")'
    proc = subprocess.run(train_cmd(tmp_path / "run", data_cache, max_steps=1, extra=[f"data.path='{payload}'"]),
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert not marker.exists()


def test_out_of_memory_mid_step_then_resume_matches_the_uninterrupted_run(tmp_path, data_cache, monkeypatch):
    """A real OOM strikes inside forward/backward, after dropout has drawn random numbers: the saved
    step must carry the random state from before the failed step, or the resumed run drifts."""
    cfg = tiny_config(data_cache, max_steps=12, ckpt_interval=100, log_interval=1)
    loop.train(cfg, tmp_path / "full")
    real_step = training.step.train_step
    calls = {"n": 0}

    def oom_mid_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:
            torch.rand(1000)  # what dropout does before the allocation that fails
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(training.run, "train_step", oom_mid_forward)
    with pytest.raises(OutOfMemory):
        loop.train(cfg, tmp_path / "oom")
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(tmp_path / "oom")] == ["step_0000006.pt"]
    loop.train(cfg, tmp_path / "oom")
    assert metrics(tmp_path / "oom") == metrics(tmp_path / "full")


def test_a_save_never_deletes_itself_when_newer_checkpoints_are_stale(tmp_path):
    """After falling back past a damaged step_20 (or resuming an older file by name), the new
    timeline's checkpoint is the one kept; the stale newer files are removed, not the new one."""
    for step in (10, 20):
        save_checkpoint(tmp_path, step, {"step": step, "model": {"w": torch.ones(2)}}, keep=2)
    newest = list_checkpoints(tmp_path)[-1]
    newest.write_bytes(newest.read_bytes()[:50])
    with pytest.warns(UserWarning, match=r"step_0000020.pt is corrupt.*falling back to .*step_0000010.pt"):
        assert latest_checkpoint(tmp_path)[1]["step"] == 10
    save_checkpoint(tmp_path, 15, {"step": 15, "model": {"w": torch.ones(2)}}, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000015.pt"]
    assert latest_checkpoint(tmp_path)[1]["step"] == 15


def test_a_half_written_metrics_line_does_not_block_the_resume(tmp_path, data_cache):
    cfg = tiny_config(data_cache, max_steps=20)
    loop.train(cfg, tmp_path / "full")
    run_dir = tmp_path / "killed"
    shutil.copytree(tmp_path / "full", run_dir)
    (run_dir / "checkpoints" / "step_0000020.pt").unlink()  # killed before the last save...
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "loss": 2.4')  # ...and in the middle of a metrics write
    loop.train(cfg, run_dir)
    assert metrics(run_dir) == metrics(tmp_path / "full")


def test_ctrl_c_before_training_starts_exits_in_one_line(tmp_path, data_cache, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training.run, "prepare", interrupted)
    with pytest.raises(SystemExit) as exited, exit_on_error():
        loop.train(tiny_config(data_cache), tmp_path)
    assert exited.value.code == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().splitlines() == ["SIGINT: interrupted outside the training steps; checkpoints written so far are kept"]


def test_fp16_overflow_is_skipped_by_the_grad_scaler_and_not_counted_as_bad():
    """The decision logic of train_step, on CPU: an enabled grad scaler skips a step with infinite
    gradients and lowers its scale (routine in fp16); without a scaler the step is skipped and bad."""
    from types import SimpleNamespace

    from model import GPT, ModelConfig
    from model.attention import build_attention
    from model.config import AttentionConfig
    from training.config import OptimConfig
    from training.optim import build_optimizer

    cpu = torch.device("cpu")
    t = SimpleNamespace(grad_accum=1, grad_clip=1.0)

    class Loader:
        def next_batch(self):
            x = torch.randint(0, 64, (2, 16))
            return x, x, None

    for scaled in (True, False):
        torch.manual_seed(0)
        attend, _ = build_attention(AttentionConfig(name="sdpa"), cpu)
        model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64), attend)
        optimizer = build_optimizer(model, OptimConfig(), cpu)
        scaler = torch.amp.GradScaler("cpu", enabled=scaled, init_scale=2.0**16)
        blow_up = model.lm_head.weight.register_hook(lambda g: g * float("inf"))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        loss, grad_norm, good = training.step.train_step(model, model, optimizer, scaler, Loader(), t, cpu, torch.float32)
        blow_up.remove()
        assert torch.isfinite(loss) and not torch.isfinite(grad_norm)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing changed
        assert bool(good) is scaled  # fp16 overflow is routine; without a scaler it is a bad step
        if scaled:
            assert scaler.get_scale() == 2.0**15


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 needs a CUDA GPU")
def test_fp16_on_gpu_survives_overflowing_steps(tmp_path, data_cache):
    cfg = tiny_config(data_cache, max_steps=10, device="cuda", dtype="fp16", max_bad_steps=2)
    summary = loop.train(cfg, tmp_path)  # the first steps overflow at scale 65536 and are skipped
    assert summary["step"] == 10
    for path in list_checkpoints(tmp_path):
        assert all(torch.isfinite(v).all() for v in load_checkpoint(path)["model"].values() if v.is_floating_point())
