"""Every default lives in the schema (training/config.py): the root config is the schema's defaults,
group files hold only what their choice changes, presets only what they change; debug and local."""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO, run_env
from training.cli import GROUPS, group_choices
from training.config import TrainConfig, register_configs, validate
from training.optim import lr_at

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


# nanoGPT's config/train_shakespeare_char.py, with the values of its train.py that the config keeps
# (beta1, weight decay, clipping, compile, no bias), as options of ours.
NANOGPT_BABY_GPT = {
    "model.n_layer": 6, "model.n_head": 6, "model.n_embd": 384, "model.block_size": 256,
    "model.dropout": 0.2, "model.attention_dropout": None, "model.bias": False,  # dropout on attention too
    "trainer.batch_size": 64, "trainer.grad_accum": 1, "trainer.max_steps": 5000,
    "optim.lr": 1e-3, "optim.min_lr": 1e-4, "optim.warmup_steps": 100, "optim.schedule": "cosine",  # lr_decay_iters = max_iters
    "optim.betas": [0.9, 0.99], "optim.weight_decay": 0.1, "trainer.grad_clip": 1.0,
    "trainer.eval_interval": 250, "trainer.eval_iters": 200, "trainer.log_interval": 10,
    "trainer.compile": True, "trainer.keep_best": True,  # always_save_checkpoint = False: the best val's checkpoint
    "data.tokenizer": "char", "data.path": None, "data.val_fraction": 0.1,  # Tiny Shakespeare, first 90% / last 10%
    "attention.name": "flash",
}


def test_the_shakespeare_char_preset_composes_to_nanogpts_baby_gpt():
    """Composed the way a user does (`python train.py experiment=shakespeare_char --cfg job`)."""
    proc = subprocess.run([sys.executable, "train.py", "experiment=shakespeare_char", "--cfg", "job"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    values = dict(leaves(OmegaConf.to_container(OmegaConf.create(proc.stdout))))
    assert {key: values[key] for key in NANOGPT_BABY_GPT} == NANOGPT_BABY_GPT
    validate(typed(composed(["experiment=shakespeare_char"])))


def nanogpt_lr(it: int, lr=1e-3, min_lr=1e-4, warmup_iters=100, lr_decay_iters=5000) -> float:
    """nanoGPT's get_lr for its iteration ``it`` (0-based): warm-up lr * (it + 1) / (warmup + 1), then
    cosine from lr to min_lr over iterations warmup .. lr_decay_iters."""
    if it < warmup_iters:
        return lr * (it + 1) / (warmup_iters + 1)
    ratio = min(1.0, (it - warmup_iters) / (lr_decay_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def test_the_preset_schedule_is_nanogpts_within_one_percent_in_warm_up_and_a_step_after():
    """Our step s (1-based) is nanoGPT's iteration s - 1. Warm-up: ours reaches lr at step 100, nanoGPT
    lr * 100 / 101 (1 % apart at most); after it both are the same cosine, ours one step ahead
    (at most 3e-7 apart, 0.03 % of min_lr), ending at min_lr where nanoGPT's step 5000 is within
    1e-10 of it."""
    optim = typed(composed(["experiment=shakespeare_char"])).optim
    ours = [lr_at(step, optim, 5000) for step in range(1, 5001)]
    theirs = [nanogpt_lr(step - 1) for step in range(1, 5001)]
    warm_up = [abs(a - b) / b for a, b in zip(ours[:100], theirs[:100])]
    assert max(warm_up) == pytest.approx(1 / 100, rel=1e-9)
    assert max(abs(a - b) for a, b in zip(ours[100:], theirs[100:])) < 3e-7
    assert ours[-1] == pytest.approx(1e-4, abs=1e-15) and theirs[-1] == pytest.approx(1e-4, abs=1e-10)
