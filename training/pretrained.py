"""Weights from elsewhere: ``model.init_from``, and the model of a Hugging Face folder.

A source is a Hugging Face GPT-2 or Llama folder (config.json and weights), a name on the Hugging
Face Hub (downloaded through huggingface_hub when the hub can be reached), or a nanoflash run folder
or checkpoint (chosen as scripts/sample.py chooses one). ``resolve`` runs at the edge
(training/cli.py): the options model/hf.py's FIELDS marks FOLDER or AT_MOST come from the source, and
one given on the command line that contradicts it fails; FREE ones (dropout, activation
checkpointing, ...) stay the run's. ``open_checked``, when the run is set up, refuses a source whose
tokenizer is not the data's; ``load_weights`` puts its weights into the new model (a run that resumes
then overwrites them with its own checkpoint's).
"""
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Dict, Optional, Tuple

import torch

from data.hf_tokenizer import FILES as TOKENIZER_FILES, folder_tokenizer
from data.tokenizers import Tokenizer, describe_tokenizer, load_tokenizer
from errors import UserError, import_optional
from model import GPT, ModelConfig
from model.hf import FIELDS, FREE, Family, adopt, fields_from_hf, from_hf
from training.checkpoint import validate_checkpoint
from training.hf_folder import is_hf_folder, read_config, read_weights
from training.trained_model import checkpoint_model, choose_checkpoint, plain_model

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # gpt2, openai-community/gpt2
NO_TOKENIZER = "it carries no tokenizer: its ids are taken as the data tokenizer's"
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", *TOKENIZER_FILES]


@dataclass
class Source:
    where: str  # how errors name it: model.init_from=<as given>, or the folder
    path: Path  # the folder or checkpoint on disk
    kind: str  # GPT2LMHeadModel, LlamaForCausalLM or "nanoflash checkpoint"
    fields: dict  # the options FIELDS takes from a source, as its model has them
    tokenizer: Optional[dict]  # its tokenizer's identity; None when it carries none
    family: Optional[Family] = None  # of a Hugging Face folder
    state: Optional[dict] = None  # of a nanoflash checkpoint


def resolve(cfg: ModelConfig, given: Collection[str]) -> ModelConfig:
    """``cfg`` with the shape of model.init_from's model; ``given``: the options set on the command line."""
    if cfg.init_from is None:
        return cfg
    source = open_source(cfg.init_from)
    return adopt(cfg, source.fields, given, source.where)


def open_source(init_from: str) -> Source:
    """What model.init_from names, its weights still on disk; UserError when it is no model."""
    where = f"model.init_from={init_from}"
    path = locate(init_from)
    if is_hf_folder(path):
        family, fields = fields_from_hf(read_config(path, where), where)
        return Source(where, path, family.architecture, fields, folder_tokenizer(path), family=family)
    try:
        found, state = choose_checkpoint(path)
    except UserError as err:
        raise UserError(f"{where} is neither a Hugging Face model folder (it has no config.json) nor a nanoflash "
                        f"checkpoint: {err}") from err
    cfg = validate_checkpoint(found, state)
    fields = {key: getattr(cfg, key) for key, field in FIELDS.items() if field.on_import != FREE}
    return Source(where, found, "nanoflash checkpoint", fields, state.get("tokenizer"), state=state)


def locate(init_from: str) -> Path:
    """The folder or checkpoint ``init_from`` names: a path here, else a Hugging Face Hub name downloaded
    into huggingface_hub's cache (the files a causal LM needs, safetensors weights only)."""
    path = Path(init_from).expanduser()
    if path.exists():
        return path
    if not HUB_NAME.match(init_from):
        raise UserError(f"model.init_from={init_from}: no such folder or checkpoint")
    hub = import_optional("huggingface_hub", f"model.init_from={init_from} (a Hugging Face Hub name)",
                          "pip install huggingface_hub")
    try:
        return Path(hub.snapshot_download(init_from, allow_patterns=HUB_FILES))
    except Exception as err:  # offline, no network, no such repository: all mean the same to the user
        raise UserError(f"model.init_from={init_from} is not a folder here and the Hugging Face Hub did not give it "
                        f"({type(err).__name__}); where there is a network run `hf download {init_from} --local-dir "
                        f"DIR` (huggingface_hub's command line) and pass model.init_from=DIR") from err


def open_checked(init_from: str, tokenizer: Tokenizer) -> Source:
    """The source of model.init_from, refused when it carries a tokenizer other than the data's ``tokenizer``."""
    source = open_source(init_from)
    if source.tokenizer is not None and source.tokenizer != tokenizer.identity:
        hint = {"gpt2": "train it on data with data.tokenizer=gpt2 (e.g. data=shakespeare)",
                "char": "train it with data.tokenizer=char on a corpus of the same characters"}
        raise UserError(f"{source.where} was trained with {describe(source.tokenizer)}, but the data gives "
                        f"{describe(tokenizer.identity)}: its token ids would mean other text; "
                        + hint.get(source.tokenizer["tokenizer"], "nanoflash trains with GPT-2 BPE or char tokenizers"))
    if source.fields["vocab_size"] < tokenizer.vocab_size:
        raise UserError(f"{source.where} has {source.fields['vocab_size']} token ids, fewer than the "
                        f"{tokenizer.vocab_size} of the data's tokenizer ({describe(tokenizer.identity)}); start from a "
                        "model of that tokenizer")
    return source


def describe(identity: dict) -> str:
    return identity["described"] if identity["tokenizer"] == "other" else describe_tokenizer(identity)


def load_weights(model: GPT, source: Source) -> dict:
    """The source's weights into ``model`` (its position table cut to model.block_size); what the run
    records of where they came from."""
    if source.family is not None:
        weights = from_hf(model.cfg, source.family, read_weights(source.path, source.where), source.where)
    else:
        weights = checkpoint_model(source.path, source.state, torch.device("cpu")).state_dict()
    if "wpe.weight" in weights:
        weights["wpe.weight"] = weights["wpe.weight"][:model.cfg.block_size]
    load(model, weights, source.where)
    origin = {"init_from": model.cfg.init_from, "path": str(source.path.resolve()), "format": source.kind}
    if source.state is not None:
        origin["step"] = source.state["step"]
    if source.tokenizer is None:
        origin["tokenizer"] = NO_TOKENIZER
    return origin


def describe_origin(origin: dict) -> str:
    note = f"; {NO_TOKENIZER}" if "tokenizer" in origin else ""
    return f"weights from {origin['init_from']} ({origin['format']}{note})"


def load(model: GPT, weights: Dict[str, torch.Tensor], where: str) -> None:
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:  # a tensor whose shape is not the config's
        lines = str(err).splitlines()
        raise UserError(f"{where}: its weights do not fit its config ({lines[min(1, len(lines) - 1)].strip()})") from err


def hf_model(folder: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> Tuple[GPT, Tokenizer, str]:
    """(model, tokenizer, architecture) of a Hugging Face folder, its weights in ``dtype``, for inference on
    ``device``."""
    where = str(folder)
    family, fields = fields_from_hf(read_config(folder, where), where)
    identity = folder_tokenizer(folder)
    if identity is None or identity["tokenizer"] == "other":
        raise UserError(f"{folder} carries {describe(identity) if identity else 'no tokenizer'}; nanoflash samples "
                        "with GPT-2 BPE or a char tokenizer (scripts/export_hf.py writes either)")
    model = plain_model(ModelConfig(**fields), device, dtype=dtype)
    load(model, from_hf(model.cfg, family, read_weights(folder, where), where), where)
    return model, load_tokenizer(identity), family.architecture
