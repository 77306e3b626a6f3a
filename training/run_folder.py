"""The run folder: checked before anything is written into it, and held by one run at a time.

``RunFolderCheck`` is a Hydra callback (configs/train.yaml, ``hydra.callbacks``): it checks the
folder Hydra is about to create, before Hydra writes its .hydra/ files there, so a path that is a
file, a folder that cannot be written, or one another run holds fails in one line and leaves the
folder as it was. ``claim_run_folder`` checks again (the loop also runs without Hydra) and takes the
folder's lock (data/folders.py) for the whole run; under torchrun rank 0 takes it.
"""
import os
from pathlib import Path
from typing import Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from data.folders import FolderLock, check_folder_path, holder_text, lock_holder, make_folder
from errors import UserError
from training import distributed
from training.checkpoint import checkpoint_dir
from training.cli import fail

OPTION = "hydra.run.dir"


def check_run_folder(run_dir: Path) -> None:
    """UserError when ``run_dir`` cannot take a run: a file stands where it or its checkpoints/ go,
    it cannot be written, or another run holds it."""
    check_folder_path(run_dir, OPTION, run_dir)
    checkpoints = checkpoint_dir(run_dir)
    if checkpoints.exists() and not checkpoints.is_dir():
        raise UserError(f"{checkpoints} is a file, not a folder: the run's checkpoints go there; remove it or give "
                        f"another {OPTION}")
    if run_dir.is_dir() and not os.access(run_dir, os.W_OK):
        raise UserError(f"cannot write to the run folder {run_dir}; give a writable {OPTION}")
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
