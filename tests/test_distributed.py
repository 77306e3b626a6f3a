"""Data parallel on CPU: two gloo processes under torchrun train exactly like one process."""
import json
import subprocess
import sys

import pytest

from conftest import REPO, run_env

COMMON = ["model=tiny", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
          "model.dropout=0.0", "data=shakespeare_char", "trainer.device=cpu", "trainer.dtype=fp32",
          "trainer.log_interval=3", "trainer.eval_interval=6", "trainer.eval_iters=2", "trainer.ckpt_interval=6",
          "trainer.sample_tokens=0", "logger.progress=false", "trainer.grad_accum=2"]


def run(cmd, run_dir, cache, *extra):
    args = [*cmd, "train.py", *COMMON, f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}", *extra]
    proc = subprocess.run(args, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def test_two_ranks_equal_one_process_with_the_same_global_batch_and_resume(tmp_path, data_cache):
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    run(TORCHRUN, ddp, data_cache, "trainer.distributed=ddp", "trainer.batch_size=4", "trainer.max_steps=12")
    proc = run(TORCHRUN, ddp, data_cache, "trainer.distributed=ddp", "trainer.batch_size=4", "trainer.max_steps=18")
    assert proc.stdout.count("resuming from") == 1  # rank 0 speaks for both
    run([sys.executable], single, data_cache, "trainer.batch_size=8", "trainer.max_steps=18")
    a, b = records(ddp), records(single)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        key = "loss" if "loss" in x else "val_loss"
        assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6)
    assert sorted(p.name for p in (ddp / "checkpoints").iterdir()) == ["step_0000012.pt", "step_0000018.pt"]


def test_ddp_without_torchrun_says_how_to_start_it(tmp_path, data_cache):
    args = [sys.executable, "train.py", *COMMON, f"data.cache_dir={data_cache}", f"hydra.run.dir={tmp_path}",
            "trainer.distributed=ddp"]
    proc = subprocess.run(args, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "trainer.distributed=ddp runs under torchrun: torchrun --nproc_per_node=N" in proc.stderr


def test_fsdp_is_not_offered_yet(tmp_path, data_cache):
    args = [sys.executable, "train.py", *COMMON, f"data.cache_dir={data_cache}", f"hydra.run.dir={tmp_path}",
            "trainer.distributed=fsdp"]
    proc = subprocess.run(args, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "trainer.distributed='fsdp' is not one of none, ddp" in proc.stderr
