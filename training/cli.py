"""The command line around Hydra: early checks of overrides, machine-aware defaults, clean errors.

Hydra composes the config; these helpers run before it (so a misspelt option fails with the list
of valid ones) and around the task (so a UserError prints one line and exits with status 2).
"""
import contextlib
import dataclasses
import re
import signal
import sys
from pathlib import Path
from typing import List, Tuple

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from errors import UserError
from training.config import TrainConfig, validate
from training.errors import Interrupted, OutOfMemory

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
GROUPS = ("model", "attention", "data", "optim", "trainer", "logger", "experiment")


def group_choices(group: str) -> List[str]:
    """Names of the YAML files in configs/<group>/ (leading underscores are private)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_overrides(args: List[str]) -> None:
    """Reject unknown keys and unknown group choices before Hydra runs, listing what is valid."""
    overrides = [a for a in args if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # Hydra's grammar errors say where the override is malformed
        fail(f"cannot parse the overrides: {str(err).splitlines()[0]}; quote a value with spaces or brackets, "
             "e.g. 'data.path=\"my file.txt\"'")
    for override in parsed:
        key = override.key_or_group
        if key.startswith("hydra") or override.is_delete():
            continue
        if "." not in key and key in GROUPS:
            _check_choice(key, override)
        else:
            field = _check_key(key)
            if field is not None and not override.is_sweep_override():
                _check_type(key, field, override.value())


def _check_choice(group: str, override) -> None:
    values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
    choices = group_choices(group)
    for value in values:
        if value is not None and str(value) not in choices:
            fail(f"{group}={value} is not a config; choose one of: {', '.join(choices)}")


def _check_key(key: str):
    """The dataclass field ``key`` names (None inside a list or dict value); fail on an unknown key."""
    node, path, field = TrainConfig, [], None
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return None  # inside a list or dict value; OmegaConf checks the rest
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            where = ".".join(path) or "the top level"
            valid = sorted(fields) + (["experiment"] if not path else [])
            fail(f"unknown option {key!r}: {where} has no key {part!r}; valid keys: {', '.join(valid)}")
        path.append(part)
        field = fields[part]
        node = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
    return field


def _check_type(key: str, field, value) -> None:
    """An int/float/bool/list option given a value of another kind fails here, in one line."""
    if isinstance(value, str) and "${" in value:
        return _check_interpolation(key, value)  # resolved later, to a value of the right type or an error
    kind = field.type
    optional = getattr(kind, "__args__", None)
    if optional and type(None) in optional:
        if value is None:
            return
        kind = next(a for a in optional if a is not type(None))
    if value is None and not optional:
        fail(f"{key} cannot be null")
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
    }.get(kind, True)
    if not ok:
        example = {int: "an integer, e.g. 100", float: "a number, e.g. 0.1", bool: "true or false"}[kind]
        fail(f"{key}={value} has the wrong type: it takes {example}")
    if getattr(kind, "__origin__", None) is list and not isinstance(value, list):
        fail(f"{key}={value} has the wrong type: it takes a list, e.g. {key}=[0.9,0.95]")


def _check_interpolation(key: str, value: str) -> None:
    """``${name:...}`` calls an OmegaConf resolver; reject names that are not registered, before Hydra
    fails on them with a traceback. No resolver evaluates Python."""
    for name in re.findall(r"(?<!\\)\$\{\s*([\w.-]+)\s*:", value):
        if not (OmegaConf.has_resolver(name) or name in ("now", "hydra")):  # Hydra registers these two later
            fail(f"{key}={value}: '{name}' is not a config resolver (there are oc.env, oc.select, oc.decode, "
                 "oc.create, now, hydra; nothing evaluates Python); write \\${...} for a literal ${")


def machine_defaults(args: List[str]) -> List[str]:
    """Extra overrides for a machine without a GPU, when the user left the model to us.

    The default model needs a GPU to train in minutes; with no GPU (or trainer.device=cpu) and no
    model or experiment chosen, `python train.py` runs experiment=cpu (model=tiny, a few minutes
    on 2 cores) instead, and says so. Options given on the command line still win.
    """
    keys = [a.split("=", 1)[0].lstrip("+~") for a in args if "=" in a and not a.startswith("-")]
    chosen_model = any(k == "model" or k.startswith("model.") or k == "experiment" for k in keys)
    wants_cpu = "trainer.device=cpu" in args or (not torch.cuda.is_available() and "trainer.device=cuda" not in args)
    if chosen_model or not wants_cpu:
        return []
    print("No GPU in use: running experiment=cpu (model=tiny, 300 steps) instead of the default "
          "model=small; pass model=small to insist.", file=sys.stderr)
    return ["experiment=cpu"]


def config_from_hydra(cfg: DictConfig) -> Tuple[TrainConfig, Path]:
    """The typed, validated config of this job and its run folder (where the resolved config is saved)."""
    try:
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        where = f" (at {err.full_key})" if getattr(err, "full_key", None) else ""
        raise UserError(f"the config does not resolve: {str(err).splitlines()[0]}{where}") from err
    validate(typed)
    for key, value in _strings(dataclasses.asdict(typed)):
        if "${" in value:  # an escaped \${...}: saving the config would read it as an interpolation again
            raise UserError(f"{key}={value}: a literal '${{' cannot be kept in a config value; remove it")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(typed), resolve=True))
    return typed, run_dir


def _strings(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _strings(value, f"{prefix}{key}.")
        elif isinstance(value, str):
            yield f"{prefix}{key}", value


@contextlib.contextmanager
def exit_on_user_error():
    """Turn a UserError into one line on stderr and exit status 2; out-of-memory gets advice;
    an interrupted run says where its checkpoint is and exits with 128 + the signal number."""
    try:
        yield
    except UserError as err:
        fail(str(err))
    except torch.OutOfMemoryError:
        fail(str(OutOfMemory()))
    except Interrupted as stop:
        print(str(stop), file=sys.stderr)
        sys.exit(128 + stop.signum)
    except KeyboardInterrupt:  # Ctrl-C while preparing data or sampling, where no step is in flight
        print("interrupted outside the training steps; checkpoints written so far are kept", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)

