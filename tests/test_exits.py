"""Every error that reaches the user is one line and exit status 2 (a signal: 128 + its number), from
train.py and from every script (training/exits.py); options that contradict each other are refused
when the config is validated, and in a sweep before the first job trains."""
import importlib.util
import os
import re
import signal

import pytest
import torch

from conftest import REPO, assert_one_error_line, tiny_config, walk
from errors import UserError
from training.exits import exit_on_error
from training.signals import StopSignal

SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py") if p.name not in ("__init__.py", "bench_common.py"))
NO_GPU = not torch.cuda.is_available()
HF_PACKAGES = all(importlib.util.find_spec(name) for name in ("transformers", "tokenizers", "safetensors"))
NO_CHECKPOINT = "{tmp}/missing holds no checkpoint" if HF_PACKAGES else "pip install transformers safetensors"


def one_error_line(stderr: str) -> str:
    """The single line of ``stderr`` (tqdm's and Hydra's progress aside), which starts with error:."""
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[20")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


# Each script (and train.py) with a wrong argument: (script, arguments with {tmp} for a scratch folder, the
# text of the line). Cases that need the absence of a GPU (the script then stops at once) are left out on a
# GPU machine.
TRAIN = ["model=tiny", "data=shakespeare_char", "data.cache_dir={tmp}/cache", "hydra.run.dir={tmp}/run",
         "hydra.sweep.dir={tmp}/sweep", "trainer.max_steps=2"]
WALK = [
    ("train.py", ["attention=naive,sdpa", *TRAIN], "Ambiguous value for argument 'attention=naive,sdpa'"),
    ("train.py", ["-cd", "{tmp}/missing", *TRAIN], "Additional config directory '{tmp}/missing' not found"),
    ("train.py", ["-m", "trainer.grad_accum=1,0", *TRAIN], "job 1 of the sweep (trainer.grad_accum=0): "
     "trainer.grad_accum=0 must be a positive number; no job was run"),
    ("train.py", ["experiment=compare_backends", *TRAIN, "trainer.grad_accum=0"], "trainer.grad_accum=0 must be a "
     "positive number; no job was run"),
    ("train.py", [*TRAIN, "model.n_embd=1099511627776", "model.n_head=4"], "out of CPU memory (an allocation of"),
    ("prepare_data.py", ["data.path={tmp}/missing.txt"], "data.path: {tmp}/missing.txt does not exist"),
    ("bench_attention.py", ["--B", "-1", "--device", "cpu"], "every size must be a positive integer"),
    ("bench_attention.py", ["--from-json", "{tmp}/missing.json"], "--from-json {tmp}/missing.json: no such file"),
    ("bench_context_parallel.py", ["--paths", "sideways", "trainer.device=cpu"], "--paths=sideways: choose plain, ring"),
    ("bench_flash.py", ["--dropout", "2"], "--dropout must be in (0, 1), got 2.0"),
    ("compare_runs.py", ["{tmp}/missing"], "{tmp}/missing is not a run folder"),
    ("compare_runs.py", ["{tmp}", "--out", "{tmp}/a-file"], "--out={tmp}/a-file: {tmp}/a-file is a file, not a folder"),
    ("eval_length.py", ["{tmp}", "--factors", "0"], "--factors, --batches and --tokens must be positive"),
    ("fit.py", ["trainer.device=cpu"], "scripts/fit.py measures GPU memory and needs a CUDA GPU"),
    ("plot_runs.py", ["--out", "{tmp}/a-file"], "--out={tmp}/a-file: {tmp}/a-file is a file, not a folder"),
    ("sample.py", ["{tmp}/missing"], "{tmp}/missing holds no checkpoint"),
    ("sample.py", ["{tmp}/missing", "--tokens", "1000000"], "--tokens=1000000 is more than 100,000"),
    ("sample.py", ["{tmp}/missing", "--seed", "-1"], "--seed=-1 must be in [0, 2**64)"),
    ("export_hf.py", ["{tmp}/missing", "--out", "{tmp}/hf"], NO_CHECKPOINT),  # without the packages: that first
    ("check_export.py", ["{tmp}/missing", "--out", "{tmp}/check"], NO_CHECKPOINT),
    ("prepare_corpus.py", ["unpack", "{tmp}/missing.tar.xz"], "{tmp}/missing.tar.xz: no such file"),
    ("recipe_ablation.py", ["report", "{tmp}/missing", "--out", "{tmp}/report"], "{tmp}/missing is not a run folder"),
    ("startup_report.py", ["table", "{tmp}/missing.jsonl"], "{tmp}/missing.jsonl: no such file of runs"),
    ("startup_report.py", ["collect", "{tmp}", "not-a-label"], "'not-a-label' is not key=value (startup_report.py"),
    ("sample.py", ["{tmp}", "--no-such-option"], "sample.py: unrecognized arguments: --no-such-option (sample.py "
     "--help lists the options)"),
    ("prepare_corpus.py", [], "prepare_corpus.py: the following arguments are required: command"),
    ("startup_report.py", ["collect", "{tmp}", "--status", "0"], "collect --status needs --wall"),
] + ([
    ("bench_decode.py", ["--out", "{tmp}/decode"], "needs a CUDA GPU"),
    ("bench_cross_entropy.py", [], "needs a CUDA GPU"),
    ("profile_flash.py", ["--out", "{tmp}/out"], "needs a CUDA GPU"),
] if NO_GPU else [])



def test_every_script_is_walked_with_a_wrong_argument():
    """A new script must be added to WALK."""
    gpu_only = {"bench_cross_entropy.py", "profile_flash.py", "bench_decode.py"} if not NO_GPU else set()
    missing = set(SCRIPTS) - {script for script, _, _ in WALK} - gpu_only
    assert not missing, f"scripts with no bad-argument case: {sorted(missing)}"


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    """Every WALK case run in one Python process (runpy, as `python <script>` runs it): (status, stderr)."""
    tmp = tmp_path_factory.mktemp("walk")
    (tmp / "a-file").write_text("")
    cases = [[str(REPO / "train.py") if script == "train.py" else f"scripts.{script.removesuffix('.py')}",
              [a.format(tmp=tmp) for a in args]] for script, args, _ in WALK]
    return tmp, walk(cases)


def test_a_script_run_as_a_file_says_to_run_it_as_a_module():
    """`python scripts/x.py` cannot import the repository's packages (no script edits sys.path)."""
    scripts = [s for s in SCRIPTS if s != "prepare_corpus.py"]  # imports nothing of nanoflash: runs either way
    for script, (code, stderr, _) in zip(scripts, walk([[f"scripts/{s}", []] for s in scripts])):
        assert code == 2, (script, stderr)
        assert_one_error_line(stderr, f"python -m scripts.{script.removesuffix('.py')}")


@pytest.mark.parametrize("case", range(len(WALK)), ids=[f"{s}-{'-'.join(a)[:24]}" for s, a, _ in WALK])
def test_a_script_with_a_wrong_argument_ends_in_one_line(walked, case):
    """Hydra's own errors were several lines with status 1; scripts ended in tracebacks (bench_attention.py
    --B -1, --from-json <missing>, compare_runs.py --out <a file>, ...); in `-m trainer.grad_accum=1,0`
    job 0 trained to the end before the bad value was refused; CPU out of memory was a traceback."""
    tmp, results = walked
    code, stderr, _ = results[case]
    assert code == 2, stderr
    assert WALK[case][2].format(tmp=tmp) in one_error_line(stderr)


def test_no_job_of_a_refused_sweep_runs(walked):
    tmp, _ = walked
    assert not (tmp / "sweep").exists() and not (tmp / "run" / "checkpoints").exists()


def exits(body, capsys, **kwargs):
    """(status, stderr) of ``body`` run under the exit policy."""
    with pytest.raises(SystemExit) as exited, exit_on_error(**kwargs):
        body()
    return exited.value.code, capsys.readouterr().err


def raising(err):
    def body():
        raise err
    return body


def test_an_unexpected_error_is_one_line_and_says_how_to_see_more(capsys, monkeypatch):
    code, err = exits(raising(RuntimeError("first\n  second line")), capsys)
    assert code == 2 and err.strip() == ("error: RuntimeError: first second line (unexpected: NANOFLASH_TRACEBACK=1 shows "
                                         "where it comes from; please report it)")
    code, err = exits(raising(IndexError()), capsys)
    assert code == 2 and "IndexError: no message" in err and len(err.splitlines()) == 1
    monkeypatch.setattr("training.exits.SHOW_TRACEBACK", True)
    with pytest.raises(RuntimeError, match="first"), exit_on_error():
        raise RuntimeError("first")


def test_running_out_of_cpu_memory_is_one_line_with_advice(capsys):
    """model.n_embd=4194304 on CPU once ended in the allocator's traceback."""
    failed = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                          "tried to allocate 211106232532992 bytes. Error code 12 (Cannot allocate memory)")
    code, err = exits(raising(failed), capsys)
    assert code == 2 and err.startswith("error: out of CPU memory (an allocation of 196,608.0 GiB failed); checkpoints "
                                        "written so far are kept. Try a smaller model") and len(err.splitlines()) == 1


def test_a_system_error_names_its_file(capsys, tmp_path):
    code, err = exits(lambda: open(tmp_path, "w"), capsys)
    assert code == 2 and err.strip() == f"error: {tmp_path}: Is a directory"


def test_a_signal_behind_another_error_still_ends_with_its_status(capsys):
    """A library that replaces the exception a signal raised inside it (torch.save's zip writer did)."""
    def replaced():
        try:
            raise StopSignal(signal.SIGUSR1)
        except BaseException as err:
            raise RuntimeError("unexpected pos 5529280") from err

    code, err = exits(replaced, capsys, stopped="sampling stopped")
    assert code == 128 + signal.SIGUSR1 and err.strip() == "SIGUSR1: sampling stopped"


def test_the_policy_restores_what_it_changes():
    before = os.environ.get("HYDRA_FULL_ERROR"), signal.getsignal(signal.SIGTERM)
    with exit_on_error():
        assert os.environ["HYDRA_FULL_ERROR"] == "1" and signal.getsignal(signal.SIGTERM) != before[1]
    assert (os.environ.get("HYDRA_FULL_ERROR"), signal.getsignal(signal.SIGTERM)) == before


COMBINATIONS = [  # options each valid, impossible or certainly wrong together
    pytest.param({"optim": {"min_lr": 1e-2}}, "optim.min_lr=0.01 is above optim.lr=0.003: the cosine schedule would climb", id="min-lr-above-lr"),
    pytest.param({"trainer": {"profile_steps": 5, "max_steps": 8}}, "trainer.profile_steps=5 records steps after 10 of "
                 "warm-up, but trainer.max_steps=8 ends before; raise trainer.max_steps to at least 15", id="profile-beyond-the-run"),
    pytest.param({"trainer": {"vram_budget_gb": 8.0}}, "trainer.vram_budget_gb=8.0 caps GPU memory, but trainer.device=cpu", id="vram-budget-on-cpu"),
    pytest.param({"attention": {"window": 32}}, "attention.window=32 is not below model.block_size=32", id="window-as-long-as-the-block"),
    pytest.param({"data": {"split": "test"}}, "data.split=test is read by data.source=hf only", id="hf-option-with-text"),
    pytest.param({"trainer": {"resume_changes": "always"}}, "trainer.resume_changes='always' is not one of refuse, allow", id="resume-changes-word"),
]


@pytest.mark.parametrize("change,message", COMBINATIONS)
def test_options_that_contradict_each_other_are_refused(data_cache, change, message):
    """optim.min_lr above optim.lr once climbed to lr 1.0, reached a loss of 54.6 and exited 0 with no checkpoint."""
    import dataclasses

    from training.config import validate

    cfg = tiny_config(data_cache)
    for section, values in change.items():
        setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **values))
    with pytest.raises(UserError, match=re.escape(message)):
        validate(cfg)


def test_a_vram_budget_on_a_cpu_found_by_auto_is_refused():
    from training.precision import apply_vram_budget

    with pytest.raises(UserError, match="trainer.vram_budget_gb=8 caps GPU memory, but this run is on the CPU"):
        apply_vram_budget(torch.device("cpu"), 8.0)


def test_a_profile_a_resumed_run_cannot_record_is_said():
    from training.profiling import StepProfiler

    assert "nothing is profiled, the run ends at step 100 before step 106" in StepProfiler("x", 5, 95, torch.device("cpu"), 100).note
    assert "only steps 91-100 are profiled" in StepProfiler("x", 20, 80, torch.device("cpu"), 100).note
    assert StepProfiler("x", 5, 0, torch.device("cpu"), 100).note == ""


@pytest.mark.parametrize("argv,message", [
    pytest.param(["+experiment=quick"], "+experiment=quick: experiment is in the defaults list of configs/train.yaml already, "
                 "so it is chosen, not added; write experiment=quick", id="add-a-group-of-the-defaults"),
    pytest.param(["hydra.output_subdir=.meta"], "hydra.output_subdir=.meta: the run writes its record", id="output-subdir"),
])
def test_overrides_hydra_would_refuse_in_many_lines(argv, message, capsys):
    from training.cli import check_overrides

    with pytest.raises(SystemExit) as exited:
        check_overrides(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_a_local_config_that_holds_a_list_fails_naming_it(tmp_path, capsys):
    """A configs/local/default.yaml holding a YAML list once failed with an AttributeError."""
    from training.cli import check_overrides

    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "default.yaml").write_text("# @package _global_\n- trainer\n- model\n")
    with pytest.raises(SystemExit) as exited:
        check_overrides(["-cd", str(tmp_path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "default.yaml holds a list; it must hold options as keys" in err, err


@pytest.mark.parametrize("file,content,message", [
    pytest.param("run.json", "{bad", "run.json is not valid JSON", id="run-json-not-json"),
    pytest.param("run.json", "[1]", "run.json holds a JSON list, not the object a run writes", id="run-json-a-list"),
    pytest.param("config.yaml", "a: [", "config.yaml is not a run's config", id="config-not-yaml"),
    pytest.param("config.yaml", "- a\n", "config.yaml holds a YAML list, not a run's config", id="config-a-list"),
])
def test_compare_runs_names_a_damaged_file(tmp_path, file, content, message):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "elapsed_s": 1.0}\n')
    (tmp_path / file).write_text(content)
    module = importlib.import_module("scripts.compare_runs")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / file}") + ".*" + re.escape(message.split(" ", 1)[1])):
        module.main([str(tmp_path)])
