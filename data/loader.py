"""Batches of random windows from a token cache, reproducible from the seed and resumable.

Step i draws one global batch of ``batch_size * world_size`` windows from a generator seeded by
(seed, 0, i); rank r takes rows [r * batch_size, (r + 1) * batch_size). A run that resumes needs only
the number of batches drawn (``state_dict``), ranks read disjoint slices, and N ranks see exactly
the windows one process with batch_size N * B would.

The cache is read with ``os.pread``, not mapped: a mapped file that shrinks under a run (another
process truncating or rewriting it in place) kills the process with SIGBUS at the next read of a lost
page; a read past its end only comes back short, and the loader raises ``TokenCacheChanged``.

Documents (data.document_mask): doc_ids[b, t] is the index, within row b, of the document token
x[b, t] belongs to. It counts the end-of-text tokens before t: an end-of-text token ends (belongs
to) its document, and the next document starts right after it. Row starts also start a document.
"""
import os
from pathlib import Path
from typing import Optional, Tuple, Union

import numpy as np
import torch

from errors import UserError

Batch = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


class TokenCacheChanged(UserError):
    """The token cache shrank while a run read it: another process truncated or rewrote it in place."""


class BatchLoader:
    def __init__(
        self,
        bin_path: Path,
        dtype: Union[str, np.dtype],
        block_size: int,
        batch_size: int,
        seed: int,
        device: Union[str, torch.device],
        rank: int = 0,
        world_size: int = 1,
        eot_id: Optional[int] = None,
        document_mask: bool = False,
    ):
        self.path, self.dtype = Path(bin_path), np.dtype(dtype)
        self.file = open(bin_path, "rb", buffering=0)
        self.n_tokens = os.fstat(self.file.fileno()).st_size // self.dtype.itemsize
        if self.n_tokens < block_size + 1:
            raise UserError(
                f"{bin_path} holds {self.n_tokens:,} tokens, fewer than model.block_size + 1 = {block_size + 1}; "
                "lower model.block_size or use a larger corpus (or a smaller data.val_fraction)"
            )
        if document_mask and eot_id is None:
            raise UserError("data.document_mask=true needs a tokenizer with an end-of-text token (data.tokenizer=gpt2)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.block_size, self.batch_size, self.seed, self.rank = block_size, batch_size, seed, rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.eot_id = eot_id if document_mask else None
        self.batches_drawn = 0

    def state_dict(self) -> dict:
        """The position (batches drawn) and the ranks it was drawn for (another number reads other windows)."""
        return {"batches_drawn": self.batches_drawn, "ranks": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.batches_drawn = int(state["batches_drawn"])

    def next_batch(self) -> Batch:
        """x, y: (B, T) int64, y the token after each of x's (x shifted by one in the data);
        doc_ids: (B, T) int32 document index within each row (see the module docstring), or None."""
        T = self.block_size
        rng = np.random.default_rng([self.seed, 0, self.batches_drawn])
        everyone = rng.integers(0, self.n_tokens - T, size=self.batch_size * self.world_size)  # window [s, s + T] fits
        starts = everyone[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        rows = torch.from_numpy(np.stack([self._window(s, T + 1) for s in starts]).astype(np.int64))  # (B, T + 1)
        self.batches_drawn += 1
        x, y = rows[:, :-1], rows[:, 1:]
        doc_ids = None if self.eot_id is None else document_ids(x, self.eot_id)
        return tuple(self._to_device(t) for t in (x, y, doc_ids))

    def _window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the cache; TokenCacheChanged when the file no longer holds them."""
        size = length * self.dtype.itemsize
        data = os.pread(self.file.fileno(), size, int(start) * self.dtype.itemsize)
        if len(data) < size:
            now = os.fstat(self.file.fileno()).st_size // self.dtype.itemsize
            raise TokenCacheChanged(f"the token cache {self.path} shrank while this run read it (from {self.n_tokens:,} "
                                    f"to {now:,} tokens): another process truncated or rewrote it")
        return np.frombuffer(data, dtype=self.dtype)

    def _to_device(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None or self.device.type == "cpu":
            return t
        return t.contiguous().pin_memory().to(self.device, non_blocking=True)


def document_ids(x: torch.Tensor, eot_id: int) -> torch.Tensor:
    """x: (B, T) token ids. Returns (B, T) int32: end-of-text tokens before each position, per row."""
    is_eot = (x == eot_id).to(torch.int32)
    return is_eot.cumsum(dim=1, dtype=torch.int32) - is_eot

