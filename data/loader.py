"""Batches of random windows from a token cache, reproducible from the seed and resumable.

Batch i of rank r is drawn from a generator seeded by (seed, r, i), so a run that resumes needs only
the number of batches drawn, and ranks draw independent streams.
"""
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch

from training.errors import UserError

Batch = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


class BatchLoader:
    def __init__(
        self,
        bin_path: Path,
        dtype: str,
        block_size: int,
        batch_size: int,
        seed: int,
        device: torch.device,
        rank: int = 0,
        eot_id: Optional[int] = None,
        document_mask: bool = False,
    ):
        self.tokens = np.memmap(bin_path, dtype=np.dtype(dtype), mode="r")
        if len(self.tokens) < block_size + 1:
            raise UserError(
                f"{bin_path} holds {len(self.tokens):,} tokens, fewer than model.block_size + 1 = {block_size + 1}; "
                "lower model.block_size or use a larger corpus (or a smaller data.val_fraction)"
            )
        if document_mask and eot_id is None:
            raise UserError("data.document_mask=true needs a tokenizer with an end-of-text token (data.tokenizer=gpt2)")
        self.block_size, self.batch_size, self.seed, self.rank = block_size, batch_size, seed, rank
        self.device = torch.device(device)
        self.eot_id = eot_id if document_mask else None
        self.batches_drawn = 0

    def state_dict(self) -> dict:
        return {"batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.batches_drawn = int(state["batches_drawn"])

    def _generator(self) -> torch.Generator:
        key = (self.seed * 1_000_003 + self.rank) * 1_000_003 + self.batches_drawn
        return torch.Generator().manual_seed(key % 2**63)

    def next_batch(self) -> Batch:
        """x, y: (B, T) int64, y = x shifted by one; doc_ids: (B, T) int32 or None.

        doc_ids[b, t] counts the end-of-text tokens before position t in the row: a document's own
        end-of-text token belongs to it, and the next document starts right after.
        """
        T = self.block_size
        starts = torch.randint(0, len(self.tokens) - T, (self.batch_size,), generator=self._generator())
        self.batches_drawn += 1
        rows = torch.from_numpy(np.stack([self.tokens[s:s + T + 1] for s in starts.tolist()]).astype(np.int64))
        x, y = rows[:, :-1], rows[:, 1:]
        doc_ids = None
        if self.eot_id is not None:
            is_eot = (x == self.eot_id).to(torch.int32)
            doc_ids = is_eot.cumsum(dim=1, dtype=torch.int32) - is_eot
        return tuple(self._to_device(t) for t in (x, y, doc_ids))

    def _to_device(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None or self.device.type == "cpu":
            return t
        return t.contiguous().pin_memory().to(self.device, non_blocking=True)
