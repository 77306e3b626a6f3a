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
FSDP with any number of ranks.

A run saves through its ``Checkpointer``, which writes nothing unless the weights and optimizer
state are finite and the disk has room for it, and starts with ``restore`` (``trainer.resume``),
which refuses a checkpoint of another model shape or layout or of another tokenizer (a checkpoint
carries its tokenizer and the identity of its corpus; a changed corpus is resumed, and said so).
"""
import errno
import math
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from data.tokenizers import describe_tokenizer
from errors import UserError
from model.config import ModelConfig
from training import distributed
from training.errors import NonFiniteState
from training.muon import MuonAdamW
from training.optim import plain_state_dict, settings_kept

NAME = re.compile(r"^step_(\d+)(\.pt)?$")
META = "meta.pt"
BEST = "best.pt"
# Model options a checkpoint must share with the run that resumes it (its weights' shapes, or what
# they compute). A key a checkpoint lacks predates the option: it was made with the default.
SHAPE_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size", "bias", "norm", "pos", "gate", "mlp",
              "qk_norm", "logit_softcap", "tie_embeddings", "value_embeds", "skips")


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
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path)
    with settings_kept(optimizer):
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_into_plain_model(path: Path, state: dict, model) -> None:
    """The weights of any checkpoint, whole or sharded, into an unsharded model in one process."""
    if not state["sharded"]:
        model.load_state_dict(state["model"])
        return
    weights = model.state_dict()
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": weights}, checkpoint_id=path, no_dist=not dist.is_initialized())  # gathers every rank's shards
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


def out_of_space(err: BaseException) -> bool:
    """Whether a disk or quota that is full caused ``err`` (anywhere in its chain)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


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


def load_checkpoint(path: Path) -> dict:
    """Load one checkpoint on the CPU; UserError naming the file when it cannot be read.

    For a sharded checkpoint (a folder) this is its ``meta.pt`` with ``"sharded": True``; the
    weights stay on disk until ``load_sharded_checkpoint``.
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
        state = torch.load(path / META if sharded else path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, not a torch file at all
        raise UserError(f"checkpoint {path} is corrupt or not a nanoflash checkpoint ({type(err).__name__})") from err
    if not isinstance(state, dict) or "step" not in state or ("model" not in state and not sharded):
        raise UserError(f"checkpoint {path} is not a nanoflash checkpoint (no model or step inside)")
    state["sharded"] = sharded
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


def state_is_finite(model, optimizer) -> bool:
    """Whether every weight and optimizer-state tensor (this rank's shards) is finite: one fused
    max-abs reduction on the device over all of them, one sync."""
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in (*model.parameters(), *state)]
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
            ranks: distributed.Ranks, lineage: dict) -> Tuple[int, Optional[str], Optional[float]]:
    """Load the checkpoint ``trainer.resume`` names into the run, whose data has ``lineage`` (the
    tokenizer's and the corpus' identity). Returns (step reached, wandb id, best validation loss so far)."""
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
        check_newer(path, state["step"], run_dir, ranks.is_main)
    check_compatible(path, state, model.cfg)
    check_optimizer(path, state, optimizer)
    check_lineage(path, state, lineage, ranks.is_main)
    check_layout(path, state, ranks)
    if state["sharded"]:
        load_sharded_checkpoint(path, model, optimizer)
    else:
        model.load_state_dict(state["model"])
        with settings_kept(optimizer):
            optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    loader.load_state_dict(state["loader"])
    restore_rng_state(state["rng"], device)
    if ranks.is_main:
        print(f"resuming from {path} (step {state['step']})")
    return state["step"], state.get("wandb_id"), state.get("best_val_loss")


def check_compatible(path: Path, state: dict, model_cfg: ModelConfig) -> None:
    """A checkpoint resumes only a model of the same shape and vocabulary."""
    saved = state.get("config", {}).get("model", {})
    for key in SHAPE_KEYS:
        mine = getattr(model_cfg, key)
        theirs = saved.get(key, getattr(ModelConfig, key)) if key != "vocab_size" else saved_vocab_size(state)
        if theirs != mine:
            raise UserError(
                f"checkpoint {path} was made with model.{key}={theirs} but this run has model.{key}={mine}; "
                f"resume with the same model and data settings, or start fresh with trainer.resume=none "
                f"(or another hydra.run.dir)"
            )


def check_optimizer(path: Path, state: dict, optimizer) -> None:
    """A checkpoint resumes only the optimizer it was made with, its parameters grouped alike (the
    roles whose learning rates are set, optim.head_lr, embed_lr, scalar_lr, decide the groups)."""
    saved = state.get("config", {}).get("optim", {})
    theirs, mine = saved.get("name", "adamw"), "muon" if isinstance(optimizer, MuonAdamW) else "adamw"
    if theirs == mine and ("optimizer" not in state
                           or group_sizes(state["optimizer"]["param_groups"]) == group_sizes(optimizer.param_groups)):
        return
    made = f"optim={theirs}" if theirs != mine else "its parameters in other optimizer groups"
    raise UserError(f"checkpoint {path} was made with {made}; resume with the optimizer settings it was made with "
                    f"(optim={theirs}, and optim.head_lr, embed_lr, scalar_lr set or null alike), or start fresh with "
                    "trainer.resume=none (or another hydra.run.dir)")


def group_sizes(param_groups) -> List[int]:
    return [len(group["params"]) for group in param_groups]


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


def check_lineage(path: Path, state: dict, lineage: dict, is_main: bool) -> None:
    """A checkpoint resumes only with the tokenizer it was trained with (token ids must keep their
    meaning); on another corpus it resumes, fine-tuning, and says so once (its own checkpoints then
    carry the new corpus). Checkpoints that carry no tokenizer were made before it was recorded."""
    if "tokenizer" not in state:
        return
    theirs, mine = describe_tokenizer(state["tokenizer"]), describe_tokenizer(lineage["tokenizer"])
    if state["tokenizer"] != lineage["tokenizer"]:
        mine = mine if mine != theirs else f"{mine[:-1]}, a different set)"
        raise UserError(f"checkpoint {path} was trained with {theirs} but this run's data gives {mine}: its token ids "
                        f"would mean other text. Resume it with the data it was trained on "
                        f"({state['corpus']['described']}), or start fresh with trainer.resume=none (or another "
                        "hydra.run.dir)")
    if state["corpus"]["digest"] != lineage["corpus"]["digest"] and is_main:
        print(f"note: checkpoint {path} was trained on {state['corpus']['described']}; this run continues it on "
              f"{lineage['corpus']['described']} (the same tokenizer)")


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
