"""Run folders and token caches: one process at a time, their problems found before training starts,
a full disk during a save, and resumes that never delete another timeline's checkpoints unannounced."""
import errno
import io
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_env, tiny_config
from data.folders import FolderLock, lock_holder
from errors import UserError
from training import distributed, loop
from training.checkpoint import list_checkpoints, save_checkpoint
from training.run_folder import claim_run_folder


def train_cmd(run_dir, cache, *extra):
    return [sys.executable, "train.py", "model=tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
            "model.block_size=32", "data=shakespeare_char", f"data.cache_dir={cache}", "trainer.device=cpu",
            "trainer.max_steps=2", "trainer.batch_size=2", "trainer.eval_iters=1", "trainer.sample_tokens=0",
            "logger.progress=false", f"hydra.run.dir={run_dir}", *extra]


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_a_second_run_into_a_busy_folder_stops_at_once_naming_the_holder(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = FolderLock(run_dir)
    assert held.try_acquire()
    try:
        proc = subprocess.run(train_cmd(run_dir, data_cache), cwd=REPO, env=run_env(), capture_output=True, text=True,
                              timeout=120)
        line = one_error_line(proc.stderr)
        assert proc.returncode == 2 and f"in use by another run (PID {os.getpid()})" in line
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing written: not even Hydra's .hydra/
        with pytest.raises(UserError, match=f"in use by another run .PID {os.getpid()}"):
            loop.train(tiny_config(data_cache), run_dir)  # the same, called in-process
    finally:
        held.release()
    loop.train(tiny_config(data_cache, max_steps=2), run_dir)  # free again


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom data.folders import FolderLock\n"
                               "assert FolderLock(sys.argv[1]).try_acquire()\nprint('held', flush=True)\ntime.sleep(60)",
                               str(tmp_path)], cwd=REPO, env=run_env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert lock_holder(tmp_path) == holder.pid
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert lock_holder(tmp_path) is None
    lock = FolderLock(tmp_path)
    assert lock.try_acquire()
    lock.release()


def test_under_torchrun_rank_0_holds_the_run_folder(tmp_path):
    other = FolderLock(tmp_path)
    assert other.try_acquire()
    try:
        assert claim_run_folder(tmp_path, distributed.Ranks(rank=1, world_size=2)) is None  # takes nothing
        with pytest.raises(UserError, match="in use by another run"):
            claim_run_folder(tmp_path, distributed.Ranks(rank=0, world_size=2))
    finally:
        other.release()
    lock = claim_run_folder(tmp_path, distributed.Ranks(rank=0, world_size=2))
    assert lock_holder(tmp_path) == os.getpid()
    lock.release()


def test_two_preparations_of_one_cache_wait_for_each_other(tmp_path):
    """Both see no cache; the second waits for the first and reuses what it built: no temporary files,
    no traceback. The test holds the cache's lock until both are waiting, so they surely overlap."""
    from data.config import DataConfig
    from data.prepare import cache_folder

    cache = tmp_path / "cache"
    folder = cache_folder(DataConfig(name="shakespeare_char", tokenizer="char", cache_dir=str(cache)))
    folder.mkdir(parents=True)
    held = FolderLock(folder)
    assert held.try_acquire()
    cmd = [sys.executable, "-m", "scripts.prepare_data", "data=shakespeare_char", f"data.cache_dir={cache}"]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for proc in procs:
            line = proc.stdout.readline()
            assert f"waiting for PID {os.getpid()}" in line, line + proc.stderr.read()
    finally:
        held.release()
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert sum(out.count("tokenizing") for out, _ in outputs) == 1, outputs
    assert not any("Traceback" in err for _, err in outputs)
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "manifest.json", "train.bin", "val.bin"]


def test_a_run_dir_that_is_a_file_fails_in_one_line(tmp_path, data_cache):
    path = tmp_path / "run"
    path.write_text("not a folder")
    proc = subprocess.run(train_cmd(path, data_cache), cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{path} is a file, not a folder" in one_error_line(proc.stderr)
    proc = subprocess.run(train_cmd(path / "sub", data_cache), cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and f"{path} is a file, not a folder" in one_error_line(proc.stderr)


def trained_nothing(run_dir) -> bool:
    return not (run_dir / "metrics.jsonl").exists()


def test_run_folder_problems_fail_before_training(tmp_path, data_cache, monkeypatch):
    cfg = tiny_config(data_cache, max_steps=2)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "checkpoints").write_text("")
    with pytest.raises(UserError, match=r"a/checkpoints is a file, not a folder.*remove it or give another hydra.run.dir"):
        loop.train(cfg, tmp_path / "a")
    assert trained_nothing(tmp_path / "a")

    (tmp_path / "b").write_text("")
    with pytest.raises(UserError, match="b is a file, not a folder"):
        loop.train(cfg, tmp_path / "b")

    (tmp_path / "c").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(tmp_path / "c") else real_access(p, mode, **kw))
    with pytest.raises(UserError, match="cannot write to the run folder .*c; give a writable hydra.run.dir"):
        loop.train(cfg, tmp_path / "c")  # as root (in CI containers) nothing is unwritable: os.access says so here
    assert trained_nothing(tmp_path / "c")


def test_a_cache_dir_that_is_a_file_fails_in_one_line(tmp_path):
    from data.config import DataConfig
    from data.prepare import prepare

    (tmp_path / "cache").write_text("")
    with pytest.raises(UserError, match=r"data.cache_dir=.*cache: .*cache is a file, not a folder"):
        prepare(DataConfig(name="c", tokenizer="char", cache_dir=str(tmp_path / "cache")))
    with pytest.raises(UserError, match=r"data.cache_dir=.*cache/sub: .*cache is a file, not a folder"):
        prepare(DataConfig(name="c", tokenizer="char", cache_dir=str(tmp_path / "cache" / "sub")))


class FillsUp(io.RawIOBase):
    """A file that takes ``room`` bytes, then fails as a full disk does (ENOSPC)."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.room:
            self.f.write(bytes(data[:self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """PyTorch's zip writer turns the failed write into `RuntimeError: ... unexpected pos`; the
    temporary file stayed (70 MB in the report) and the next save failed the same way."""
    state = lambda step: {"step": step, "model": {"w": torch.full((100_000,), float(step))}}
    save_checkpoint(tmp_path, 1, state(1), keep=2)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: real_save(obj, FillsUp(f, 50_000)))
    with pytest.raises(UserError, match=r"no space left on .*checkpoints: the checkpoint of step 2 was not written; "
                                        r"the previous checkpoints are kept"):
        save_checkpoint(tmp_path, 2, state(2), keep=2)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000001.pt"]
    assert save_checkpoint(tmp_path, 2, state(2), keep=2).name == "step_0000002.pt"  # space again: it saves


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import training.checkpoint

    save_checkpoint(tmp_path, 1, {"step": 1, "model": {"w": torch.ones(100_000)}}, keep=2)
    size = (tmp_path / "checkpoints" / "step_0000001.pt").stat().st_size
    monkeypatch.setattr(training.checkpoint.shutil, "disk_usage", lambda p: SimpleNamespace(free=size // 2))
    with pytest.raises(UserError, match=r"no space left on .*checkpoints: the checkpoint of step 2 was not written "
                                        r"\(0.2 MB free, the last one took 0.4 MB\)"):
        save_checkpoint(tmp_path, 2, {"step": 2, "model": {"w": torch.ones(100_000)}}, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000001.pt"]


def test_resuming_another_folders_checkpoint_never_deletes_this_folders_newer_ones(tmp_path, data_cache):
    cfg = tiny_config(data_cache, max_steps=4, ckpt_interval=2)
    loop.train(cfg, tmp_path / "a")
    cfg.trainer.max_steps = 10
    loop.train(cfg, tmp_path / "b")
    cfg.trainer.resume = str(tmp_path / "a" / "checkpoints" / "step_0000004.pt")
    cfg.trainer.max_steps = 12
    with pytest.raises(UserError, match=r"holds a newer checkpoint, .*b/checkpoints/step_0000010.pt, .*"
                                        r"give another hydra.run.dir"):
        loop.train(cfg, tmp_path / "b")
    assert list_checkpoints(tmp_path / "b")[-1].name == "step_0000010.pt"


def test_rolling_back_in_the_same_folder_says_which_checkpoints_it_replaces(tmp_path, data_cache, capsys):
    cfg = tiny_config(data_cache, max_steps=6, ckpt_interval=2)
    loop.train(cfg, tmp_path)
    capsys.readouterr()
    cfg.trainer.resume = str(tmp_path / "checkpoints" / "step_0000002.pt")
    loop.train(cfg, tmp_path)
    out = capsys.readouterr().out
    assert "rolling back to step 2: step_0000004.pt, step_0000006.pt of this folder are replaced by this run's" in out
