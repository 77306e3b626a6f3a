"""The recipe's scripts without a GPU: the ablation's variants and report, the second corpus' packing,
the compile caches' defaults and the startup clock."""
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time

import pytest
import torch

from conftest import REPO, run_env


def test_the_variants_turn_each_switch_on_and_off_and_compose(tmp_path):
    from test_configs import composed, typed

    from training.config import validate

    from scripts import recipe_ablation

    names = recipe_ablation.write_variants(tmp_path, ["add", "remove"], "speedrun_char")
    assert len(names) == 2 + 2 * len(recipe_ablation.SWITCHES)
    recipe = typed(composed(["experiment=speedrun_char"]))
    picks = {  # variant: (optim, tie_embeddings, qk_norm)
        "ablation_base": ("adamw", True, False), "ablation_recipe": ("muon", False, True),
        "ablation_base_plus_muon": ("muon", True, False), "ablation_recipe_minus_untied": ("muon", True, True)}
    for name, (optim, tied, qk_norm) in picks.items():
        cfg = typed(composed([f"experiment={name}", f"hydra.searchpath=[file://{tmp_path}]"]))
        validate(cfg)
        assert cfg.trainer.run_name == name and cfg.trainer.max_steps == recipe.trainer.max_steps
        assert (cfg.optim.name, cfg.model.tie_embeddings, cfg.model.qk_norm) == (optim, tied, qk_norm)


def write_run(folder, name, vals, wall, first_log=0.5):
    """A run's folder: its first log record at first_log seconds, then len(vals) evaluations over wall seconds."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"trainer:\n  run_name: {name}\nattention:\n  name: sdpa\n")
    records = [{"step": 1, "loss": 5.0, "tokens_per_s": 1000.0, "elapsed_s": first_log}]
    records += [{"step": 100 * (i + 1), "val_loss": v, "elapsed_s": first_log + wall * (i + 1) / len(vals)}
                for i, v in enumerate(vals)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_report_times_the_target_and_the_baselines_final_loss(tmp_path, capsys):
    from scripts import recipe_ablation

    # the baseline's first job paid 8 s of kernel builds before its first log; the seconds count after it
    write_run(tmp_path / "runs" / "0-ablation_base", "ablation_base", [1.6, 1.5, 1.48], wall=30.0, first_log=8.0)
    write_run(tmp_path / "runs" / "1-ablation_recipe", "ablation_recipe", [1.5, 1.46, 1.44], wall=36.0)
    recipe_ablation.main(["report", str(tmp_path / "runs"), "--target", "base", "--out", str(tmp_path / "out")])
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| ablation_base | 1.4800 | 1.4800 | 300 | 30.0 | 1.00 | 1,000 | 30.0 | 8.0 |" in table
    assert "| ablation_recipe | 1.4400 | 1.4400 | 200 | 24.0 | 0.80 | 1,000 | 36.0 | 0.5 |" in table  # 2/3 of 36 s
    assert (tmp_path / "out" / "val_vs_time.png").is_file() and (tmp_path / "out" / "val_vs_step.png").is_file()
    recipe_ablation.main(["report", str(tmp_path / "runs"), "--target", "1.45", "--out", str(tmp_path / "out")])
    assert "| ablation_base | 1.4800 | 1.4800 | n/a | n/a | n/a |" in capsys.readouterr().out


def test_the_startup_report_times_the_target_from_the_command_and_shows_the_phases(tmp_path, capsys):
    from scripts import startup_report

    run = tmp_path / "run"
    write_run(run, "speedrun", [1.5, 1.46, 1.44], wall=3.0, first_log=0.0)  # evaluations 1, 2 and 3 s after the loop's start
    (run / "config.yaml").write_text("trainer:\n  grad_accum: 1\nmodel:\n  block_size: 10\n")
    info = {"batch_size": 2, "loop_start_s": 7.5, "first_step_s": 9.0, "startup_phases_s": {"imports": 4.0, "step 1": 1.5},
            "time_in": {"evaluation": {"count": 3, "seconds": 0.9, "first_seconds": 0.5}},
            "compile_caches": {"fxgraph_cache_hit": 2, "autograd_cache_miss": 1}}
    (run / "run.json").write_text(json.dumps(info))
    runs = tmp_path / "runs.jsonl"
    lines = [startup_report.collect(run, {"experiment": "speedrun_char", "compile": "false", "cache": "warm"}, 0, 12.0),
             startup_report.collect(tmp_path / "none", {"experiment": "gpt2"}, "skipped: no time", None)]
    runs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    startup_report.main(["table", str(runs), "--target", "1.47"])
    out = capsys.readouterr().out
    # 20 tokens a step at 1000 tokens/s; 1.46 <= 1.47 at step 200, 7.5 + 2 s from the command
    assert "| speedrun_char | false | warm | 200 | 9.5 | 1.4400 (300) | 1.4400 | 20.00 | 3, 0.9 (0.5) | 0.0 | 12.0 | ok |" in out
    assert "| speedrun_char | false | warm | 4.0 | n/a |" in out and "| 9.0 | 0.5 | 2/0/0 | 0/1/0 | 12.0 | ok |" in out
    assert "| gpt2 | ? | ? | n/a |" in out and "| skipped: no time |" in out


def fake_kernel_deb(folder):
    """A .deb shaped like linux-source-6.1's: usr/src/linux-source-6.1.tar.xz holding a few files."""
    files = {"Documentation/a.rst": "Prose.\n", "Documentation/b.png": "x", "fs/ext4/inode.c": "int x;\n",
             "drivers/x.c": "int y;\n", "kernel/sched.h": "#define Z\n", "README": "r"}
    root = folder / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text("Package: linux-source-6.1\nVersion: 1\nArchitecture: all\n"
                                             "Maintainer: t <t@t>\nDescription: t\n")
    (root / "usr" / "src").mkdir(parents=True)
    with tarfile.open(root / "usr" / "src" / "linux-source-6.1.tar.xz", "w:xz") as tar:
        for path, text in files.items():
            info = tarfile.TarInfo(f"linux-source-6.1/{path}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    deb = folder / "linux-source-6.1_1_all.deb"
    subprocess.run(["dpkg-deb", "--build", str(root), str(deb)], check=True, capture_output=True)
    return deb


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb (Debian)")
def test_the_corpus_is_packed_from_the_package_and_unpacked_to_text_documents(tmp_path):
    deb = fake_kernel_deb(tmp_path)
    archive = tmp_path / "corpus" / "linux-6.1.tar.xz"
    for args in (["pack", "--deb", str(deb), "--out", str(archive)], ["unpack", str(archive)]):
        proc = subprocess.run([sys.executable, "-m", "scripts.prepare_corpus", *args], cwd=REPO, env=run_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    docs = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "corpus" / "linux-6.1").iterdir())
    assert docs == ["Documentation__a.rst.txt", "fs__ext4__inode.c.txt"]  # no drivers, headers, images
    proc = subprocess.run([sys.executable, "-m", "scripts.prepare_corpus", "unpack", str(tmp_path / "none.tar.xz")],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no such file; write it with" in proc.stderr


def test_compile_caches_get_a_lasting_folder_unless_the_environment_names_one():
    from training.caches import keep_compiled_code

    env = {"XDG_CACHE_HOME": "/c"}
    keep_compiled_code(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/c/nanoflash/inductor" and env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    env = {"TORCHINDUCTOR_CACHE_DIR": "/mine", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    keep_compiled_code(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/mine" and env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "0"


def test_the_startup_clock_counts_from_the_process_start_phase_by_phase():
    from training import metrics

    age = metrics.process_age_s()
    assert age is None or 0 < age < 24 * 3600
    metrics.imports_done()
    clock = metrics.StartupClock(torch.device("cpu"), steps=2)
    clock.phase("data")
    clock.loop_started()
    assert [clock.step_done(), clock.step_done(), clock.step_done()] == [False, True, False]
    for pause in (0.02, 0.01):
        with clock.timed("evaluation"):
            time.sleep(pause)
    record = clock.record()
    assert len(record["steps_done_s"]) == 2 and record["first_step_in_job_s"] >= 0
    evaluations = record["time_in"]["evaluation"]
    assert evaluations["count"] == 2 and 0.02 <= evaluations["first_seconds"] < evaluations["seconds"]
    phases = record["startup_phases_s"]
    later = list(phases)[2 if age is not None else 0:]
    assert later == ["data", "setup", "step 1", "step 2"] and all(s >= 0 for s in phases.values())
    assert clock.summary().endswith(f"step 2 {phases['step 2']:.1f} s") and "data " in clock.summary()
    if age is not None:
        assert list(phases)[:2] == ["imports", "config"] and age <= phases["imports"] + phases["config"] + 1e-3  # rounded to ms
        assert age <= record["loop_start_s"] <= record["first_step_s"] <= record["steps_done_s"][1]
    # a later run of the same process (a multirun's next job) starts at its own train() call
    assert "imports" not in metrics.StartupClock(torch.device("cpu")).record()["startup_phases_s"]


def test_the_startup_clock_counts_the_compile_caches_hits_of_its_own_run():
    import torch._dynamo.utils

    from training.metrics import StartupClock

    counters = torch._dynamo.utils.counters
    counters["inductor"]["fxgraph_cache_miss"] += 3  # an earlier job of the process
    clock = StartupClock(torch.device("cpu"))
    counters["inductor"]["fxgraph_cache_hit"] += 2
    counters["aot_autograd"]["autograd_cache_hit"] += 1
    counters["inductor"]["pattern_matcher_count"] += 5  # not a cache
    assert clock.record()["compile_caches"] == {"fxgraph_cache_hit": 2, "autograd_cache_hit": 1}


def test_the_second_corpus_recipe_turns_on_every_switch_of_speedrun_char():
    from omegaconf import OmegaConf
    from test_configs import composed, typed

    from training.config import validate

    from scripts import recipe_ablation

    linux, char = (composed([f"experiment={name}"]) for name in ("linux_recipe", "speedrun_char"))
    validate(typed(linux))
    for switch, key in recipe_ablation.SWITCHES.items():
        assert OmegaConf.select(linux, key) == OmegaConf.select(char, key), switch
    assert linux.data.name == "linux-6.1" and linux.trainer.max_steps < composed(["experiment=linux_corpus"]).trainer.max_steps
