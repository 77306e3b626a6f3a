"""The autotuner's picks on disk, so a tuning key is timed once per machine, not once per process.

One JSON file per entry, ``<folder>/<kernel>-<hash>.json``, holding the entry's full key and what
was picked::

    {"key": {"kernel": "dq", "gpu": "NVIDIA H100 80GB HBM3", "family": "hopper",
             "triton": "3.6.0", "source": "<kernel source hash>", "candidates": [...],
             "dtype": "torch.bfloat16", "T_BUCKET": 2048, "constexprs": {"HEAD_DIM": 128, ...}},
     "pick": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
     "timings_ms": {...}, "seconds": 4.1}

The file name is a hash of the key (``tuning.Tuner.disk_key``), and a file is used only when the key
stored inside equals the key asked for, so a new GPU, Triton version, kernel source or candidate
list tunes again. A
file that cannot be read, is not JSON or holds another key is ignored with a warning. Writes go
to a temporary file in the same folder, then ``os.replace`` it into place: a concurrent reader
sees the old file or the new one, never half of one, and concurrent writers of one key (DDP
ranks tuning together) leave one whole file.

The folder is ``$XDG_CACHE_HOME/nanoflash/autotune`` (``~/.cache/nanoflash/autotune``) unless
a tuner is given another (``tuning.Tuner(cache_dir=...)``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path


def default_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nanoflash" / "autotune"


def entry_path(folder: Path, key: dict) -> Path:
    """Where the entry of ``key`` (JSON-serialisable, with a "kernel" name) lives in ``folder``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return Path(folder) / f"{key['kernel']}-{digest}.json"


def load(folder: Path, key: dict, allowed: list[dict]) -> dict | None:
    """The pick stored for ``key``, one of ``allowed``; None when there is none (a file that is not
    a whole entry of this very key, or picks something else, is ignored with a warning)."""
    path = entry_path(folder, key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"nanoflash: cannot read the tuning cache file {path} ({e}); tuning again", stacklevel=2)
        return None
    try:
        entry = json.loads(text)
        stored_key, pick = entry["key"], entry["pick"]
    except (ValueError, KeyError, TypeError):
        warnings.warn(f"nanoflash: ignoring the tuning cache file {path}: not an entry this version wrote; "
                      "tuning again", stacklevel=2)
        return None
    if stored_key != json.loads(json.dumps(key)):
        warnings.warn(f"nanoflash: ignoring the tuning cache file {path}: it holds another key; tuning again",
                      stacklevel=2)
        return None
    if pick not in allowed:
        warnings.warn(f"nanoflash: ignoring the tuning cache file {path}: its pick {pick} is not a candidate; "
                      "tuning again", stacklevel=2)
        return None
    return pick


def store(folder: Path, key: dict, entry: dict) -> Path | None:
    """Write ``entry`` (with ``key`` added) atomically; its path, or None (with a warning) when the
    folder is not writable."""
    path = entry_path(folder, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, **entry}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        warnings.warn(f"nanoflash: cannot write the tuning cache in {path.parent} ({e}); the pick is kept for "
                      "this process only", stacklevel=2)
        return None
    return path
