"""Signals a scheduler or a terminal sends: SIGHUP, SIGUSR1 and SIGUSR2 like SIGTERM, a stop that does
not wait for a long evaluation to finish (schedulers give about 30 s before SIGKILL), and the same
stop while tokenizing, sampling, or inside a save."""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO, run_env, tiny_config
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


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2], ids=["SIGHUP", "SIGUSR1", "SIGUSR2"])
def test_sighup_sigusr1_and_sigusr2_save_and_exit_like_sigterm(tmp_path, data_cache, monkeypatch, capsys,
                                                              hangup_fails_the_test, signum):
    """A dropped SSH session sends SIGHUP, schedulers such as SLURM SIGUSR1 before pre-empting (the run
    once died at once, nothing saved): the run saves the step it is in and exits 128 + the signal."""
    real_step = training.step.train_step
    calls = {"n": 0}

    def step_then_signal(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signum)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(training.run, "train_step", step_then_signal)
    with pytest.raises(SystemExit) as exited, exit_on_error():
        loop.train(tiny_config(data_cache, max_steps=20, ckpt_interval=100), tmp_path)
    assert exited.value.code == 128 + signum
    assert f"{signal.Signals(signum).name}: stopped after step 3" in capsys.readouterr().err
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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_while_tokenizing_removes_the_partial_cache_and_ends_in_one_line(tmp_path, monkeypatch, capsys, signum):
    """SIGTERM or SIGHUP while tokenizing once killed the process with no message and left the .tmp file."""
    from data.config import DataConfig
    from data.prepare import prepare
    from data.tokenizers import CharTokenizer

    real_encode = CharTokenizer.encode_batch
    being_written = []

    def encode_then_signal(self, texts, num_threads=1):
        being_written.extend(p.name for p in tmp_path.rglob(".*.tmp"))
        os.kill(os.getpid(), signum)
        return real_encode(self, texts, num_threads)

    monkeypatch.setattr(CharTokenizer, "encode_batch", encode_then_signal)
    with pytest.raises(SystemExit) as exited, exit_on_error():
        prepare(DataConfig(name="stopped", tokenizer="char", cache_dir=str(tmp_path)))
    assert exited.value.code == 128 + signum
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{signal.Signals(signum).name}: interrupted outside the training steps; checkpoints written so far are kept"]
    (folder,) = tmp_path.iterdir()
    assert being_written == [".train.bin.tmp"] and [p.name for p in folder.iterdir()] == [".lock"]


def test_sigterm_during_the_final_sample_ends_in_one_line(tmp_path, data_cache, monkeypatch, capsys):
    """It once ended the run silently, with no sample.txt and no word: now it says that the run is
    finished and how to write the sample."""
    real_generate = GPT.generate

    def generate_then_sigterm(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", generate_then_sigterm)
    with pytest.raises(SystemExit) as exited, exit_on_error():
        loop.train(tiny_config(data_cache, max_steps=4, sample_tokens=20), tmp_path)
    assert exited.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"SIGTERM: stopped while sampling; the run is finished and saved in {tmp_path / 'checkpoints' / 'step_0000004.pt'} "
        f"(write a sample with python -m scripts.sample {tmp_path})")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000004.pt"]


SECOND_SIGNAL_INSIDE_A_SAVE = """
import os, signal, sys, torch
from training.checkpoint import save_checkpoint
from training.signals import StopRequest
run_dir = sys.argv[1]
save_checkpoint(run_dir, 1, {"step": 1}, keep=2)
real_save = torch.save

def interrupted_save(obj, f):
    f.write(b"x" * 100_000)  # half a checkpoint written...
    os.kill(os.getpid(), signal.SIGINT)  # ...when the second Ctrl-C arrives

torch.save = interrupted_save
with StopRequest():
    os.kill(os.getpid(), signal.SIGINT)  # the first: a checkpoint is due
    save_checkpoint(run_dir, 2, {"step": 2}, keep=2)
print("the second signal did not stop the process")
"""


def test_a_second_signal_during_a_save_leaves_no_temporary_file(tmp_path):
    """Two fast Ctrl-C during a save: the status was right, but a 55 MB .tmp checkpoint stayed."""
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL_INSIDE_A_SAVE, str(tmp_path)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000001.pt"]


def test_ctrl_c_while_sampling_is_one_line(tmp_path, data_cache, monkeypatch, capsys):
    import importlib

    loop.train(tiny_config(data_cache, max_steps=2, ckpt_interval=2), tmp_path)
    sample = importlib.import_module("scripts.sample")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(GPT, "generate", interrupted)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited, exit_on_error(stopped="sampling stopped; nothing was printed"):
        sample.main([str(tmp_path), "--device", "cpu", "--tokens", "1000"])
    assert exited.value.code == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().splitlines()[-1] == "SIGINT: sampling stopped; nothing was printed"
