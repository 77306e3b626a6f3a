"""Checkpoints: atomic writes, the last N kept, and resume that skips a damaged newest file.

A checkpoint is one file ``<run dir>/checkpoints/step_XXXXXXX.pt`` holding plain tensors and
containers only, so it loads with ``torch.load(weights_only=True)``: model, optimizer, grad scaler,
step, RNG states, data-loader position, the config it was made with, and the wandb run id.
"""
import os
import re
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from training.errors import UserError

NAME = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> List[Path]:
    """Finished checkpoints in the run folder, oldest first (temporary files are never listed)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically, then drop all but the newest ``keep``.

    The bytes go to a temporary file that is flushed to disk before it is renamed, so a crash at any
    point leaves either the old set of checkpoints or the new one, never a half-written file under
    a checkpoint's name.
    """
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{step:07d}.pt"
    tmp = folder / f".step_{step:07d}.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(folder)
    # Newer files belong to an abandoned timeline (a damaged newest one was skipped, or an older file was
    # resumed by name): drop them, or they would outrank this save and pruning could delete it.
    kept = [p for p in list_checkpoints(run_dir) if int(NAME.match(p.name).group(1)) <= step]
    for old in set(list_checkpoints(run_dir)) - set(kept[-keep:]):
        old.unlink(missing_ok=True)
    return final


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> dict:
    """Load one checkpoint on the CPU; UserError naming the file when it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"trainer.resume={path}: no such checkpoint file; use trainer.resume=auto or none")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, not a torch file at all
        raise UserError(f"checkpoint {path} is corrupt or not a nanoflash checkpoint ({type(err).__name__})") from err
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise UserError(f"checkpoint {path} is not a nanoflash checkpoint (no model or step inside)")
    return state


def latest_checkpoint(run_dir: Path) -> Tuple[Optional[Path], Optional[dict]]:
    """The newest checkpoint that loads, warning about each newer one that does not (naming the fallback)."""
    damaged = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            state = load_checkpoint(path)
        except UserError as err:
            damaged.append(err)
            continue
        for err in damaged:
            warnings.warn(f"{err}; falling back to {path} (step {state['step']})", stacklevel=2)
        return path, state
    for err in damaged:
        warnings.warn(f"{err}; no older checkpoint loads, starting from step 0", stacklevel=2)
    return None, None


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
