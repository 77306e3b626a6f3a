"""Generation with a KV cache: prefill once, then one token a step, and sampling on the device.

``generate_cached`` is ``GPT.generate``'s default path. The prompt's last ``block_size`` tokens are
prefilled with the configured backend (once, at batch 1, when every row holds the same prompt: the
samples of one prompt, as nanochat's engine does; the cache copies its keys and values to every
row); then each step feeds the newest token, attends to the cache (model/kv_cache.py) and samples
the next. Once the context is ``block_size`` tokens long, the
model must see only the last ``block_size`` (nanoGPT's rule), and with learned or rotary positions
every token then sits at a new position: each further token re-prefills the last ``block_size``
tokens, which is exactly what the uncached path computes, so greedy output stays equal to it.

A step (``DecodeStep``) runs in one of ``STEPS``:
- ``eager``: the model's forward and the sampling as plain PyTorch calls;
- ``graph``: one real step eagerly (Triton builds or loads the decode kernels), then the step is
  captured as one CUDA graph and replayed: the token to feed, the position and the cache rows are
  all read and written on the device, so the host only replays. Under autocast the graph casts
  every weight again at every step: inference models hold their weights in the dtype they run in
  (training/trained_model.py), and only the sample at the end of training runs under autocast;
- ``compile``: the step under ``torch.compile(mode="reduce-overhead")`` (gpt-fast's way: Inductor
  fuses the small kernels, and its CUDA graphs replay them); the first steps pay the compilation;
- ``auto``: ``graph`` on a CUDA GPU outside torch.distributed (an FSDP model gathers its weights
  with collectives in every forward), else ``eager``. ``graph`` compiles nothing, so a sample
  starts in seconds; scripts/bench_decode.py measures ``compile``'s speed and first call beside it.
Either way the step's random numbers are drawn eagerly before it, from the caller's generator.

Sampling (``Sampler``) never syncs with the host: a draw from probabilities p is the argmax of p / E
with E ~ Exp(1) independent per token id (the exponential race: the same law as ``torch.multinomial``).
"""
import functools
from typing import Callable, Optional

import torch

STEPS = ("auto", "eager", "graph", "compile")
COMPILE_OPTIONS = {"mode": "reduce-overhead", "fullgraph": True}


class Sampler:
    """Next tokens from the last position's logits: ``draw`` the step's random numbers (eager, from
    ``generator``), then ``pick`` (capturable); ``sampler(logits)`` does both.

    temperature <= 0: greedy (argmax, no random numbers); else softmax(logits / temperature) over the
    ``top_k`` likeliest ids (None: all). ``vocab_limit``: ids at or above it (the padding of the
    embedding table) are never picked.
    """

    def __init__(self, temperature: float, top_k: Optional[int], vocab_limit: Optional[int],
                 generator: Optional[torch.Generator]):
        self.temperature, self.top_k, self.vocab_limit, self.generator = temperature, top_k, vocab_limit, generator
        self.noise: Optional[torch.Tensor] = None  # (B, V') Exp(1) draws, V' the ids that may be picked

    def draw(self, batch: int, vocab: int, device: torch.device) -> None:
        """Fill the noise for the next pick from ``batch`` rows of ``vocab`` logits."""
        if self.temperature <= 0:
            return
        if self.noise is None:
            limited = vocab if self.vocab_limit is None else min(self.vocab_limit, vocab)
            self.noise = torch.empty((batch, limited), dtype=torch.float32, device=device)
        self.noise.exponential_(generator=self.generator)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Token ids (B, 1) int64 from logits (B, V), with the noise drawn last."""
        logits = logits.float()
        if self.vocab_limit is not None:
            logits = logits[:, :self.vocab_limit]
        if self.temperature <= 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / self.temperature
        if self.top_k is not None:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return (probs / self.noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1, keepdim=True)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.draw(logits.shape[0], logits.shape[-1], logits.device)
        return self.pick(logits)


def decode_step(model, cache, seq: torch.Tensor, sampler: Sampler) -> None:
    """One decode step on ``seq`` (B, T_total): feed its token at the cache's next position, sample
    the one after it into ``seq``. Every index is read on the device."""
    fed = seq.index_select(1, cache.next_pos)  # (B, 1)
    logits, _ = model(fed, cache=cache)  # advances next_pos
    seq.index_copy_(1, cache.next_pos, sampler.pick(logits[:, -1]))


@functools.lru_cache(maxsize=None)
def compiled_decode_step(options: tuple):
    """``decode_step`` under ``torch.compile(**dict(options))``, made once per process (its graphs then
    serve every generation; new cache tensors only re-record the CUDA graphs)."""
    return torch.compile(decode_step, **dict(options))


class DecodeStep:
    """``decode_step`` run one of the ``STEPS`` ways (but auto), the step's random numbers drawn first."""

    def __init__(self, model, cache, seq: torch.Tensor, sampler: Sampler, mode: str):
        self.model, self.cache, self.seq, self.sampler, self.mode = model, cache, seq, sampler, mode
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.steps = 0

    def __call__(self) -> None:
        args = (self.model, self.cache, self.seq, self.sampler)
        self.sampler.draw(self.seq.shape[0], self.model.cfg.vocab_size, self.seq.device)
        self.steps += 1
        if self.mode == "eager" or (self.mode == "graph" and self.steps == 1):
            decode_step(*args)
        elif self.mode == "graph":
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    decode_step(*args)
            self.graph.replay()
        else:
            if self.steps == 1:
                self.mark_static()
            compiled_decode_step(tuple(sorted(COMPILE_OPTIONS.items())))(*args)

    def mark_static(self) -> None:
        """Tell torch.compile that the tensors the step reads and writes in place keep their addresses:
        its CUDA graphs use them as they are, no copies in and out. Another generation's tensors make
        it record its graphs again, without compiling again (guard=False)."""
        noise = [self.sampler.noise] if self.sampler.noise is not None else []
        for t in (self.seq, *self.cache.tensors(), *noise):
            torch._dynamo.mark_static_address(t, guard=False)


def resolve_step(step: str, device: torch.device) -> str:
    """The step mode ``step`` (one of ``STEPS``) means on ``device``."""
    if step not in STEPS:
        raise ValueError(f"step={step!r} is not one of {', '.join(STEPS)}")
    if step == "graph" and device.type != "cuda":
        raise ValueError(f"step='graph' captures a CUDA graph and this generation runs on {device.type}; use eager or auto")
    if step != "auto":
        return step
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return "graph" if device.type == "cuda" and not distributed else "eager"


@torch.no_grad()
def generate_cached(model, idx: torch.Tensor, max_new_tokens: int, sampler: Sampler, step: str = "auto",
                    on_token: Optional[Callable[[int], object]] = None) -> torch.Tensor:
    """``GPT.generate`` with a KV cache: idx (B, T0) -> (B, T0 + max_new_tokens), max_new_tokens >= 1.
    ``on_token(1)`` is called after each token is queued (a progress bar's update; nothing waits for the GPU)."""
    mode = resolve_step(step, idx.device)
    B, T0 = idx.shape
    block = model.cfg.block_size
    seq = torch.empty((B, T0 + max_new_tokens), dtype=idx.dtype, device=idx.device)
    seq[:, :T0] = idx
    one_prompt = B > 1 and bool((idx == idx[:1]).all())  # samples of one prompt: prefilled once, at batch 1
    cache = model.kv_cache(B, min(block, T0 + max_new_tokens - 1), idx.device)
    decode = DecodeStep(model, cache, seq, sampler, mode)
    for t in range(T0 - 1, T0 + max_new_tokens - 1):  # t: the position of the newest token
        if t == T0 - 1 or t >= block:  # (re-)prefill the last block_size tokens up to t
            cache.reset()
            rows = seq[:1] if one_prompt and t == T0 - 1 else seq  # the cache copies one row to all
            logits, _ = model(rows[:, max(0, t + 1 - block):t + 1], cache=cache)
            seq[:, t + 1] = sampler(logits[:, -1].expand(B, -1))[:, 0]
        else:  # the cache holds positions 0..t-1 and the token at t is fed at cache row t
            decode()
        if on_token is not None:
            on_token(1)
    return seq
