"""The command line around Hydra: early checks of overrides, machine-aware defaults, clean errors.

Hydra composes the config; these helpers run before it (so a misspelt option fails with the list
of valid ones) and around the task (so a UserError prints one line and exits with status 2). They
read the command line with Hydra's own argument parser, so every Hydra flag (--cfg, --info, -cn,
-cp, -cd, --package, -m, --shell-completion, ...) keeps its meaning and its value is never taken
for an override.
"""
import argparse
import dataclasses
import itertools
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from errors import UserError, first_line
from training import pretrained
from training.config import TrainConfig, register_configs, validate
from training.exits import fail

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "configs"
GROUPS = ("model", "attention", "data", "optim", "trainer", "logger", "experiment", "local", "debug")


def hydra_args(argv: List[str]) -> argparse.Namespace:
    """The command line as Hydra reads it: its own flags (--cfg, --info, -cn, -cp, -cd, -m, ...) and
    the overrides it will apply (``.overrides``). A wrong flag stops here with Hydra's usage line.
    The one private function of Hydra's that nanoflash calls, ``hydra._internal.utils.get_args_parser``:
    tests/test_cli.py pins what it returns under the hydra-core of requirements.txt."""
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
        if key == "hydra.output_subdir" and override.value() is not None:
            fail(f"{override.input_line}: the run writes its record (config.yaml, .hydra/) itself, once it owns its "
                 "folder; leave hydra.output_subdir out")
        if key.startswith("hydra"):
            continue
        if "." not in key and key in GROUPS:
            if override.is_add() and args.config_name in (None, "train"):
                fail(f"{override.input_line}: {key} is in the defaults list of configs/train.yaml already, so it is "
                     f"chosen, not added; write {override.input_line[1:]}")
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
        fail(f"cannot parse the overrides: {first_line(err)}; quote a value with spaces or brackets, "
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
        fail(f"{path} is not valid YAML: {first_line(err)}")
    if values is not None and not isinstance(values, dict):
        fail(f"{path} holds a {type(values).__name__}; it must hold options as keys, e.g. 'trainer:' then "
             "'  batch_size: 8' on the next line")
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


def typed_config(cfg: DictConfig) -> TrainConfig:
    """The typed, validated config of a composed one (the model's shape taken from model.init_from, where
    set, against the job's overrides); UserError naming the first problem."""
    try:
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        where = f" (at {err.full_key})" if getattr(err, "full_key", None) else ""
        raise UserError(f"the config does not resolve: {first_line(err)}{where}") from err
    typed.model = pretrained.resolve(typed.model, model_options_given(HydraConfig.get().overrides.task))
    validate(typed)
    for key, value in _leaves(dataclasses.asdict(typed)):
        # An escaped \${...}: saving the config would read it as an interpolation again.
        if isinstance(value, str) and "${" in value:
            raise UserError(f"{key}={value}: a literal '${{' cannot be kept in a config value; remove it")
    return typed


def config_from_hydra(cfg: DictConfig) -> Tuple[TrainConfig, Path, Dict[str, str]]:
    """The typed, validated config of this job, its run folder, and Hydra's record of the job (.hydra/:
    the composed config, Hydra's own, the overrides), which the run writes once it owns the folder
    (Hydra's own writing of it is off: hydra.output_subdir=null in configs/train.yaml)."""
    typed = typed_config(cfg)
    hydra_cfg = HydraConfig.get()
    record = {
        ".hydra/config.yaml": OmegaConf.to_yaml(cfg),
        ".hydra/hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})),
        ".hydra/overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task),
    }
    return typed, Path(hydra_cfg.runtime.output_dir), record


def sweep_jobs(config: DictConfig) -> List[List[str]]:
    """The overrides of every job of a multirun, as Hydra's basic sweeper makes them: the sweeper's
    params (hydra.sweeper.params) then the command line's, each sweep taking each of its values, in
    the cartesian product."""
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    choices = {}
    for override in parser.parse_overrides(params + list(config.hydra.overrides.task)):
        key = override.get_key_element()
        values = override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
        choices[key] = [f"{key}={value}" for value in values]
    return [list(job) for job in itertools.product(*choices.values())]


class SweepCheck(Callback):
    """Before a multirun's first job: every job's config composed and validated, so that a bad value
    (``-m trainer.grad_accum=1,0``) fails in one line before any job trains. Other sweepers than
    Hydra's basic one (optuna, ...) choose their values as they go: nothing to check ahead."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return
        loader = GlobalHydra.instance().config_loader()
        outer = HydraConfig.instance().cfg
        jobs = sweep_jobs(config)
        shared = set.intersection(*map(set, jobs))  # the overrides every job has: not worth naming
        try:
            for number, overrides in enumerate(jobs):
                try:
                    job = loader.load_sweep_config(config, overrides)
                    HydraConfig.instance().set_config(job)  # for ${hydra:...} in the job's values
                    with read_write(job), open_dict(job):
                        del job["hydra"]  # what the job's task gets (hydra/core/utils.py: run_job)
                    typed_config(job)
                except (UserError, HydraException, OmegaConfBaseException) as err:
                    varying = " ".join(o for o in overrides if o not in shared)
                    fail(f"job {number} of the sweep ({varying}): {err}; no job was run")
        finally:
            HydraConfig.instance().cfg = outer
