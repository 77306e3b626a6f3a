"""Checkpoints: atomic writes, the last N kept, and resume that skips a damaged newest checkpoint.

A checkpoint is one file ``<run dir>/checkpoints/step_XXXXXXX.pt`` holding plain tensors and
containers only, so it loads with ``torch.load(weights_only=True)``: model, optimizer, grad scaler,
step, RNG states, data-loader position, the config it was made with, the wandb run id and the best
validation loss so far.

With ``trainer.keep_best=true`` the run also keeps ``checkpoints/best.pt``: the same contents at
the evaluation with the lowest validation loss so far (its ``val_loss`` added), rewritten each
time it improves and never pruned. Resuming (``trainer.resume=auto``) still takes the newest
``step_`` checkpoint.

Under FSDP (``trainer.distributed=fsdp``) it is a folder ``step_XXXXXXX/`` instead: every rank
writes its shards of the model and optimizer with ``torch.distributed.checkpoint`` (DCP) and rank 0
adds ``meta.pt`` with everything else. DCP reshards on load, so such a checkpoint resumes under
FSDP with any number of ranks. DCP is imported only for such a checkpoint: it takes seconds to import.

A run saves through its ``Checkpointer``, which writes nothing unless the weights and optimizer
state are finite and the disk has room for it, and starts with ``restore`` (``trainer.resume``).

Nothing of a checkpoint is used before ``validate_checkpoint`` has checked it: its fields and their
types, its config, the names and shapes of its weights against the model, finite values in its
weights and optimizer state, the sizes of its RNG states. Resuming then compares its config with the
run's (training/changes.py: what differs in shape is refused, in meaning refused unless
``trainer.resume_changes=allow``, in data order said), refuses another tokenizer (a checkpoint carries
its tokenizer and the identity of its corpus) and another layout.
"""
import dataclasses
import math
import os
import re
import shutil
import typing
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from data.config import DataConfig
from data.folders import out_of_space
from data.tokenizers import GPT2Tokenizer, describe_tokenizer
from errors import UserError
from model.config import AttentionConfig, ModelConfig, validate_model
from training import distributed
from training.changes import MEANING, ORDER, SHAPE, compare, listed
from training.config import TrainConfig
from training.errors import NonFiniteState
from training.optim import plain_state_dict, settings_kept
from training.signals import temporary

# torch.distributed.checkpoint (DCP) and DTensor are imported where a sharded checkpoint or an FSDP model
# is handled: importing them takes about half a second, which sampling from a whole checkpoint never needs.

NAME = re.compile(r"^step_(\d+)(\.pt)?$")
LR_ROLES = ("head_lr", "embed_lr", "scalar_lr")  # optim options that, set, give their parameters a group
META = "meta.pt"
BEST = "best.pt"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_of(checkpoint: Path) -> int:
    return int(NAME.match(checkpoint.name).group(1))


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
    final = _write_atomically(run_dir, f"step_{step:07d}.pt", state, step)
    prune(run_dir, step, keep)
    return final


def best_checkpoint(run_dir: Path) -> Path:
    """Where ``trainer.keep_best`` keeps the checkpoint of the lowest validation loss."""
    return checkpoint_dir(run_dir) / BEST


def _write_atomically(run_dir: Path, name: str, state: dict, step: int) -> Path:
    """``state`` (of ``step``) as ``name`` in the run's checkpoint folder, through a temporary file
    flushed to disk and then renamed, so a crash at any point leaves the old file or the new one, never
    a half-written file under the name; refused in one line when the disk lacks the room."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final, tmp = folder / name, folder / f".{name}.tmp"
    check_space(run_dir, step)
    with temporary(tmp):  # a second signal (an exit at once) removes it
        _write_synced(tmp, state, step)
        os.replace(tmp, final)
    _fsync_dir(folder)
    return final


def save_sharded_checkpoint(run_dir: Path, step: int, model, optimizer, meta: dict, keep: int, is_main: bool) -> Path:
    """Every rank writes its shards of ``model`` and ``optimizer``; rank 0 adds ``meta`` and publishes.

    All ranks must call this together. The shards go to a temporary folder that rank 0 renames to
    ``step_XXXXXXX`` only after every rank has finished and ``meta.pt`` is on disk, so a crash
    leaves no half-written checkpoint under a checkpoint's name.
    """
    folder = checkpoint_dir(run_dir)
    final, tmp = folder / f"step_{step:07d}", folder / f".step_{step:07d}.tmp"
    if is_main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    distributed.barrier()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with temporary(tmp):
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
        distributed.barrier()
        if is_main:
            _write_synced(tmp / META, meta, step)
            remove_checkpoint(final)
            os.replace(tmp, final)
            _fsync_dir(folder)
            prune(run_dir, step, keep)
    distributed.barrier()
    return final


def load_sharded_checkpoint(path: Path, model, optimizer) -> None:
    """Read the shards of ``path`` into the sharded ``model`` and ``optimizer`` (all ranks together)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path)
    with settings_kept(optimizer):
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_into_plain_model(path: Path, state: dict, model) -> None:
    """The weights of any checkpoint, whole or sharded, into an unsharded model in one process (a whole
    checkpoint's weights checked with ``validate_checkpoint(path, state, model)`` first; a sharded one's
    are checked once loaded)."""
    if not state["sharded"]:
        model.load_state_dict(state["model"])
        return
    import torch.distributed.checkpoint as dcp

    weights = model.state_dict()
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": weights}, checkpoint_id=path, no_dist=not dist.is_initialized())  # gathers every rank's shards
    bad = first_non_finite(weights)
    if bad:
        raise UserError(f"checkpoint {path} cannot be used: its weight {bad} holds NaN or infinity")
    model.load_state_dict(weights)


def saved_vocab_size(state: dict) -> int:
    return state["vocab_size"] if "vocab_size" in state else state["model"]["wte.weight"].shape[0]


def prune(run_dir: Path, step: int, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints up to ``step``; drop the rest and any newer than ``step``.

    Newer ones belong to an abandoned timeline (a damaged newest one was skipped, or an older one
    was resumed by name): they would outrank this save, and pruning could delete it.
    """
    kept = [p for p in list_checkpoints(run_dir) if step_of(p) <= step]
    for old in set(list_checkpoints(run_dir)) - set(kept[-keep:]):
        remove_checkpoint(old)


def remove_checkpoint(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _write_synced(path: Path, state: dict, step: int) -> None:
    """Write ``state`` to ``path`` and flush it to disk; on any failure remove what was written, and
    say a full disk in one line (torch's zip writer reports it as "unexpected pos")."""
    try:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as err:
        path.unlink(missing_ok=True)
        if out_of_space(err):
            raise UserError(no_space(path.parent, step)) from err
        raise


def check_space(run_dir: Path, step: int) -> None:
    """Refuse to start writing when the disk has less room than the last checkpoint took."""
    last = [p for p in list_checkpoints(run_dir) if p.is_file()]
    if not last:
        return
    needed, free = last[-1].stat().st_size, shutil.disk_usage(checkpoint_dir(run_dir)).free
    if free < needed:
        raise UserError(no_space(checkpoint_dir(run_dir), step, f" ({free / 1e6:.1f} MB free, the last one took "
                                                                 f"{needed / 1e6:.1f} MB)"))


def no_space(folder: Path, step: int, detail: str = "") -> str:
    return (f"no space left on {folder}: the checkpoint of step {step} was not written{detail}; the previous "
            "checkpoints are kept. Free some space (or lower trainer.keep_checkpoints), then start the same command "
            "again to resume")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: Path, mmap: bool = False) -> dict:
    """Load one checkpoint on the CPU; UserError naming the file when it cannot be read.

    For a sharded checkpoint (a folder) this is its ``meta.pt`` with ``"sharded": True``; the
    weights stay on disk until ``load_sharded_checkpoint``. With ``mmap`` the tensors are mapped
    from the file and read when used (a reader of the weights alone never reads the optimizer state).
    """
    path = Path(path)
    sharded = path.is_dir()
    if not (path.is_file() or sharded):
        raise UserError(f"trainer.resume={path}: no such checkpoint; use trainer.resume=auto or none")
    if sharded and not (path / ".metadata").is_file():
        raise UserError(f"{path} is a folder but not a complete sharded checkpoint (no .metadata inside); give a "
                        "checkpoint (checkpoints/step_XXXXXXX.pt, or the checkpoints/step_XXXXXXX folder of an FSDP "
                        "run) or trainer.resume=auto")
    try:
        state = torch.load(path / META if sharded else path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, bad pickle, not a torch file at all
        raise UserError(f"checkpoint {path} is corrupt or not a nanoflash checkpoint ({type(err).__name__})") from err
    if not isinstance(state, dict) or "step" not in state or ("model" not in state and not sharded):
        raise UserError(f"checkpoint {path} is not a nanoflash checkpoint (no model or step inside)")
    state["sharded"] = sharded
    return state


def latest_checkpoint(run_dir: Path, mmap: bool = False) -> Tuple[Optional[Path], Optional[dict]]:
    """The newest checkpoint that loads (``load_checkpoint``), warning about each newer one that does not
    (naming the fallback)."""
    damaged = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            state = load_checkpoint(path, mmap)
        except UserError as err:
            damaged.append(err)
            continue
        for err in damaged:
            warnings.warn(f"{err}; falling back to {path} (step {state['step']})", stacklevel=2)
        return path, state
    for err in damaged:
        warnings.warn(f"{err}; no older checkpoint loads, starting from step 0", stacklevel=2)
    return None, None


class Problem(Exception):
    """What is wrong with a checkpoint (``validate_checkpoint`` names the file)."""


def validate_checkpoint(path: Path, state: dict, model=None, optimizer=None) -> ModelConfig:
    """Check a loaded checkpoint before anything of it is used; UserError naming ``path`` and the first problem.

    Without ``model``: its fields and their types, and its config (sections of the schema's keys and
    types, a model that can be built): what building the model needs. Returns the checkpoint's
    ModelConfig, its vocab_size filled in. With ``model`` (built from that config, or the run's that
    resumes it): also its weights, the names and shapes of ``model``'s, every value finite (a sharded
    checkpoint's weights are checked once loaded). With ``optimizer`` (a resume): also the optimizer
    state (its groups, and its shapes against ``optimizer``'s parameters; finite values), the grad
    scaler, the loader position and the RNG states (their sizes).

    Sampling and exporting call it twice, before and after building the model:
    ``model = GPT(validate_checkpoint(path, state), ...)``, then ``validate_checkpoint(path, state, model)``.
    """
    try:
        model_cfg = _checked_fields(state)
        if model is not None and not state.get("sharded"):
            _check_weights(state["model"], model.state_dict())
        if optimizer is not None:
            _check_training_state(state, optimizer)
    except Problem as problem:
        raise UserError(f"checkpoint {path} cannot be used: {problem} (it is damaged, or was not written by this "
                        "version of nanoflash)") from None
    return model_cfg


FIELDS = {"step": int, "scaler": dict, "loader": dict, "rng": dict, "config": dict}  # every checkpoint
WHOLE_FIELDS = {"model": dict, "optimizer": dict}  # besides, every checkpoint that is not sharded
OPTIONAL_FIELDS = {"vocab_size": int, "wandb_id": (str, type(None)), "best_val_loss": (float, type(None)),
                   "val_loss": float, "tokenizer": dict, "corpus": dict}


def _checked_fields(state: dict) -> ModelConfig:
    required = {**FIELDS, **({} if state.get("sharded") else WHOLE_FIELDS)}
    for name, kind in {**required, **OPTIONAL_FIELDS}.items():
        if name not in state:
            if name in required:
                raise Problem(f"it has no {name!r}")
            continue
        if not _is(state[name], kind):
            raise Problem(f"its {name!r} is of type {type(state[name]).__name__}, not {_kind_name(kind)}")
    if state["step"] < 0:
        raise Problem(f"its step is {state['step']}")
    if ("tokenizer" in state) != ("corpus" in state):
        raise Problem("it records its tokenizer without its corpus or the other way round")
    if "tokenizer" in state:
        _check_lineage_fields(state["tokenizer"], state["corpus"])
    config = state["config"]
    for name, schema in (("model", ModelConfig), ("attention", AttentionConfig), ("data", DataConfig)):
        if name not in config:
            if name == "model":
                raise Problem("its config has no model section")
            continue
        _check_section(config[name], schema, f"config.{name}")
    model_cfg = ModelConfig(**config["model"])
    model_cfg.vocab_size = _vocab_size(state, model_cfg)
    tokens = _tokenizer_size(state.get("tokenizer"))
    if tokens > model_cfg.vocab_size:
        raise Problem(f"its tokenizer has {tokens} tokens, more than its model's vocab_size {model_cfg.vocab_size}")
    try:
        validate_model(model_cfg)
    except UserError as err:
        raise Problem(f"its config makes no model: {err}") from None
    return model_cfg


def _is(value, kind) -> bool:
    """isinstance, where a bool is not an int and an int is a float too."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds) or (float in kinds and isinstance(value, int))


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def _check_section(values, schema, where: str) -> None:
    """``values`` (a dict) holds only keys of the dataclass ``schema``, each of its type."""
    if not isinstance(values, dict):
        raise Problem(f"its {where} is of type {type(values).__name__}, not dict")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in values.items():
        if key not in fields:
            raise Problem(f"its {where} has the key {key!r}, which this version does not know")
        hints = typing.get_type_hints(schema)[key]
        kinds = typing.get_args(hints) or (hints,)  # Optional[int] -> (int, NoneType)
        if hints is not typing.Any and not _is(value, kinds):
            raise Problem(f"its {where}.{key} is {value!r}, not {_kind_name(kinds)}")


def _vocab_size(state: dict, model_cfg: ModelConfig) -> int:
    """The vocabulary the weights have: the checkpoint's vocab_size, or its embedding's rows."""
    if "vocab_size" in state:
        vocab = state["vocab_size"]
    elif not state.get("sharded") and torch.is_tensor(state["model"].get("wte.weight")):
        vocab = state["model"]["wte.weight"].shape[0]
    else:
        raise Problem("it records no vocab_size")
    if vocab <= 0 or (model_cfg.vocab_size is not None and model_cfg.vocab_size != vocab):
        raise Problem(f"its vocab_size {vocab} disagrees with its config's model.vocab_size={model_cfg.vocab_size}")
    return vocab


def _tokenizer_size(identity: Optional[dict]) -> int:
    """How many token ids a checkpoint's tokenizer gives (0 when it records none)."""
    if identity is None:
        return 0
    return len(identity["chars"]) if identity["tokenizer"] == "char" else GPT2Tokenizer.vocab_size


def _check_lineage_fields(tokenizer: dict, corpus: dict) -> None:
    name = tokenizer.get("tokenizer")
    if name not in ("gpt2", "char") or (name == "char" and not isinstance(tokenizer.get("chars"), str)):
        raise Problem(f"its tokenizer record {str(tokenizer)[:80]} names no tokenizer of ours")
    if not all(isinstance(corpus.get(key), str) for key in ("digest", "described")):
        raise Problem("its corpus record lacks its digest or description")


def _check_weights(saved: dict, expected: Dict[str, torch.Tensor]) -> None:
    """``saved`` has exactly the names and shapes of ``expected`` (a model's state_dict), finite values."""
    missing = [name for name in expected if name not in saved]
    if missing:
        raise Problem(f"its weights lack {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    extra = [name for name in saved if name not in expected]
    if extra:
        raise Problem(f"its weights have {extra[0]!r}, which the model has not")
    for name, want in expected.items():
        have = saved[name]
        if not torch.is_tensor(have) or have.shape != want.shape or have.is_floating_point() != want.is_floating_point():
            what = f"a {type(have).__name__}" if not torch.is_tensor(have) else f"{tuple(have.shape)} {have.dtype}"
            raise Problem(f"its weight {name} is {what} where the model has {tuple(want.shape)} {want.dtype}")
    bad = first_non_finite(saved)
    if bad:
        raise Problem(f"its weight {bad} holds NaN or infinity")


def _check_training_state(state: dict, optimizer) -> None:
    """What only a resume uses: optimizer state, grad scaler, loader position, RNG states."""
    if not state.get("sharded"):
        _check_optimizer(state["optimizer"], optimizer)
    for key, value in state["scaler"].items():
        if not (_is(value, float) and math.isfinite(value)):
            raise Problem(f"its grad scaler's {key} is {value!r}, not a finite number")
    drawn, ranks = state["loader"].get("batches_drawn"), state["loader"].get("ranks", 1)
    if not (_is(drawn, int) and drawn >= 0 and _is(ranks, int) and ranks >= 1):
        raise Problem(f"its loader position (batches_drawn) is {drawn!r} for {ranks!r} ranks, not a count")
    rng = state["rng"]
    sizes = {"cpu": torch.get_rng_state().numel()}
    if torch.cuda.is_available():
        sizes["cuda"] = torch.cuda.get_rng_state().numel()
    for device, size in sizes.items():
        value = rng.get(device, None if device == "cpu" else torch.empty(size, dtype=torch.uint8))
        if not (torch.is_tensor(value) and value.dtype == torch.uint8 and value.shape == (size,)):
            what = f"{tuple(value.shape)} {value.dtype}" if torch.is_tensor(value) else repr(value)[:40]
            raise Problem(f"its {device} RNG state is {what}, not the {size} bytes of torch's generator")


def _check_optimizer(saved: dict, optimizer) -> None:
    """The optimizer state of a whole checkpoint: groups of ``optimizer``'s sizes, per-parameter tensors
    of their parameters' shapes (the step a scalar), every value finite."""
    groups, per_param = saved.get("param_groups"), saved.get("state")
    if not (isinstance(groups, list) and isinstance(per_param, dict)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        raise Problem("its optimizer state is not that of a torch optimizer (param_groups, state)")
    sizes = [len(g["params"]) for g in groups]
    live = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != live:
        raise Problem(f"its optimizer has groups of {sizes} parameters where this model's has {live}")
    params = {index: param for g, live_group in zip(groups, optimizer.param_groups)
              for index, param in zip(g["params"], live_group["params"])}
    for index, values in per_param.items():
        if index not in params or not isinstance(values, dict):
            raise Problem(f"its optimizer state has an entry {index!r} for no parameter")
        for name, value in values.items():
            if not torch.is_tensor(value):
                continue
            shape = () if name == "step" else params[index].shape
            if value.numel() != math.prod(shape) or (name != "step" and value.shape != shape):
                raise Problem(f"its optimizer's {name} of parameter {index} is {tuple(value.shape)}, not {tuple(shape)}")
    bad = first_non_finite({f"{name} of parameter {index}": value for index, values in per_param.items()
                            for name, value in values.items() if torch.is_tensor(value)})
    if bad:
        raise Problem(f"its optimizer's {bad} holds NaN or infinity")


def first_non_finite(named: Dict[str, torch.Tensor]) -> Optional[str]:
    """The name of the first floating tensor of ``named`` that holds a NaN or an infinity, or None: one
    fused max-abs reduction over all of them."""
    floating = {name: t for name, t in named.items() if t.is_floating_point() and t.numel()}
    if not floating:
        return None
    largest = torch.stack([m.float() for m in torch._foreach_norm(list(floating.values()), ord=float("inf"))])
    bad = (~largest.isfinite()).nonzero()
    return list(floating)[bad[0].item()] if len(bad) else None


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def state_is_finite(model, optimizer) -> bool:
    """Whether every weight and optimizer-state tensor (this rank's shards) is finite: one fused
    max-abs reduction on the device over all of them, one sync."""
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
    tensors = [t.to_local() if distributed.is_dtensor(t) else t for t in (*model.parameters(), *state)]
    largest = torch._foreach_norm([t for t in tensors if t.is_floating_point() and t.numel()], ord=float("inf"))
    return bool(torch.stack([m.float() for m in largest]).isfinite().all())


class Checkpointer:
    """What a run saves: model, optimizer, grad scaler, the loader position, RNG state, config, wandb
    id, and its ``lineage``: the tokenizer's identity and the corpus' (data/prepare.py). Whole-model
    files come from rank 0; under FSDP every rank writes its shards."""

    def __init__(self, run_dir: Path, keep: int, model, optimizer, scaler, ranks: distributed.Ranks,
                 device: torch.device, config: dict, wandb_id: Optional[str], lineage: dict,
                 best_val_loss: Optional[float] = None, keep_best: bool = False):
        self.run_dir, self.keep, self.ranks, self.device = run_dir, keep, ranks, device
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.config, self.wandb_id, self.lineage = config, wandb_id, lineage
        self.best_val_loss, self.keep_best = best_val_loss, keep_best  # the lowest validation loss so far

    def save(self, step: int, loader_state: dict, rng: Optional[dict] = None) -> Optional[Path]:
        """Save ``step`` (RNG state ``rng``, default now); the path written, None on ranks that write nothing.
        NonFiniteState, on every rank, when a weight or optimizer-state value is not finite."""
        bad = not state_is_finite(self.model, self.optimizer)  # DDP ranks hold the same values: the same answer
        if distributed.any_rank(bad, self.ranks) if self.ranks.sharded else bad:
            raise NonFiniteState(step)
        if not (self.ranks.is_main or self.ranks.sharded):
            return None  # a whole-model checkpoint is rank 0's alone
        state = self._meta(step, loader_state, rng)
        if self.ranks.sharded:
            return save_sharded_checkpoint(self.run_dir, step, self.model, self.optimizer, state, self.keep,
                                           self.ranks.is_main)
        state.update(model=self.model.state_dict(), optimizer=plain_state_dict(self.optimizer))
        return save_checkpoint(self.run_dir, step, state, self.keep)

    def save_if_best(self, step: int, val_loss: float, loader_state: dict) -> Optional[Path]:
        """Remember ``val_loss`` when it is finite and lower than the best so far; with keep_best, write
        it to checkpoints/best.pt (rank 0). The path written, or None."""
        if not math.isfinite(val_loss) or (self.best_val_loss is not None and val_loss >= self.best_val_loss):
            return None
        self.best_val_loss = val_loss
        if not (self.keep_best and self.ranks.is_main):
            return None
        state = self._meta(step, loader_state, None)
        state.update(model=self.model.state_dict(), optimizer=plain_state_dict(self.optimizer), val_loss=val_loss)
        return _write_atomically(self.run_dir, BEST, state, step)

    def _meta(self, step: int, loader_state: dict, rng: Optional[dict]) -> dict:
        """Everything a checkpoint holds besides the model and optimizer."""
        return {
            "step": step,
            "vocab_size": self.model.cfg.vocab_size,
            "scaler": self.scaler.state_dict(),
            "loader": loader_state,
            "rng": rng if rng is not None else rng_state(self.device),
            "config": self.config,
            "wandb_id": self.wandb_id,
            "best_val_loss": self.best_val_loss,
            **self.lineage,
        }


def restore(resume: str, run_dir: Path, model, optimizer, scaler, loader, device: torch.device,
            ranks: distributed.Ranks, lineage: dict, config: dict) -> Tuple[int, Optional[str], Optional[float]]:
    """Load the checkpoint ``trainer.resume`` names into the run, whose data has ``lineage`` (the
    tokenizer's and the corpus' identity) and whose config is ``config`` (a dict). Returns (step
    reached, wandb id, best validation loss so far)."""
    if resume == "none":
        best = best_checkpoint(run_dir)
        old = list_checkpoints(run_dir) + ([best] if best.is_file() else []) if ranks.is_main else []
        if old:
            print(f"trainer.resume=none: starting over, removing {len(old)} old checkpoint(s) in {checkpoint_dir(run_dir)}")
            for path in old:
                remove_checkpoint(path)
        distributed.barrier()  # no rank may look for checkpoints while rank 0 removes them
        return 0, None, None
    if resume == "auto":
        path, state = latest_checkpoint(run_dir)
        if state is None:
            return 0, None, None
    else:
        path, state = Path(resume), load_checkpoint(Path(resume))
    validate_checkpoint(path, state)
    if resume != "auto":
        check_newer(path, state["step"], run_dir, ranks.is_main)
    changes = check_changes(path, state, config, model.cfg, lineage, ranks.is_main, loader.world_size)
    check_optimizer(path, state, config)
    check_lineage(path, state, lineage, ranks.is_main, data_changed=any(k.startswith("data.") for k, _, _ in changes))
    check_layout(path, state, ranks)
    validate_checkpoint(path, state, model, optimizer)
    if state["sharded"]:
        load_sharded_checkpoint(path, model, optimizer)
        if distributed.any_rank(not state_is_finite(model, optimizer), ranks):
            raise UserError(f"checkpoint {path} cannot be used: its weights or optimizer state hold NaN or infinity")
    else:
        model.load_state_dict(state["model"])
        with settings_kept(optimizer):
            optimizer.load_state_dict(state["optimizer"])
    if state["scaler"]:  # empty when saved without loss scaling (bf16, fp32): a fp16 run then starts its own
        scaler.load_state_dict(state["scaler"])
    loader.load_state_dict(state["loader"])
    restore_rng_state(state["rng"], device)
    if ranks.is_main:
        print(f"resuming from {path} (step {state['step']})")
    return state["step"], state.get("wandb_id"), state.get("best_val_loss")


def check_changes(path: Path, state: dict, config: dict, model_cfg: ModelConfig, lineage: dict,
                  is_main: bool, data_ranks: int = 1) -> List[Tuple[str, object, object]]:
    """Compare the checkpoint's config with this run's (training/changes.py): a change of shape is refused; of
    meaning refused unless trainer.resume_changes=allow, then said; of data order (with the number of
    data-parallel ranks, ``data_ranks`` now) said in one line. Returns the changes of meaning and order."""
    saved, now = _comparable(state["config"], saved_vocab_size(state)), _comparable(config, model_cfg.vocab_size)
    if "corpus" in state and state["corpus"]["digest"] == lineage["corpus"]["digest"]:
        now["data"]["path"] = saved.get("data", {}).get("path")  # the same text, wherever it lies now
    changes = compare(saved, now, schema_defaults())
    if state["loader"].get("ranks", data_ranks) != data_ranks:  # the global batch is split over them
        changes[ORDER].append(("data-parallel ranks", state["loader"]["ranks"], data_ranks))
    if changes[SHAPE]:
        key, theirs, mine = changes[SHAPE][0]
        raise UserError(f"checkpoint {path} was made with {key}={theirs} but this run has {key}={mine}; resume with "
                        "the same model and data settings, or start fresh with trainer.resume=none (or another "
                        "hydra.run.dir)")
    meaning = listed(changes[MEANING])
    if meaning and config["trainer"]["resume_changes"] != "allow":
        raise UserError(f"checkpoint {path}: this run changes {meaning}, which changes what the model computes or "
                        "learns; resume with the checkpoint's settings, add trainer.resume_changes=allow to continue "
                        "with the change, or start fresh with trainer.resume=none (or another hydra.run.dir)")
    if is_main and meaning:
        print(f"resuming with changes of meaning (trainer.resume_changes=allow): {meaning}")
    if is_main and changes[ORDER]:
        print(f"data order changes: {listed(changes[ORDER])}")
    return changes[MEANING] + changes[ORDER]


def schema_defaults() -> dict:
    """Every option's default (training/config.py), as a checkpoint's config holds them."""
    return dataclasses.asdict(TrainConfig())


def _comparable(config: dict, vocab_size: int) -> dict:
    """A copy of a config dict with what compares by effect filled in: the resolved vocabulary, and
    n_kv_head null as the n_head it means."""
    config = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    model = config.get("model", {})
    model["vocab_size"] = vocab_size
    if model.get("n_kv_head") is None and "n_head" in model:
        model["n_kv_head"] = model["n_head"]
    return config


def check_optimizer(path: Path, state: dict, config: dict) -> None:
    """A checkpoint resumes only the optimizer it was made with, its parameters grouped alike: the
    roles whose learning rates are set (optim.head_lr, embed_lr, scalar_lr; null: optim.lr) have groups
    of their own. A key the checkpoint's config lacks predates the option: it was made with the default."""
    saved, mine = state["config"].get("optim", {}), config["optim"]
    theirs = saved.get("name", "adamw")
    if theirs != mine["name"]:
        made = f"optim={theirs}"
    elif any((saved.get(role) is None) != (mine[role] is None) for role in LR_ROLES):
        made = "its parameters in other optimizer groups"
    else:
        return
    raise UserError(f"checkpoint {path} was made with {made}; resume with the optimizer settings it was made with "
                    f"(optim={theirs}, and optim.head_lr, embed_lr, scalar_lr set or null alike), or start fresh with "
                    "trainer.resume=none (or another hydra.run.dir)")


def check_newer(path: Path, step: int, run_dir: Path, is_main: bool) -> None:
    """``trainer.resume=<path>`` where the run folder holds checkpoints of later steps, which the saves of
    this run would delete as an abandoned timeline: refused when ``path`` is another folder's checkpoint,
    said when it is this folder's own (a roll-back)."""
    newer = [p for p in list_checkpoints(run_dir) if step_of(p) > step]
    if not newer:
        return
    if path.resolve().parent != checkpoint_dir(run_dir).resolve():
        raise UserError(f"trainer.resume={path}: the run folder {run_dir} holds a newer checkpoint, {newer[-1]}, "
                        "which this run's saves would delete; give another hydra.run.dir for this run, continue "
                        "that folder's own with trainer.resume=auto, or move its checkpoints away")
    if is_main:
        print(f"trainer.resume={path}: rolling back to step {step}: {', '.join(p.name for p in newer)} of this folder "
              f"{'are' if len(newer) > 1 else 'is'} replaced by this run's checkpoints (removed at its first save)")


def check_lineage(path: Path, state: dict, lineage: dict, is_main: bool, data_changed: bool = False) -> None:
    """A checkpoint resumes only with the tokenizer it was trained with (token ids must keep their
    meaning); on another corpus it resumes, fine-tuning, and says so once (its own checkpoints then
    carry the new corpus): naming both corpora, or, where a changed data option says it already
    (``data_changed``: data.val_fraction, ...), nothing more. Checkpoints that carry no tokenizer were
    made before it was recorded."""
    if "tokenizer" not in state:
        return
    theirs, mine = describe_tokenizer(state["tokenizer"]), describe_tokenizer(lineage["tokenizer"])
    if state["tokenizer"] != lineage["tokenizer"]:
        mine = mine if mine != theirs else f"{mine[:-1]}, a different set)"
        raise UserError(f"checkpoint {path} was trained with {theirs} but this run's data gives {mine}: its token ids "
                        f"would mean other text. Resume it with the data it was trained on "
                        f"({state['corpus']['described']}), or start fresh with trainer.resume=none (or another "
                        "hydra.run.dir)")
    if state["corpus"]["digest"] == lineage["corpus"]["digest"] or not is_main:
        return
    theirs, mine = state["corpus"]["described"], lineage["corpus"]["described"]
    if theirs != mine:
        print(f"note: checkpoint {path} was trained on {theirs}; this run continues it on {mine} (the same tokenizer)")
    elif not data_changed:
        print(f"note: the text of {mine} changed since checkpoint {path} was trained on it; this run continues it on "
              "the new text (the same tokenizer)")


def check_layout(path: Path, state: dict, ranks: distributed.Ranks) -> None:
    """Sharded (FSDP) checkpoints resume under FSDP only, whole-model ones under none or ddp only."""
    if state["sharded"] == ranks.sharded:
        return
    if state["sharded"]:
        raise UserError(f"checkpoint {path} is sharded (saved with trainer.distributed=fsdp); resume it under "
                        "torchrun with trainer.distributed=fsdp (any number of ranks), or start fresh with "
                        "trainer.resume=none")
    raise UserError(f"checkpoint {path} holds the whole model (saved with trainer.distributed=none or ddp); "
                    "resume it with trainer.distributed=none or ddp, or start fresh with trainer.resume=none")
