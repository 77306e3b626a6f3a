"""The GPT: token embedding, a stack of pre-norm transformer blocks, a language-model head.

Read top to bottom: rotary embeddings, the attention layer, the MLP, the block, the model. The
attention layer hands q, k, v in (B, T, H, D) layout to the backend chosen by ``attention=``; every
other part is plain PyTorch. Positions come from a learned table (model.pos=learned), rotary q and
k (rope), or nowhere (none: causality, and with model.gate=forget the gates' decay, tell tokens
apart). ``generate`` keeps a KV cache: the same forward, given the cache, prefills it with the
backend and then decodes one token a step against it (model/kv_cache.py, model/generate.py).

The small-GPT recipe of modded-nanogpt is a set of switches of ModelConfig, each off by default
(GPT-2 as it was): model.qk_norm, mlp=relu2, zero_init, logit_softcap, tie_embeddings=false,
value_embeds and skips=unet (docs/RECIPE.md). QK-norm and the value embeddings act where q, k and
v are made (``CausalSelfAttention.project``), so every backend, and the KV cache, see plain q, k and v.
"""
import functools
import logging
import math
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kernels.cross_entropy import capped_logits
from model.attention import Attention
from model.config import NORM_EPS, ROPE_BASE, ModelConfig
from model.generate import Sampler, generate_cached
from model.kv_cache import KVCache, LayerCache
from model.loss import lm_loss


def rope_tables(positions: torch.Tensor, head_dim: int, base: float = ROPE_BASE) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles of tokens at ``positions`` (T,): each (T, head_dim // 2), fp32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.float(), inv_freq)
    return angles.cos(), angles.sin()


class RotaryTables(nn.Module):
    """cos and sin of the rotary angles of positions 0 .. block_size - 1, (block_size, head_dim // 2)
    each: computed once, not in every forward (Inductor inlines a per-forward table into the kernels
    that read it and recomputes the trig for every element of q and k). Not saved with the weights
    (a function of the config), and always fp32: after any move or cast of the model (``.to(dtype)``,
    ``.to_empty``) they are computed again on the model's device."""

    def __init__(self, block_size: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        cos, sin = rope_tables(torch.arange(block_size), head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.cos, self.sin = rope_tables(torch.arange(self.cos.shape[0], device=self.cos.device), self.head_dim)
        return self

    def forward(self, positions: Optional[torch.Tensor], T: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The tables' rows for ``positions`` (T,), or for 0 .. T-1 when None: (T, head_dim // 2) each."""
        if positions is None:
            return self.cos[:T], self.sin[:T]
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) by position. x: (B, T, H, D); cos, sin: (T, D/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.n_embd, eps=NORM_EPS)
    return nn.LayerNorm(cfg.n_embd, eps=NORM_EPS, bias=cfg.bias)


class Projected(NamedTuple):
    """What the attention layer makes of its input, as the backends and the KV cache take it.

    q: (B, T, H, D); k, v: (B, T, H_kv, D), RoPE applied to q and k; g: (B, T, H) float32 log forget
    gates or None; qkv: (B, T, H + 2 * H_kv, D), the fused projection whose slices q, k and v are,
    or None when q or k were changed after it (a backend's packed variant takes it whole).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: Optional[torch.Tensor]
    qkv: Optional[torch.Tensor]


def uses_value_embedding(cfg: ModelConfig, layer: int) -> bool:
    """Whether block ``layer`` mixes a value embedding into V: the first and the last model.value_embeds blocks."""
    return layer < cfg.value_embeds or layer >= cfg.n_layer - cfg.value_embeds


def value_embedding_table(cfg: ModelConfig, layer: int) -> int:
    """Which table block ``layer`` uses: i for the i-th of the first blocks and the i-th of the last
    (modded-nanogpt's 012...012 pattern)."""
    return layer if layer < cfg.value_embeds else layer - (cfg.n_layer - cfg.value_embeds)


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention around a pluggable backend."""

    def __init__(self, cfg: ModelConfig, attention: Attention, layer: int = 0):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        qkv_width = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, qkv_width, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_projection = True
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.attn_dropout = cfg.attention_dropout_p  # of the attention probabilities, inside the backend
        # model.gate=forget (the Forgetting Transformer, FoX: Lin et al., ICLR 2025): a forget gate
        # f = sigmoid(w.x + b) per token and query head, whose logs g = log f <= 0 sum into the decay
        # c_i - c_j the backend adds to the scores. The weight starts like every other projection's
        # (N(0, 0.02)); the bias starts at model.gate_bias_init (GPT.__init__), 3 by default, so gates
        # start near 1 (0.95: a head looks ~20 tokens back) and training shortens or lengthens each
        # head's memory. FoX's code starts the bias at 0 (gates 0.5); gate_bias_init=0 does the same.
        # Like every Linear, the weight decays and the bias does not (training/optim.py).
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.n_head, bias=True) if cfg.gate == "forget" else None
        self.qk_norm = cfg.qk_norm
        # model.value_embeds: v = a * v + b * ve, ve this block's value embedding of the input tokens
        # (GPT.value_embeds), with learned (a, b) starting at (0.5, 0.5) as in modded-nanogpt.
        self.ve_mix = nn.Parameter(torch.full((2,), 0.5)) if uses_value_embedding(cfg, layer) else None
        self.attention = attention  # the backend; its packed variant, when it has one, takes qkv unsplit

    def forward(self, x: torch.Tensor, rope: Optional[Tuple[torch.Tensor, torch.Tensor]], doc_ids: Optional[torch.Tensor],
                ve: Optional[torch.Tensor] = None, cache: Optional[LayerCache] = None) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C); ve: (B, T, Hkv * D), this block's value embedding, or None. With a
        cache (generation), k, v and the gates go into it, and a decode step attends to it instead of
        calling the backend (model/kv_cache.py)."""
        B, T, C = x.shape
        p = self.project(x, rope, ve)
        if cache is not None:
            cache.write(p.k, p.v, p.g)
        y = cache.attend(p.q) if cache is not None and cache.decoding else self.attend(p, doc_ids)  # (B, T, H, D)
        return self.resid_dropout(self.c_proj(y.reshape(B, T, C)))

    def project(self, x: torch.Tensor, rope: Optional[Tuple[torch.Tensor, torch.Tensor]],
                ve: Optional[torch.Tensor] = None) -> Projected:
        """q, k, v and the log gates of x (B, T, C), after QK-norm (model.qk_norm), rotary positions and
        the value embedding's mix (model.value_embeds; ve: (B, T, Hkv * D) or None): the one projection
        training, prefill and decode share. q, k, v stay in the projection's dtype (autocast may compute
        a norm in fp32, and the value tables are fp32)."""
        B, T, _ = x.shape
        qkv = self.c_attn(x).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim)
        g = F.logsigmoid(self.gate_proj(x).float()) if self.gate_proj is not None else None  # (B, T, H) fp32
        q, k, v = qkv.split([self.n_head, self.n_kv_head, self.n_kv_head], dim=2)  # (B, T, H|Hkv, D)
        if rope is None and not self.qk_norm and self.ve_mix is None:
            return Projected(q, k, v, g, qkv)
        if self.qk_norm:
            q, k = (F.rms_norm(t, (self.head_dim,)).to(qkv.dtype) for t in (q, k))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.ve_mix is not None:
            v = (self.ve_mix[0] * v + self.ve_mix[1] * ve.view_as(v)).to(qkv.dtype)
        return Projected(q, k, v, g, None)

    def attend(self, p: Projected, doc_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """The backend's attention over the forward's own tokens: (B, T, H, D)."""
        options = {"dropout_p": self.attn_dropout} if self.training and self.attn_dropout > 0 else {}
        if p.g is not None:
            options["g"] = p.g
        if p.qkv is not None and self.attention.packed is not None:
            return self.attention.packed(p.qkv, self.n_head, doc_ids=doc_ids, **options)
        return self.attention(p.q, p.k, p.v, doc_ids=doc_ids, **options)


class MLP(nn.Module):
    """GELU or ReLU² (4x wide), or SwiGLU (about 8/3 x wide, rounded to 64) feed-forward layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.mlp
        self.gated = cfg.mlp == "swiglu"
        hidden = cfg.mlp_hidden
        self.c_fc = nn.Linear(cfg.n_embd, 2 * hidden if self.gated else hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.kind == "relu2":
            h = F.relu(h).square()  # So et al. 2021 (Primer); modded-nanogpt's MLP
        else:
            h = F.gelu(h, approximate="tanh")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, attention: Attention, layer: int = 0):
        super().__init__()
        self.ln_1, self.attn = make_norm(cfg), CausalSelfAttention(cfg, attention, layer)
        self.ln_2, self.mlp = make_norm(cfg), MLP(cfg)

    def forward(self, x: torch.Tensor, rope=None, doc_ids=None, ve=None, cache: Optional[LayerCache] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, doc_ids, ve, cache)
        return x + self.mlp(self.ln_2(x))


def checkpoint_options(kept_ops: Tuple, recompute: bool) -> dict:
    """``checkpoint``'s options for a block under model.activation_checkpointing: every op of the block runs
    again in the backward except the backend's attention kernels (``Attention.kept_ops``), whose output and
    lse are kept (2 C + 4 H bytes a token and layer in bf16) rather than paying their O(T^2) work twice; with
    ``recompute`` (model.recompute_attention) those run again too. The policy holds in eager and compiled
    runs alike (left to itself, torch.compile keeps or recomputes a custom op by torch version)."""
    if not kept_ops:
        return {}
    policy = functools.partial(_recompute_policy if recompute else _keep_policy, frozenset(kept_ops))
    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}


class _NoInPlaceOpsNotice(logging.Filter):
    """torch.compile warns, once a process, that a checkpointed region with a ``context_fn`` must hold no in-place
    ops: a block holds none, so the notice is dropped (every other record of that logger passes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_NoInPlaceOpsNotice())


# Two functions rather than one with the policy as an argument: dynamo tells compiled graphs apart by the function,
# not by what a partial or closure binds, so a process that compiles both settings gets each its own graph.
def _keep_policy(kept_ops: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in kept_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_policy(kept_ops: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE if op in kept_ops else CheckpointPolicy.PREFER_RECOMPUTE


class GPT(nn.Module):
    """Decoder-only transformer with GPT-2 initialisation, its head tied to the token embedding
    unless model.tie_embeddings=false.

    ``cfg.vocab_size`` must be set (the padded vocabulary); ``attention`` is the backend
    (model/attention: ``build_attention``).
    """

    def __init__(self, cfg: ModelConfig, attention: Attention):
        super().__init__()
        assert cfg.vocab_size is not None, "resolve model.vocab_size from the tokenizer before building"
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos == "learned" else None
        self.rotary = RotaryTables(cfg.block_size, cfg.head_dim) if cfg.pos == "rope" else None
        # model.value_embeds: tables of Hkv * D per token, the width of V (modded-nanogpt's value embeddings)
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.kv_heads * cfg.head_dim)
                                          for _ in range(cfg.value_embeds))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, attention, layer) for layer in range(cfg.n_layer))
        self.checkpoint_options = checkpoint_options(attention.kept_ops, cfg.recompute_attention)
        # model.skips=unet: block n_layer-1-i's input gains skip_weights[i] times block i's output
        self.skip_weights = nn.Parameter(torch.ones(cfg.n_layer // 2)) if cfg.skips == "unet" else None
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        self._init_recipe()

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer), zero biases."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual_projection", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @torch.no_grad()
    def _init_recipe(self) -> None:
        """What the switches change in the GPT-2 init: forget-gate biases, value tables at the scale of
        the values they join (LayerNorm'd x times N(0, 0.02) weights: 0.02 * sqrt(n_embd)), and with
        model.zero_init the output projections (and an untied head) at zero."""
        for block in self.blocks:
            if block.attn.gate_proj is not None:
                nn.init.constant_(block.attn.gate_proj.bias, self.cfg.gate_bias_init)
            if self.cfg.zero_init:
                block.attn.c_proj.weight.zero_()
                block.mlp.c_proj.weight.zero_()
        for table in self.value_embeds:
            nn.init.normal_(table.weight, mean=0.0, std=0.02 * math.sqrt(self.cfg.n_embd))
        if self.cfg.zero_init and not self.cfg.tie_embeddings:
            self.lm_head.weight.zero_()

    def weight_matrices(self):
        """The blocks' weight matrices (attention and MLP projections; not the gates), each with how its
        rows split into matrices of their own: (q, k, v) rows of the fused projection, (gate, up) of
        SwiGLU, or None. optim=muon orthogonalises each part separately (training/muon.py)."""
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            yield attn.c_attn.weight, (attn.n_head * attn.head_dim,) + (attn.n_kv_head * attn.head_dim,) * 2
            yield attn.c_proj.weight, None
            yield mlp.c_fc.weight, (mlp.c_proj.in_features,) * 2 if mlp.gated else None
            yield mlp.c_proj.weight, None

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the tables that are only looked up (no matmul work): the
        position table, the value embeddings, and the token embedding when the head is not tied to it."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            lookups = [self.wpe, *self.value_embeds] + ([self.wte] if not self.cfg.tie_embeddings else [])
            n -= sum(table.weight.numel() for table in lookups if table is not None)
        return n

    def forward(
        self,
        idx: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        doc_ids: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """idx, targets: (B, T) token ids; doc_ids: (B, T) document index or None; positions: (T,)
        int64, where idx's tokens sit in their sequences (a context-parallel shard), None for 0..T-1.
        cache: a KV cache (``kv_cache``) when generating: idx's tokens go in at its next positions
        (prefill on an empty cache, decode on a filled one; model/kv_cache.py).

        Returns (logits, loss): logits (B, T, V), soft-capped with model.logit_softcap, and None when no
        targets are given (with a cache, only the last position's: (B, 1, V)); with targets, None and the
        mean cross-entropy over all positions, computed in chunks so the full logits never exist
        (model/loss.py).
        """
        B, T = idx.shape
        x = self.wte(idx)
        if cache is not None:
            positions = cache.begin(T)
        rope = self.rotary(positions, T) if self.rotary is not None else None
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device) if positions is None else positions)
        x = self.drop(x)
        values = [table(idx) for table in self.value_embeds]  # (B, T, Hkv * D) each
        n_skips = 0 if self.skip_weights is None else len(self.skip_weights)
        skips = []  # model.skips=unet: outputs of the first n_skips blocks, the last one on top
        for layer, block in enumerate(self.blocks):
            if layer >= self.cfg.n_layer - n_skips:
                x = x + self.skip_weights[self.cfg.n_layer - 1 - layer] * skips.pop()
            ve = values[value_embedding_table(self.cfg, layer)] if block.attn.ve_mix is not None else None
            if self.cfg.activation_checkpointing and self.training:
                x = checkpoint(block, x, rope, doc_ids, ve, use_reentrant=False, **self.checkpoint_options)
            else:
                x = block(x, rope, doc_ids, ve, cache.layers[layer] if cache is not None else None)
            if layer < n_skips:
                skips.append(x)
        if cache is not None:
            cache.advance(T)
            return capped_logits(self.lm_head(self.ln_f(x[:, -1:])), self.cfg.logit_softcap), None
        x = self.ln_f(x)
        if targets is None:
            return capped_logits(self.lm_head(x), self.cfg.logit_softcap), None
        return None, lm_loss(x, self.lm_head.weight, targets, chunk=self.cfg.loss_chunk, softcap=self.cfg.logit_softcap)

    def kv_cache(self, batch: int, capacity: int, device: torch.device) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``capacity`` tokens (model/kv_cache.py)."""
        return KVCache(self.cfg, batch, capacity, self.blocks[0].attn.attention.window, device)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        vocab_limit: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        use_cache: bool = True,
        step: str = "auto",
        on_token: Optional[Callable[[int], object]] = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to idx: (B, T0) -> (B, T0 + max_new_tokens).

        The model sees the last ``block_size`` tokens (nanoGPT's rule). ``temperature`` <= 0 is
        greedy; else a draw from softmax(logits / temperature) over the ``top_k`` likeliest tokens
        (model/generate.py: on the device, from ``generator``). ``vocab_limit`` masks the padding ids
        above the tokenizer's vocabulary. ``use_cache``: prefill once, then one token a step against a
        KV cache (model/generate.py; greedy output equals that of ``use_cache=False``, which runs
        the whole context again for every token); ``step``: how a cached step runs, one of
        ``generate.STEPS`` (auto: one CUDA graph on a GPU outside torch.distributed, else eager);
        ``on_token(1)`` after each new token (a progress bar).
        """
        sampler = Sampler(temperature, top_k, vocab_limit, generator)
        if use_cache and max_new_tokens > 0:
            return generate_cached(self, idx, max_new_tokens, sampler, step, on_token)
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size:])
            idx = torch.cat([idx, sampler(logits[:, -1])], dim=1)
            if on_token is not None:
                on_token(1)
        return idx
