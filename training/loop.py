"""The training loop: set up, then for each step forward/backward/step, log, evaluate, checkpoint.

``train(cfg, run_dir)`` is everything `python train.py` does after the config is composed.
"""
import dataclasses
import json
import signal
import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from data.loader import BatchLoader
from data.prepare import prepare
from data.tokenizers import load_tokenizer
from model import GPT, ModelConfig
from model.attention import build_attention
from model.config import padded_vocab
from training.checkpoint import (
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_sharded_checkpoint,
    remove_checkpoint,
    restore_rng_state,
    rng_state,
    save_checkpoint,
    saved_vocab_size,
    save_sharded_checkpoint,
)
from training.config import TrainConfig, TrainerConfig
from errors import UserError
from training.fit import auto_batch_size
from training import distributed
from training.loggers import MetricsLogger, QuietLogger
from training.metrics import ThroughputMeter, flops_per_token, peak_tflops
from training.optim import build_optimizer, clip_in_step, lr_at, plain_state_dict, set_lr
from training.cuda_graph import CapturedStep, use_cuda_graph
from training.profiling import StepProfiler
from training.precision import apply_vram_budget, autocast, dtype_name, make_grad_scaler, resolve_device, resolve_dtype
from training.signals import StopRequest

# Model options a checkpoint must share with the run that resumes it.
SHAPE_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size", "bias", "norm", "pos", "mlp")


class TrainingStopped(UserError):
    """The run cannot go on (non-finite loss for too many steps); the last good checkpoint is kept."""


class OutOfMemory(UserError):
    """A training step ran out of GPU memory; the last finished step was saved."""

    def __init__(self, step: int, saved: Optional[Path], budget_gb: Optional[float]):
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        limit = f" of the trainer.vram_budget_gb={budget_gb:g} GiB budget" if budget_gb else ""
        kept = f"; step {step - 1} is saved in {saved}" if saved else ""
        super().__init__(
            f"out of GPU memory at step {step} (peak {peak:.2f} GiB allocated{limit}){kept}. Try a smaller "
            "trainer.batch_size with a larger trainer.grad_accum (same tokens per step), attention=flash or "
            "hybrid instead of naive, model.activation_checkpointing=true, or a shorter model.block_size "
            "(scripts/fit.py finds what fits)"
        )


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived; a checkpoint of the last finished step was saved."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


def train(cfg: TrainConfig, run_dir: Path) -> dict:
    """Train the model ``cfg`` describes; write metrics and checkpoints under ``run_dir``.

    Returns a summary: {"step", "loss", "val_loss", "backend", "elapsed_s", "sample"}.
    """
    ranks, device = distributed.setup(cfg.trainer.distributed, resolve_device(cfg.trainer.device))
    try:
        return train_ranks(cfg, Path(run_dir), ranks, device)
    finally:
        distributed.teardown()


def train_ranks(cfg: TrainConfig, run_dir: Path, ranks: distributed.Ranks, device: torch.device) -> dict:
    """``train`` on this rank's device; rank 0 logs, evaluates for the record and saves."""
    t = cfg.trainer
    run_dir.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(t.dtype, device)
    captured = use_cuda_graph(t.cuda_graph, device, dtype, t.distributed, cfg.data.document_mask)
    apply_vram_budget(device, t.vram_budget_gb)
    torch.manual_seed(t.seed)

    data = prepare_once(cfg.data, ranks)
    tokenizer = load_tokenizer(data.manifest)
    model_cfg = resolve_vocab(cfg.model, data.vocab_size)
    batch_size = t.batch_size
    if batch_size == "auto":
        batch_size = auto_batch_size(model_cfg, cfg.attention, device, dtype)
        print(f"trainer.batch_size=auto: {batch_size} sequences per micro-batch fit")
    attend, backend = build_attention(cfg.attention, device)
    model = GPT(model_cfg, attend).to(device)
    parallel_model = distributed.wrap(model, ranks, device, dtype)
    optimizer = build_optimizer(model, cfg.optim, device)
    scaler = make_grad_scaler(device, dtype)
    loader_args = dict(block_size=model_cfg.block_size, batch_size=batch_size, device=device,
                       eot_id=data.eot_id, document_mask=cfg.data.document_mask)
    train_loader = BatchLoader(data.train_path, data.dtype, seed=t.seed, rank=ranks.rank,
                               world_size=ranks.world_size, **loader_args)
    val_loader = BatchLoader(data.val_path, data.dtype, seed=t.seed + 1, rank=ranks.rank,
                             world_size=ranks.world_size, **loader_args)

    start_step, wandb_id = restore(t, run_dir, model_cfg, model, optimizer, scaler, train_loader, device, ranks)
    if start_step >= t.max_steps:
        print(f"{run_dir} holds a finished run (step {start_step} of {t.max_steps}): extend it with "
              f"trainer.max_steps=N, start over with trainer.resume=none, or use another hydra.run.dir")
        return {"step": start_step, "loss": None, "val_loss": None, "backend": backend, "elapsed_s": 0.0, "sample": ""}

    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    if ranks.is_main:
        logger = MetricsLogger(run_dir, cfg.logger, t.max_steps, start_step, t.run_name, config_dict, wandb_id)
    else:
        logger = QuietLogger()
    n_params = model.num_params()
    tokens_per_step = batch_size * t.grad_accum * model_cfg.block_size * ranks.world_size
    peak = peak_tflops(device, t.peak_tflops)
    meter = ThroughputMeter(device, flops_per_token(model_cfg, n_params, model_cfg.block_size),
                            peak * ranks.world_size if peak else None)  # MFU per GPU
    logger.message(
        f"{n_params / 1e6:.2f}M parameters | attention={backend} | {device.type} {dtype_name(dtype)} | "
        f"{batch_size * t.grad_accum * ranks.world_size} sequences = {tokens_per_step:,} tokens/step"
        + (f" over {ranks.world_size} ranks" if ranks.enabled else "")
        + f" | run dir {run_dir}"
        + (f" | resumed at step {start_step}" if start_step else "")
    )
    if ranks.is_main:
        write_run_info(run_dir, backend, device, dtype, n_params, batch_size)
    step_model = compiled(parallel_model, ranks) if t.compile else parallel_model

    def one_step(loader):
        return train_step(step_model, model, optimizer, scaler, loader, t, device, dtype)

    run_step = CapturedStep(one_step, optimizer, t.grad_accum) if captured else one_step
    profiler = StepProfiler(run_dir, t.profile_steps if ranks.is_main else 0, start_step, device, t.max_steps)

    started = time.perf_counter()
    loss, val_loss = float("nan"), None
    bad_streak = torch.zeros((), dtype=torch.int64, device=device)  # consecutive bad steps, on the device
    worst_streak = torch.zeros_like(bad_streak)  # longest streak since the last check
    def save(step, loader_state, rng=None):
        if not (ranks.is_main or ranks.sharded):
            return None  # a whole-model checkpoint is rank 0's alone
        state = run_state(step, model_cfg, scaler, loader_state, config_dict, logger.wandb_id, device, rng)
        if ranks.sharded:
            return save_sharded_checkpoint(run_dir, step, model, optimizer, state, t.keep_checkpoints, ranks.is_main)
        state.update(model=model.state_dict(), optimizer=plain_state_dict(optimizer))
        return save_checkpoint(run_dir, step, state, t.keep_checkpoints)

    with StopRequest() as stop:
        for step in range(start_step + 1, t.max_steps + 1):
            loader_before, rng_before = train_loader.state_dict(), rng_state(device)  # an OOM saves the step before
            lr = lr_at(step, cfg.optim, t.max_steps)
            set_lr(optimizer, lr)
            profiler.before_step(step)
            try:
                loss_t, grad_norm_t, good = run_step(train_loader)
            except torch.OutOfMemoryError as err:
                optimizer.zero_grad(set_to_none=True)
                # A sharded save needs every rank, and the others may be waiting inside the failed step.
                can_save = step - 1 > start_step and not ranks.sharded
                saved = save(step - 1, loader_before, rng_before) if can_save else None
                logger.close()
                raise OutOfMemory(step, saved, t.vram_budget_gb) from err
            bad_streak = (bad_streak + 1) * (~good)
            worst_streak = torch.maximum(worst_streak, bad_streak)
            meter.tick(tokens_per_step)
            logger.advance()
            profiled = profiler.after_step(step)
            if profiled:
                logger.message(profiled)

            stopping = distributed.any_rank(bool(stop.signum), ranks)
            log_due = step % t.log_interval == 0 or step == t.max_steps
            eval_due = step % t.eval_interval == 0 or step == t.max_steps
            ckpt_due = step % t.ckpt_interval == 0 or step == t.max_steps or stopping
            if not (log_due or eval_due or ckpt_due):
                continue  # nothing read from the device: the host runs ahead of the GPU
            loss, grad_norm, worst, current = (v.item() for v in (loss_t, grad_norm_t, worst_streak, bad_streak))
            worst_streak = bad_streak.clone()
            if worst >= t.max_bad_steps:
                logger.close()
                newest = list_checkpoints(run_dir)
                raise TrainingStopped(
                    f"loss or gradients were not finite for {worst} steps in a row (seen at step {step}); those steps "
                    f"changed nothing and the last good checkpoint is {newest[-1] if newest else 'none'}. Lower "
                    "optim.lr, raise optim.warmup_steps, keep trainer.grad_clip on, or use trainer.dtype=bf16/fp32 "
                    "(trainer.max_bad_steps sets the limit)"
                )
            if log_due:
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm}
                record.update(meter.report())
                record["peak_vram_mb"] = distributed.maximum(record["peak_vram_mb"])
                record["elapsed_s"] = time.perf_counter() - started
                logger.log(record)
            if eval_due:
                paused = time.perf_counter()
                val_loss = evaluate(step_model, val_loader, t.eval_iters, device, dtype)
                logger.log({"step": step, "val_loss": val_loss, "elapsed_s": time.perf_counter() - started})
                meter.exclude(time.perf_counter() - paused)
            if ckpt_due and current == 0:
                paused = time.perf_counter()
                path = save(step, train_loader.state_dict())
                meter.exclude(time.perf_counter() - paused)
            if stopping:
                logger.close()
                kept = path if current == 0 else (list_checkpoints(run_dir) or ["no checkpoint"])[-1]
                signum = stop.signum or signal.SIGTERM  # a rank the signal did not reach stops with the others
                raise Interrupted(signum, f"{signal.Signals(signum).name}: stopped after step {step}; {kept} holds "
                                          "the run (start the same command again to resume)")
    elapsed = time.perf_counter() - started
    logger.close()

    # Sharded weights are gathered collectively: every rank generates the same text, rank 0 keeps it.
    generating = ranks.is_main or ranks.sharded
    sample = generate_sample(model, tokenizer, t.sample_tokens if generating else 0, device, dtype, t.seed)
    sample = sample if ranks.is_main else ""
    if sample:
        (run_dir / "sample.txt").write_text(sample)
        print(f"--- sample after {t.max_steps} steps ---\n{sample}\n---")
    return {"step": t.max_steps, "loss": loss, "val_loss": val_loss, "backend": backend, "elapsed_s": elapsed, "sample": sample}


def compiled(parallel_model, ranks: distributed.Ranks):
    """``torch.compile`` the model; under FSDP block by block, so the sharding hooks stay between the graphs."""
    if not ranks.sharded:
        return torch.compile(parallel_model)
    for block in parallel_model.blocks:
        block.compile()
    return parallel_model


def prepare_once(data_cfg, ranks: distributed.Ranks):
    """The token cache, built by rank 0 while the other ranks wait, then read by all."""
    if ranks.is_main:
        data = prepare(data_cfg)
    distributed.barrier()
    return data if ranks.is_main else prepare(data_cfg)


def write_run_info(run_dir: Path, backend: str, device, dtype, n_params: int, batch_size: int) -> None:
    """run.json: what actually ran (the backend after any fallback, the GPU, the versions)."""
    info = {
        "attention": backend,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": dtype_name(dtype),
        "torch": torch.__version__,
        "triton": triton_version_or_none(),
        "params": n_params,
        "batch_size": batch_size,
    }
    (run_dir / "run.json").write_text(json.dumps(info, indent=1) + "\n")


def triton_version_or_none():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


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


def train_step(step_model, model, optimizer, scaler, loader, t: TrainerConfig, device, dtype):
    """One optimizer step over ``grad_accum`` micro-batches, queued without waiting for the device.

    Returns device tensors (mean loss, grad norm, good) where ``good`` says the step counted. A step
    whose loss or gradient is not finite updates nothing: with fp16 the grad scaler skips it (and
    lowers its scale; only a non-finite loss counts as bad then, overflowing gradients are routine),
    otherwise the fused optimizer is told to skip it through ``found_inf``.
    """
    loss_sum = torch.zeros((), device=device)
    for micro in range(t.grad_accum):
        x, y, doc_ids = loader.next_batch()
        with distributed.gradient_sync(step_model, micro == t.grad_accum - 1):
            with autocast(device, dtype):
                _, loss = step_model(x, y, doc_ids)
            loss_sum += loss.detach()
            scaler.scale(loss / t.grad_accum).backward()
    max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
    loss_mean = distributed.mean(loss_sum / t.grad_accum)  # every rank decides on the same loss
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
        grad_norm = distributed.local(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        good = torch.isfinite(loss_mean)
        scaler.step(optimizer)
        scaler.update()
    else:
        if distributed.is_sharded(model):
            grad_norm = distributed.local(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        else:
            grad_norm = clip_in_step(optimizer, model.parameters(), max_norm)
        good = torch.isfinite(loss_mean) & torch.isfinite(grad_norm)
        optimizer.found_inf = (~good).float()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_mean, grad_norm, good


@torch.no_grad()
def evaluate(step_model, loader: BatchLoader, iters: int, device, dtype) -> float:
    """Mean loss over the same ``iters`` validation batches every time (the loader restarts)."""
    step_model.eval()
    loader.load_state_dict({"batches_drawn": 0})
    total = torch.zeros((), device=device)
    for _ in range(iters):
        x, y, doc_ids = loader.next_batch()
        with autocast(device, dtype):
            _, loss = step_model(x, y, doc_ids)
        total += loss.float()
    step_model.train()
    return distributed.mean(total / iters).item()


def run_state(step, model_cfg: ModelConfig, scaler, loader_state: dict, config: dict, wandb_id: Optional[str], device,
              rng: Optional[dict] = None) -> dict:
    """What a checkpoint holds besides the model and optimizer."""
    return {
        "step": step,
        "vocab_size": model_cfg.vocab_size,
        "scaler": scaler.state_dict(),
        "loader": loader_state,
        "rng": rng if rng is not None else rng_state(device),
        "config": config,
        "wandb_id": wandb_id,
    }


def restore(t: TrainerConfig, run_dir: Path, model_cfg: ModelConfig, model, optimizer, scaler, loader, device,
            ranks: distributed.Ranks):
    """Load the checkpoint ``trainer.resume`` names into the run. Returns (step reached, wandb id)."""
    if t.resume == "none":
        old = list_checkpoints(run_dir) if ranks.is_main else []
        if old:
            print(f"trainer.resume=none: starting over, removing {len(old)} old checkpoint(s) in {checkpoint_dir(run_dir)}")
            for path in old:
                remove_checkpoint(path)
        distributed.barrier()  # no rank may look for checkpoints while rank 0 removes them
        return 0, None
    if t.resume == "auto":
        path, state = latest_checkpoint(run_dir)
        if state is None:
            return 0, None
    else:
        path, state = Path(t.resume), load_checkpoint(Path(t.resume))
    check_compatible(path, state, model_cfg)
    check_layout(path, state, ranks)
    if state["sharded"]:
        load_sharded_checkpoint(path, model, optimizer)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    loader.load_state_dict(state["loader"])
    restore_rng_state(state["rng"], device)
    if ranks.is_main:
        print(f"resuming from {path} (step {state['step']})")
    return state["step"], state.get("wandb_id")


def check_compatible(path: Path, state: dict, model_cfg: ModelConfig) -> None:
    """A checkpoint resumes only a model of the same shape and vocabulary."""
    saved = state.get("config", {}).get("model", {})
    for key in SHAPE_KEYS:
        mine = getattr(model_cfg, key)
        theirs = saved.get(key, mine) if key != "vocab_size" else saved_vocab_size(state)
        if theirs != mine:
            raise UserError(
                f"checkpoint {path} was made with model.{key}={theirs} but this run has model.{key}={mine}; "
                f"resume with the same model and data settings, or start fresh with trainer.resume=none "
                f"(or another hydra.run.dir)"
            )


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


@torch.no_grad()
def generate_sample(model: GPT, tokenizer, n_tokens: int, device, dtype, seed: int) -> str:
    """Text generated from a newline prompt with top-k sampling; empty when n_tokens is 0."""
    if n_tokens == 0:
        return ""
    model.eval()
    prompt = torch.tensor([tokenizer.encode("\n")], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with autocast(device, dtype):
        out = model.generate(prompt, n_tokens, temperature=0.8, top_k=200, vocab_limit=tokenizer.vocab_size, generator=gen)
    model.train()
    return tokenizer.decode(out[0, 1:].tolist())
