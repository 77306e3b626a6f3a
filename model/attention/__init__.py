"""Attention backends: one file each, one row each in ``BACKENDS``.

Every backend is a function ``attend(q, k, v, doc_ids=None, **options) -> o`` with q: (B, T, H, D),
k and v: (B, T, H_kv, D) (grouped-query attention when H_kv < H), doc_ids: (B, T) document index
or None; causal, scaled by 1/sqrt(D); o: (B, T, H, D). Its :class:`Backend` row says everything it
can do, and validation (``training/config.validate``), context parallelism
(``training/context_parallel.check_options``) and the tests read that row. The options ``attend``
takes follow from it: ``window`` (bound once by ``build_attention`` from AttentionConfig, like the
keys in ``tunes``); ``dropout_p``, the probability of dropping each attention probability, which
the model passes in training only (model.dropout, or model.attention_dropout when set); ``g``, the
(B, T, H) float32 log forget gates of model.gate=forget, one per token and query head (under GQA
too): the scores gain c_i - c_j with c = cumsum(g) along the sequence, restarting at each document
(masks.py). The caller passes the last two only when they are in use.

A backend may also offer a packed variant ``attend_packed(qkv, n_head, doc_ids=None, **options) -> o``
taking q, k and v side by side in qkv: (B, T, H + 2 * H_kv, D), as the fused projection makes them;
the model uses it when nothing (RoPE) changes q and k after the projection. And a ring step
(``ring_steps.StepAttention``), with which it runs as ring attention under context parallelism
(``build_attention(..., context=group)``; ring.py): no packed variant then, and no window,
dropout, forget gate or document masks.

Adding a backend: its file here, one row in ``BACKENDS``, and configs/attention/<name>.yaml; the
tests parametrised over ``BACKENDS`` pick it up (README, "Adding a backend").
"""
import dataclasses
import functools
import importlib
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from errors import UserError, check_positive
from model.config import FLASH_KERNELS, AttentionConfig

# What a row can compute beyond plain causal attention, as the config asks for it: the Backend
# field that says so, and the keyword option ``attend`` then takes (None: a document mask arrives
# as doc_ids, which every call may pass).
FEATURES = {"window": "window", "dropout": "dropout_p", "gate": "g", "documents": None}


@dataclass(frozen=True)
class Backend:
    """One row of the table: everything a backend can do. Functions are named ``"module:name"`` and
    imported when the backend is built, so one whose dependencies are missing (triton) costs nothing
    until it is chosen."""

    name: str
    attend: str  # attend(q, k, v, doc_ids=None, **options) -> o
    packed: Optional[str] = None  # attend_packed(qkv, n_head, doc_ids=None, **options) -> o
    ring_step: Optional[str] = None  # a ring_steps.StepAttention: runs under trainer.context_parallel > 1
    window: bool = False  # attention.window: sliding-window causal attention
    dropout: bool = False  # dropout of the attention probabilities (model.dropout / model.attention_dropout)
    gate: bool = False  # model.gate=forget: the scores gain c_i - c_j
    documents: bool = False  # data.document_mask=true: doc_ids keep every document to itself
    tunes: Tuple[str, ...] = ()  # AttentionConfig keys that only tune it (bound when built; others ignore them)
    devices: Optional[Tuple[str, ...]] = None  # the device types it runs on (None: any torch device)
    unavailable: Optional[str] = None  # device -> why it cannot run there ("" when it can); default: ``devices``
    fallback: Optional[str] = None  # what runs instead where it cannot (a warning; attention.strict=true fails)
    kept: Optional[str] = None  # its attention ops, whose outputs activation checkpointing keeps (kept_ops)

    @property
    def options(self) -> Tuple[str, ...]:
        """The keyword options ``attend`` (and ``attend_packed``) take."""
        return (*(option for feature, option in FEATURES.items() if option and getattr(self, feature)), *self.tunes)


ALL_FEATURES = dict(window=True, dropout=True, gate=True, documents=True)
BACKENDS: Dict[str, Backend] = {backend.name: backend for backend in (
    Backend("naive", "model.attention.naive:attend", ring_step="model.attention.ring_steps:NAIVE", **ALL_FEATURES),
    Backend("hybrid", "model.attention.hybrid:attend", tunes=("block_size",), **ALL_FEATURES),
    Backend("tiled", "model.attention.tiled:attend", **ALL_FEATURES),
    Backend("sdpa", "model.attention.sdpa:attend", ring_step="model.attention.ring_steps:SDPA",
            kept="model.attention.sdpa:kept_ops", **ALL_FEATURES),
    Backend("flash", "model.attention.flash:attend", packed="model.attention.flash:attend_packed",
            ring_step="model.attention.ring_steps:FLASH", tunes=("kernel",), devices=("cuda",),
            unavailable="kernels:flash_attn_unavailable", fallback="sdpa", kept="model.attention.flash:kept_ops",
            **ALL_FEATURES),
)}


@dataclass(frozen=True)
class Attention:
    """A backend bound to its configured options: ``attention(q, k, v, doc_ids=None, **options)``."""

    name: str  # the backend that runs (after any fallback)
    attend: Callable
    packed: Optional[Callable] = None
    window: Optional[int] = None  # attention.window, bound into attend: what a KV cache's decode step must apply too
    # the ops whose outputs activation checkpointing keeps rather than recomputes (model/gpt.py): the fused
    # attention kernels, whose O(T^2) work would run again for O(T) bytes of output and lse; none for the
    # backends written in PyTorch and for the ring (which would keep every step's output)
    kept_ops: Tuple = ()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids=None, **options) -> torch.Tensor:
        return self.attend(q, k, v, doc_ids=doc_ids, **options)


def unavailable_reason(name: str, device: torch.device) -> str:
    """Why backend ``name`` cannot run on ``device``; empty when it can."""
    backend = BACKENDS[name]
    if backend.unavailable:
        return _load(backend.unavailable)(device)
    if backend.devices is not None and device.type not in backend.devices:
        return f"it runs on {' or '.join(backend.devices)} and this run uses {device.type}"
    return ""


def validate_attention(cfg: AttentionConfig) -> None:
    """Reject an unknown backend, bad values, and a feature the chosen backend cannot compute."""
    if cfg.name not in BACKENDS:
        raise UserError(f"attention={cfg.name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    if cfg.block_size is not None:
        check_positive("attention.block_size", cfg.block_size, kind="integer")
    if cfg.window is not None and cfg.window <= 0:
        raise UserError(f"attention.window={cfg.window} must be a positive number of keys (or null for none)")
    check_features(cfg.name, window_in_use(cfg))
    check_kernel(cfg, window_in_use(cfg))


def check_kernel(cfg: AttentionConfig, wanted: Dict[str, str]) -> None:
    """attention.kernel: one of FLASH_KERNELS, set only for attention=flash, and ``gluon`` (the Hopper
    forward) only without the features ``wanted`` asks for (it has none of them yet)."""
    if cfg.kernel not in FLASH_KERNELS:
        raise UserError(f"attention.kernel={cfg.kernel!r} is not one of {', '.join(FLASH_KERNELS)}")
    if cfg.kernel != "auto" and cfg.name != "flash":
        raise UserError(f"attention.kernel={cfg.kernel} picks the flash kernel's forward; it needs attention=flash, "
                        f"not attention={cfg.name}")
    if cfg.kernel == "gluon" and wanted:
        raise UserError(f"attention.kernel=gluon (the Hopper forward) cannot run with {next(iter(wanted.values()))} yet; "
                        "attention.kernel=auto runs it on the tl kernel")


def window_in_use(cfg: AttentionConfig) -> Dict[str, str]:
    """{"window": the setting} when ``cfg`` asks for a sliding window, else {}."""
    return {} if cfg.window is None else {"window": f"attention.window={cfg.window}"}


def check_features(name: str, wanted: Dict[str, str]) -> None:
    """Fail in one line when backend ``name`` cannot compute every feature in ``wanted``
    ({FEATURES key: the setting that asks for it})."""
    missing = [setting for feature, setting in wanted.items() if not getattr(BACKENDS[name], feature)]
    if missing:
        able = [b.name for b in BACKENDS.values() if all(getattr(b, feature) for feature in wanted)]
        raise UserError(f"attention={name} cannot run with {missing[0]}; backends that can: {', '.join(able) or 'none'}")


def ring_backends() -> Tuple[str, ...]:
    """The backends with a ring step: those that run under context parallelism."""
    return tuple(name for name, backend in BACKENDS.items() if backend.ring_step)


def ring_step(name: str):
    """Backend ``name``'s ``ring_steps.StepAttention``; UserError for one without it."""
    if BACKENDS[name].ring_step is None:
        able = ring_backends()
        raise UserError(f"attention={name} does not run under context parallelism (ring attention); use "
                        f"attention={', '.join(able[:-1])} or {able[-1]}")
    return _load(BACKENDS[name].ring_step)


def build_attention(cfg: AttentionConfig, device: torch.device,
                    context: Optional[dist.ProcessGroup] = None) -> Tuple[Attention, str]:
    """The backend ``cfg`` names, bound to its options, for ``device``, and the name of the one that runs.

    A backend that cannot run here falls back (flash: to sdpa) with one warning, or fails when
    ``attention.strict=true`` or it has no fallback. With ``context``, the process group of the
    ranks that share each sequence (context parallelism), it runs as the step of ring attention over
    that group; the caller has refused what the ring cannot compute (a window, document masks).
    """
    if cfg.name not in BACKENDS:
        raise UserError(f"attention={cfg.name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    name, reason = cfg.name, unavailable_reason(cfg.name, device)
    if cfg.kernel == "gluon" and (reason or device.type != "cuda"):
        raise UserError(f"attention.kernel=gluon runs flash's Hopper forward on an H100/H200: "
                        f"{reason or f'this run uses {device.type}'}; attention.kernel=auto runs the tl kernel")
    if reason:
        fallback = BACKENDS[name].fallback
        if cfg.strict or fallback is None:
            way_out = f"; drop attention.strict=true to fall back to {fallback}" if fallback else ""
            raise UserError(f"attention={name} cannot run: {reason}{way_out}")
        warnings.warn(f"attention={name} cannot run ({reason}); using attention={fallback} instead", stacklevel=2)
        name = fallback
    check_features(name, window_in_use(cfg))
    if context is not None:
        return ring_attention_of(name, context), name
    backend = BACKENDS[name]
    config_keys = {f.name for f in dataclasses.fields(AttentionConfig)}
    bound = {key: getattr(cfg, key) for key in backend.options if key in config_keys}
    packed = functools.partial(_load(backend.packed), **bound) if backend.packed else None
    kept_ops = _load(backend.kept)() if backend.kept else ()
    return Attention(name, functools.partial(_load(backend.attend), **bound), packed, cfg.window, kept_ops), name


def ring_attention_of(name: str, group: Optional[dist.ProcessGroup]) -> Attention:
    """Backend ``name`` as ring attention over ``group``: q, k, v are this rank's zigzag shard. With no
    group, a ring of one rank: the whole sequence, no communication (what N=1 costs through the ring)."""
    from model.attention import ring

    return Attention(name, functools.partial(ring.attend, group=group, step=ring_step(name)))


def _load(ref: str) -> Callable:
    module, function = ref.split(":")
    return getattr(importlib.import_module(module), function)
