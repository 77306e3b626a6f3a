"""Hugging Face model folders on disk: read one (config.json and its weights), write one (the export).

Weights are read from model.safetensors (or a sharded model.safetensors.index.json) with safetensors,
or from pytorch_model.bin (or its index) with ``torch.load(weights_only=True)``, which runs no pickled
code. An export is one model.safetensors, config.json, generation_config.json and the tokenizer files,
written into a temporary folder renamed to its name once complete. safetensors (and, for the
tokenizer, tokenizers) are imported only here, with a one-line pip hint when missing.
"""
import json
import os
import shutil
from pathlib import Path
from typing import Dict

import torch

from data.hf_tokenizer import PIP, write_tokenizer
from data.tokenizers import Tokenizer
from errors import UserError, import_optional

CONFIG = "config.json"
WEIGHTS = (("model.safetensors.index.json", "model.safetensors"), ("pytorch_model.bin.index.json", "pytorch_model.bin"))


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG).is_file()


def read_config(folder: Path, where: str) -> dict:
    try:
        return json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{where}: {folder / CONFIG} is not readable JSON ({type(err).__name__})") from err


def read_weights(folder: Path, where: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the folder's weights, on the CPU, by name."""
    for index, single in WEIGHTS:
        if (folder / index).is_file():
            files = sorted(set(json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"].values()))
        elif (folder / single).is_file():
            files = [single]
        else:
            continue
        return {name: tensor for file in files for name, tensor in read_weight_file(folder / file, where).items()}
    raise UserError(f"{where}: {folder} has a config.json but no weights (model.safetensors or pytorch_model.bin)")


def read_weight_file(path: Path, where: str) -> Dict[str, torch.Tensor]:
    safetensors = import_optional("safetensors.torch", f"reading {path}", PIP) if path.suffix == ".safetensors" else None
    try:
        if safetensors is not None:
            return safetensors.load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, not a weights file, or pickled code that weights_only refuses
        raise UserError(f"{where}: {path} cannot be read as weights ({type(err).__name__})") from err


def require_export_packages():
    """The safetensors module that writes the weights, once it and tokenizers are known to import."""
    import_optional("tokenizers", "scripts/export_hf.py", PIP)
    return import_optional("safetensors.torch", "scripts/export_hf.py", PIP)


def check_out(out: Path) -> None:
    """An export goes to a new (or empty) folder: nothing is overwritten."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder; give a new folder (nothing is overwritten)")


def write_hf_folder(out: Path, config: dict, generation: dict, weights: Dict[str, torch.Tensor],
                    tokenizer: Tokenizer, max_length: int) -> None:
    """The folder ``out``: model.safetensors of ``weights``, config.json, generation_config.json and the
    tokenizer files, written under a temporary name and renamed when all are on disk."""
    safetensors = require_export_packages()
    check_out(out)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        safetensors.save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, content in ((CONFIG, config), ("generation_config.json", generation)):
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
        write_tokenizer(tokenizer, tmp, max_length)
        if out.exists():
            out.rmdir()  # empty (check_out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
