"""The run folder: checked before anything is written into it, held by one run at a time, and its
record (config.yaml, .hydra/) written only once the run is accepted.

``RunFolderCheck`` is a Hydra callback (configs/train.yaml, ``hydra.callbacks``): it checks the
folder Hydra is about to create, so a path that is a file, a folder that cannot be written, or one
another run holds fails in one line and leaves the folder as it was. ``claim_run_folder`` checks again
(the loop also runs without Hydra) and takes the folder's lock (data/folders.py) for the whole run;
under torchrun rank 0 takes it. Only then, and only once the checkpoint it resumes (if any) is
accepted, does the run write ``write_record``: a refused run changes nothing in the folder, and the
record always describes the checkpoints in it (Hydra's own early writing of .hydra/ is off:
``hydra.output_subdir: null``).
"""
import os
from pathlib import Path
from typing import Dict, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.folders import (FolderLock, check_file_paths, check_folder_path, holder_text, lock_holder, make_folder,
                          remove_temporaries)
from errors import UserError
from training import distributed
from training.checkpoint import checkpoint_dir
from training.config import TrainConfig
from training.exits import fail

OPTION = "hydra.run.dir"
# Every file a run writes at the top of its folder, and its folders (a test holds a run to this list).
RUN_FILES = (".lock", "config.yaml", "run.json", "metrics.jsonl", "metrics.jsonl.tmp", "sample.txt", "profile.md",
             ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")
RUN_FOLDERS = ("checkpoints", ".hydra", "wandb")


def check_run_folder(run_dir: Path) -> None:
    """UserError when ``run_dir`` cannot take a run: a file stands where it or one of its folders goes, a
    folder where one of its files goes, it (or, while it does not exist, the folder it would be made in)
    cannot be written, or another run holds it."""
    check_folder_path(run_dir, OPTION, run_dir)
    for name in RUN_FOLDERS:
        if (run_dir / name).exists() and not (run_dir / name).is_dir():
            raise UserError(f"{run_dir / name} is a file, not a folder: the run's {name} go there; remove it or give "
                            f"another {OPTION}")
    check_file_paths(run_dir, RUN_FILES, OPTION, run_dir)
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        what = f"write to the run folder {run_dir}" if existing == run_dir else f"create the run folder {run_dir} in {existing}"
        raise UserError(f"cannot {what}; give a writable {OPTION} (this one is read-only or not yours)")
    holder = lock_holder(run_dir)
    if holder is not None:
        raise in_use(run_dir, holder)


def in_use(run_dir: Path, holder: int) -> UserError:
    return UserError(f"{run_dir} is in use by another run ({holder_text(holder)}); wait for it to end or stop it, or "
                     f"give another {OPTION}")


def claim_run_folder(run_dir: Path, ranks: distributed.Ranks) -> Optional[FolderLock]:
    """Check ``run_dir``, create it and take its lock for this run: on rank 0 (None on the others)."""
    if not ranks.is_main:
        return None
    check_run_folder(run_dir)
    make_folder(run_dir, OPTION, run_dir)
    lock = FolderLock(run_dir)
    if not lock.try_acquire():
        raise in_use(run_dir, lock_holder(run_dir))
    return lock


def write_record(run_dir: Path, cfg: TrainConfig, extra: Optional[Dict[str, str]] = None) -> None:
    """The record of an accepted run: config.yaml (the resolved config) and ``extra`` ({path in the folder:
    text}, Hydra's .hydra/ files), each written whole (a temporary file, then renamed); and the
    temporary files a killed run left among the checkpoints are removed (this run holds the lock)."""
    files = {"config.yaml": OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True), **(extra or {})}
    for name, text in files.items():
        path = run_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    if checkpoint_dir(run_dir).is_dir():
        remove_temporaries(checkpoint_dir(run_dir))


class RunFolderCheck(Callback):
    """``check_run_folder`` on hydra.run.dir before Hydra creates it; a failure is one line, exit status 2."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if os.environ.get("RANK", "0") != "0":
            return  # under torchrun rank 0 checks and holds the folder
        try:
            run_dir = Path(config.hydra.run.dir)
        except OmegaConfBaseException:
            return  # an interpolation that does not resolve yet: Hydra reports it
        try:
            check_run_folder(run_dir)
        except UserError as err:
            fail(str(err))
