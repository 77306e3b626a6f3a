"""The loop end to end (on CPU, and with a GPU-only backend on the GPU): loss falls, metrics are
complete, resume is exact; every backend of the table that runs here on a device of its own."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, backend_params, device_for, run_env, tiny_config
from training.checkpoint import list_checkpoints, load_checkpoint
from training.loop import train

RECORD_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_vram_mb", "elapsed_s"}


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


BACKENDS_HERE = backend_params(emulated_too=False)


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_loss_falls_and_every_record_is_complete(tmp_path, data_cache, backend):
    cfg = tiny_config(data_cache, max_steps=60, batch_size=16, log_interval=10, eval_interval=30,
                      device=device_for(backend))
    cfg.attention.name = backend
    summary = train(cfg, tmp_path)
    records = read_metrics(tmp_path)
    train_records = [r for r in records if "loss" in r]
    assert all(RECORD_KEYS <= r.keys() for r in train_records)
    assert train_records[-1]["loss"] < train_records[0]["loss"] - 0.5
    on_cpu = cfg.trainer.device == "cpu"  # no MFU and no VRAM on the CPU
    assert all((r["mfu"] is None and r["peak_vram_mb"] is None) == on_cpu for r in train_records)
    assert all(r["tokens_per_s"] > 0 for r in train_records)
    assert [r["step"] for r in records if "val_loss" in r] == [30, 60]
    assert summary["backend"] == backend and summary["step"] == 60


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_resume_after_a_kill_matches_the_uninterrupted_run_exactly(tmp_path, data_cache, backend):
    """Run 20 steps; then, in a copy, drop the step-20 checkpoint and the records after step 10 are
    replayed from the step-10 checkpoint: every metric and the final weights must be bitwise equal.
    Dropout is on everywhere, attention probabilities included (the RNG state is in the checkpoint).
    Uncaptured on a GPU, as this test checks the checkpoint; test_cuda_graph.py compares captured runs
    with uncaptured ones, under PyTorch's deterministic algorithms."""
    cfg = tiny_config(data_cache, device=device_for(backend), cuda_graph=False)
    cfg.model.attention_dropout = 0.3
    cfg.attention.name = backend
    full = tmp_path / "full"
    train(cfg, full)
    killed = tmp_path / "killed"
    shutil.copytree(full, killed)
    (killed / "checkpoints" / "step_0000020.pt").unlink()
    train(cfg, killed)

    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in rs]
    assert strip(read_metrics(killed)) == strip(read_metrics(full))
    a = load_checkpoint(full / "checkpoints" / "step_0000020.pt")["model"]
    b = load_checkpoint(killed / "checkpoints" / "step_0000020.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_only_the_newest_checkpoints_are_kept_and_they_load_weights_only(tmp_path, data_cache):
    cfg = tiny_config(data_cache, max_steps=30, ckpt_interval=5, keep_checkpoints=2)
    train(cfg, tmp_path)
    kept = list_checkpoints(tmp_path)
    assert [p.name for p in kept] == ["step_0000025.pt", "step_0000030.pt"]
    state = torch.load(kept[-1], weights_only=True)
    assert {"model", "optimizer", "scaler", "loader", "rng", "config", "step"} <= state.keys()


def test_a_finished_run_is_not_trained_again(tmp_path, data_cache, capsys):
    cfg = tiny_config(data_cache, max_steps=10)
    train(cfg, tmp_path)
    summary = train(cfg, tmp_path)
    assert summary["loss"] is None
    assert "finished run" in capsys.readouterr().out


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_activation_checkpointing_gives_the_same_losses(tmp_path, data_cache, backend):
    cfg = tiny_config(data_cache, max_steps=10, device=device_for(backend))
    cfg.model.dropout = 0.0
    cfg.attention.name = backend
    train(cfg, tmp_path / "plain")
    cfg.model.activation_checkpointing = True
    train(cfg, tmp_path / "ckpt")
    losses = lambda d: [r["loss"] for r in read_metrics(d) if "loss" in r]
    assert losses(tmp_path / "plain") == pytest.approx(losses(tmp_path / "ckpt"), rel=1e-5)


def test_train_py_runs_end_to_end_and_writes_the_run_folder(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    args = [sys.executable, "train.py", "model=tiny", "data=shakespeare_char", f"data.cache_dir={data_cache}",
            "trainer.max_steps=10", "trainer.batch_size=4", "trainer.eval_interval=5", "trainer.eval_iters=1",
            "trainer.log_interval=5", "trainer.sample_tokens=20", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(args, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "config.yaml").is_file() and (run_dir / "sample.txt").is_file()
    assert "sample after 10 steps" in proc.stdout
    assert len(read_metrics(run_dir)) == 4


def test_profile_steps_writes_where_the_step_time_goes(tmp_path, data_cache):
    cfg = tiny_config(data_cache, max_steps=14, profile_steps=3, log_interval=7, eval_interval=14)
    train(cfg, tmp_path)
    text = (tmp_path / "profile.md").read_text()
    assert text.startswith("# Profile of steps 11-13 (3 steps, cpu,")
    assert "- wall time per step:" in text and "| matmul |" in text and "| attention |" in text
    shares = [float(line.split("|")[3].strip().rstrip("%")) for line in text.splitlines()
              if line.startswith("| ") and line.rstrip().endswith("% |")]
    assert sum(shares) == pytest.approx(100.0, abs=0.5)
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [7, 14]  # the run itself goes on


def test_profiling_is_skipped_when_the_run_ends_before_the_warm_up(tmp_path, data_cache, capsys):
    """Validation refuses it (trainer.profile_steps beyond trainer.max_steps); a resumed run that starts too
    late to profile says so instead of writing nothing silently."""
    train(tiny_config(data_cache, max_steps=8, profile_steps=3), tmp_path)
    assert not (tmp_path / "profile.md").exists()
    assert "trainer.profile_steps=3: nothing is profiled, the run ends at step 8 before step 11" in capsys.readouterr().out


@pytest.mark.parametrize("name,kind", [
    ("_attn_bwd_dkdv_kernel", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void con", "attention"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int,", "attention"),
    ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64,", "attention"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
    ("Memcpy DtoD (Device -> Device)", "memory copies"),
    ("triton_red_fused__to_copy_native_layer_norm_0", "other (norms, activations, loss, elementwise)"),
])
def test_profile_categories_name_the_kind_of_work(name, kind):
    from training.profiling import category
    assert category(name) == kind


def test_gpu_profile_counts_kernels_once_and_skips_named_regions(tmp_path):
    from types import SimpleNamespace

    from training.profiling import StepProfiler

    def event(key, device, us, annotation=False):
        return SimpleNamespace(key=key, device_type=SimpleNamespace(name=device), device_time_total=us,
                               self_cpu_time_total=0, is_user_annotation=annotation)

    profiler = StepProfiler(tmp_path, 2, 0, torch.device("cuda", 0), 100)
    profiler.prof = SimpleNamespace(key_averages=lambda: [
        event("_attn_fwd_kernel", "CUDA", 30.0),
        event("Optimizer.step#AdamW.step", "CUDA", 50.0, annotation=True),  # spans the kernel below
        event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", "CUDA", 45.0),
        event("aten::mm", "CPU", 80.0),
    ])
    assert profiler._times_us() == {"_attn_fwd_kernel": 30.0, "multi_tensor_apply_kernel<FusedAdamMathFunctor>": 45.0}


def test_gpu_profile_says_how_much_communication_ran_under_other_kernels(tmp_path):
    from types import SimpleNamespace

    from training.profiling import hidden_communication_us, overlap_us, report

    assert overlap_us([(0, 10), (20, 30)], [(5, 12), (8, 22), (40, 50)]) == (20, 7)

    def kernel(name, start, end):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name="CUDA"), time_range=SimpleNamespace(start=start, end=end))

    prof = SimpleNamespace(events=lambda: [kernel("ncclDevKernel_SendRecv", 0, 100), kernel("_attn_fwd_kernel", 10, 70),
                                           kernel("ampere_bf16_gemm", 60, 90),
                                           SimpleNamespace(name="aten::mm", device_type=SimpleNamespace(name="CPU"))])
    assert hidden_communication_us(prof) == (100, 80)
    text = report({"ncclDevKernel_SendRecv": 100.0, "_attn_fwd_kernel": 60.0}, 0.001, 1, torch.device("cpu"), (1, 1),
                  (100.0, 80.0))
    assert "Communication kernels: 0.10 ms per step, 0.08 ms of it (80%) while other kernels ran" in text


def test_the_profile_lists_kernels_until_they_hold_most_of_the_time():
    from training.profiling import LISTED_SHARE, MAX_LISTED, longest_first

    times = {f"k{i}": 100.0 for i in range(5)} | {f"small{i}": 1.0 for i in range(100)}
    listed = longest_first(times)
    assert [name for name, _ in listed[:5]] == [f"k{i}" for i in range(5)]
    assert len(listed) == 75 and sum(us for _, us in listed) == LISTED_SHARE * sum(times.values())
    assert len(longest_first({f"k{i}": 1.0 for i in range(500)})) == MAX_LISTED
    assert len(longest_first({f"k{i}": 1.0 for i in range(5)})) == 5
