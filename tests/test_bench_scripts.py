"""The measurement scripts run on CPU: bench_attention, compare_runs (on a real multirun) and fit."""
import csv
import json
import subprocess
import sys

import pytest

from conftest import REPO, run_env


def run(args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=timeout)


def test_bench_attention_on_cpu_writes_table_files_and_plots(tmp_path):
    proc = run(["scripts/bench_attention.py", "--device", "cpu", "--dtype", "fp32", "--B", "1", "--H", "2",
                "--D", "16", "--T", "32,64", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("| fwd")]
    assert len(table) == 2 * 2 * 3  # modes x lengths x (naive, hybrid, sdpa)
    assert "# flash: n/a" in proc.stdout and "# sdpa-cudnn: n/a (needs a CUDA GPU)" in proc.stdout
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert {r["backend"] for r in rows} == {"naive", "hybrid", "sdpa"}
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows)
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["device"] == "cpu"
    assert (tmp_path / "bench_fwd.png").stat().st_size > 1000 and (tmp_path / "bench_fwd_bwd.png").is_file()


@pytest.mark.parametrize("script,args,message", [
    ("scripts/bench_attention.py", ["--device", "cpu", "--vram-budget-gb", "8"], "needs a CUDA GPU"),
    ("scripts/fit.py", ["model=tiny"], "needs a CUDA GPU"),
])
def test_gpu_only_options_fail_clearly_without_cuda(script, args, message):
    proc = run([script, *args])
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_compare_runs_reads_a_multirun(tmp_path, data_cache):
    sweep = tmp_path / "mr"
    proc = run(["train.py", "experiment=compare_backends", "model=tiny", "data=shakespeare_char",
                f"data.cache_dir={data_cache}", "trainer.max_steps=6", "trainer.batch_size=2", "trainer.log_interval=2",
                "trainer.eval_interval=3", "trainer.eval_iters=1", "trainer.sample_tokens=0", "logger.progress=false",
                f"hydra.sweep.dir={sweep}"], timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "cmp"
    proc = run(["scripts/compare_runs.py", str(sweep), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(open(out / "table.csv")))
    assert [r["backend"] for r in rows] == ["naive", "hybrid", "sdpa", "flash (ran sdpa)"]
    assert all(r["steps"] == "6" and float(r["tokens_per_s"]) > 0 for r in rows)
    assert len({r["train_loss"] for r in rows}) == 1  # same function, same losses on CPU
    for name in ("loss_vs_step.png", "loss_vs_time.png", "throughput_memory.png"):
        assert (out / name).stat().st_size > 1000


def test_compare_runs_says_when_there_is_nothing_to_compare(tmp_path):
    proc = run(["scripts/compare_runs.py", str(tmp_path)])
    assert proc.returncode == 2 and "no run folders" in proc.stderr
