"""The token cache's manifest.json: what a cache was made from, and whether it still matches.

A manifest records the settings (spec), the tokenizer, the token counts, the dtype, the source
(each local file's size, mtime and sha256; for a hub dataset its name, config, split and
fingerprint) and a checksum of each bin. ``stale_reason`` compares all of that with the present and
says, in a few words, why the cache must be rebuilt. ``write_manifest`` writes atomically (temporary
file, then rename), so a killed preparation never leaves a manifest that looks valid.
"""
import hashlib
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

FORMAT = 2
BIN_FULL_CHECKSUM_LIMIT = 64 * 2**20  # bins up to this size are hashed whole
BIN_SAMPLES = 64  # larger bins: this many 1 MiB blocks, evenly spaced, the first and the last included
SAMPLE_BYTES = 2**20
# The shape of a manifest: key -> type of its value ("tokens" and "bins" hold one entry per split).
SHAPE = {"format": int, "spec": dict, "tokenizer": str, "vocab_size": int, "dtype": str, "tokens": dict,
         "documents": dict, "source": dict, "bins": dict}


def read_manifest(folder: Path):
    """The parsed manifest.json of ``folder``, None when there is none, or the text "not JSON"."""
    path = folder / "manifest.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return "not JSON"


def damage(manifest) -> str:
    """Why a manifest as ``read_manifest`` gives it cannot be one of ours; empty when it has our shape."""
    if isinstance(manifest, str):
        return manifest
    if not (isinstance(manifest, dict) and all(isinstance(manifest.get(k), kind) for k, kind in SHAPE.items())):
        return "not a cache manifest"
    splits_ok = all(isinstance(manifest["tokens"].get(split), int) and isinstance(manifest["bins"].get(split), str)
                    for split in ("train", "val"))
    chars_ok = manifest["tokenizer"] != "char" or isinstance(manifest.get("chars"), str)
    return "" if splits_ok and chars_ok and "eot_id" in manifest else "not a cache manifest"


def write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / ".manifest.json.tmp"
    try:
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, folder / "manifest.json")
    finally:
        tmp.unlink(missing_ok=True)  # gone already once renamed


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**22), b""):
            h.update(chunk)
    return h.hexdigest()


def bin_checksum(path: Path) -> str:
    """sha256 of the whole bin up to 64 MiB; above that, of its size and 64 evenly spaced 1 MiB blocks."""
    size = path.stat().st_size
    if size <= BIN_FULL_CHECKSUM_LIMIT:
        return file_sha256(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for offset in np.linspace(0, size - SAMPLE_BYTES, BIN_SAMPLES, dtype=np.int64):
            f.seek(int(offset))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def source_records(files: Sequence[Path], previous: Sequence[dict] = ()) -> List[Dict]:
    """[{path, bytes, mtime_ns, sha256}] of each file; a file whose size and mtime match its
    ``previous`` record keeps that sha256 instead of being read again."""
    known = {r["path"]: r for r in previous}
    records = []
    for f in files:
        stat = f.stat()
        record = {"path": str(f.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        old = known.get(record["path"])
        same_stat = old is not None and (old["bytes"], old["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns)
        record["sha256"] = old["sha256"] if same_stat else file_sha256(f)
        records.append(record)
    return records


def stale_reason(manifest, spec: dict, folder: Path, files: Optional[Sequence[Path]]) -> str:
    """Why the cache in ``folder`` cannot be used as it is; empty when it can.

    ``manifest`` is what ``read_manifest`` gave; ``files`` are the local source files (None for a hub
    dataset, which is identified by the spec).
    """
    if manifest is None:
        return "no cache yet"
    if damage(manifest):
        return f"manifest.json is damaged ({damage(manifest)})"
    if manifest.get("format") != FORMAT or manifest.get("spec") != spec:
        return "the cache was made with other settings"
    if files is not None:
        reason = _source_change(manifest["source"].get("files", []), files)
        if reason:
            return reason
    for split in ("train", "val"):
        path = folder / f"{split}.bin"
        expected = manifest["tokens"][split] * np.dtype(manifest["dtype"]).itemsize
        if not path.is_file() or path.stat().st_size != expected:
            return f"{split}.bin is missing or truncated"
        if bin_checksum(path) != manifest["bins"][split]:
            return f"{split}.bin was altered"
    return ""


def _source_change(recorded: Sequence[dict], files: Sequence[Path]) -> str:
    now = source_records(files, recorded)
    if [r["path"] for r in now] != [r["path"] for r in recorded]:
        return "the set of source files changed"
    for old, new in zip(recorded, now):
        if old["sha256"] != new["sha256"]:
            return f"the source file {new['path']} changed"
    return ""
