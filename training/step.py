"""What the loop runs on the model: one optimizer step, an evaluation, a sample of text."""
from typing import Callable, Optional

import torch

from data.loader import BatchLoader
from data.tokenizers import default_prompt
from model import GPT
from training import distributed
from training.config import TrainerConfig
from training.context_parallel import SequenceShard
from training.optim import clip_in_step
from training.precision import autocast


def train_step(step_model, model, optimizer, scaler, loader, t: TrainerConfig, device, dtype,
               shard: SequenceShard = SequenceShard()):
    """One optimizer step over ``grad_accum`` micro-batches, queued without waiting for the device.

    ``shard`` picks the tokens of each sequence this rank trains on (context parallelism).

    Returns device tensors (mean loss, grad norm, good) where ``good`` says the step counted. A step
    whose loss or gradient is not finite updates nothing: with fp16 the grad scaler skips it (and
    lowers its scale; only a non-finite loss counts as bad then, overflowing gradients are routine),
    otherwise the fused optimizer is told to skip it through ``found_inf``.
    """
    loss_sum = torch.zeros((), device=device)
    for micro in range(t.grad_accum):
        x, y, doc_ids = loader.next_batch()
        x, y, positions = shard(x, y)
        with distributed.gradient_sync(step_model, micro == t.grad_accum - 1):
            with autocast(device, dtype):
                _, loss = step_model(x, y, doc_ids, positions)
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
def evaluate(step_model, loader: BatchLoader, iters: int, device, dtype, shard: SequenceShard = SequenceShard(),
             stop: Callable[[], bool] = lambda: False) -> Optional[float]:
    """Mean loss over the same ``iters`` validation batches every time (the loader restarts); None
    when ``stop()`` (asked before each batch, the same answer on every rank) says to stop early."""
    step_model.eval()
    loader.load_state_dict({"batches_drawn": 0})
    total = torch.zeros((), device=device)
    try:
        for _ in range(iters):
            if stop():
                return None
            x, y, doc_ids = loader.next_batch()
            x, y, positions = shard(x, y)
            with autocast(device, dtype):
                _, loss = step_model(x, y, doc_ids, positions)
            total += loss.float()
    finally:
        step_model.train()
    return distributed.mean(total / iters).item()


@torch.no_grad()
def generate_sample(model: GPT, tokenizer, n_tokens: int, device, dtype, seed: int) -> str:
    """Text generated from ``default_prompt`` with top-k sampling; empty when n_tokens is 0."""
    if n_tokens == 0:
        return ""
    model.eval()
    prompt = torch.tensor([default_prompt(tokenizer)], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with autocast(device, dtype):
        out = model.generate(prompt, n_tokens, temperature=0.8, top_k=200, vocab_limit=tokenizer.vocab_size, generator=gen)
    model.train()
    return tokenizer.decode(out[0, 1:].tolist())
