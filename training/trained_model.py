"""A trained model in one process, for what reads one (scripts/sample.py, scripts/export_hf.py,
model.init_from): which checkpoint a path means, its model with the weights in, and its tokenizer.

A run folder means its best checkpoint (checkpoints/best.pt, kept with trainer.keep_best=true) when
it has one, else its newest; a checkpoint file or a sharded (FSDP) checkpoint folder means itself.
The tokenizer comes from the checkpoint, so neither the corpus nor its token cache is needed (a
checkpoint made before checkpoints carried their tokenizer rebuilds it from its saved data settings).

Reading is cheap: a checkpoint is memory-mapped (its optimizer state, twice the weights, is never
read), and the model is built on its device without initialising its weights, since the weights
loaded next overwrite every one. An inference model
holds its weights in the dtype it runs in (``plain_model``'s ``dtype``: scripts/sample.py's --dtype)
and runs without autocast, as transformers does: autocast would cast every weight again at every
step.
"""
import contextlib
import dataclasses
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

from data.config import DataConfig
from data.prepare import prepare
from data.tokenizers import Tokenizer, load_tokenizer
from errors import UserError
from model import GPT, ModelConfig
from model.attention import build_attention
from model.config import AttentionConfig
from training.checkpoint import (NAME, best_checkpoint, latest_checkpoint, load_checkpoint, load_into_plain_model,
                                 validate_checkpoint)

INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                  "kaiming_normal_", "xavier_uniform_", "xavier_normal_")  # what GPT and torch.nn's layers call


def choose_checkpoint(path: Path) -> Tuple[Path, dict]:
    """(checkpoint path, its state): the checkpoint named, or of a run folder its best.pt when it has
    one, else its newest checkpoint."""
    if NAME.match(path.name) or path.is_file():
        return path, load_checkpoint(path, mmap=True)
    if best_checkpoint(path).is_file():
        return best_checkpoint(path), load_checkpoint(best_checkpoint(path), mmap=True)
    found, state = latest_checkpoint(path, mmap=True)
    if state is None:
        raise UserError(f"{path} holds no checkpoint; give a run folder with checkpoints/ or a checkpoint")
    return found, state


def checkpoint_tokenizer(state: dict) -> Tokenizer:
    """The tokenizer a checkpoint carries, or for an older one that of the data settings saved in it."""
    if "tokenizer" in state:
        return load_tokenizer(state["tokenizer"])
    return load_tokenizer(prepare(DataConfig(**state["config"]["data"])).manifest)


def plain_model(cfg: ModelConfig, device: torch.device, window: Optional[int] = None,
                dtype: torch.dtype = torch.float32) -> GPT:
    """An unsharded GPT of ``cfg`` for inference on ``device``, its weights in ``dtype``: sdpa attention (with
    ``window``), no dropout. The weights are not initialised: the caller loads every one."""
    attend, _ = build_attention(AttentionConfig(name="sdpa", window=window), device)
    with device, initialisation_skipped():  # built where it runs, its memory as it was allocated
        return GPT(dataclasses.replace(cfg, dropout=0.0), attend).to(dtype).eval()


@contextlib.contextmanager
def initialisation_skipped():
    """torch.nn.init's functions as no-ops (transformers' no_init_weights does the same), while a model whose
    weights are all loaded next is built: initialising GPT-2 124M takes 1.5 s on a CPU. (The meta device
    would also skip it, but its tensors go through PyTorch's Python decompositions, whose first use
    imports torch._dynamo and sympy: seconds more.)"""
    saved = {name: getattr(nn.init, name) for name in INIT_FUNCTIONS}
    for name in saved:
        setattr(nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _unchanged(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def checkpoint_model(path: Path, state: dict, device: torch.device, dtype: torch.dtype = torch.float32,
                     on_phase: Callable[[str], object] = lambda phase: None) -> GPT:
    """The model of checkpoint ``path`` (whole or sharded) with its weights in ``dtype``, for inference on
    ``device``; the checkpoint is checked before its config and its weights are used (UserError naming the
    problem). ``on_phase(name)`` as each phase ends (scripts/sample.py --timings)."""
    model = plain_model(validate_checkpoint(path, state), device, state["config"]["attention"].get("window"), dtype)
    on_phase("model built")
    validate_checkpoint(path, state, model)
    on_phase("checkpoint checked (weights' names, shapes, finite values)")
    load_into_plain_model(path, state, model)
    on_phase("weights loaded")
    return model
