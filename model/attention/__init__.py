"""Attention backends: one file each, one table (``BACKENDS``).

Every backend is a function ``attend(q, k, v, doc_ids=None, **options) -> o`` with q: (B, T, H, D),
k and v: (B, T, H_kv, D) (grouped-query attention when H_kv < H), doc_ids: (B, T) document index
or None; causal, scaled by 1/sqrt(D); o: (B, T, H, D). It takes exactly the keyword options its
row lists: AttentionConfig keys of that name are bound once by ``build_attention``; the others are
passed by the caller at each call, only when they are in use: ``dropout_p``, the probability of
dropping each attention probability, which the model passes in training only (model.dropout, or
model.attention_dropout when set); ``g``, the (B, T, H) float32 log forget gates of
model.gate=forget, one per token and query head (under GQA too): the scores gain c_i - c_j with
c = cumsum(g) along the sequence, restarting at each document (masks.py).

A backend may also offer a packed variant ``attend_packed(qkv, n_head, doc_ids=None, **options) -> o``
taking q, k and v side by side in qkv: (B, T, H + 2 * H_kv, D), as the fused projection makes them;
the model uses it when nothing (RoPE) changes q and k after the projection. flash does: its
backward then returns qkv's gradient as one tensor instead of three that autograd concatenates.

Under context parallelism each sequence is sharded over the N ranks of a process group and a
backend runs as the per-step attention of ring attention (``build_attention(..., context=group)``;
model/attention/ring.py, ring_steps.py): naive, sdpa and flash have such a step; there is no packed
variant then, and no window, dropout or forget gate.

Adding a backend: its file here, one row in ``BACKENDS``, and configs/attention/<name>.yaml.
"""
import dataclasses
import functools
import importlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from errors import UserError, check_positive
from model.config import AttentionConfig


@dataclass(frozen=True)
class Backend:
    """One row of the table. Functions are named ``"module:function"`` and imported when the backend
    is built, so one whose dependencies are missing (triton) costs nothing until it is chosen."""

    name: str
    attend: str  # attend(q, k, v, doc_ids=None, **options) -> o
    packed: Optional[str] = None  # attend_packed(qkv, n_head, doc_ids=None, **options) -> o
    options: Tuple[str, ...] = ()  # the keyword options both take
    unavailable: Optional[Callable[[torch.device], str]] = None  # why it cannot run on a device; "" when it can
    fallback: Optional[str] = None  # what runs instead where it cannot (a warning; attention.strict=true fails)


def flash_unavailable_reason(device: torch.device) -> str:
    """Why our Triton kernel cannot run on ``device``; empty when it can."""
    try:
        from kernels import flash_attn_available
    except ImportError as err:  # triton missing (Windows, macOS)
        return f"triton is not importable ({err})"
    ok, reason = flash_attn_available()
    if not ok:
        return reason
    if device.type != "cuda":
        return "" if os.environ.get("TRITON_INTERPRET") == "1" else f"the kernel runs on CUDA GPUs and this run uses {device.type}"
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0) and tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 3):
        return (f"triton {triton.__version__} does not compile for compute capability {major}.{minor} "
                "(Turing and older; it needs 8.0, Ampere, or newer)")
    return ""


BACKENDS: Dict[str, Backend] = {backend.name: backend for backend in (
    Backend("naive", "model.attention.naive:attend", options=("window", "dropout_p", "g")),
    Backend("hybrid", "model.attention.hybrid:attend", options=("window", "block_size", "dropout_p", "g")),
    Backend("tiled", "model.attention.tiled:attend", options=("window", "dropout_p", "g")),
    Backend("sdpa", "model.attention.sdpa:attend", options=("window", "dropout_p", "g")),
    Backend("flash", "model.attention.flash:attend", packed="model.attention.flash:attend_packed",
            options=("window", "dropout_p", "g"), unavailable=flash_unavailable_reason, fallback="sdpa"),
)}

# AttentionConfig keys that change what attention computes, with the value that turns them off: set
# to anything else, they need a backend that takes them. Other keys a backend takes (hybrid's
# block_size) only tune it, and the backends that do not take them ignore them.
FEATURES = {"window": None}


@dataclass(frozen=True)
class Attention:
    """A backend bound to its configured options: ``attention(q, k, v, doc_ids=None, **options)``."""

    name: str  # the backend that runs (after any fallback)
    attend: Callable
    packed: Optional[Callable] = None
    window: Optional[int] = None  # attention.window, bound into attend: what a KV cache's decode step must apply too

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids=None, **options) -> torch.Tensor:
        return self.attend(q, k, v, doc_ids=doc_ids, **options)


def unavailable_reason(name: str, device: torch.device) -> str:
    """Why backend ``name`` cannot run on ``device``; empty when it can."""
    backend = BACKENDS[name]
    return backend.unavailable(device) if backend.unavailable else ""


def validate_attention(cfg: AttentionConfig) -> None:
    """Reject an unknown backend, bad values, and a feature the chosen backend cannot compute."""
    if cfg.name not in BACKENDS:
        raise UserError(f"attention={cfg.name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    if cfg.block_size is not None:
        check_positive("attention.block_size", cfg.block_size, kind="integer")
    if cfg.window is not None and cfg.window <= 0:
        raise UserError(f"attention.window={cfg.window} must be a positive number of keys (or null for none)")
    check_options(cfg.name, features_in_use(cfg))


def features_in_use(cfg: AttentionConfig) -> Dict[str, str]:
    """{option: the setting that asks for it} for the FEATURES ``cfg`` turns on."""
    return {key: f"attention.{key}={getattr(cfg, key)}" for key, off in FEATURES.items() if getattr(cfg, key) != off}


def check_options(name: str, wanted: Dict[str, str]) -> None:
    """Fail in one line when backend ``name`` does not take every option in ``wanted`` ({option: setting})."""
    missing = [setting for option, setting in wanted.items() if option not in BACKENDS[name].options]
    if missing:
        able = [b.name for b in BACKENDS.values() if set(wanted) <= set(b.options)]
        raise UserError(f"attention={name} cannot run with {missing[0]}; backends that can: {', '.join(able) or 'none'}")


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
    if reason:
        fallback = BACKENDS[name].fallback
        if cfg.strict or fallback is None:
            way_out = f"; drop attention.strict=true to fall back to {fallback}" if fallback else ""
            raise UserError(f"attention={name} cannot run: {reason}{way_out}")
        warnings.warn(f"attention={name} cannot run ({reason}); using attention={fallback} instead", stacklevel=2)
        name = fallback
    check_options(name, features_in_use(cfg))
    if context is not None:
        return ring_attention_of(name, context), name
    backend = BACKENDS[name]
    config_keys = {f.name for f in dataclasses.fields(AttentionConfig)}
    bound = {key: getattr(cfg, key) for key in backend.options if key in config_keys}
    packed = functools.partial(_load(backend.packed), **bound) if backend.packed else None
    return Attention(name, functools.partial(_load(backend.attend), **bound), packed, cfg.window), name


def ring_attention_of(name: str, group: Optional[dist.ProcessGroup]) -> Attention:
    """Backend ``name`` as ring attention over ``group``: q, k, v are this rank's zigzag shard. With no
    group, a ring of one rank: the whole sequence, no communication (what N=1 costs through the ring)."""
    from model.attention import ring, ring_steps

    return Attention(name, functools.partial(ring.attend, group=group, step=ring_steps.ring_step_attention(name)))


def _load(ref: str) -> Callable:
    module, function = ref.split(":")
    return getattr(importlib.import_module(module), function)
