"""Context parallelism (``trainer.context_parallel=N``): each sequence is sharded over N ranks.

    torchrun --nproc_per_node=2 train.py trainer.distributed=ddp trainer.context_parallel=2 ...

The world is a (data parallel x context parallel) mesh (training/distributed.py): the N ranks of a
context group read the same batch, and each keeps its zigzag shard of every sequence (tokens of
chunks r and 2N-1-r of 2N, model/attention/zigzag.py) with the real positions of those tokens, so
learned position embeddings and RoPE see what one process would. Attention runs as ring attention
over the group (model/attention/ring.py); everything else is per token and needs no communication.
Each rank's loss is the mean over its T/N tokens of each sequence; the loss reported is the mean
over all ranks, and DDP/FSDP average the weight gradients over all of them too (dp x cp), which is
the gradient of the mean over every token of the global batch.

``check_options`` refuses, when the config is checked, what the ring cannot run.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from errors import UserError, check_positive
from model.attention import ring_step
from model.attention.zigzag import zigzag_positions, zigzag_shard


@dataclass(frozen=True)
class SequenceShard:
    """The tokens of each sequence this rank trains on: all of them (size 1), or its zigzag shard as
    rank ``rank`` of the ``size`` ranks of its context group."""

    rank: int = 0
    size: int = 1

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """x, y: (B, T) -> this rank's (B, T / size) of each, and their positions (T / size,) int64;
        (x, y, None) when the rank holds whole sequences."""
        if self.size == 1:
            return x, y, None
        positions = zigzag_positions(x.shape[1], self.rank, self.size, x.device)
        return zigzag_shard(x, self.rank, self.size), zigzag_shard(y, self.rank, self.size), positions


def check_options(cfg) -> None:
    """The combinations ``trainer.context_parallel`` cannot run with, each refused in one line (cfg: TrainConfig)."""
    n = cfg.trainer.context_parallel
    check_positive("trainer.context_parallel", n, kind="integer")
    if n == 1:
        return
    cp = f"trainer.context_parallel={n}"
    if cfg.trainer.distributed == "none":
        raise UserError(f"{cp} runs under torchrun with trainer.distributed=ddp or fsdp: torchrun "
                        f"--nproc_per_node={n} train.py trainer.distributed=ddp {cp} ...")
    try:
        ring_step(cfg.attention.name)
    except UserError as err:
        raise UserError(f"{err} (or trainer.context_parallel=1)") from err
    if cfg.attention.window is not None:
        raise UserError(f"attention.window={cfg.attention.window} does not run under {cp} (ring attention is "
                        "plain causal); drop attention.window or use trainer.context_parallel=1")
    if cfg.model.attention_dropout_p > 0:
        raise UserError(f"attention dropout ({cfg.model.attention_dropout_p:g}) does not run under {cp} (ring attention "
                        "has no dropout yet); set model.attention_dropout=0 (model.dropout keeps the rest) or use "
                        "trainer.context_parallel=1")
    if cfg.model.gate != "none":
        raise UserError(f"model.gate={cfg.model.gate} does not run under {cp} (ring attention has no forget gate "
                        "yet); set model.gate=none or use trainer.context_parallel=1")
    if cfg.data.document_mask:
        raise UserError(f"data.document_mask=true does not run under {cp} (ring attention has no document "
                        "boundaries yet); set data.document_mask=false or use trainer.context_parallel=1")
    T, chunks = cfg.model.block_size, 2 * n
    if T % chunks:
        raise UserError(f"model.block_size={T} is not divisible by {chunks} (2 x {cp}: each sequence is cut into "
                        f"{chunks} equal chunks); use model.block_size={max(chunks, T // chunks * chunks)}")
    if cfg.trainer.batch_size == "auto":
        raise UserError(f"trainer.batch_size=auto measures one process and does not run under {cp}; give a number "
                        "(batch 1 for the longest sequences)")
