"""The run folder's record (config.yaml, .hydra/) is written only by the run that owns the folder and
only once its checkpoint is accepted; a resume says what it changes, by the kind of each option
(training/changes.py), and refuses what changes the run's meaning."""
import dataclasses
import shutil

import pytest
import torch

from conftest import tiny_config
from data.folders import FolderLock
from errors import UserError
from training import loop
from training.changes import FREE, KINDS, MEANING, ORDER, SHAPE
from training.checkpoint import list_checkpoints, load_checkpoint, validate_checkpoint
from training.config import TrainConfig
from training.run_folder import RUN_FILES, RUN_FOLDERS, check_run_folder

RECORD = {".hydra/overrides.yaml": "- model.n_layer=2\n", ".hydra/config.yaml": "first\n"}


def schema_options(cls=TrainConfig, prefix=""):
    """Every leaf option of the schema, dotted."""
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            yield from schema_options(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_every_schema_option_is_sorted_for_resume():
    """A new option of the schema must say what a resume that changes it does."""
    options = list(schema_options())
    assert sorted(set(options) - set(KINDS)) == [], "options not sorted in training/changes.py"
    assert sorted(set(KINDS) - set(options)) == [], "training/changes.py sorts options the schema lacks"
    assert set(KINDS.values()) == {SHAPE, MEANING, ORDER, FREE}


def record_of(run_dir):
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in [run_dir / "config.yaml", *(run_dir / ".hydra").iterdir()]}


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, data_cache):
    """A tiny run of two steps, its record as train.py writes it (config.yaml and .hydra/)."""
    run_dir = tmp_path_factory.mktemp("two-steps")
    loop.train(tiny_config(data_cache, max_steps=2, ckpt_interval=2, eval_interval=2), run_dir, RECORD)
    return run_dir


@pytest.fixture
def copied_run(two_step_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(two_step_run, run_dir)
    return run_dir


def test_a_refused_resume_changes_nothing_in_the_folder(copied_run, data_cache):
    """A resume refused in one line (model.n_layer changed) once rewrote config.yaml to the refused shape."""
    before = record_of(copied_run)
    assert b"n_layer: 2" in before["config.yaml"] and before[".hydra/overrides.yaml"] == RECORD[".hydra/overrides.yaml"].encode()
    cfg = tiny_config(data_cache, max_steps=4)
    cfg.model.n_layer = 3
    with pytest.raises(UserError, match="made with model.n_layer=2 but this run has model.n_layer=3"):
        loop.train(cfg, copied_run, {".hydra/overrides.yaml": "- model.n_layer=3\n", ".hydra/config.yaml": "refused\n"})
    assert record_of(copied_run) == before


def test_a_run_refused_by_the_lock_writes_no_record(copied_run, data_cache):
    """Two runs started together into one folder: the one that does not hold the lock writes nothing (its
    config.yaml and .hydra/overrides.yaml once replaced those of the run that trained)."""
    before = record_of(copied_run)
    held = FolderLock(copied_run)
    assert held.try_acquire()
    try:
        with pytest.raises(UserError, match="in use by another run"):
            loop.train(tiny_config(data_cache, max_steps=4), copied_run, {".hydra/overrides.yaml": "- other\n"})
    finally:
        held.release()
    assert record_of(copied_run) == before


def test_an_accepted_resume_writes_the_record_of_the_run_that_trains(copied_run, data_cache):
    cfg = tiny_config(data_cache, max_steps=3, batch_size=8)
    loop.train(cfg, copied_run, {".hydra/overrides.yaml": "- trainer.batch_size=8\n"})
    assert b"batch_size: 8" in (copied_run / "config.yaml").read_bytes()
    assert (copied_run / ".hydra" / "overrides.yaml").read_text() == "- trainer.batch_size=8\n"
    assert load_checkpoint(list_checkpoints(copied_run)[-1])["config"]["trainer"]["batch_size"] == 8


def test_every_file_a_run_writes_is_in_the_run_folder_list(tmp_path, data_cache):
    """The list check_run_folder checks (a folder where a file goes, a file where a folder goes) holds
    every path a run writes: a run with a profile, a sample and the best checkpoint."""
    cfg = tiny_config(data_cache, max_steps=11, profile_steps=1, sample_tokens=3, keep_best=True, eval_interval=11)
    loop.train(cfg, tmp_path, RECORD)
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    tops = {p.name for p in tmp_path.iterdir()}
    assert tops <= {name.split("/")[0] for name in RUN_FILES} | set(RUN_FOLDERS), tops
    assert {w for w in written if not w.startswith("checkpoints/")} <= set(RUN_FILES), written


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_folder_where_a_run_writes_a_file_fails_before_training(tmp_path, name):
    (tmp_path / name).mkdir(parents=True)
    with pytest.raises(UserError, match=f"{name} is a folder, but it is where a file goes; remove it or point "
                                        "hydra.run.dir at another folder"):
        check_run_folder(tmp_path)


def test_a_run_folder_that_cannot_be_made_fails_in_one_line(tmp_path, data_cache, monkeypatch):
    """hydra.run.dir under a read-only mount, not made yet: once an OSError from mkdir."""
    import os

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(tmp_path) else real_access(p, mode, **kw))
    with pytest.raises(UserError, match=f"cannot create the run folder {tmp_path}/ro/run in {tmp_path}; give a "
                                        "writable hydra.run.dir"):
        loop.train(tiny_config(data_cache), tmp_path / "ro" / "run")
    assert not (tmp_path / "ro").exists()


RESUMES = [  # (change, its kind, how the resume names it)
    pytest.param({"attention": {"window": 4}}, MEANING, "attention.window None → 4", id="window"),
    pytest.param({"model": {"dropout": 0.2}}, MEANING, "model.dropout 0.1 → 0.2", id="dropout"),
    pytest.param({"trainer": {"batch_size": 8}}, ORDER, "trainer.batch_size 4 → 8", id="batch-size"),
    pytest.param({"trainer": {"grad_accum": 2}}, ORDER, "trainer.grad_accum 1 → 2", id="grad-accum"),
    pytest.param({"trainer": {"seed": 7}}, ORDER, "trainer.seed 1337 → 7", id="seed"),
    pytest.param({"data": {"val_fraction": 0.2}}, ORDER, "data.val_fraction 0.1 → 0.2", id="val-fraction"),
]


def changed(cfg: TrainConfig, change: dict) -> TrainConfig:
    for section, values in change.items():
        setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **values))
    return cfg


@pytest.mark.parametrize("change,kind,named", RESUMES)
def test_a_resume_says_what_it_changes_and_refuses_a_change_of_meaning(copied_run, data_cache, capsys, change, kind,
                                                                       named):
    """attention.window=4 once resumed a full-context run silently; batch_size, grad_accum and seed changed
    the data order without a word; a changed val_fraction was reported as continuing "on the embedded
    Tiny Shakespeare"."""
    cfg = changed(tiny_config(data_cache, max_steps=3), change)
    said = f"data order changes: {named}"
    if kind == MEANING:
        with pytest.raises(UserError, match=f"this run changes {named}, which changes what the model computes or "
                                            "learns; .*add trainer.resume_changes=allow"):
            loop.train(cfg, copied_run)
        assert len(list_checkpoints(copied_run)) == 1
        cfg.trainer.resume_changes = "allow"
        said = f"resuming with changes of meaning (trainer.resume_changes=allow): {named}"
    capsys.readouterr()
    assert loop.train(cfg, copied_run)["step"] == 3
    out = capsys.readouterr().out
    assert said in out and "continues it on" not in out, out


def test_a_resumed_optimizer_takes_the_runs_hyperparameters(copied_run, data_cache):
    """Loading an optimizer state brings back the weight decay, betas and eps it was saved with."""
    cfg = tiny_config(data_cache, max_steps=3)
    cfg.optim = dataclasses.replace(cfg.optim, weight_decay=0.3, betas=[0.8, 0.9], eps=1e-6)
    loop.train(cfg, copied_run)
    groups = load_checkpoint(list_checkpoints(copied_run)[-1])["optimizer"]["param_groups"]
    assert groups[0]["weight_decay"] == 0.3 and groups[1]["weight_decay"] == 0.0
    assert all(tuple(g["betas"]) == (0.8, 0.9) and g["eps"] == 1e-6 for g in groups)
    assert torch.is_tensor(load_checkpoint(list_checkpoints(copied_run)[-1])["rng"]["cpu"])


def test_a_resume_on_another_number_of_ranks_says_the_data_order_changes(two_step_run, capsys):
    """Ranks read disjoint slices of one global batch: on another number of them the windows differ."""
    from training.checkpoint import check_changes

    path = list_checkpoints(two_step_run)[-1]
    state = load_checkpoint(path)
    corpus = {"corpus": state["corpus"]}
    check_changes(path, state, state["config"], validate_checkpoint(path, state), corpus, True, data_ranks=2)
    assert capsys.readouterr().out.strip() == "data order changes: data-parallel ranks 1 → 2"
