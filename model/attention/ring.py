"""Ring attention: causal attention over a sequence sharded across the ranks of a process group.

Each of the N ranks holds the zigzag shard of q, k, v (model/attention/zigzag.py: chunks r and
2N-1-r of 2N). Forward, N steps: at step i rank r holds the key/value shard of rank s = r - i
(mod N). It first starts sending that shard to rank r+1 and receiving the next one from rank r-1
(``torch.distributed`` P2P), then attends to the shard in hand while the transfer runs, and merges
the block's output and log-sum-exp into its running result (online-softmax rescaling, in fp32).

Which part of a block is visible follows from the zigzag layout, so only step 0 needs a mask:

- s == r (step 0): both local chunks against both, causal;
- s < r: chunk s is before both local chunks and chunk 2N-1-s after both, so every local query
  sees the first half of the block in full and nothing of the second half;
- s > r: chunks s and 2N-1-s both lie between the local chunks r and 2N-1-r, so only the second
  local chunk's queries see the block, and they see all of it.

Backward, N steps again: the key/value shards travel the same way, each rank recomputes its block
with the saved output and log-sum-exp of the whole attention (``ring_steps``), adds the block's dq
to its own and its dk, dv to an fp32 accumulator that travels with the shard, one hop behind it.
After N hops each accumulator is back with the rank that owns those keys. Both transfers overlap
the next block's computation.

Saved for backward: q, k, v (the local shards), o (B, T/N, H, D) and lse (B, H, T/N) float32 --
O(T/N) per rank. In flight per rank: two key/value shards (the one in use, the one arriving), and
in the backward also two fp32 dk/dv accumulators.

With N = 1 (no group) there is no communication: one causal block, the backend's own attention.

``attend`` is the registry's face of the ring (model/attention/__init__.py, ``build_attention``
with a context group): a backend's ``attend`` signature, the backend's ring step inside, and no
graph for ``torch.compile`` (TorchDynamo does not trace P2P calls: it stops at ``P2POp``), so a
compiled model runs the ring eagerly between its compiled pieces.
"""
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from errors import UserError
from model.attention.ring_steps import StepAttention, accumulation_dtype

Tensor = torch.Tensor


def _visible_block(rank: int, source: int, half: int) -> Tuple[slice, slice, bool]:
    """(local query rows, key rows of the block, causal) of the block from rank ``source``."""
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


class _Hop:
    """One hop of the ring in flight: ``sent`` going to the next rank, ``received`` arriving from
    the previous one (``torch.distributed`` P2P). Holds ``sent`` until the transfer is done, and no
    longer: in the backward the accumulator sent on is freed before the next one is allocated."""

    def __init__(self, sent: Tensor, group: dist.ProcessGroup, rank: int, n: int):
        self.sent, self.received = sent, torch.empty_like(sent)
        to_next = dist.get_global_rank(group, (rank + 1) % n)
        from_previous = dist.get_global_rank(group, (rank - 1) % n)
        self.requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, self.sent, to_next, group),
                                                dist.P2POp(dist.irecv, self.received, from_previous, group)])

    def wait(self) -> Tensor:
        """Block until both transfers are done; the buffer that arrived."""
        for request in self.requests:
            request.wait()
        self.sent = None
        return self.received


def merge_block(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's partial attention into the running result, in place (exact).

    out: (B, T, H, D) and lse: (B, H, T) in the accumulation dtype; block_out, block_lse: the
    block's own softmax-normalised output and log-sum-exp over the same query rows. The merged
    lse is log(e^lse + e^block_lse); each output is weighted by its share of that sum.
    """
    merged = torch.logaddexp(lse, block_lse.to(lse.dtype))
    keep = torch.exp(lse - merged).transpose(1, 2).unsqueeze(-1)
    add = torch.exp(block_lse.to(lse.dtype) - merged).transpose(1, 2).unsqueeze(-1)
    out.mul_(keep).add_(block_out.to(out.dtype) * add)
    lse.copy_(merged)


class _RingAttention(torch.autograd.Function):
    """``ring_attention``'s forward and backward (the module docstring has the algorithm)."""

    @staticmethod
    def forward(ctx, q, k, v, group, step: StepAttention, scale: float):
        rank, n = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        if n == 1:
            out, lse = step.forward(q, k, v, True, scale)
        else:
            out, lse = _ring_forward(q, k, v, group, rank, n, step, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.rank, ctx.n, ctx.step, ctx.scale = group, rank, n, step, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        if ctx.n == 1:
            dq, dk, dv = ctx.step.backward(do, q, k, v, o, lse, True, ctx.scale)
        else:
            dq, dk, dv = _ring_backward(do, q, k, v, o, lse, ctx.group, ctx.rank, ctx.n, ctx.step, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _ring_forward(q, k, v, group, rank: int, n: int, step: StepAttention, scale: float):
    """The N steps of the forward. Returns out (B, T, H, D) and lse (B, H, T), accumulation dtype."""
    half, h_kv = q.shape[1] // 2, k.shape[2]
    kv = torch.cat([k, v], dim=2)  # (B, T, 2 H_kv, D): one message per step
    acc = accumulation_dtype(q.dtype)
    out = lse = None
    for i in range(n):
        hop = _Hop(kv, group, rank, n) if i + 1 < n else None  # the next shard, during this one's attention
        rows, keys, causal = _visible_block(rank, (rank - i) % n, half)
        block_out, block_lse = step.forward(q[:, rows], kv[:, keys, :h_kv], kv[:, keys, h_kv:], causal, scale)
        if i == 0:
            out, lse = block_out.to(acc), block_lse.to(acc)
        else:
            merge_block(out[:, rows], lse[:, :, rows], block_out, block_lse)
        if hop is not None:
            kv = hop.wait()
    return out, lse


def _ring_backward(do, q, k, v, o, lse, group, rank: int, n: int, step: StepAttention, scale: float):
    """The N steps of the backward. Returns dq (accumulation dtype) and this rank's dk, dv."""
    half, h_kv = q.shape[1] // 2, k.shape[2]
    kv = torch.cat([k, v], dim=2)
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # travels with the shard, one hop behind
    dkv_hop = None
    for i in range(n):
        hop = _Hop(kv, group, rank, n) if i + 1 < n else None
        rows, keys, causal = _visible_block(rank, (rank - i) % n, half)
        block_dq, block_dk, block_dv = step.backward(do[:, rows], q[:, rows], kv[:, keys, :h_kv],
                                                     kv[:, keys, h_kv:], o[:, rows], lse[:, :, rows], causal, scale)
        dq[:, rows] += block_dq
        if dkv_hop is not None:
            dkv = dkv_hop.wait()  # the accumulator of the shard in hand
        dkv[:, keys, :h_kv] += block_dk
        dkv[:, keys, h_kv:] += block_dv
        dkv_hop = _Hop(dkv, group, rank, n)
        if hop is not None:
            kv = hop.wait()
    dkv = dkv_hop.wait()  # the last hop brings this rank's own accumulator home
    return dq, dkv[:, :, :h_kv], dkv[:, :, h_kv:]


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup], step: StepAttention,
                   softmax_scale: Optional[float] = None) -> Tensor:
    """Causal attention of the whole sequence, computed from this rank's zigzag shard of it.

    q: (B, T/N, H, D); k, v: (B, T/N, H_kv, D), H % H_kv == 0 -- this rank's tokens in the zigzag
    layout (``zigzag_shard``) of a sequence of T tokens sharded over the N ranks of ``group``
    (None: N = 1, no communication). step: the backend's ring step (``model.attention.ring_step``).
    softmax_scale defaults to 1/sqrt(D). Returns o: (B, T/N, H, D) in q's dtype, the rows of the
    whole sequence's causal attention that belong to this rank's queries. Differentiable in q, k, v;
    every rank of the group must call it with the same shapes, in the same order.
    """
    n = dist.get_world_size(group) if group is not None else 1
    if n > 1 and q.shape[1] % 2 != 0:
        raise ValueError(f"ring attention needs an even number of tokens per rank (two zigzag chunks); "
                         f"got {q.shape[1]} of a sequence of {q.shape[1] * n} over {n} ranks")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _RingAttention.apply(q, k, v, group, step, float(scale))


@torch.compiler.disable
def attend(q: Tensor, k: Tensor, v: Tensor, doc_ids: Optional[Tensor] = None, dropout_p: float = 0.0, *,
           group: dist.ProcessGroup, step: StepAttention) -> Tensor:
    """``ring_attention`` with a backend's ``attend`` signature: q: (B, T/N, H, D), k, v: (B, T/N, H_kv, D),
    this rank's zigzag shard; returns o: (B, T/N, H, D). The ring has no document masks (doc_ids must be
    None) and no attention dropout: a call that asks for it fails."""
    if doc_ids is not None:
        raise ValueError("ring attention has no document masks; pass doc_ids=None")
    if dropout_p > 0:
        raise UserError(f"attention dropout (dropout_p={dropout_p}) does not run under context parallelism (ring "
                        "attention); set it to 0 or use trainer.context_parallel=1")
    return ring_attention(q, k, v, group, step)
