"""Tests of the flash-decoding kernel (kernels/flash_decoding) against reference.py.

Ground truth is the float64 reference. The tolerance comes from the reference run in the inputs'
own precision, as in test_flash_kernel.py: the kernel's max error in o and lse must be at most
``FACTOR`` times that reference's max error, plus a small atol.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set below before
Triton is imported) on a few small fp32/fp16 cases (bf16 ``tl.dot`` is wrong in the interpreter).
The full matrix, bf16 and CUDA-graph replay run only on a GPU.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from kernels.flash_decoding import DecodeConfig, decode_config, decode_ref, flash_decode  # noqa: E402
from kernels.flash_decoding import kernel as decode_kernel  # noqa: E402
from kernels.flash_decoding import launch  # noqa: E402
from kernels.gpu import GpuResources, resources_of  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
FACTOR = 2.0
ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}
DT_NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

if not CUDA and type(decode_kernel._decode_split_kernel).__name__ != "InterpretedFunction":
    pytest.skip("kernels were imported before TRITON_INTERPRET=1 was set (no CUDA here); run this module on its "
                "own or export TRITON_INTERPRET=1", allow_module_level=True)

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@dataclasses.dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...]  # each sequence's length (new queries included); B = len(lengths)
    Tq: int  # new queries
    H: int
    HKV: int
    D: int
    dtype: torch.dtype
    capacity: int = 0  # the cache's T_max; 0: the longest length
    window: int | None = None
    gate: bool = False  # c: the running sum of log forget gates, float64
    splits: int | None = None  # None: the heuristic's

    @property
    def id(self) -> str:
        s = f"L{'_'.join(map(str, self.lengths))}-Tq{self.Tq}-H{self.H}-HKV{self.HKV}-D{self.D}-{DT_NAME[self.dtype]}"
        if self.capacity:
            s += f"-cap{self.capacity}"
        if self.window is not None:
            s += f"-W{self.window}"
        if self.gate:
            s += "-gate"
        if self.splits is not None:
            s += f"-S{self.splits}"
        return s


def make_inputs(c: Case, seed: int = 0):
    """q (B, Tq, H, D); k, v caches (B, T_max, H_kv, D); lengths (B,) int32; c (B, T_max, H) or None."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(c.lengths), c.capacity or max(c.lengths)
    q = torch.randn(B, c.Tq, c.H, c.D, generator=g).to(DEVICE, c.dtype)
    k = torch.randn(B, T, c.HKV, c.D, generator=g).to(DEVICE, c.dtype)
    v = torch.randn(B, T, c.HKV, c.D, generator=g).to(DEVICE, c.dtype)
    lengths = torch.tensor(c.lengths, dtype=torch.int32, device=DEVICE)
    gates = torch.nn.functional.logsigmoid(torch.randn(B, T, c.H, generator=g, dtype=torch.float64) + 2.0)
    return q, k, v, lengths, gates.cumsum(1).to(DEVICE) if c.gate else None


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def check_case(c: Case) -> None:
    q, k, v, lengths, gate = make_inputs(c)
    kw = dict(window_size=c.window, gate_cache=gate)
    o, lse = flash_decode(q, k, v, lengths, num_splits=c.splits, return_lse=True, **kw)
    assert o.dtype == c.dtype and o.shape == q.shape and lse.dtype == torch.float32
    assert lse.shape == (len(c.lengths), c.H, c.Tq)
    o64, lse64 = decode_ref(q, k, v, lengths, **kw)
    olp, lselp = decode_ref(q, k, v, lengths, compute_dtype=None, **kw)
    failures = []
    for name, out, truth, lowp in (("o", o, o64, olp), ("lse", lse, lse64, lselp)):
        err, base = max_err(out, truth), max_err(lowp, truth)
        if not torch.isfinite(out).all() or err > FACTOR * base + ATOL[c.dtype]:
            failures.append(f"{name}: max err {err:.3e} > {FACTOR} x {base:.3e} + {ATOL[c.dtype]}")
    assert not failures, f"{c.id}: " + "; ".join(failures)


# ---------------------------------------------------------------------------------------------
# CPU (interpreter) subset: fp32 / fp16, caches up to 200. Also runs on CUDA.
CPU_CASES = [
    Case((1,), 1, 2, 2, 32, F32),  # a cache of one row: the query sees only itself
    Case((200, 37), 1, 4, 2, 64, F16, splits=3),  # per-sequence lengths; the short one leaves splits empty
    Case((130,), 1, 8, 1, 32, F32, splits=4),  # G = 8 query heads on one KV head
    Case((150, 63), 5, 4, 2, 80, F32, capacity=200, splits=2),  # causal among 5 new queries; odd D
    Case((120,), 16, 2, 1, 32, F16, splits=2),  # the most new queries: 32 rows in one program
    Case((190, 100), 3, 2, 2, 32, F32, window=50, splits=3),  # window: the early keys are skipped
    Case((200,), 4, 4, 2, 48, F16, gate=True, splits=5),
    Case((177, 9), 2, 4, 4, 32, F32, window=20, gate=True),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CPU_CASES])
def test_flash_decode_matches_reference(case):
    check_case(case)


def test_flash_decode_compiles_without_a_graph_break():
    """The op's fake shapes the traced graph (fullgraph=True), and the compiled call equals the eager one."""
    c = Case((40, 17), 2, 4, 2, 32, F32, gate=True)
    q, k, v, lengths, gate = make_inputs(c)

    def decode(q, k, v, lengths, gate):
        return flash_decode(q, k, v, lengths, gate_cache=gate, num_splits=2) * 2.0

    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, lengths, gate), decode(q, k, v, lengths, gate))


@pytest.mark.parametrize("change, message", [
    (dict(q_shape=(2, 17, 4, 32)), "1 to 16 new queries"),
    (dict(q_shape=(2, 1, 3, 32)), "multiple of the cache's heads"),
    (dict(lengths_dtype=torch.int64), "int32"),
    (dict(gate_dtype=torch.float32), "float64"),
    (dict(window=0), "window_size"),
], ids=["queries", "heads", "lengths", "gate", "window"])
def test_flash_decode_rejects_bad_inputs_in_one_line(change, message):
    q = torch.zeros(change.get("q_shape", (2, 1, 4, 32)), device=DEVICE)
    k = v = torch.zeros(2, 8, 2, 32, device=DEVICE)
    lengths = torch.ones(2, dtype=change.get("lengths_dtype", torch.int32), device=DEVICE)
    gate = torch.zeros(2, 8, q.shape[2], dtype=change.get("gate_dtype", torch.float64), device=DEVICE)
    with pytest.raises(ValueError, match=message):
        flash_decode(q, k, v, lengths, gate_cache=gate, window_size=change.get("window"))


H100_LIKE = GpuResources(132, 232448, 3.35e12)  # SMs, shared memory per program, HBM bytes/s
H200_LIKE = GpuResources(132, 232448, 4.81e12)
CONSUMER = GpuResources(128, 101376, 1.008e12)  # an RTX 4090


@pytest.mark.parametrize("gpu, batch, kv_heads, capacity, head_dim, expected", [
    pytest.param(H100_LIKE, 1, 12, 32768, 64, DecodeConfig(22, 64, 4, 3), id="gpt2-B1-32k"),  # 2 per SM in flight
    pytest.param(H100_LIKE, 2, 12, 32768, 64, DecodeConfig(11, 64, 4, 3), id="gpt2-B2-32k"),  # 264 programs
    pytest.param(H100_LIKE, 4, 12, 32768, 64, DecodeConfig(5, 64, 4, 3), id="gpt2-B4-32k"),  # 240: balanced enough
    pytest.param(H100_LIKE, 8, 12, 32768, 64, DecodeConfig(4, 128, 4, 2), id="gpt2-B8-32k"),  # 2 splits: 192, uneven
    pytest.param(H100_LIKE, 32, 12, 32768, 64, DecodeConfig(1, 128, 4, 2), id="gpt2-B32-32k"),  # 384 pairs: no split
    pytest.param(H100_LIKE, 1, 12, 1024, 64, DecodeConfig(16, 64, 4, 3), id="gpt2-B1-1k"),  # a step of keys a split
    pytest.param(H100_LIKE, 1, 8, 32768, 128, DecodeConfig(16, 64, 2, 3), id="gqa-B1-32k"),  # 1 per SM in flight; 2 warps
    pytest.param(H100_LIKE, 8, 8, 32768, 128, DecodeConfig(2, 64, 2, 3), id="gqa-B8-32k"),
    pytest.param(H200_LIKE, 1, 12, 32768, 64, DecodeConfig(33, 64, 4, 3), id="h200-gpt2-B1-32k"),  # 1.5x the bandwidth: 3 per SM
    pytest.param(H200_LIKE, 32, 12, 32768, 64, DecodeConfig(1, 64, 4, 3), id="h200-gpt2-B32-32k"),  # all needed
    pytest.param(H200_LIKE, 1, 8, 32768, 128, DecodeConfig(33, 64, 2, 3), id="h200-gqa-B1-32k"),
    pytest.param(H200_LIKE, 16, 8, 32768, 128, DecodeConfig(1, 128, 4, 3), id="h200-gqa-B16-32k"),  # 128 pairs: one wide each
    pytest.param(H100_LIKE, 15, 8, 32768, 128, DecodeConfig(1, 128, 4, 3), id="gqa-B15-32k"),  # 120 pairs: balanced enough
    pytest.param(H200_LIKE, 12, 8, 32768, 128, DecodeConfig(2, 64, 2, 3), id="h200-gqa-B12-32k"),  # 96 pairs: uneven
    pytest.param(H200_LIKE, 11, 12, 32768, 64, DecodeConfig(3, 64, 4, 3), id="h200-gpt2-B11-32k"),  # D = 64: split
    pytest.param(H100_LIKE, 1, 1, 65536, 256, DecodeConfig(128, 32, 4, 3), id="one-head-D256"),  # the most splits
    pytest.param(CONSUMER, 1, 12, 32768, 64, DecodeConfig(10, 64, 4, 3), id="consumer-gpt2-B1-32k"),  # 1 TB/s: 1 per SM
    pytest.param(CONSUMER, 8, 12, 32768, 64, DecodeConfig(2, 64, 4, 3), id="consumer-gpt2-B8-32k"),  # 2 long don't fit
])
def test_the_launch_follows_the_shapes_and_the_gpu(monkeypatch, gpu, batch, kv_heads, capacity, head_dim, expected):
    """Programs per SM keep the GPU's share of bandwidth in flight, more where they would share the SMs
    unevenly, in 128-key steps past what the bandwidth needs (D <= 64); each split at least one step
    of keys, at most 128; two warps at D = 128, and one split of 128-key steps on four warps where the
    pairs fill the SMs; the splits given are kept."""
    monkeypatch.setattr(launch, "gpu_resources", lambda device: gpu)
    cuda = torch.device("cuda")
    assert decode_config(batch, kv_heads, capacity, head_dim, 2, cuda) == expected
    assert decode_config(batch, kv_heads, capacity, head_dim, 2, cuda, num_splits=3).num_splits == 3


def test_the_gpu_bandwidth_comes_from_its_memory_clock_and_bus():
    """An H100 SXM reports a 2619 MHz clock on a 5120-bit bus: 3.35 TB/s at double data rate."""
    props = {"multiprocessor_count": 132, "max_shared_mem": 232448, "mem_clock_rate": 2619000, "mem_bus_width": 5120}
    assert resources_of(props) == GpuResources(132, 232448, pytest.approx(3.352e12, rel=1e-3))


# ---------------------------------------------------------------------------------------------
# Full matrix: CUDA only.
def _cuda_cases() -> list[Case]:
    cases = []
    for length in (1, 17, 64, 200, 1000, 4097, 32768):
        for D, dt in ((64, BF16), (128, F16), (80, BF16), (256, F16)):
            cases.append(Case((length, max(1, length // 3)), 1, 8, 2, D, dt))
    for H, HKV in ((1, 1), (4, 4), (8, 1), (32, 8), (12, 12)):
        cases.append(Case((3000, 5, 1500), 1, H, HKV, 64, BF16))
    for Tq in (2, 7, 16):
        cases.append(Case((1000, Tq, 300), Tq, 8, 2, 64, BF16))
        cases.append(Case((1000, 300), Tq, 32, 8, 128, F16, window=256))
    for W in (1, 16, 1000):
        cases.append(Case((5000, 800), 1, 8, 2, 64, BF16, window=W))
    for splits in (1, 2, 7, 64, 128):
        cases.append(Case((5000, 33), 1, 8, 2, 64, BF16, splits=splits))
    cases += [Case((4000, 1000), 1, 8, 2, 64, BF16, gate=True),
              Case((4000, 1000), 4, 8, 8, 128, F16, gate=True, window=300),
              Case((20000,), 1, 12, 12, 64, BF16, gate=True),
              Case((1000, 100), 1, 8, 2, 64, F32),
              Case((1000, 100), 3, 8, 2, 128, F32, gate=True),
              Case((700, 2), 1, 8, 2, 64, BF16, capacity=2048),
              Case(tuple(range(100, 4100, 250)), 1, 32, 8, 128, BF16)]  # 128 pairs: one wide program each
    return cases


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in _cuda_cases()])
def test_flash_decode_matches_reference_cuda(case):
    check_case(case)


@gpu
@pytest.mark.gpu
def test_a_captured_decode_replays_at_every_length():
    """One CUDA graph, captured at one length, replays correctly as the lengths grow (they stay on the device)."""
    c = Case((300, 40), 1, 8, 2, 64, BF16, capacity=1024, gate=True)
    q, k, v, lengths, gate = make_inputs(c)
    flash_decode(q, k, v, lengths, gate_cache=gate)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = flash_decode(q, k, v, lengths, gate_cache=gate)
    for step in (1, 200, 700):
        lengths.copy_(torch.tensor([300 + step, 40 + step], dtype=torch.int32))
        graph.replay()
        assert torch.equal(o, flash_decode(q, k, v, lengths, gate_cache=gate)), step


def test_triton_key_is_computed_on_a_background_thread():
    """kernels/triton_start.py: the thread fills triton_key's per-process cache, so the first launch hits it
    (the driver it also builds needs a GPU: sample.py's timings show it there)."""
    from triton.runtime.cache import triton_key

    from kernels.triton_start import start_triton_setup

    triton_key.cache_clear()
    thread = start_triton_setup()
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert triton_key.cache_info().currsize == 1
    key = triton_key()
    assert triton_key.cache_info().hits == 1 and key
