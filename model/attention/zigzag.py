"""The zigzag sequence layout of context parallelism: which tokens each of N ranks holds.

A sequence of T tokens is cut into 2N equal chunks; rank r holds chunk r followed by chunk
2N-1-r. Under a causal mask the early chunk is cheap (few keys before it) and the late chunk
dear, so every rank does the same amount of attention work. A rank's tokens stay in increasing
position order, so a plain causal mask over its own 2 chunks is the right one.

With N = 1 the layout is the identity (any T). With N > 1, T must be divisible by 2N.
"""
from typing import Optional, Sequence

import torch


def check_zigzag_length(seq_len: int, world_size: int) -> None:
    """Raise ValueError when ``seq_len`` tokens cannot be cut into 2 * ``world_size`` equal chunks."""
    if world_size > 1 and seq_len % (2 * world_size) != 0:
        raise ValueError(f"context parallelism over {world_size} ranks cuts each sequence into "
                         f"{2 * world_size} equal chunks, but T={seq_len} is not divisible by "
                         f"{2 * world_size}; choose a sequence length that is")


def zigzag_chunks(rank: int, world_size: int) -> tuple:
    """Indices of the two chunks (out of 2 * world_size) that ``rank`` holds, in order."""
    return rank, 2 * world_size - 1 - rank


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """The tokens of ``rank``: x: (B, T, ...) -> (B, T / N, ...) along ``dim`` (a copy when N > 1)."""
    if world_size == 1:
        return x
    check_zigzag_length(x.shape[dim], world_size)
    chunks = x.chunk(2 * world_size, dim=dim)
    first, second = zigzag_chunks(rank, world_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``zigzag_shard``: the N shards in rank order -> the whole sequence along ``dim``."""
    world_size = len(shards)
    if world_size == 1:
        return shards[0]
    chunks = [None] * (2 * world_size)
    for rank, shard in enumerate(shards):
        first, second = zigzag_chunks(rank, world_size)
        chunks[first], chunks[second] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def zigzag_positions(seq_len: int, rank: int, world_size: int,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """Positions in the whole sequence of ``rank``'s tokens: (T / N,) int64, increasing.

    What learned position embeddings and RoPE must use instead of ``arange(T / N)``.
    """
    return zigzag_shard(torch.arange(seq_len, device=device), rank, world_size, dim=0)
