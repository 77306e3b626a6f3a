"""The typed schema of a run and its registration with Hydra.

The dataclasses hold every default: what `python train.py` runs with the default choices of
configs/train.yaml (model=small, attention=sdpa, data=shakespeare, optim=adamw, trainer=default,
logger=default). A YAML file under configs/ holds only what its choice changes, and is merged onto
these dataclasses, so a misspelt key or a value of the wrong type fails when the config is composed.
``validate`` checks the values that types cannot (choices, ranges, combinations) and raises
UserError naming the option.
"""
from dataclasses import dataclass, field
from typing import Any, List, Optional

from data.config import DataConfig, validate as validate_data
from errors import UserError, check_choice, check_positive
from model.attention import check_features, check_kernel, validate_attention
from model.config import AttentionConfig, ModelConfig, validate_model
from training.context_parallel import check_options as check_context_parallel
from training.distributed import KINDS
from training.muon import COEFFICIENTS, LR_SCALES
from training.profiling import WARMUP_STEPS

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
RESUME_CHANGES = ("refuse", "allow")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bf16", "fp16", "fp32")
LOGGERS = ("default", "wandb")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon: Muon for the blocks' weight matrices, AdamW for the rest (training/muon.py)
    lr: float = 1e-3  # AdamW's; the schedule's shape (warmup, decay to min_lr / lr) applies to every group
    min_lr: float = 1e-4
    weight_decay: float = 0.1  # AdamW, on matmul weights only; norms, biases and embeddings decay-free
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 100
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay) | constant
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying to min_lr
    head_lr: Optional[float] = None  # AdamW lr of the head (and of the token embedding tied to it); null: lr
    embed_lr: Optional[float] = None  # of the tables only looked up: untied token embedding, positions, value embeddings; null: lr
    scalar_lr: Optional[float] = None  # of norms, biases, gates, value-mix and skip weights; null: lr
    muon_lr: float = 0.02  # optim=muon: the blocks' weight matrices
    muon_momentum: float = 0.95  # Nesterov
    muon_weight_decay: float = 0.0  # decoupled: each step multiplies a matrix by 1 - lr * muon_weight_decay
    muon_cautious: bool = True  # decay a weight only where the update moves it toward zero (modded-nanogpt)
    muon_coefficients: str = "polar_express"  # polar_express (modded-nanogpt) | jordan (torch.optim.Muon)
    muon_lr_scale: str = "shape"  # shape: lr x sqrt(max(1, rows/cols)) | rms: lr x 0.2 sqrt(max(rows, cols))


@dataclass
class TrainerConfig:
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 where supported, else fp16 on CUDA, fp32 on CPU) | bf16 | fp16 | fp32
    compile: Any = False  # true: the whole model one graph | blocks: each block (one graph shared, compiled once) | false
    cuda_graph: Any = "auto"  # auto | true | false: replay each optimizer step as one CUDA graph (CUDA, bf16/fp32, one process)
    max_steps: int = 500
    batch_size: Any = 32  # sequences per micro-batch, or auto: the largest that fits in GPU memory (scripts/fit.py)
    grad_accum: int = 1
    grad_clip: float = 1.0  # 0 disables clipping
    eval_interval: int = 100
    eval_iters: int = 20
    log_interval: int = 10
    ckpt_interval: int = 250
    keep_checkpoints: int = 2
    keep_best: bool = False  # also write checkpoints/best.pt whenever the validation loss improves (never pruned)
    resume: str = "auto"  # auto | none | <path to a checkpoint file>
    resume_changes: str = "refuse"  # refuse | allow: resume even where an option that changes the run's meaning differs (training/changes.py)
    seed: int = 1337
    peak_tflops: Optional[float] = None  # override the GPU peak used for MFU
    vram_budget_gb: Optional[float] = None  # cap GPU memory to act like a smaller card
    distributed: str = "none"  # none | ddp | fsdp (start with torchrun --nproc_per_node=N)
    context_parallel: int = 1  # N > 1: each sequence sharded over N ranks, ring attention (training/context_parallel.py)
    max_bad_steps: int = 5  # stop after this many consecutive steps with a non-finite loss or gradient
    sample_tokens: int = 200  # tokens of text generated at the end (0: none)
    profile_steps: int = 0  # > 0: profile this many steps (after 10 of warm-up) into <run dir>/profile.md
    run_name: str = "${model.name}-${attention.name}-${data.name}"


@dataclass
class LoggerConfig:
    name: str = "default"  # default (progress bar + metrics.jsonl) | wandb (adds Weights & Biases)
    progress: bool = True
    project: str = "nanoflash"
    mode: str = "online"  # wandb: online | offline | disabled
    entity: Optional[str] = None


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def register_configs() -> None:
    """Make the schema known to Hydra as `train_schema` (the first entry of configs/train.yaml). Hydra is
    imported here, not with the module: the scripts that only read a run (sample.py, export_hf.py)
    start about 0.4 s sooner without it."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def features_in_use(cfg: TrainConfig) -> dict:
    """{feature of model/attention's FEATURES: the setting that asks for it} for what ``cfg`` turns on
    beyond plain causal attention; the backend's row must say it computes each."""
    wanted = {}
    if cfg.attention.window is not None:
        wanted["window"] = f"attention.window={cfg.attention.window}"
    if cfg.model.attention_dropout_p > 0:
        setting = "model.dropout" if cfg.model.attention_dropout is None else "model.attention_dropout"
        wanted["dropout"] = f"{setting}={cfg.model.attention_dropout_p} (attention dropout)"
    if cfg.model.gate != "none":
        wanted["gate"] = f"model.gate={cfg.model.gate}"
    if cfg.data.document_mask:
        wanted["documents"] = "data.document_mask=true"
    return wanted


def validate(cfg: TrainConfig) -> None:
    """Check every value the type system cannot; raise UserError naming the option and the fix."""
    validate_model(cfg.model)
    validate_attention(cfg.attention)
    validate_data(cfg.data)
    check_features(cfg.attention.name, features_in_use(cfg))
    check_kernel(cfg.attention, features_in_use(cfg))
    o, t = cfg.optim, cfg.trainer
    check_choice("optim", o.name, OPTIMIZERS)
    check_choice("optim.schedule", o.schedule, SCHEDULES)
    check_positive("optim.lr", o.lr)
    for key in ("head_lr", "embed_lr", "scalar_lr"):
        if getattr(o, key) is not None:
            check_positive(f"optim.{key}", getattr(o, key))
    check_positive("optim.muon_lr", o.muon_lr)
    check_positive("optim.muon_weight_decay", o.muon_weight_decay, allow_zero=True)
    if not 0.0 <= o.muon_momentum < 1.0:
        raise UserError(f"optim.muon_momentum={o.muon_momentum} must be in [0, 1), e.g. 0.95")
    check_choice("optim.muon_coefficients", o.muon_coefficients, tuple(COEFFICIENTS))
    check_choice("optim.muon_lr_scale", o.muon_lr_scale, LR_SCALES)
    if o.name == "muon" and t.distributed == "fsdp":
        raise UserError("optim=muon orthogonalises whole weight matrices, which trainer.distributed=fsdp splits over "
                        "the ranks; use trainer.distributed=ddp (or optim=adamw)")
    check_positive("optim.min_lr", o.min_lr, allow_zero=True)
    check_positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    check_positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    check_positive("optim.eps", o.eps)
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise UserError(f"optim.betas={list(o.betas)} must be two numbers in [0, 1), e.g. [0.9,0.95]")
    if not 0.0 < o.decay_fraction <= 1.0:
        raise UserError(f"optim.decay_fraction={o.decay_fraction} must be in (0, 1]")
    check_choice("trainer.device", t.device, DEVICES)
    check_choice("trainer.dtype", t.dtype, DTYPES)
    check_choice("trainer.distributed", t.distributed, KINDS)
    if t.keep_best and t.distributed == "fsdp":
        raise UserError("trainer.keep_best=true writes a whole-model best.pt, which trainer.distributed=fsdp does not "
                        "make; use trainer.distributed=ddp or none, or trainer.keep_best=false")
    if t.batch_size != "auto" and (isinstance(t.batch_size, bool) or not isinstance(t.batch_size, int) or t.batch_size <= 0):
        raise UserError(f"trainer.batch_size={t.batch_size!r} must be a positive integer or auto")
    if not (isinstance(t.cuda_graph, bool) or t.cuda_graph == "auto"):
        raise UserError(f"trainer.cuda_graph={t.cuda_graph!r} must be true, false or auto")
    if not (isinstance(t.compile, bool) or t.compile == "blocks"):
        raise UserError(f"trainer.compile={t.compile!r} must be true, false or blocks")
    if t.vram_budget_gb is not None:
        check_positive("trainer.vram_budget_gb", t.vram_budget_gb)
    for key in ("max_steps", "grad_accum", "eval_interval", "eval_iters",
                "log_interval", "ckpt_interval", "keep_checkpoints", "max_bad_steps"):
        check_positive(f"trainer.{key}", getattr(t, key))
    check_positive("trainer.grad_clip", t.grad_clip, allow_zero=True)
    check_positive("trainer.sample_tokens", t.sample_tokens, allow_zero=True)
    check_positive("trainer.profile_steps", t.profile_steps, allow_zero=True)
    check_positive("trainer.seed", t.seed, allow_zero=True)
    if t.seed >= 2**64:
        raise UserError(f"trainer.seed={t.seed} must be below 2**64")
    if t.peak_tflops is not None:
        check_positive("trainer.peak_tflops", t.peak_tflops)
    check_choice("trainer.resume_changes", t.resume_changes, RESUME_CHANGES)
    check_context_parallel(cfg)
    check_choice("logger", cfg.logger.name, LOGGERS)
    check_choice("logger.mode", cfg.logger.mode, WANDB_MODES)
    check_combinations(cfg)


def check_combinations(cfg: TrainConfig) -> None:
    """Options that are each valid but cannot work together, or together certainly do not do what was meant."""
    o, t = cfg.optim, cfg.trainer
    if o.min_lr > o.lr and o.schedule != "constant":
        raise UserError(f"optim.min_lr={o.min_lr} is above optim.lr={o.lr}: the {o.schedule} schedule would climb "
                        "instead of decay; give a min_lr at most lr (e.g. lr / 10), or optim.schedule=constant")
    if t.profile_steps and WARMUP_STEPS + 1 > t.max_steps:
        raise UserError(f"trainer.profile_steps={t.profile_steps} records steps after {WARMUP_STEPS} of warm-up, "
                        f"but trainer.max_steps={t.max_steps} ends before; raise trainer.max_steps to at least "
                        f"{WARMUP_STEPS + t.profile_steps} or set trainer.profile_steps=0")
    if t.vram_budget_gb is not None and t.device == "cpu":
        raise UserError(f"trainer.vram_budget_gb={t.vram_budget_gb} caps GPU memory, but trainer.device=cpu; remove "
                        "it, or train on a GPU")
    window = cfg.attention.window
    if window is not None and window >= cfg.model.block_size:
        raise UserError(f"attention.window={window} is not below model.block_size={cfg.model.block_size}: every "
                        "query sees all its keys anyway; lower attention.window or leave it null")
    d = cfg.data
    if d.source == "text":
        hf_only = {"data.hf_config": (d.hf_config, None), "data.split": (d.split, "train"),
                   "data.text_column": (d.text_column, "text")}
        for option, (value, unused) in hf_only.items():
            if value != unused:
                raise UserError(f"{option}={value} is read by data.source=hf only, and this run reads text files "
                                f"(data.source=text); remove it, or use data=hf")
