"""Our GPT as two Hugging Face architectures and back: configs as dicts, weights as tensors.

Learned positions, LayerNorm, the tanh-GELU MLP and multi-head attention are GPT-2
(``GPT2LMHeadModel``); RoPE, RMSNorm, SwiGLU and grouped-query attention are Llama
(``LlamaForCausalLM``). ``FIELDS`` is the one table of every ModelConfig option: the values each
family holds, and what a run that starts from a folder (``model.init_from``) does with the option.
Nothing here reads files or imports transformers (training/hf_folder.py does the I/O).

Layouts. Our fused ``c_attn`` rows are [q heads, k heads, v heads], as GPT-2's columns are; GPT-2
keeps its Linear weights as Conv1D, (in, out), so they are transposed. Llama keeps q/k/v/o and
gate/up/down apart: our ``c_attn`` rows cut into q_proj, k_proj, v_proj and our ``c_fc`` rows into
[gate_proj, up_proj]. Llama's RoPE rotates the halves of each head (``rotate_half``) as
``model.gpt.apply_rope`` does, so q and k need no permutation. The token embedding is the output
head in both (``tie_word_embeddings``), so no ``lm_head.weight`` is written.
"""
import dataclasses
import re
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, Tuple

import torch

from errors import UserError
from model.config import NORM_EPS, ROPE_BASE, ModelConfig

ANY = "any"  # every value of the option exports
MULTI_HEAD = "n_kv_head=n_head"  # n_kv_head unset or equal to n_head
# What model.init_from does with an option:
FOLDER = "folder"  # the folder's value; a different one given on the command line fails
AT_MOST = "at most"  # the folder's value, or a lower one given on the command line (block_size: a shorter context)
FREE = "free"  # not held by the weights: the run's own value


@dataclass(frozen=True)
class Field:
    gpt2: object  # ANY, MULTI_HEAD or the values GPT2LMHeadModel holds
    llama: object  # the same for LlamaForCausalLM
    on_import: str  # FOLDER, AT_MOST or FREE


# Every ModelConfig option (tests/test_hf.py fails on one missing here).
FIELDS: Dict[str, Field] = {
    "name": Field(ANY, ANY, FREE),
    "n_layer": Field(ANY, ANY, FOLDER),
    "n_head": Field(ANY, ANY, FOLDER),
    "n_kv_head": Field(MULTI_HEAD, ANY, FOLDER),
    "n_embd": Field(ANY, ANY, FOLDER),
    "block_size": Field(ANY, ANY, AT_MOST),
    "vocab_size": Field(ANY, ANY, FOLDER),
    "dropout": Field(ANY, ANY, FREE),
    "attention_dropout": Field(ANY, ANY, FREE),
    "bias": Field(ANY, ANY, FOLDER),  # GPT-2 always has biases: bias=false exports zeros
    "norm": Field(("layernorm",), ("rmsnorm",), FOLDER),
    "pos": Field(("learned",), ("rope",), FOLDER),
    "gate": Field(("none",), ("none",), FOLDER),
    "gate_bias_init": Field(ANY, ANY, FREE),  # the gate's bias before training; the weights hold the trained one
    "mlp": Field(("gelu",), ("swiglu",), FOLDER),
    "qk_norm": Field((False,), (False,), FOLDER),
    "zero_init": Field(ANY, ANY, FREE),  # how the weights started; the weights hold where they went
    "logit_softcap": Field((None,), (None,), FOLDER),
    "tie_embeddings": Field((True,), (True,), FOLDER),  # the mapping writes one embedding for both
    "value_embeds": Field((0,), (0,), FOLDER),
    "skips": Field(("none",), ("none",), FOLDER),
    "activation_checkpointing": Field(ANY, ANY, FREE),
    "recompute_attention": Field(ANY, ANY, FREE),
    "loss_chunk": Field(ANY, ANY, FREE),
    "init_from": Field(ANY, ANY, FREE),
}


@dataclass(frozen=True)
class Family:
    key: str  # the attribute of Field: gpt2 | llama
    name: str
    architecture: str
    model_type: str


GPT2 = Family("gpt2", "GPT-2", "GPT2LMHeadModel", "gpt2")
LLAMA = Family("llama", "Llama", "LlamaForCausalLM", "llama")
FAMILIES = (GPT2, LLAMA)
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are tanh-approximated GELU
SAVED_BUFFERS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")  # masks and tables, not weights


def holds(rule, cfg: ModelConfig, key: str) -> bool:
    """Whether a family whose FIELDS rule is ``rule`` holds ``cfg``'s value of ``key``."""
    if rule == ANY:
        return True
    if rule == MULTI_HEAD:
        return cfg.kv_heads == cfg.n_head
    return getattr(cfg, key) in rule


# The recipe's switches (docs/RECIPE.md) as both families have them: off.
PLAIN = dict(qk_norm=False, logit_softcap=None, tie_embeddings=True, value_embeds=0, skips="none")


def describe_family(family: Family) -> str:
    """``GPT-2 (norm=layernorm pos=learned gate=none mlp=gelu n_kv_head=n_head)``, from FIELDS (the
    recipe's switches, off in both, left out)."""
    rules = [(key, getattr(field, family.key)) for key, field in FIELDS.items()
             if getattr(field, family.key) != ANY and key not in PLAIN]
    rules.sort(key=lambda rule: rule[1] == MULTI_HEAD)  # the choices first
    return f"{family.name} ({' '.join(rule if rule == MULTI_HEAD else f'{key}={rule[0]}' for key, rule in rules)})"


def exportable() -> str:
    return (f"Hugging Face export takes {' or '.join(describe_family(f) for f in FAMILIES)} models with the "
            "recipe's switches off and no attention.window")


def export_family(cfg: ModelConfig, window: Optional[int]) -> Family:
    """The family ``cfg`` exports as (by its positions); UserError naming the first option it cannot hold."""
    family = {"learned": GPT2, "rope": LLAMA}.get(cfg.pos)
    if family is None:
        raise UserError(f"cannot export model.pos={cfg.pos}: {exportable()}")
    for key, field in FIELDS.items():
        rule = getattr(field, family.key)
        if not holds(rule, cfg, key):
            needs = f"n_kv_head equal to n_head ({cfg.n_head})" if rule == MULTI_HEAD else f"model.{key}={rule[0]}"
            raise UserError(f"cannot export model.{key}={getattr(cfg, key)}: a model.pos={cfg.pos} model exports as "
                            f"{family.name} ({family.architecture}), which needs {needs}. {exportable()}")
    if window is not None:
        raise UserError(f"cannot export attention.window={window}: neither GPT-2 nor Llama has a sliding window. "
                        f"{exportable()}")
    return family


def hf_config(cfg: ModelConfig, family: Family, eot_id: Optional[int], dtype: str) -> dict:
    """config.json of ``cfg`` as ``family``, in the keys every transformers version reads; ``eot_id`` is the
    tokenizer's end-of-text id (None for char), ``dtype`` the weights' ("float32", "bfloat16", "float16")."""
    common = {"architectures": [family.architecture], "model_type": family.model_type, "vocab_size": cfg.vocab_size,
              "tie_word_embeddings": True, "bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": None,
              "torch_dtype": dtype, "initializer_range": 0.02, "use_cache": True}
    if family is GPT2:
        return {**common, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                "n_positions": cfg.block_size, "n_inner": cfg.mlp_hidden, "activation_function": GPT2_ACTIVATIONS[0],
                "layer_norm_epsilon": NORM_EPS, "embd_pdrop": cfg.dropout, "resid_pdrop": cfg.dropout,
                "attn_pdrop": cfg.attention_dropout_p, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    return {**common, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.kv_heads, "hidden_size": cfg.n_embd, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.mlp_hidden, "hidden_act": "silu", "max_position_embeddings": cfg.block_size,
            "rms_norm_eps": NORM_EPS, "rope_theta": ROPE_BASE, "rope_scaling": None, "attention_bias": cfg.bias,
            "mlp_bias": cfg.bias, "attention_dropout": cfg.attention_dropout_p, "pretraining_tp": 1}


def generation_config(eot_id: Optional[int], vocab_limit: int, vocab_size: int) -> dict:
    """generation_config.json: the padding ids above the tokenizer's ``vocab_limit`` are never generated,
    as our sampler masks them, so greedy decoding gives our tokens."""
    padding = list(range(vocab_limit, vocab_size))
    return {"bos_token_id": eot_id, "eos_token_id": eot_id, "suppress_tokens": padding or None}


@dataclass(frozen=True)
class Slot:
    """One of our tensors and where it lives in the Hugging Face model."""

    ours: str
    theirs: Tuple[str, ...]  # one name, or the pieces our tensor's rows are cut into, in order
    rows: Tuple[int, ...] = ()  # the pieces' sizes when there are several
    conv1d: bool = False  # GPT-2 keeps Linear weights as Conv1D (in, out): transposed


def slots(cfg: ModelConfig, family: Family, bias: bool) -> List[Slot]:
    """Every tensor of ``cfg``'s model as ``family`` holds it, biases included when ``bias`` (GPT-2: always)."""
    if family is GPT2:
        out = [Slot("wte.weight", ("transformer.wte.weight",)), Slot("wpe.weight", ("transformer.wpe.weight",))]
        for i in range(cfg.n_layer):
            for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
                ours, theirs = f"blocks.{i}.{part}", f"transformer.h.{i}.{part}"
                out.append(Slot(f"{ours}.weight", (f"{theirs}.weight",), conv1d=not part.startswith("ln")))
                out.append(Slot(f"{ours}.bias", (f"{theirs}.bias",)))
        return out + [Slot("ln_f.weight", ("transformer.ln_f.weight",)), Slot("ln_f.bias", ("transformer.ln_f.bias",))]
    q, kv, hidden = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.mlp_hidden
    out = [Slot("wte.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        out += [Slot(f"{ours}.ln_1.weight", (f"{theirs}.input_layernorm.weight",)),
                Slot(f"{ours}.ln_2.weight", (f"{theirs}.post_attention_layernorm.weight",))]
        for kind in ("weight", "bias") if bias else ("weight",):
            attn, mlp = f"{theirs}.self_attn", f"{theirs}.mlp"
            out += [Slot(f"{ours}.attn.c_attn.{kind}", tuple(f"{attn}.{p}_proj.{kind}" for p in "qkv"), (q, kv, kv)),
                    Slot(f"{ours}.attn.c_proj.{kind}", (f"{attn}.o_proj.{kind}",)),
                    Slot(f"{ours}.mlp.c_fc.{kind}", (f"{mlp}.gate_proj.{kind}", f"{mlp}.up_proj.{kind}"),
                         (hidden, hidden)),
                    Slot(f"{ours}.mlp.c_proj.{kind}", (f"{mlp}.down_proj.{kind}",))]
    return out + [Slot("ln_f.weight", ("model.norm.weight",))]


def to_hf(cfg: ModelConfig, family: Family, ours: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Our state dict as ``family``'s (tensors of their own, no tied ``lm_head.weight``). A GPT-2 bias we do not
    have (model.bias=false) is written as zeros of its weight's rows."""
    out = {}
    for slot in slots(cfg, family, bias=cfg.bias or family is GPT2):
        tensor = ours.get(slot.ours)
        if tensor is None:
            tensor = torch.zeros(ours[slot.ours.replace(".bias", ".weight")].shape[0])
        tensor = tensor.t() if slot.conv1d else tensor
        for name, piece in zip(slot.theirs, tensor.split(slot.rows) if slot.rows else [tensor]):
            out[name] = piece.clone(memory_format=torch.contiguous_format)  # owns its memory, as safetensors needs
    return out


def from_hf(cfg: ModelConfig, family: Family, theirs: Dict[str, torch.Tensor], where: str) -> Dict[str, torch.Tensor]:
    """``family``'s state dict as ours (fp32, the tied head included) for the model of ``cfg``; UserError
    when a weight is missing or left over. Names with or without the causal-LM class's prefix (a base
    model's save has none) are read, and buffers that older versions saved are skipped."""
    prefix = "transformer." if family is GPT2 else "model."
    theirs = {name if name.startswith(prefix) or name == "lm_head.weight" else prefix + name: tensor
              for name, tensor in theirs.items() if not SAVED_BUFFERS.search(name)}
    theirs.pop("lm_head.weight", None)  # tied: the embedding
    wanted = slots(cfg, family, bias=cfg.bias)
    missing = [name for slot in wanted for name in slot.theirs if name not in theirs]
    extra = sorted(set(theirs) - {name for slot in wanted for name in slot.theirs})
    if missing or extra:
        listed = ", ".join(([f"{len(missing)} missing ({missing[0]}, ...)"] if missing else [])
                           + ([f"{len(extra)} it has no place for ({extra[0]}, ...)"] if extra else []))
        raise UserError(f"{where}: its weights do not fit its config.json: {listed}")
    out = {}
    for slot in wanted:
        tensor = torch.cat([theirs[name] for name in slot.theirs]) if slot.rows else theirs[slot.theirs[0]]
        out[slot.ours] = (tensor.t() if slot.conv1d else tensor).float().contiguous()
    out["lm_head.weight"] = out["wte.weight"]
    return out


def family_of(config: dict, where: str) -> Family:
    """The family of a config.json; UserError when nanoflash loads no such model."""
    family = next((f for f in FAMILIES if f.model_type == config.get("model_type")), None)
    if family is None:
        names = " and ".join(f.model_type for f in FAMILIES)
        raise UserError(f"{where}: config.json has model_type={config.get('model_type')!r}; nanoflash loads {names} "
                        f"models ({', '.join(f.architecture for f in FAMILIES)})")
    return family


def fields_from_hf(config: dict, where: str) -> Tuple[Family, dict]:
    """(family, the ModelConfig options FIELDS takes from the folder) of a config.json; UserError naming
    the first key whose value our model cannot reproduce. Missing keys take transformers' defaults."""
    family = family_of(config, where)
    if family is GPT2:
        n_embd = config.get("n_embd", 768)
        fields = dict(n_layer=config.get("n_layer", 12), n_head=config.get("n_head", 12), n_kv_head=None,
                      n_embd=n_embd, block_size=config.get("n_positions", 1024),
                      vocab_size=config.get("vocab_size", 50257),
                      bias=True, norm="layernorm", pos="learned", gate="none", mlp="gelu", **PLAIN)
        wanted = {"activation_function": (config.get("activation_function", "gelu_new"), GPT2_ACTIVATIONS),
                  "n_inner": (config.get("n_inner"), (None, 4 * n_embd)),
                  "layer_norm_epsilon": (config.get("layer_norm_epsilon", 1e-5), (NORM_EPS,)),
                  "scale_attn_weights": (config.get("scale_attn_weights", True), (True,)),
                  "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False), (False,)),
                  "add_cross_attention": (config.get("add_cross_attention", False), (False,)),
                  "tie_word_embeddings": (config.get("tie_word_embeddings", True), (True,))}
    else:
        heads, n_embd = config.get("num_attention_heads", 32), config.get("hidden_size", 4096)
        kv = config.get("num_key_value_heads") or heads
        bias = config.get("attention_bias", False)
        fields = dict(n_layer=config.get("num_hidden_layers", 32), n_head=heads, n_kv_head=None if kv == heads else kv,
                      n_embd=n_embd, block_size=config.get("max_position_embeddings", 2048),
                      vocab_size=config.get("vocab_size", 32000), bias=bias, norm="rmsnorm", pos="rope", gate="none",
                      mlp="swiglu", **PLAIN)
        rope = config.get("rope_parameters") or {}  # transformers 5; before it rope_theta and rope_scaling
        scaling = config.get("rope_scaling") or rope
        wanted = {"hidden_act": (config.get("hidden_act", "silu"), ("silu",)),
                  "intermediate_size": (config.get("intermediate_size", 11008),
                                        (ModelConfig(n_embd=n_embd, mlp="swiglu").mlp_hidden,)),
                  "head_dim": (config.get("head_dim"), (None, n_embd // heads)),
                  "rms_norm_eps": (config.get("rms_norm_eps", 1e-6), (NORM_EPS,)),
                  "rope_theta": (config.get("rope_theta", rope.get("rope_theta", ROPE_BASE)), (ROPE_BASE,)),
                  "rope_type": (scaling.get("rope_type", scaling.get("type", "default")), ("default",)),
                  "mlp_bias": (config.get("mlp_bias", False), (bias,)),
                  "tie_word_embeddings": (config.get("tie_word_embeddings", False), (True,))}
    for key, (value, accepted) in wanted.items():
        if value not in accepted:
            raise UserError(f"{where}: config.json has {key}={value!r}, which nanoflash's {family.name} cannot "
                            f"reproduce (it takes {' or '.join(repr(a) for a in accepted)})")
    return family, fields


def adopt(cfg: ModelConfig, theirs: dict, given: Collection[str], where: str) -> ModelConfig:
    """``cfg`` with the source's value (``theirs``) of every option FIELDS takes from it; the options of
    ``given`` (set on the command line) must agree, except that AT_MOST ones may be lower."""
    changes = {}
    for key, field in FIELDS.items():
        if field.on_import == FREE:
            continue
        mine, folder = getattr(cfg, key), theirs[key]
        if key not in given:
            changes[key] = folder
        elif key == "n_kv_head":
            if (mine or cfg.n_head) != (folder or theirs["n_head"]):
                raise clash(key, mine, folder, where)
        elif mine != folder and not (field.on_import == AT_MOST and mine < folder):
            raise clash(key, mine, folder, where, lower=field.on_import == AT_MOST)
    return dataclasses.replace(cfg, **changes)


def clash(key: str, mine, folder, where: str, lower: bool = False) -> UserError:
    hint = f"remove model.{key} (or give at most {folder})" if lower else f"remove model.{key}"
    return UserError(f"model.{key}={mine} contradicts {where}, whose model has {key}={folder}: the model's shape comes "
                     f"from there; {hint}")
