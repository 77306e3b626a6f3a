"""What a training run owns, built once before its first step: ``setup_run`` returns a ``Run``.

The order matters and is kept: the token cache, the model (seeded), its DDP/FSDP wrapper, the
optimizer, the loaders, then the checkpoint the run resumes from; the logger, meter and profiler
start from the step it reached.
"""
import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple, Union

import torch
from omegaconf import OmegaConf

from data.loader import BatchLoader
from data.prepare import PreparedData, corpus_identity, prepare
from data.tokenizers import Tokenizer, load_tokenizer
from errors import UserError
from model import GPT, ModelConfig
from model.attention import build_attention
from model.config import padded_vocab
from training import distributed, pretrained
from training.caches import cache_custom_autograd_graphs
from training.checkpoint import Checkpointer, restore
from training.config import TrainConfig, features_in_use
from training.context_parallel import SequenceShard
from training.cuda_graph import CapturedStep, use_cuda_graph
from training.fit import auto_batch_size
from training.loggers import MetricsLogger, QuietLogger
from training.metrics import ThroughputMeter, flops_per_token, peak_tflops
from training.optim import build_optimizer
from training.precision import apply_vram_budget, dtype_name, make_grad_scaler, resolve_dtype
from training.profiling import StepProfiler
from training.step import train_step


@dataclass
class Run:
    """Everything the loop uses. ``model`` is the plain GPT (its weights, its config, generation);
    ``step_model`` is what the steps and evaluation run through (DDP/FSDP, compiled as configured)."""

    cfg: TrainConfig
    run_dir: Path
    ranks: distributed.Ranks
    device: torch.device
    dtype: torch.dtype
    backend: str  # the attention backend that runs (after any fallback)
    tokenizer: Tokenizer
    model: GPT
    step_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: BatchLoader
    val_loader: BatchLoader
    step: Callable  # step(loader) -> (loss, grad_norm, good) device tensors: one optimizer step, as a CUDA graph or not
    shard: SequenceShard  # the tokens of each sequence this rank trains on (a zigzag shard under context parallelism)
    start_step: int  # the last step already done (0, or the step of the checkpoint resumed)
    tokens_per_step: int
    checkpointer: Checkpointer
    logger: Union[MetricsLogger, QuietLogger]
    meter: ThroughputMeter
    profiler: StepProfiler


def setup_run(cfg: TrainConfig, run_dir: Path, ranks: distributed.Ranks, device: torch.device,
              phase: Callable[[str], None] = lambda name: None) -> Run:
    """Build the run ``cfg`` describes on this rank's ``device``, resumed as ``trainer.resume`` says.

    ``phase(name)`` is called as each part is done: "data", "model", "optimizer" (StartupClock.phase)."""
    t = cfg.trainer
    dtype = resolve_dtype(t.dtype, device)
    captured = use_cuda_graph(t.cuda_graph, device, dtype, t.distributed, cfg.data.document_mask)
    apply_vram_budget(device, t.vram_budget_gb)
    torch.manual_seed(t.seed)

    data = prepare_once(cfg.data, ranks)
    tokenizer = load_tokenizer(data.manifest)
    source = pretrained.open_checked(cfg.model.init_from, tokenizer) if cfg.model.init_from else None
    phase("data")
    model_cfg = resolve_vocab(cfg.model, data.vocab_size)
    batch_size = resolve_batch_size(t.batch_size, model_cfg, cfg, device, dtype)
    attention, backend = build_attention(cfg.attention, device, ranks.context_group)
    with torch.device(device):  # the weights are made and initialized where they train
        model = GPT(model_cfg, attention)
    origin = pretrained.load_weights(model, source) if source else None
    parallel_model = distributed.wrap(model, ranks, device, dtype)
    phase("model")
    optimizer = build_optimizer(model, cfg.optim, device)
    scaler = make_grad_scaler(device, dtype)
    phase("optimizer")
    train_loader, val_loader = make_loaders(data, cfg, batch_size, ranks, device)
    lineage = {"tokenizer": tokenizer.identity, "corpus": corpus_identity(data.manifest)}
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    start_step, wandb_id, best_val_loss = restore(t.resume, run_dir, model, optimizer, scaler, train_loader, device,
                                                  ranks, lineage, config)

    finished = start_step >= t.max_steps
    logger = QuietLogger() if finished or not ranks.is_main else MetricsLogger(
        run_dir, cfg.logger, t.max_steps, start_step, t.run_name, config, wandb_id)  # rank 0 reports
    tokens_per_step = batch_size * t.grad_accum * model_cfg.block_size * ranks.data_size
    logger.message(
        f"{model.num_params() / 1e6:.2f}M parameters | attention={backend} | {device.type} {dtype_name(dtype)} | "
        f"{batch_size * t.grad_accum * ranks.data_size} sequences = {tokens_per_step:,} tokens/step"
        + (f" over {ranks.world_size} ranks" if ranks.enabled else "")
        + (f" ({ranks.data_size} data parallel x {ranks.context_size} context parallel: ring attention, "
           f"{model_cfg.block_size // ranks.context_size} tokens of each sequence per rank)"
           if ranks.context_size > 1 else "")
        + f" | run dir {run_dir}" + (f" | resumed at step {start_step}" if start_step else "")
        + (f" | {pretrained.describe_origin(origin)}" if origin and not start_step else "")
    )
    if ranks.is_main and not finished:
        write_run_info(run_dir, backend, device, dtype, model.num_params(), batch_size, origin,
                       flash_forward(cfg, backend, model_cfg, device, dtype))

    profiler = StepProfiler(run_dir, t.profile_steps if ranks.is_main else 0, start_step, device, t.max_steps)
    if profiler.note:
        logger.message(profiler.note)

    step_model = compiled(parallel_model, model, ranks, t.compile) if t.compile else parallel_model
    shard = SequenceShard(ranks.context_rank, ranks.context_size)
    step = functools.partial(train_step, step_model, model, optimizer, scaler, t=t, device=device, dtype=dtype,
                             shard=shard)
    return Run(
        cfg, run_dir, ranks, device, dtype, backend, tokenizer, model, step_model, optimizer, train_loader, val_loader,
        step=CapturedStep(step, optimizer, t.grad_accum) if captured else step,
        shard=shard,
        start_step=start_step,
        tokens_per_step=tokens_per_step,
        checkpointer=Checkpointer(run_dir, t.keep_checkpoints, model, optimizer, scaler, ranks, device, config,
                                  logger.wandb_id, lineage, best_val_loss, t.keep_best),
        logger=logger,
        meter=throughput_meter(model, ranks, device, t.peak_tflops),
        profiler=profiler,
    )


def prepare_once(data_cfg, ranks: distributed.Ranks) -> PreparedData:
    """The token cache, built by rank 0 while the other ranks wait, then read by all."""
    if ranks.is_main:
        data = prepare(data_cfg)
    distributed.barrier()
    return data if ranks.is_main else prepare(data_cfg)


def resolve_vocab(cfg: ModelConfig, tokenizer_vocab: int) -> ModelConfig:
    """Fill model.vocab_size from the tokenizer (padded to a multiple of 64), or check the one given."""
    if cfg.vocab_size is None:
        return dataclasses.replace(cfg, vocab_size=padded_vocab(tokenizer_vocab))
    if cfg.vocab_size < tokenizer_vocab:
        raise UserError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} tokens; "
            "set model.vocab_size=null to take it from the tokenizer"
        )
    return cfg


def resolve_batch_size(batch_size, model_cfg: ModelConfig, cfg: TrainConfig, device, dtype) -> int:
    """``trainer.batch_size``, or for ``auto`` the largest micro-batch that fits (found by trial)."""
    if batch_size != "auto":
        return batch_size
    batch_size = auto_batch_size(model_cfg, cfg.attention, device, dtype)
    print(f"trainer.batch_size=auto: {batch_size} sequences per micro-batch fit")
    return batch_size


def make_loaders(data: PreparedData, cfg: TrainConfig, batch_size: int, ranks: distributed.Ranks,
                 device) -> Tuple[BatchLoader, BatchLoader]:
    """(train, validation) loaders of this rank's slice of each global batch (the ranks of a context group
    read the same slice)."""
    common = dict(block_size=cfg.model.block_size, batch_size=batch_size, device=device, eot_id=data.eot_id,
                  document_mask=cfg.data.document_mask, rank=ranks.data_rank, world_size=ranks.data_size)
    seed = cfg.trainer.seed
    return (BatchLoader(data.train_path, data.dtype, seed=seed, **common),
            BatchLoader(data.val_path, data.dtype, seed=seed + 1, **common))


def throughput_meter(model: GPT, ranks: distributed.Ranks, device, peak_override) -> ThroughputMeter:
    """Tokens/s over all ranks; MFU per GPU."""
    peak = peak_tflops(device, peak_override)
    per_token = flops_per_token(model.cfg, model.num_params(), model.cfg.block_size)
    return ThroughputMeter(device, per_token, peak * ranks.world_size if peak else None)


def compiled(parallel_model, model: GPT, ranks: distributed.Ranks, how):
    """The model under ``torch.compile`` as trainer.compile says: true, the whole model as one graph
    (under FSDP block by block, so the sharding hooks stay between the graphs); blocks, each block on
    its own (regional compilation): the blocks share one graph, compiled once, in a fraction of the
    time, and what lies between them runs eagerly. AOTAutograd's disk cache may keep graphs with our
    custom autograd.Functions (training/caches.py). Graphs an earlier job of a multirun compiled in this
    process are dropped first: each run compiles its own (from the disk caches when it can), and a long
    multirun never meets dynamo's limit on recompilations, past which it would run uncompiled."""
    torch._dynamo.reset()
    cache_custom_autograd_graphs()
    if how != "blocks" and not ranks.sharded:
        return torch.compile(parallel_model)
    for block in model.blocks:
        block.compile()
    return parallel_model


def flash_forward(cfg: TrainConfig, backend: str, model_cfg: ModelConfig, device, dtype) -> Optional[str]:
    """attention=flash: the forward kernel its calls of block_size tokens run ("gluon" or "tl"); None for other
    backends."""
    if backend != "flash":
        return None
    from model.attention.flash import forward_kernel

    return forward_kernel(cfg.attention.kernel, device, dtype, model_cfg.n_head, model_cfg.kv_heads,
                          model_cfg.head_dim, model_cfg.block_size, bool(features_in_use(cfg)))


def write_run_info(run_dir: Path, backend: str, device, dtype, n_params: int, batch_size: int,
                   origin: Optional[dict], flash_kernel: Optional[str] = None) -> None:
    """run.json: what actually ran (the backend after any fallback and, for flash, its forward kernel,
    the GPU, the versions) and where the first weights came from (model.init_from; null: initialized
    at random)."""
    info = {
        "attention": backend,
        "flash_forward": flash_kernel,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": dtype_name(dtype),
        "torch": torch.__version__,
        "triton": triton_version_or_none(),
        "params": n_params,
        "batch_size": batch_size,
        "init_from": origin,
    }
    (run_dir / "run.json").write_text(json.dumps(info, indent=1) + "\n")


def add_run_info(run_dir: Path, fields: dict) -> None:
    """Add ``fields`` to run.json (the startup times, training/metrics.py: StartupClock)."""
    path = run_dir / "run.json"
    info = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**info, **fields}, indent=1) + "\n")


def triton_version_or_none():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__
