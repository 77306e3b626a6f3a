"""ModelConfig: the shape of the GPT, and the checks that reject impossible shapes early."""
import math
from dataclasses import dataclass
from typing import Optional

from errors import UserError, check_choice, check_finite, check_positive

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope", "none")
GATES = ("none", "forget")
MLPS = ("gelu", "swiglu", "relu2")
SKIPS = ("none", "unet")
NORM_EPS = 1e-5  # of every LayerNorm and RMSNorm (exported as layer_norm_epsilon / rms_norm_eps)
ROPE_BASE = 10000.0  # rotary angles' base (exported as rope_theta)


@dataclass
class ModelConfig:
    """The defaults are model=small: ~10.7M parameters besides the embeddings."""

    name: str = "small"
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: Optional[int] = None  # grouped-query attention; None means n_head
    n_embd: int = 384
    block_size: int = 256  # longest sequence the model accepts
    vocab_size: Optional[int] = None  # None: taken from the tokenizer, padded to a multiple of 64
    dropout: float = 0.1  # embeddings, residual branches, MLP and (unless attention_dropout is set) attention probabilities
    attention_dropout: Optional[float] = None  # dropout of the attention probabilities; None: the same as dropout
    bias: bool = False
    norm: str = "layernorm"
    pos: str = "learned"  # learned: a position table; rope: rotary q and k; none: no position signal (causality and gates only)
    gate: str = "none"  # forget: a per-head forget gate on the attention scores (FoX, model/gpt.py)
    gate_bias_init: float = 3.0  # forget gate's bias at init: gates start at sigmoid(3) = 0.95 (0: FoX's code, 0.5)
    mlp: str = "gelu"  # gelu (4x wide) | swiglu (~8/3x, gated) | relu2: relu(x)^2, 4x wide
    qk_norm: bool = False  # RMSNorm (no weight) of each head's q and k before attention (and before RoPE)
    zero_init: bool = False  # the output projections (attention, MLP; the head when untied) start at zero
    logit_softcap: Optional[float] = None  # s: the logits count as s * tanh(logit / s), in the loss and in generation
    tie_embeddings: bool = True  # the head is the token embedding (GPT-2); false: a head of its own
    value_embeds: int = 0  # k > 0: k token tables mixed into V of the first k and the last k blocks (modded-nanogpt)
    skips: str = "none"  # unet: block n_layer-1-i's input gains a learned weight times block i's output, i < n_layer/2
    activation_checkpointing: bool = False
    recompute_attention: bool = False  # with activation_checkpointing: also recompute flash's or sdpa's kernels (their output is kept otherwise)
    loss_chunk: int = 4096  # rows of logits the loss makes at a time: more is faster, costs chunk x vocab memory
    init_from: Optional[str] = None  # start from these weights: a Hugging Face GPT-2/Llama folder or hub name, or a nanoflash run folder or checkpoint (training/init_from.py)

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """Width of the MLP's hidden layer: 4 x n_embd (gelu), about 8/3 x rounded up to a multiple of 64 (swiglu)."""
        return 64 * math.ceil(8 * self.n_embd / 3 / 64) if self.mlp == "swiglu" else 4 * self.n_embd

    @property
    def attention_dropout_p(self) -> float:
        """The probability of dropping each attention probability in training."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round the tokenizer's vocabulary up so the embedding matmuls hit fast tile sizes (50257 -> 50304)."""
    return -(-vocab_size // multiple) * multiple


def validate_model(cfg: ModelConfig) -> None:
    """Reject shapes the model cannot be built with; each message names the option and the fix."""
    for key in ("n_layer", "n_head", "n_embd", "block_size", "loss_chunk"):
        check_positive(f"model.{key}", getattr(cfg, key), kind="integer")
    if cfg.n_embd % cfg.n_head:
        raise UserError(
            f"model.n_embd={cfg.n_embd} is not divisible by model.n_head={cfg.n_head}; "
            f"pick n_embd as a multiple of n_head (e.g. {cfg.n_head * max(1, cfg.n_embd // cfg.n_head)})"
        )
    if cfg.kv_heads <= 0 or cfg.n_head % cfg.kv_heads:
        raise UserError(
            f"model.n_head={cfg.n_head} is not a multiple of model.n_kv_head={cfg.n_kv_head}; "
            "choose n_kv_head among the divisors of n_head"
        )
    if cfg.pos == "rope" and cfg.head_dim % 2:
        raise UserError(f"model.pos=rope needs an even head size, got n_embd/n_head={cfg.head_dim}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise UserError(f"model.dropout={cfg.dropout} must be in [0, 1)")
    if cfg.attention_dropout is not None and not 0.0 <= cfg.attention_dropout < 1.0:
        raise UserError(f"model.attention_dropout={cfg.attention_dropout} must be in [0, 1) (or null for model.dropout's)")
    check_finite("model.gate_bias_init", float(cfg.gate_bias_init))
    for key, choices in (("norm", NORMS), ("pos", POSITIONS), ("gate", GATES), ("mlp", MLPS), ("skips", SKIPS)):
        check_choice(f"model.{key}", getattr(cfg, key), choices)
    if cfg.logit_softcap is not None:
        check_positive("model.logit_softcap", float(cfg.logit_softcap))
    if not 0 <= cfg.value_embeds <= cfg.n_layer // 2:
        raise UserError(f"model.value_embeds={cfg.value_embeds} must be between 0 (none) and n_layer/2 = "
                        f"{cfg.n_layer // 2}: each table serves one of the first and one of the last blocks")
    if cfg.recompute_attention and not cfg.activation_checkpointing:
        raise UserError("model.recompute_attention=true acts on activation checkpointing's recompute: add "
                        "model.activation_checkpointing=true or drop model.recompute_attention")
    if cfg.vocab_size is not None and cfg.vocab_size <= 0:
        raise UserError(f"model.vocab_size={cfg.vocab_size} must be positive (or null to use the tokenizer's)")


FLASH_KERNELS = ("auto", "tl", "gluon")  # attention.kernel (kernels/flash_attention/function.py: kernel=)


@dataclass
class AttentionConfig:
    name: str = "sdpa"  # a row of model/attention's BACKENDS table
    block_size: Optional[int] = None  # hybrid: queries per block; null sizes blocks from T and memory
    window: Optional[int] = None  # sliding-window causal attention: each query sees its last `window` keys
    strict: bool = False  # fail instead of falling back (flash: to sdpa) when the backend cannot run here
    kernel: str = "auto"  # flash: auto (the Gluon forward on H100/H200 at head dim 128, else tl; tl backward) | tl | gluon (Gluon forward and backward)
