"""Data parallel on CPU: two gloo processes (DDP and FSDP2) train exactly like one process. The ranks are
forked from one process (tests/forked_ranks.py) but in the tests of torchrun itself (its signals, its errors)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import triton

from conftest import REPO, run_env
from training.checkpoint import list_checkpoints

INTERPRETER_RUNS_FLASH = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)
COMMON = ["model=tiny", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
          "model.dropout=0.0", "data=shakespeare_char", "trainer.device=cpu", "trainer.dtype=fp32",
          "trainer.log_interval=3", "trainer.eval_interval=6", "trainer.eval_iters=2", "trainer.ckpt_interval=6",
          "trainer.sample_tokens=0", "logger.progress=false", "trainer.grad_accum=2"]


def command(cmd, run_dir, cache, *extra):
    return [*cmd, "train.py", *COMMON, f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}", *extra]


def run(cmd, run_dir, cache, *extra, env=None):
    proc = subprocess.run(command(cmd, run_dir, cache, *extra), cwd=REPO, env=env or run_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# The ranks forked from one process that imported torch once (tests/forked_ranks.py): for the tests of what the
# ranks compute; those of torchrun itself (signals, its errors) start TORCHRUN.
FORKED = [sys.executable, str(REPO / "tests" / "forked_ranks.py"), "--nproc_per_node=2"]
FORKED_1 = [*FORKED[:-1], "--nproc_per_node=1"]


def assert_same_curve(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        key = "loss" if "loss" in x else "val_loss"
        assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache):
    """The one-process run that two ranks (batch 4 each) and one rank of batch 8 must reproduce: 18 steps."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    run([sys.executable], run_dir, data_cache, "trainer.batch_size=8", "trainer.max_steps=18")
    return run_dir


def test_two_ranks_equal_one_process_with_the_same_global_batch_and_resume(tmp_path, data_cache, single):
    ddp = tmp_path / "ddp"
    run(FORKED, ddp, data_cache, "trainer.distributed=ddp", "trainer.batch_size=4", "trainer.max_steps=12")
    proc = run(FORKED, ddp, data_cache, "trainer.distributed=ddp", "trainer.batch_size=4", "trainer.max_steps=18")
    assert proc.stdout.count("resuming from") == 1  # rank 0 speaks for both
    assert_same_curve(records(ddp), records(single))
    assert sorted(p.name for p in (ddp / "checkpoints").iterdir()) == ["step_0000012.pt", "step_0000018.pt"]


def test_fsdp_equals_one_process_and_resumes_its_sharded_checkpoint_on_another_world_size(tmp_path, data_cache, single):
    fsdp = tmp_path / "fsdp"
    run(FORKED, fsdp, data_cache, "trainer.distributed=fsdp", "trainer.batch_size=4", "trainer.max_steps=12")
    saved = fsdp / "checkpoints" / "step_0000012"
    assert (saved / ".metadata").is_file() and (saved / "meta.pt").is_file()
    assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one shard per rank
    # One rank with twice the micro-batch sees the same global batches: the curve must go on unchanged.
    proc = run(FORKED_1, fsdp, data_cache, "trainer.distributed=fsdp", "trainer.batch_size=8", "trainer.max_steps=18")
    assert "resuming from" in proc.stdout
    assert_same_curve(records(fsdp), records(single))
    assert sorted(p.name for p in (fsdp / "checkpoints").iterdir()) == ["step_0000012", "step_0000018"]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("backend", ["naive", "hybrid", "flash"])
def test_every_attention_backend_trains_under_ddp_and_fsdp(tmp_path, data_cache, kind, backend):
    if backend == "flash" and not INTERPRETER_RUNS_FLASH:
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot run the flash kernel on the CPU (a loop bound "
                    "computed with tl.minimum is not a 0-d scalar there); triton >= 3.7 runs it")
    env = dict(run_env(), TRITON_INTERPRET="1")  # flash runs our kernel in Triton's interpreter on the CPU
    proc = run(FORKED, tmp_path, data_cache, f"trainer.distributed={kind}", f"attention={backend}",
               "attention.strict=true", "trainer.batch_size=2", "trainer.max_steps=3", "trainer.grad_accum=1", env=env)
    assert f"attention={backend}" in proc.stdout
    losses = [r["loss"] for r in records(tmp_path) if "loss" in r]
    assert losses and all(0 < x < 10 for x in losses)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_sigterm_to_torchrun_stops_every_rank_at_one_step_and_the_run_resumes(tmp_path, data_cache, kind):
    extra = [f"trainer.distributed={kind}", "trainer.batch_size=4", "trainer.max_steps=100000",
             "trainer.ckpt_interval=100000", "trainer.eval_interval=100000"]
    proc = subprocess.Popen(command(TORCHRUN, tmp_path, data_cache, *extra), cwd=REPO, env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler does: torchrun and both ranks get it
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "start the same command again to resume" in err
    saved = list_checkpoints(tmp_path)
    assert len(saved) == 1
    step = int(saved[0].name.split("_")[1].split(".")[0])
    resumed = run(FORKED, tmp_path, data_cache, *extra[:2], f"trainer.max_steps={step + 3}")
    assert f"resuming from {saved[0]} (step {step})" in resumed.stdout
    assert records(tmp_path)[-1]["step"] == step + 3


def test_a_sharded_checkpoint_samples_in_one_process_but_resumes_only_under_fsdp(tmp_path, data_cache):
    run(FORKED, tmp_path, data_cache, "trainer.distributed=fsdp", "trainer.batch_size=2", "trainer.max_steps=6")
    sample = subprocess.run([sys.executable, "-m", "scripts.sample", str(tmp_path / "checkpoints" / "step_0000006"),
                             "--tokens", "16", "--device", "cpu"], cwd=REPO, env=run_env(), capture_output=True,
                            text=True, timeout=120)
    assert sample.returncode == 0, sample.stderr
    assert len(sample.stdout.split("---")[0].strip()) > 0 and "Warning" not in sample.stderr
    args = command([sys.executable], tmp_path, data_cache, "trainer.batch_size=4", "trainer.max_steps=9")
    proc = subprocess.run(args, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "is sharded (saved with trainer.distributed=fsdp); resume it under torchrun" in proc.stderr


def test_torchrun_with_several_processes_but_no_distributed_kind_says_to_add_it(tmp_path, data_cache):
    proc = subprocess.run(command(TORCHRUN, tmp_path, data_cache), cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "error: started by torchrun with several processes but trainer.distributed=none; add " \
           "trainer.distributed=ddp" in proc.stderr


def test_more_ranks_than_gpus_says_to_lower_nproc_per_node(monkeypatch):
    from training import distributed
    from errors import UserError
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"local rank 1 has no GPU \(1 visible\); use --nproc_per_node at most"):
        distributed.setup("ddp", distributed.torch.device("cuda", 0))
