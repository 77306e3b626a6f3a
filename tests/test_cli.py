"""Hydra's own flags work as in any Hydra app, and the early checks read the command line as Hydra does.

`python train.py --help` / `--hydra-help` list the flags; each has a test here. The flags that run
nothing are walked in one process (conftest.walk: ``FLAG_RUNS``, with the config folders it writes); those
that train run train.py in a subprocess each. The in-process tests call the checks train.py makes
before Hydra starts.
"""
import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import QUICK, REPO, run_env, run_train, walk
from training.cli import add_overrides, check_overrides, machine_defaults
from training.exits import exit_on_error
from training.config import TrainConfig

SECTIONS = sorted(TrainConfig.__dataclass_fields__)


def train_py(*args, timeout=120):
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=timeout)


INFO = [
    (None, ["Installed Hydra Plugins", "Config search path", "Defaults Tree", "Defaults List", "Config\n******"]),
    ("defaults", ["Defaults List"]),
    ("defaults-tree", ["Defaults Tree"]),
    ("config", ["Config search path", "Defaults List", "Config\n******"]),
    ("searchpath", ["Config search path"]),
    ("plugins", ["Installed Hydra Plugins"]),
]
HELP = [("--help", "== Configuration groups =="), ("-h", "debug: "), ("--hydra-help", "== Flags =="),
        ("--version", "Hydra 1.3")]
CFG = [("job", SECTIONS), ("hydra", ["hydra"]), ("all", SECTIONS + ["hydra"])]
FLAG_RUNS = {  # name: train.py's arguments ({tmp}: a folder of the walk)
    **{f"cfg {which}": ["--cfg", which, "model=tiny", "hydra.run.dir={tmp}/run"] for which, _ in CFG},
    "resolve": ["--cfg", "job", "--resolve", "model=tiny", "attention=naive"],
    "package": ["-c", "job", "--package", "trainer", "trainer.max_steps=9"],
    "config name": ["-cd", "{tmp}/mine", "-cn", "mine", "--cfg", "job"],  # folders the fixture writes
    "config dir": ["--config-dir", "{tmp}/mine", "--config-name", "train", "model=wide", "--cfg", "job"],
    "config path": ["-cp", "{tmp}/configs", "model=deep", "--cfg", "job"],
    **{f"info {what}": ["--info", *([what] if what else [])] for what, _ in INFO},  # a bare --info is last
    **{flag: [flag] for flag, _ in HELP},
    "shell completion": ["--shell-completion", "install=bash"],
    "wrong flag": ["--cfg", "everything"],
    "config not found": ["model=deep", "--cfg", "job"],
}


@pytest.fixture(scope="module")
def flag_runs(tmp_path_factory):
    """{name: (status, stderr, stdout)} of every FLAG_RUNS command, walked in one process, and the walk's folder."""
    tmp = tmp_path_factory.mktemp("flags")
    write_config_folders(tmp)
    found = walk([[str(REPO / "train.py"), [a.format(tmp=tmp) for a in args]] for args in FLAG_RUNS.values()])
    return dict(zip(FLAG_RUNS, found)), tmp


def write_config_folders(tmp):
    """``tmp``/mine, a config folder with a primary config mine.yaml and a model only it has, wide; and
    ``tmp``/configs, a copy of configs/ with a new model, deep."""
    (tmp / "mine" / "model").mkdir(parents=True)
    (tmp / "mine" / "mine.yaml").write_text("defaults:\n  - train\n  - _self_\ntrainer:\n  max_steps: 7\n")
    (tmp / "mine" / "model" / "wide.yaml").write_text("name: wide\nn_embd: 512\nn_head: 8\n")
    shutil.copytree(REPO / "configs", tmp / "configs")
    (tmp / "configs" / "model" / "deep.yaml").write_text("name: deep\nn_layer: 24\n")


def flag_output(flag_runs, name: str) -> str:
    """The stdout of a FLAG_RUNS command that must succeed."""
    code, stderr, stdout = flag_runs[0][name]
    assert code == 0, stderr
    return stdout


@pytest.mark.parametrize("which,sections", CFG)
def test_cfg_prints_the_config_and_runs_nothing(flag_runs, which, sections):
    cfg = yaml.safe_load(flag_output(flag_runs, f"cfg {which}"))
    assert sorted(cfg) == sorted(sections)
    if which != "hydra":
        assert cfg["model"]["name"] == "tiny" and cfg["trainer"]["run_name"] == "${model.name}-${attention.name}-${data.name}"
    assert not (flag_runs[1] / "run").exists()


def test_resolve_prints_the_interpolations_resolved(flag_runs):
    cfg = yaml.safe_load(flag_output(flag_runs, "resolve"))
    assert cfg["trainer"]["run_name"] == "tiny-naive-shakespeare"


def test_package_prints_one_section(flag_runs):
    printed = flag_output(flag_runs, "package")
    assert printed.startswith("# @package trainer\n")
    assert yaml.safe_load(printed)["max_steps"] == 9


@pytest.mark.parametrize("what,headings", INFO)
def test_info_prints_what_hydra_knows(flag_runs, what, headings):
    printed = flag_output(flag_runs, f"info {what}")
    assert all(heading in printed for heading in headings)
    if what in (None, "defaults", "config"):
        assert "model/tiny" in printed  # experiment=cpu, added on a machine without a GPU, is in it


def test_config_name_and_config_dir_choose_another_primary_config(flag_runs):
    assert yaml.safe_load(flag_output(flag_runs, "config name"))["trainer"]["max_steps"] == 7
    model = yaml.safe_load(flag_output(flag_runs, "config dir"))["model"]
    assert model["name"] == "wide" and model["n_embd"] == 512  # a choice only the extra folder has


def test_config_path_replaces_configs(flag_runs):
    model = yaml.safe_load(flag_output(flag_runs, "config path"))["model"]
    assert model["name"] == "deep" and model["n_layer"] == 24


def test_a_config_in_no_config_folder_is_refused(flag_runs):
    code, stderr, _ = flag_runs[0]["config not found"]  # model=deep: not in configs/
    assert code == 2 and "model=deep is not a config" in stderr


def test_multirun_runs_one_job_per_value(tmp_path, data_cache):
    sweep = tmp_path / "sweep"
    proc = train_py("-m", "attention=naive,sdpa", *QUICK, f"data.cache_dir={data_cache}", f"hydra.sweep.dir={sweep}",
                    timeout=300)
    assert proc.returncode == 0, proc.stderr
    ran = {path.parent.name: json.loads(path.read_text())["attention"] for path in sweep.glob("*/run.json")}
    assert ran == {"0-naive": "naive", "1-sdpa": "sdpa"}


def test_run_flag_runs_one_job(tmp_path):
    proc = run_train(["--run"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_debug_fast_trains_a_few_steps_with_everything_on_the_way(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    proc = train_py("debug=fast", "model=tiny", "data=shakespeare_char", "trainer.batch_size=4", "logger.progress=false",
                    f"data.cache_dir={data_cache}", f"hydra.run.dir={run_dir}", timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 11))
    assert [r["step"] for r in records if "val_loss" in r] == [5, 10]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_0000005.pt", "step_0000010.pt"]
    assert not (run_dir / "sample.txt").exists()


def test_shell_completion_installs_a_script(flag_runs):
    assert "hydra_bash_completion()" in flag_output(flag_runs, "shell completion")


@pytest.mark.parametrize("flag,text", HELP)
def test_help_and_version(flag_runs, flag, text):
    assert text in flag_output(flag_runs, flag)


def test_a_wrong_flag_fails_with_hydras_usage_line(flag_runs):
    code, stderr, _ = flag_runs[0]["wrong flag"]
    assert code == 2 and "invalid choice: 'everything'" in stderr and "Traceback" not in stderr


# --- the checks before Hydra, in process ---------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["--cfg", "job", "model=tiny"],
    ["model=tiny", "--cfg", "job", "--resolve"],
    ["--info", "defaults", "attention=naive"],
    ["-cn", "train", "-p", "trainer", "-c", "job"],
    ["-m", "attention=glob(*)"],
    ["--shell-completion", "install=bash"],
    ["--shell-completion", "query=bash"],
])
def test_flag_values_are_not_read_as_overrides(argv, capsys):
    check_overrides(argv)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv,message", [
    (["--cfg", "job", "modl=tiny"], "unknown option 'modl'"),
    (["-p", "trainer", "debug=fsat"], "debug=fsat is not a config; choose one of: fast, profile"),
    (["-m", "attention=glob(zz*)"], "attention=glob(zz*) matches no config; there are: "),
    (["local=mine"], "local=mine is not a config"),
])
def test_wrong_overrides_next_to_flags_fail_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        check_overrides(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("content,message", [
    ("# @package _global_\ntrainer:\n  bach_size: 3\n", "typo.yaml: unknown option 'trainer.bach_size': trainer has no key 'bach_size'"),
    ("# @package _global_\ntrainer:\n  seed: abc\n", "typo.yaml: trainer.seed=abc has the wrong type: it takes an integer"),
    ("# @package _global_\ntrainer: [\n", "typo.yaml is not valid YAML"),
    ("trainer:\n  seed: 3\n", "typo.yaml: make '# @package _global_' its first line"),
    ("# my machine\n# @package _global_\n", "typo.yaml: make '# @package _global_' its first line"),
])
def test_a_wrong_local_file_fails_naming_it(tmp_path, capsys, content, message):
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "typo.yaml").write_text(content)
    with pytest.raises(SystemExit) as exited:
        check_overrides(["-cd", str(tmp_path), "local=typo"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("argv,extra,expected", [
    ([], ["e=1"], ["e=1"]),
    (["--info"], ["e=1"], ["e=1", "--info"]),
    (["--cfg", "job", "a=1", "b=2"], ["e=1"], ["--cfg", "job", "a=1", "b=2", "e=1"]),
    (["a=1", "--cfg", "job"], ["e=1"], ["a=1", "e=1", "--cfg", "job"]),
    (["-cn", "a=1", "a=1"], ["e=1"], ["-cn", "a=1", "a=1", "e=1"]),
])
def test_added_overrides_go_where_hydra_reads_overrides(argv, extra, expected):
    assert add_overrides(argv, extra) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine defaults apply without a GPU")
def test_machine_defaults_apply_where_a_config_is_composed(capsys):
    assert machine_defaults(["--cfg", "job"]) == ["experiment=cpu"]
    assert machine_defaults(["--cfg", "job", "trainer.device=cuda"]) == []
    assert machine_defaults(["-p", "model", "-c", "job", "model.n_layer=2"]) == []
    for nothing_composed in (["--help"], ["--hydra-help"], ["--shell-completion", "install=bash"]):
        assert machine_defaults(nothing_composed) == []


def test_out_of_memory_outside_the_steps_gets_the_same_advice(capsys):
    """Evaluation, sampling or a trial batch running out of memory: the advice of training/errors.py."""
    with pytest.raises(SystemExit) as exited, exit_on_error():
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: out of GPU memory") and "checkpoints written so far are kept. Try a smaller trainer.batch_size" in err


def test_hydras_argument_parser_reads_every_flag_as_the_early_checks_expect():
    """training/cli.py reads the command line with hydra._internal.utils.get_args_parser (``hydra_args``),
    Hydra's one private function it calls: this pins what it returns under the hydra-core that
    requirements.txt allows (>=1.3,<1.4), so a release that changes it fails here, not in a user's run."""
    import hydra
    from training.cli import hydra_args

    assert hydra.__version__.startswith("1.3."), hydra.__version__
    argv = ["-m", "--cfg", "job", "-p", "model", "-cn", "config", "-cp", "configs", "-cd", "/tmp/x", "--info",
            "defaults", "-r", "model=tiny", "trainer.max_steps=3"]
    assert {key: value for key, value in vars(hydra_args(argv)).items() if key != "experimental_rerun"} == {
        "help": False, "hydra_help": False, "overrides": ["model=tiny", "trainer.max_steps=3"], "cfg": "job",
        "resolve": False, "package": "model", "run": True, "multirun": True, "shell_completion": False,
        "config_path": "configs", "config_name": "config", "config_dir": "/tmp/x", "info": "defaults"}
    plain = vars(hydra_args(["attention=flash"]))
    assert plain["overrides"] == ["attention=flash"] and not plain["multirun"] and plain["config_dir"] is None
    with pytest.raises(SystemExit):  # a wrong flag: Hydra's usage line and status 2
        hydra_args(["--no-such-flag"])
