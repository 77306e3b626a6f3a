"""A trained model in one process, for what reads one (scripts/sample.py, scripts/export_hf.py,
model.init_from): which checkpoint a path means, its model with the weights in, and its tokenizer.

A run folder means its best checkpoint (checkpoints/best.pt, kept with trainer.keep_best=true) when
it has one, else its newest; a checkpoint file or a sharded (FSDP) checkpoint folder means itself.
The tokenizer comes from the checkpoint, so neither the corpus nor its token cache is needed (a
checkpoint made before checkpoints carried their tokenizer rebuilds it from its saved data settings).
"""
import dataclasses
from pathlib import Path
from typing import Optional, Tuple

import torch

from data.config import DataConfig
from data.prepare import prepare
from data.tokenizers import Tokenizer, load_tokenizer
from errors import UserError
from model import GPT, ModelConfig
from model.attention import build_attention
from model.config import AttentionConfig
from training.checkpoint import (NAME, best_checkpoint, latest_checkpoint, load_checkpoint, load_into_plain_model,
                                 validate_checkpoint)


def choose_checkpoint(path: Path) -> Tuple[Path, dict]:
    """(checkpoint path, its state): the checkpoint named, or of a run folder its best.pt when it has
    one, else its newest checkpoint."""
    if NAME.match(path.name) or path.is_file():
        return path, load_checkpoint(path)
    if best_checkpoint(path).is_file():
        return best_checkpoint(path), load_checkpoint(best_checkpoint(path))
    found, state = latest_checkpoint(path)
    if state is None:
        raise UserError(f"{path} holds no checkpoint; give a run folder with checkpoints/ or a checkpoint")
    return found, state


def checkpoint_tokenizer(state: dict) -> Tokenizer:
    """The tokenizer a checkpoint carries, or for an older one that of the data settings saved in it."""
    if "tokenizer" in state:
        return load_tokenizer(state["tokenizer"])
    return load_tokenizer(prepare(DataConfig(**state["config"]["data"])).manifest)


def plain_model(cfg: ModelConfig, device: torch.device, window: Optional[int] = None) -> GPT:
    """An unsharded GPT of ``cfg`` for inference on ``device``: sdpa attention (with ``window``), no dropout."""
    attend, _ = build_attention(AttentionConfig(name="sdpa", window=window), device)
    with device:  # built where it runs: no initialisation on the CPU and copy
        return GPT(dataclasses.replace(cfg, dropout=0.0), attend).eval()


def checkpoint_model(path: Path, state: dict, device: torch.device) -> GPT:
    """The model of checkpoint ``path`` (whole or sharded) with its weights, for inference on ``device``;
    the checkpoint is checked before its config and its weights are used (UserError naming the problem)."""
    model = plain_model(validate_checkpoint(path, state), device, state["config"]["attention"].get("window"))
    validate_checkpoint(path, state, model)
    load_into_plain_model(path, state, model)
    return model
