"""The static KV cache of one generation: every layer's keys and values so far, in preallocated tensors.

``GPT.forward(idx, cache=cache)`` feeds idx's T tokens at the cache's next positions. On an empty
cache it is a prefill: the configured attention backend attends over the prompt as in training,
and each layer keeps its keys and values (RoPE keys rotated) in rows 0..T-1. On a filled cache it
is a decode step: each layer writes the new tokens' keys and values at their rows and attends to
the cache, with our flash-decoding kernel (kernels/flash_decoding) on a CUDA GPU with Triton and
its PyTorch reference elsewhere. With model.gate=forget the cache also keeps c, the running sum of
the log forget gates (float64), so the decay c_i - c_j of the new tokens is the one the whole
sequence would give.

Nothing in a forward reads the device from the host: the next position lives on the device, so a
decode step can be captured as one CUDA graph (or compiled) and replayed at every length. The
cache holds sequences of one length (B rows: the samples of one prompt); the kernel itself takes
a length per sequence.
"""
from typing import List, Optional

import torch

from kernels.flash_decoding import decode_ref, flash_decode, flash_decode_available
from model.config import ModelConfig


class KVCache:
    """Keys, values (and gates' c) of ``batch`` sequences of up to ``capacity`` tokens, for every layer.

    ``next_pos``: (1,) int64 on the device, the position of the next token fed; ``filled``: (host)
    whether a prefill has run, so the next forward decodes; ``window``: attention.window, applied
    by the decode step as the backend applies it in the prefill.
    """

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, window: Optional[int], device: torch.device):
        self.batch, self.capacity, self.window = batch, capacity, window
        self.next_pos = torch.zeros(1, dtype=torch.long, device=device)
        self.filled = False
        self.use_kernel = flash_decode_available(self.next_pos)  # a CUDA GPU with Triton
        self.positions: Optional[torch.Tensor] = None  # (T,) of the forward running now
        self.lengths: Optional[torch.Tensor] = None  # (B,) int32: each sequence's length once it has run
        self.layers: List[LayerCache] = [LayerCache(self) for _ in range(cfg.n_layer)]

    def reset(self) -> None:
        """Empty the cache (the rows stay allocated): the next forward is a prefill from position 0."""
        self.next_pos.zero_()
        self.filled = False

    def begin(self, n_tokens: int) -> torch.Tensor:
        """Positions (T,) int64 of the ``n_tokens`` a forward feeds, on the device; sets the lengths
        the layers attend with."""
        self.positions = self.next_pos + torch.arange(n_tokens, device=self.next_pos.device)
        self.lengths = (self.positions[-1:] + 1).to(torch.int32).expand(self.batch).contiguous()
        return self.positions

    def advance(self, n_tokens: int) -> None:
        """After a forward of ``n_tokens``: they are in the cache."""
        self.next_pos.add_(n_tokens)
        self.filled = True

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor a decode step reads or writes in place (for ``torch._dynamo.mark_static_address``)."""
        rows = [t for layer in self.layers for t in (layer.k, layer.v, layer.c) if t is not None]
        return [self.next_pos, *rows]


class LayerCache:
    """One layer's rows: k, v (B, capacity, H_kv, D) in the dtype the layer makes them (its weights', or
    autocast's), allocated zeroed at the first write; c (B, capacity, H) float64 with a forget gate, else None."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.c: Optional[torch.Tensor] = None

    @property
    def decoding(self) -> bool:
        return self.owner.filled

    def write(self, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor]) -> None:
        """Store the forward's k, v (B, T, H_kv, D) and, with g (B, T, H) log forget gates, c = the
        running sum of g, at the forward's positions. A batch of one row (a prompt prefilled once for
        all its samples) is stored in every row."""
        owner = self.owner
        k, v = (x.expand(owner.batch, *x.shape[1:]) for x in (k, v))
        if self.k is None:
            rows = (owner.batch, owner.capacity)
            self.k = k.new_zeros(rows + k.shape[2:])  # zeros: rows not yet written are finite
            self.v = v.new_zeros(rows + v.shape[2:])
            self.c = g.new_zeros(rows + g.shape[2:], dtype=torch.float64) if g is not None else None
        self.k.index_copy_(1, owner.positions, k)
        self.v.index_copy_(1, owner.positions, v)
        if g is not None:
            first = owner.positions[:1]
            before = self.c.index_select(1, (first - 1).clamp_min(0))  # (B, 1, H): c just before the forward
            before = torch.where(first > 0, before, torch.zeros_like(before))
            self.c.index_copy_(1, owner.positions, before + g.double().cumsum(dim=1))

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """Attention of q (B, T, H, D), the forward's queries (already written), to the cache: (B, T, H, D)."""
        owner = self.owner
        if owner.use_kernel:
            return flash_decode(q, self.k, self.v, owner.lengths, window_size=owner.window, gate_cache=self.c)
        return decode_ref(q, self.k, self.v, owner.lengths, window_size=owner.window, gate_cache=self.c,
                          compute_dtype=None)[0]
