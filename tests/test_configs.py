"""Every default lives in the schema (training/config.py): the root config is the schema's defaults,
group files hold only what their choice changes, presets only what they change; debug and local."""
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO
from training.cli import GROUPS, group_choices
from training.config import TrainConfig, register_configs, validate

CONFIGS = REPO / "configs"
PRESETS = ("experiment", "debug")  # `# @package _global_` files that set values of other groups


def composed(overrides=(), searchpath=None, hydra=False):
    """configs/train.yaml composed with ``overrides``, without any local file of this machine."""
    register_configs()
    extra = ["~local"] + ([f"hydra.searchpath=[file://{searchpath}]"] if searchpath else [])
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="train", overrides=extra + list(overrides), return_hydra_config=hydra)


def typed(cfg) -> TrainConfig:
    return OmegaConf.to_object(cfg)


def leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def body(path: Path) -> dict:
    """A config file's own values: without its defaults list and hydra settings."""
    values = OmegaConf.to_container(OmegaConf.load(path)) or {}
    return {k: v for k, v in values.items() if k not in ("defaults", "hydra")}


def test_the_root_config_is_the_schemas_defaults():
    assert typed(composed()) == typed(OmegaConf.structured(TrainConfig()))


@pytest.mark.parametrize("group", ["model", "attention", "data", "optim", "trainer", "logger"])
def test_a_group_file_holds_only_what_its_choice_changes(group):
    defaults = getattr(TrainConfig(), group)
    for path in sorted((CONFIGS / group).glob("*.yaml")):
        repeated = [key for key, value in leaves(body(path)) if getattr(defaults, key) == value]
        assert not repeated, f"{path.relative_to(REPO)} repeats the schema's defaults of {group}.{', '.join(repeated)}"


def restated(path: Path, group: str) -> dict:
    """{dotted key: value} that the files a preset builds on set: the presets of its group it includes
    and the group choices it overrides (model/gpt2.yaml as model.*), recursively."""
    found = {}
    for entry in OmegaConf.to_container(OmegaConf.load(path)).get("defaults", []):
        if isinstance(entry, str):
            base = CONFIGS / group / f"{entry}.yaml"
            found.update(restated(base, group), **dict(leaves(body(base))))
        else:
            (key, choice), = entry.items()
            chosen = key.removeprefix("override /")
            found.update(leaves(body(CONFIGS / chosen / f"{choice}.yaml"), f"{chosen}."))
    return found


@pytest.mark.parametrize("group", PRESETS)
def test_a_preset_does_not_restate_what_it_builds_on(group):
    """A preset states its own values (they may equal a schema default on purpose: a preset keeps them
    if a default moves), but none that the files it builds on already set."""
    for path in sorted((CONFIGS / group).glob("*.yaml")):
        below = restated(path, group)
        repeated = [key for key, value in leaves(body(path)) if key in below and below[key] == value]
        assert not repeated, f"{path.relative_to(REPO)} restates {', '.join(repeated)}"


@pytest.mark.parametrize("group", GROUPS)
def test_every_config_in_every_group_composes_and_validates(group):
    for choice in group_choices(group):
        overrides = [f"{group}={choice}"] + (["data.path=some/dataset"] if choice == "hf" else [])
        validate(typed(composed(overrides)))


def test_the_three_gpu_presets_share_one_base_and_half_a_million_tokens_a_step():
    runs = {name: typed(composed([f"experiment={name}"])) for name in ("gpu8gb", "gpu12gb", "gpu24gb")}
    shared = {(c.model.name, c.attention.name, c.trainer.max_steps, c.trainer.eval_interval, c.optim.lr) for c in runs.values()}
    assert shared == {("gpt2", "flash", 5000, 250, 6e-4)}
    assert {c.trainer.batch_size * c.trainer.grad_accum * c.model.block_size for c in runs.values()} == {524288}
    assert [c.trainer.batch_size for c in runs.values()] == [8, 16, 32]


def test_debug_fast_wins_over_an_experiment_and_runs_in_a_fresh_folder():
    cfg = composed(["experiment=gpt2", "debug=fast"], hydra=True)
    t = cfg.trainer
    assert cfg.model.name == "gpt2"
    assert (t.max_steps, t.compile, t.cuda_graph, t.sample_tokens, t.eval_iters) == (10, False, False, 0, 2)
    assert re.fullmatch(r"outputs/debug/\$\{now:.*\}", OmegaConf.to_container(cfg.hydra.run)["dir"])


def test_debug_profile_records_five_steps_after_the_warm_up():
    t = typed(composed(["debug=profile"])).trainer
    assert (t.max_steps, t.profile_steps) == (15, 5)


def test_a_local_file_applies_after_the_presets_and_local_picks_another(tmp_path):
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "default.yaml").write_text("# @package _global_\ntrainer:\n  seed: 5\n  max_steps: 7\n")
    (tmp_path / "local" / "other.yaml").write_text("# @package _global_\ntrainer:\n  seed: 6\n")
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        def seed_and_steps(*overrides):
            cfg = compose(config_name="train", overrides=[f"hydra.searchpath=[file://{tmp_path}]", *overrides])
            return cfg.trainer.seed, cfg.trainer.max_steps
        assert seed_and_steps("experiment=quick") == (5, 7)  # after the experiment
        assert seed_and_steps("local=other") == (6, 500)
        assert seed_and_steps("~local") == (1337, 500)


def test_the_machines_own_local_files_stay_out_of_git():
    ignore = (CONFIGS / "local" / ".gitignore").read_text().splitlines()
    assert "*" in ignore and "!.gitignore" in ignore
