"""Ring attention (context parallelism): the zigzag layout, each backend's ring step, and the ring.

- The zigzag helpers, as pure functions.
- Each backend's ring step against a float64 masked attention over the block shapes the ring
  uses, merged by log-sum-exp, with the backward fed the merged output and lse. Tolerance: a
  multiple of the error of the same attention computed in the inputs' own precision (as in
  test_flash_kernel.py). On CPU: naive and sdpa in fp64/fp32, flash in fp32 under Triton's
  interpreter; on a GPU: all three in bf16/fp32.
- The ring over 2 and 4 gloo processes against one process on the whole sequence (outputs and
  dq, dk, dv; 1e-5 in fp32, 1e-12 in fp64). One spawn of 4 processes serves the whole module.
"""
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from conftest import device_for, emulated
from errors import UserError
from gloo import on_gloo_ranks
from model.attention import BACKENDS, ring_backends, ring_step, sdpa
from model.attention.ring import merge_block, ring_attention
from model.attention.ring_steps import accumulation_dtype
from model.attention.zigzag import zigzag_positions, zigzag_shard, zigzag_unshard

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
DT_NAME = {F64: "fp64", F32: "fp32", BF16: "bf16"}


# ---------------------------------------------------------------------------------------------
# The zigzag layout

def test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r():
    assert zigzag_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(16, 1, 4).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_unshard_inverts_shard_and_positions_follow_the_tokens(n):
    x = torch.randn(2, 24, 3, 5)
    shards = [zigzag_shard(x, r, n) for r in range(n)]
    assert torch.equal(zigzag_unshard(shards), x)
    for r, shard in enumerate(shards):
        assert torch.equal(shard, x[:, zigzag_positions(24, r, n)])


def test_one_rank_holds_the_whole_sequence_of_any_length():
    x = torch.randn(1, 7, 2)
    assert zigzag_shard(x, 0, 1) is x
    assert zigzag_positions(7, 0, 1).tolist() == list(range(7))


def test_a_length_not_divisible_by_2n_says_so():
    with pytest.raises(ValueError, match=r"over 4 ranks cuts each sequence into 8 equal chunks, but T=20 is "
                                         r"not divisible by 8"):
        zigzag_shard(torch.zeros(1, 20), 0, 4)


@pytest.mark.parametrize("backend", [name for name, row in BACKENDS.items() if row.ring_step is None])
def test_a_backend_without_a_ring_step_names_those_with_one(backend):
    able = ring_backends()
    assert able and all(BACKENDS[name].ring_step for name in able)
    with pytest.raises(UserError, match=rf"^attention={backend} does not run under context parallelism \(ring "
                                        rf"attention\); use attention={', '.join(able[:-1])} or {able[-1]}$"):
        ring_step(backend)


# ---------------------------------------------------------------------------------------------
# One ring step per backend

# The block shapes of a ring step: queries against one key block or more, each seen in full or
# causally (causal blocks are square and sit at the end of the key range). ``c`` is a chunk.
LAYOUTS = {
    "causal": (2, [(2, True)]),              # step 0: both local chunks, causal
    "before+causal": (1, [(1, False), (1, True)]),
    "q2x": (2, [(1, False), (1, False)]),    # a rank below: every query, the first chunk
    "k2x": (1, [(2, False), (2, False)]),    # a rank above: the second chunk's queries, both chunks
}
FWD_FACTOR, BWD_FACTOR = 2.0, 3.0
ATOL = {F64: 1e-12, F32: 1e-5, BF16: 1e-3}


def masked_attention(q, k, v, mask, dtype):
    """softmax(q k^T / sqrt(D), where mask) v with matmuls in ``dtype`` and the softmax in at least
    fp32. q: (B, Tq, H, D); k, v: (B, Tk, H_kv, D); mask: (Tq, Tk). Returns o (B, Tq, H, D), lse (B, H, Tq)."""
    groups = q.shape[2] // k.shape[2]
    qh = q.to(dtype).transpose(1, 2)
    kh, vh = (x.to(dtype).transpose(1, 2).repeat_interleave(groups, dim=1) for x in (k, v))
    scores = (qh @ kh.transpose(-1, -2)).to(accumulation_dtype(dtype)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    o = torch.softmax(scores, dim=-1).to(dtype) @ vh
    return o.transpose(1, 2), torch.logsumexp(scores, dim=-1)


def layout_mask(q_len, pieces, device):
    return torch.cat([torch.ones(q_len, t, dtype=torch.bool, device=device).tril() if causal else
                      torch.ones(q_len, t, dtype=torch.bool, device=device) for t, causal in pieces], dim=1)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def check_step(backend, dtype, device, layout, B=2, c=8, H=4, HKV=2, D=16):
    """The step's blocks merged = the attention over all of them; their backwards (with the merged
    o and lse) add up to its gradients."""
    step = ring_step(backend)
    q_chunks, key_chunks = LAYOUTS[layout]
    pieces = [(n * c, causal) for n, causal in key_chunks]
    g = torch.Generator().manual_seed(0)
    tq, tk = q_chunks * c, sum(t for t, _ in pieces)
    q, do = (torch.randn(B, tq, H, D, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(B, tk, HKV, D, generator=g).to(device, dtype) for _ in range(2))
    mask, scale = layout_mask(tq, pieces, device), D ** -0.5

    def reference(compute_dtype):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, lse = masked_attention(*leaves, mask, compute_dtype)
        return o, lse, torch.autograd.grad(o, leaves, do.to(o.dtype))

    truth, lowp = reference(F64), reference(dtype)

    starts = [sum(t for t, _ in pieces[:i]) for i in range(len(pieces))]
    blocks = [(k[:, s:s + t], v[:, s:s + t], causal) for s, (t, causal) in zip(starts, pieces)]
    acc = accumulation_dtype(dtype)
    out = lse = None
    for kb, vb, causal in blocks:
        block_out, block_lse = step.forward(q, kb, vb, causal, scale)
        if out is None:
            out, lse = block_out.to(acc), block_lse.to(acc)
        else:
            merge_block(out, lse, block_out, block_lse)
    o = out.to(dtype)
    grads = [step.backward(do, q, kb, vb, o, lse, causal, scale) for kb, vb, causal in blocks]
    dq = sum(gr[0].double() for gr in grads)
    dk, dv = (torch.cat([gr[i] for gr in grads], dim=1) for i in (1, 2))

    failures = []
    for name, got, want, base, factor in (("o", o, truth[0], lowp[0], FWD_FACTOR),
                                          ("lse", lse, truth[1], lowp[1], FWD_FACTOR),
                                          ("dq", dq, truth[2][0], lowp[2][0], BWD_FACTOR),
                                          ("dk", dk, truth[2][1], lowp[2][1], BWD_FACTOR),
                                          ("dv", dv, truth[2][2], lowp[2][2], BWD_FACTOR)):
        assert got.shape == want.shape, name
        err, bound = max_err(got, want), factor * max_err(base, want) + ATOL[dtype]
        if not err <= bound:
            failures.append(f"{name}: max err {err:.3e} > {bound:.3e}")
    assert not failures, f"{backend} {DT_NAME[dtype]} {layout}: " + "; ".join(failures)


# Every ring backend that runs on the CPU here: fp64 and fp32, or fp32 only emulated (flash under
# the interpreter conftest.py sets up, when there is no GPU).
CPU_STEPS = [(name, dtype) for name in ring_backends() if device_for(name) == "cpu"
             for dtype in ((F32,) if emulated(name) else (F64, F32))]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend,dtype", [pytest.param(b, d, id=f"{b}-{DT_NAME[d]}") for b, d in CPU_STEPS])
def test_ring_step_blocks_add_up_to_the_attention_over_all_keys(backend, dtype, layout):
    check_step(backend, dtype, "cpu", layout)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [BF16, F32], ids=DT_NAME.get)
@pytest.mark.parametrize("backend", ring_backends())
def test_ring_step_blocks_add_up_to_the_attention_over_all_keys_cuda(backend, dtype, layout):
    check_step(backend, dtype, "cuda", layout, c=128, D=64)


@pytest.mark.parametrize("backend", [name for name in ring_backends() if not emulated(name) and device_for(name) == "cpu"])
def test_a_ring_of_one_is_plain_causal_attention(backend):
    g = torch.Generator().manual_seed(1)
    q, do = torch.randn(2, 9, 4, 6, generator=g, dtype=F64), torch.randn(2, 9, 4, 6, generator=g, dtype=F64)
    k, v = (torch.randn(2, 9, 2, 6, generator=g, dtype=F64) for _ in range(2))
    results = []
    for attend in (lambda *x: ring_attention(*x, None, ring_step(backend)), sdpa.attend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = attend(*leaves)
        results.append((o, *torch.autograd.grad(o, leaves, do)))
    for got, want in zip(*results):
        assert max_err(got, want) < 1e-12


@gpu
@pytest.mark.gpu
def test_a_ring_of_one_with_flash_is_the_kernel_bit_for_bit_cuda():
    from kernels import flash_attn

    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(2, 1024, 8, 64, device="cuda", generator=g, dtype=BF16) for _ in range(2))
    k, v = (torch.randn(2, 1024, 2, 64, device="cuda", generator=g, dtype=BF16) for _ in range(2))
    results = []
    for attend in (lambda *x: ring_attention(*x, None, ring_step("flash")), flash_attn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = attend(*leaves)
        results.append((o, *torch.autograd.grad(o, leaves, do)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# The ring over gloo processes

@dataclasses.dataclass(frozen=True)
class RingCase:
    ranks: int
    backend: str
    dtype: torch.dtype
    B: int
    T: int
    H: int
    HKV: int
    D: int

    @property
    def id(self) -> str:
        return (f"N{self.ranks}-{self.backend}-B{self.B}-T{self.T}-H{self.H}-HKV{self.HKV}-D{self.D}-"
                f"{DT_NAME[self.dtype]}")


WORLD = 4
RING_CASES = [
    RingCase(2, "naive", F64, 2, 16, 4, 2, 8),   # GQA
    RingCase(4, "naive", F64, 2, 16, 4, 2, 8),
    RingCase(4, "naive", F32, 1, 24, 2, 2, 5),   # ragged head dim
    RingCase(2, "sdpa", F32, 2, 16, 4, 1, 12),   # one key/value head
    RingCase(4, "sdpa", F64, 1, 32, 4, 2, 8),
]
if not CUDA:
    RING_CASES.append(RingCase(2, "flash", F32, 2, 16, 2, 1, 16))
RING_ATOL = {F64: 1e-12, F32: 1e-5}


def _gather_sequence(x, group, n):
    """The whole sequence from every rank's zigzag shard (all_gather + zigzag_unshard)."""
    shards = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return zigzag_unshard(shards)


def _ring_errors(case, group, rank):
    """Max errors of the ring's o, dq, dk, dv (gathered) against one process on the whole sequence."""
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(case.B, case.T, case.H, case.D, generator=g, dtype=case.dtype) for _ in range(2))
    k, v = (torch.randn(case.B, case.T, case.HKV, case.D, generator=g, dtype=case.dtype) for _ in range(2))
    step = ring_step(case.backend)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    o = ring_attention(*whole, None, step)
    one_process = (o, *torch.autograd.grad(o, whole, do))
    shards = [zigzag_shard(t, rank, case.ranks).requires_grad_() for t in (q, k, v)]
    o = ring_attention(*shards, group, step)
    ring = (o, *torch.autograd.grad(o, shards, zigzag_shard(do, rank, case.ranks)))
    return {name: max_err(_gather_sequence(got, group, case.ranks), want)
            for name, got, want in zip(("o", "dq", "dk", "dv"), ring, one_process)}


def _odd_shard_error(group):
    x = torch.zeros(1, 5, 2, 4)
    try:
        ring_attention(x, x, x, group, ring_step("naive"))
    except ValueError as err:
        return str(err)
    return "no error"


def _ring_results(rank, world):
    groups = {world: dist.group.WORLD, 2: dist.new_group([0, 1])}
    results = {case.id: _ring_errors(case, groups[case.ranks], rank) for case in RING_CASES if rank < case.ranks}
    if rank < 2:
        results["odd"] = _odd_shard_error(groups[2])
    return results


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    return on_gloo_ranks(_ring_results, WORLD, tmp_path_factory.mktemp("ring"))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in RING_CASES])
def test_the_ring_over_ranks_equals_one_process_on_the_whole_sequence(ring_results, case):
    errors = ring_results[case.id]
    assert all(e <= RING_ATOL[case.dtype] for e in errors.values()), errors


def test_an_odd_number_of_tokens_per_rank_says_what_the_ring_needs(ring_results):
    assert ring_results["odd"] == ("ring attention needs an even number of tokens per rank (two zigzag "
                                   "chunks); got 5 of a sequence of 10 over 2 ranks")
