"""The command line around Hydra: early checks of overrides, machine-aware defaults, clean errors.

Hydra composes the config; these helpers run before it (so a misspelt option fails with the list
of valid ones) and around the task (so a UserError prints one line and exits with status 2). They
read the command line with Hydra's own argument parser, so every Hydra flag (--cfg, --info, -cn,
-cp, -cd, --package, -m, --shell-completion, ...) keeps its meaning and its value is never taken
for an override.
"""
import argparse
import contextlib
import dataclasses
import re
import signal
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Set, Tuple

import torch
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from errors import UserError
from training import pretrained
from training.config import TrainConfig, register_configs, validate
from training.errors import Interrupted, OutOfMemory

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "configs"
GROUPS = ("model", "attention", "data", "optim", "trainer", "logger", "experiment", "local", "debug")


def hydra_args(argv: List[str]) -> argparse.Namespace:
    """The command line as Hydra reads it: its own flags (--cfg, --info, -cn, -cp, -cd, -m, ...) and
    the overrides it will apply (``.overrides``). A wrong flag stops here with Hydra's usage line."""
    return get_args_parser().parse_args(argv)


def config_dirs(args: argparse.Namespace) -> List[Path]:
    """Where the configs come from: --config-dir (searched first), then configs/ or --config-path
    (relative to the repository, where train.py is). Empty for a pkg:// path, whose files cannot be
    listed here: Hydra then checks the group choices itself."""
    primary = CONFIG_DIR
    if args.config_path is not None:
        if args.config_path.startswith("pkg://"):
            return []
        primary = REPO / args.config_path
    return ([Path(args.config_dir).resolve()] if args.config_dir else []) + [primary]


def group_choices(group: str, dirs: Sequence[Path] = (CONFIG_DIR,)) -> List[str]:
    """Names of the YAML files in <dir>/<group>/ of every config dir (leading underscores are private)."""
    return sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml") if not p.stem.startswith("_")})


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_overrides(argv: List[str]) -> None:
    """Reject unknown keys and unknown group choices before Hydra runs, listing what is valid.

    ``argv`` is the command line after the program name; the overrides are those Hydra's own parser
    finds in it, and the group choices those of the config dirs it names (-cp, -cd). The machine's
    file of configs/local/ is checked too.
    """
    args = hydra_args(argv)
    if args.shell_completion:
        return  # its words (install=bash, query=...) are not overrides
    dirs = config_dirs(args)
    overrides = parse_overrides(args.overrides)
    for override in overrides:
        key = override.key_or_group
        if key.startswith("hydra"):
            continue
        if "." not in key and key in GROUPS:
            if not override.is_delete():
                _check_choice(key, override, dirs)
            continue
        field = _check_key(key)
        if field is None:
            continue
        if override.is_delete():
            fail(f"~{key}: options of the schema cannot be removed; set a value instead, e.g. {key}=<value>")
        for value in sweep_values(override) if override.is_sweep_override() else [override.value()]:
            _check_type(key, field, value)
    _check_local_file(overrides, dirs)


def sweep_values(override) -> list:
    """The values a choice or range sweep takes (-m key=a,b,c); none for an interval, which only a
    sweeper plugin samples (and which is numeric by its grammar)."""
    try:
        return list(override.sweep_iterator())
    except HydraException:
        return []


def parse_overrides(overrides: List[str]):
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # Hydra's grammar errors say where the override is malformed
        fail(f"cannot parse the overrides: {str(err).splitlines()[0]}; quote a value with spaces or brackets, "
             "e.g. 'data.path=\"my file.txt\"'")


def _check_choice(group: str, override, dirs: Sequence[Path]) -> None:
    if not dirs:
        return
    choices = group_choices(group, dirs)
    value = override.value()
    if isinstance(value, Glob):
        if not value.filter(choices):
            fail(f"{override.input_line} matches no config; there are: {', '.join(choices) or 'none'}")
        return
    values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [value]
    for value in values:
        if value is not None and str(value) not in choices:
            there = f"choose one of: {', '.join(choices)}" if choices else f"there is no {group}/{value}.yaml"
            fail(f"{group}={value} is not a config; {there}")


def _check_local_file(overrides, dirs: Sequence[Path]) -> None:
    """The configs/local/ file this run loads (local=<name>, else default.yaml; none with ~local): its
    header, keys and value types."""
    chosen = [o for o in overrides if o.key_or_group == "local"]
    if chosen and (chosen[-1].is_delete() or not isinstance(chosen[-1].value(), str)):
        return  # ~local, or a sweep over local files (each is checked by the group choice)
    name = chosen[-1].value() if chosen else "default"
    path = next((d / "local" / f"{name}.yaml" for d in dirs if (d / "local" / f"{name}.yaml").is_file()), None)
    if path is None:
        return
    text = path.read_text()
    if _package_header(text) != "_global_":
        fail(f"{path}: make '# @package _global_' its first line, so that its keys (trainer:, data:, ...) are "
             "the run's own")
    try:
        values = OmegaConf.to_container(OmegaConf.create(text))
    except Exception as err:  # YAML syntax
        fail(f"{path} is not valid YAML: {str(err).splitlines()[0]}")
    for key, value in _leaves(values or {}):
        if key.split(".")[0] in ("defaults", "hydra"):
            continue
        field = _check_key(key, where=f"{path}: ")
        if field is not None:
            _check_type(key, field, value, where=f"{path}: ")


def _package_header(text: str) -> Optional[str]:
    """The ``# @package`` of a config file, read as Hydra does: from the ``# @`` lines before any other."""
    for line in filter(None, (line.strip() for line in text.splitlines())):
        header = re.match(r"#\s*@package\s+(\S+)", line)
        if header or not re.match(r"#\s*@", line):
            return header.group(1) if header else None
    return None


def _leaves(tree: dict, prefix: str = ""):
    """(dotted key, value) of every leaf of a nested dict; lists are leaves."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _check_key(key: str, where: str = ""):
    """The dataclass field ``key`` names (None inside a list or dict value); fail on an unknown key.
    ``where`` starts the message (the file the key is in)."""
    node, path, field = TrainConfig, [], None
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return None  # inside a list or dict value; OmegaConf checks the rest
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            parent = ".".join(path) or "the top level"
            valid = sorted(fields) + ([g for g in GROUPS if g not in fields] if not path else [])
            fail(f"{where}unknown option {key!r}: {parent} has no key {part!r}; valid keys: {', '.join(valid)}")
        path.append(part)
        field = fields[part]
        node = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
    return field


def _check_type(key: str, field, value, where: str = "") -> None:
    """An int/float/bool/list option given a value of another kind fails here, in one line."""
    if isinstance(value, str) and "${" in value:
        return _check_interpolation(key, value, where)  # resolved later, to a value of the right type or an error
    kind = field.type
    optional = getattr(kind, "__args__", None)
    if optional and type(None) in optional:
        if value is None:
            return
        kind = next(a for a in optional if a is not type(None))
    if value is None and not optional:
        fail(f"{where}{key} cannot be null")
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
    }.get(kind, True)
    if not ok:
        example = {int: "an integer, e.g. 100", float: "a number, e.g. 0.1", bool: "true or false"}[kind]
        fail(f"{where}{key}={value} has the wrong type: it takes {example}")
    if getattr(kind, "__origin__", None) is list and not isinstance(value, list):
        fail(f"{where}{key}={value} has the wrong type: it takes a list, e.g. {key}=[0.9,0.95]")


def _check_interpolation(key: str, value: str, where: str = "") -> None:
    """``${name:...}`` calls an OmegaConf resolver; reject names that are not registered, before Hydra
    fails on them with a traceback. No resolver evaluates Python."""
    for name in re.findall(r"(?<!\\)\$\{\s*([\w.-]+)\s*:", value):
        if not (OmegaConf.has_resolver(name) or name in ("now", "hydra")):  # Hydra registers these two later
            fail(f"{where}{key}={value}: '{name}' is not a config resolver (there are oc.env, oc.select, oc.decode, "
                 "oc.create, now, hydra; nothing evaluates Python); write \\${...} for a literal ${")


def machine_defaults(argv: List[str]) -> List[str]:
    """Extra overrides for a machine without a GPU, when the user left the model to us.

    The default model needs a GPU to train in minutes; with no GPU (or trainer.device=cpu) and no
    model or experiment chosen, `python train.py` runs experiment=cpu (model=tiny, a few minutes
    on 2 cores) instead, and says so. Options given on the command line still win. Nothing is added
    where nothing is composed (--help, --hydra-help, --shell-completion).
    """
    args = hydra_args(argv)
    if args.help or args.hydra_help or args.shell_completion:
        return []
    parsed = parse_overrides(args.overrides)
    keys = [o.key_or_group for o in parsed]
    chosen_model = any(k == "model" or k.startswith("model.") or k == "experiment" for k in keys)
    device = next((o.value() for o in reversed(parsed) if o.key_or_group == "trainer.device"), None)
    wants_cpu = device == "cpu" or (not torch.cuda.is_available() and device != "cuda")
    if chosen_model or not wants_cpu:
        return []
    print("No GPU in use: running experiment=cpu (model=tiny, 300 steps) instead of the default "
          "model=small; pass model=small to insist.", file=sys.stderr)
    return ["experiment=cpu"]


def add_overrides(argv: List[str], extra: List[str]) -> List[str]:
    """``argv`` with ``extra`` overrides where Hydra's parser reads them as overrides: right after the
    user's (argparse takes the overrides as one run of words), else first (a trailing bare --info
    would take the next word as its value)."""
    overrides = hydra_args(argv).overrides
    n = len(overrides)
    end = next((i + n for i in range(len(argv) - n, -1, -1) if n and argv[i:i + n] == overrides), 0)
    return argv[:end] + extra + argv[end:]


def compose_config(overrides: List[str]) -> TrainConfig:
    """The typed, validated config of ``overrides`` composed outside a Hydra app (the scripts: fit.py, ...)."""
    check_overrides(overrides)
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=overrides))
    cfg.model = pretrained.resolve(cfg.model, model_options_given(overrides))
    validate(cfg)
    return cfg


def model_options_given(overrides: List[str]) -> Set[str]:
    """The model options ``overrides`` (the command line's) set by key, ``model.n_layer=4`` -> n_layer;
    a group choice (model=tiny) and the files it and any experiment bring set none."""
    keys = (o.key_or_group for o in parse_overrides(list(overrides)) if not o.is_delete())
    return {key.split(".", 1)[1] for key in keys if key.startswith("model.")}


def config_from_hydra(cfg: DictConfig) -> Tuple[TrainConfig, Path]:
    """The typed, validated config of this job and its run folder (where the resolved config is saved)."""
    try:
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        where = f" (at {err.full_key})" if getattr(err, "full_key", None) else ""
        raise UserError(f"the config does not resolve: {str(err).splitlines()[0]}{where}") from err
    typed.model = pretrained.resolve(typed.model, model_options_given(HydraConfig.get().overrides.task))
    validate(typed)
    for key, value in _leaves(dataclasses.asdict(typed)):
        # An escaped \${...}: saving the config would read it as an interpolation again.
        if isinstance(value, str) and "${" in value:
            raise UserError(f"{key}={value}: a literal '${{' cannot be kept in a config value; remove it")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(typed), resolve=True))
    return typed, run_dir


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

