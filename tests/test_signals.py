"""Signals a scheduler or a terminal sends: SIGHUP like SIGTERM, and a stop that does not wait for a
long evaluation to finish (schedulers give about 30 s before SIGKILL)."""
import json
import os
import signal

import pytest

from conftest import tiny_config
import training.run
import training.step
from model.gpt import GPT
from training import loop
from training.checkpoint import list_checkpoints
from training.exits import exit_on_error


@pytest.fixture
def hangup_fails_the_test():
    """Without our handler a SIGHUP would end the test process: make it fail the test instead."""
    def unhandled(signum, frame):
        raise AssertionError("SIGHUP reached the default handler: the run would have died without saving")

    previous = signal.signal(signal.SIGHUP, unhandled)
    yield
    signal.signal(signal.SIGHUP, previous)


def test_sighup_saves_and_exits_129_like_sigterm(tmp_path, data_cache, monkeypatch, capsys, hangup_fails_the_test):
    """A dropped SSH session sends SIGHUP: the run saves the step it is in and exits 128 + 1."""
    real_step = training.step.train_step
    calls = {"n": 0}

    def step_then_hangup(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGHUP)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(training.run, "train_step", step_then_hangup)
    with pytest.raises(SystemExit) as exited, exit_on_error():
        loop.train(tiny_config(data_cache, max_steps=20, ckpt_interval=100), tmp_path)
    assert exited.value.code == 128 + signal.SIGHUP
    assert "SIGHUP: stopped after step 3" in capsys.readouterr().err
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000003.pt"]


def test_sigterm_during_a_long_evaluation_stops_it_and_saves(tmp_path, data_cache, monkeypatch):
    """eval_iters=400 once ran to the end (139 s in the report), then one more step, before saving."""
    real_forward = GPT.forward
    evaluated = {"batches": 0}

    def forward(self, *args):
        if not self.training:
            evaluated["batches"] += 1
            if evaluated["batches"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        return real_forward(self, *args)

    monkeypatch.setattr(GPT, "forward", forward)
    cfg = tiny_config(data_cache, max_steps=20, eval_interval=5, eval_iters=400, ckpt_interval=100, log_interval=1)
    with pytest.raises(loop.Interrupted, match="SIGTERM: stopped after step 5"):
        loop.train(cfg, tmp_path)
    assert evaluated["batches"] <= 3
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000005.pt"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 5 and not any("val_loss" in r for r in records)  # no half evaluation
