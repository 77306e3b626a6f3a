"""The replay of the flash kernels' launches (kernels/flash_attention/launch.py).

A replayed launch must be the launch Triton would make. The CPU tests hold the plan key against
every argument of our three launches (forward, dQ, dK/dV): each argument, changed in any way Triton
specialises on, changes the key, and the arguments the key is made from are all the kernel's
parameters. The GPU tests check that the binary each replayed launch runs is the one Triton's own
lookup returns for its arguments, over calls that differ in every specialised way, and that
replayed and plain launches give the same bits.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.flash_attention import backward, forward, launch  # noqa: E402
from kernels.flash_attention.dropout import draw_dropout_rng  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
TUNERS = (forward.FWD, backward.DQ, backward.DKDV)
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
sm90 = pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability()[0] == 9),
                          reason="needs an sm90 GPU (H100/H200)")


def _inputs(B=1, T=40, H=2, HKV=1, D=32, dtype=None, offset=0, seed=0):
    """q, k, v, do: (B, T, H|HKV, D) starting ``offset`` elements into their buffers."""
    dtype = dtype or (torch.bfloat16 if CUDA else torch.float32)
    gen = torch.Generator().manual_seed(seed)

    def randn(h):
        flat = torch.randn(B * T * h * D + offset, generator=gen).to(DEVICE, dtype)
        return flat[offset:].view(B, T, h, D)

    return randn(H), randn(HKV), randn(HKV), randn(H)


def _forward_backward(q, k, v, do, window=0, cu=None, longest=0, dropout=0.0, gate=None):
    """One forward and backward through the launch functions (the tuners pick the configs)."""
    rng = draw_dropout_rng(q.device) if dropout else None
    options = (q.shape[-1] ** -0.5, True, window, cu, longest)
    o, lse = forward.attn_fwd(q, k, v, *options, rng, dropout, gate)
    return o, lse, backward.attn_bwd(do, q, k, v, o, lse, *options, None, rng, dropout, gate)


def _launches(monkeypatch, call) -> list[tuple]:
    """(tuner, rows, grid_yz, tensors, values, cfg) of each tile-kernel launch ``call`` makes."""
    seen = []
    for tuner in TUNERS:
        def record(rows, grid_yz, tensors, values, cfg=None, tuner=tuner, launch=tuner.launch):
            seen.append((tuner, rows, grid_yz, tensors, values, cfg))
            return launch(rows, grid_yz, tensors, values, cfg)

        monkeypatch.setattr(tuner, "launch", record)
    call()
    return seen


def _compiled(jit):
    """The JIT function of a kernel (the interpreter's wraps it)."""
    from triton.runtime.jit import JITFunction

    return jit if isinstance(jit, JITFunction) else JITFunction(jit.fn)


def _changed(x):
    """Ways ``x`` can change that Triton specialises on (or that a key must tell apart)."""
    if isinstance(x, torch.Tensor):
        other = torch.float16 if x.dtype != torch.float16 else torch.float32
        misaligned = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
        return [x.to(other), misaligned, None]
    if x is None:
        return [torch.zeros(4, device=DEVICE)]
    if isinstance(x, bool):
        return [not x, int(x)]
    if isinstance(x, int):
        return [float(x), 1 if x != 1 else 2, x + 16, 2 ** 40]
    return [int(x), x + 0.5]


def test_the_plan_key_changes_with_every_argument_of_every_launch(monkeypatch):
    """For the forward, dQ and dK/dV launches of a gated, windowed call: the tensors and values
    handed to the launch are every parameter of the kernel but the tiles, and changing any one of
    them (its dtype, alignment or presence; an integer to 1, to another multiple of 16, past 32
    bits; a number's type; a flag) changes the plan key."""
    q, k, v, do = _inputs(T=40)
    gate = torch.zeros(1, 40, 2, device=DEVICE)
    launches = _launches(monkeypatch, lambda: _forward_backward(q, k, v, do, window=9, gate=gate))
    assert {entry[0].kind for entry in launches} == {"fwd", "dq", "dkdv"}
    for tuner, rows, grid_yz, tensors, values, cfg in launches:
        params = _compiled(tuner.jit).params
        assert len(tensors) + len(values) == len(params) - 2
        assert [p.name for p in params[-2:]] == ["BLOCK_M", "BLOCK_N"]
        where = (q.device, rows, grid_yz, cfg)
        key = launch.plan_key(0, where, tensors, values)
        assert launch.plan_key(0, where, tensors, values) == key
        for i, t in enumerate(tensors):
            for new in _changed(t):
                changed = tensors[:i] + (new,) + tensors[i + 1:]
                assert launch.plan_key(0, where, changed, values) != key, (tuner.kind, params[i].name)
        for i, x in enumerate(values):
            for new in _changed(x):
                changed = values[:i] + (new,) + values[i + 1:]
                assert launch.plan_key(0, where, tensors, changed) != key, (tuner.kind, params[len(tensors) + i].name)
        assert launch.plan_key(1, where, tensors, values) != key  # another current device


def test_the_plan_key_holds_what_triton_specialises_a_gluon_descriptor_on():
    """A Hopper launch's tensor descriptor is keyed by its dtype, tile and shared-memory layout, what
    Triton specialises it on; not by its tensor's address or sizes, which the launch passes at run time."""
    import dataclasses

    from kernels.flash_attention import hopper

    def key(desc):
        return launch.plan_key(0, (), (desc,), ())

    x = torch.zeros(2, 64, 4, 128, dtype=torch.bfloat16)
    desc = hopper.descriptor(x, 64)
    assert key(hopper.descriptor(torch.zeros(3, 200, 2, 128, dtype=torch.bfloat16), 64)) == key(desc)
    assert key(hopper.descriptor(x.half(), 64)) != key(desc)
    assert key(hopper.descriptor(x, 128)) != key(desc)
    other_layout = dataclasses.replace(desc.layout, swizzle_byte_width=64)
    assert key(dataclasses.replace(desc, layout=other_layout)) != key(desc)


def test_replay_is_off_under_the_interpreter_and_on_unread_tritons(monkeypatch):
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    jit = _compiled(forward.FWD.jit)
    assert not launch.replay_supported(InterpretedFunction(jit.fn))
    for version, supported in (("3.6.0", True), ("3.7.1", True), ("3.9.0", True), ("3.10.0", False),
                               ("4.0.0", False), ("3.5.1", False)):
        monkeypatch.setattr(triton, "__version__", version)
        assert launch.replay_supported(jit) == supported, version
    if not CUDA:
        assert not any(t.replay.on for t in TUNERS)


# A call of each kind Triton specialises apart: the dtype, a length that is or is not a multiple
# of 16, one query head per kv head (an integer argument equal to 1), pointers off 16 bytes, and the
# optional paths (window, dropout, packed documents, gate).
REPLAY_CASES = [
    pytest.param({}, {}, id="bf16"),
    pytest.param(dict(dtype=torch.float16), {}, id="fp16"),
    pytest.param(dict(T=48), {}, id="T48"),
    pytest.param(dict(HKV=2), {}, id="G1"),
    pytest.param(dict(offset=1), {}, id="misaligned"),
    pytest.param({}, dict(window=9, dropout=0.2), id="window-dropout"),
    pytest.param({}, dict(cu=[0, 15, 40], longest=25, gate=True), id="varlen-gate"),
]


def _run_case(shape: dict, options: dict, seed: int = 0):
    q, k, v, do = _inputs(**shape, seed=seed)
    options = dict(options)
    if options.get("cu"):
        options["cu"] = torch.tensor(options["cu"], dtype=torch.int32, device=DEVICE)
    torch.manual_seed(seed)  # the gate's draws and dropout's seed: the same for the same seed
    if options.pop("gate", False):
        options["gate"] = torch.nn.functional.logsigmoid(torch.randn(q.shape[:3], device=DEVICE) + 2.0)
    return _forward_backward(q, k, v, do, **options)


@gpu
@pytest.mark.parametrize("shape,options", REPLAY_CASES)
def test_every_replayed_binary_is_the_one_triton_looks_up_cuda(monkeypatch, shape, options):
    """The second call of a case (new tensors, the same kind) replays each of its three launches;
    the binary replayed is the one ``kernel.warmup`` (Triton's own binding and lookup) returns for
    that launch's arguments."""
    _run_case(shape, options)
    launches = _launches(monkeypatch, lambda: _run_case(shape, options, seed=1))
    assert len(launches) == 3
    for tuner, rows, grid_yz, tensors, values, cfg in launches:
        q = tensors[0]
        plan = tuner.replay.plans[tuner.replay.key((q.device, rows, grid_yz, cfg), tensors, values)]
        split = len(values) - len(tuner.constexpr_names)
        cfg = tuner.pick(q.device, q.dtype, rows, grid_yz, tensors + values[:split],
                         dict(zip(tuner.constexpr_names, values[split:])))
        looked_up = tuner.jit.warmup(*tensors, *values, grid=tuner.grid(cfg, rows, grid_yz), **cfg.options)
        assert plan.binary is looked_up, tuner.kind


@gpu
@pytest.mark.parametrize("shape,options", [REPLAY_CASES[0], REPLAY_CASES[4], REPLAY_CASES[6]])
def test_replayed_and_plain_launches_give_the_same_bits_cuda(monkeypatch, shape, options):
    _run_case(shape, options)
    replayed = _run_case(shape, options, seed=1)
    for tuner in TUNERS:
        monkeypatch.setattr(tuner.replay, "on", False)
    plain = _run_case(shape, options, seed=1)
    o, lse, grads = replayed
    o_p, lse_p, grads_p = plain
    assert torch.equal(o, o_p) and torch.equal(lse, lse_p)
    for a, b in zip(grads, grads_p):
        assert (a is None and b is None) or torch.equal(a, b)


@gpu
def test_a_tensor_subclass_records_no_plan_cuda():
    """A Parameter's hash is its identity, not what Triton specialises on: no plan is kept for it."""
    q, k, v, do = _inputs(T=56)
    before = len(forward.FWD.replay.plans)
    forward.attn_fwd(torch.nn.Parameter(q), k, v, 0.125, True)
    assert len(forward.FWD.replay.plans) == before
    forward.attn_fwd(q, k, v, 0.125, True)
    assert len(forward.FWD.replay.plans) == before + 1


def _hopper_launches(monkeypatch, call) -> list[tuple]:
    """(replay, grid, tensors, values, options) of each Hopper-kernel launch ``call`` makes."""
    from kernels.flash_attention import hopper

    seen = []
    for replay in (hopper.FWD, hopper.DKDV, hopper.DELTA, hopper.DQ_OUT):
        def record(grid, tensors, values, replay=replay, launch=replay.launch, **options):
            seen.append((replay, grid, tensors, values, options))
            return launch(grid, tensors, values, **options)

        monkeypatch.setattr(replay, "launch", record)
    call()
    return seen


def _hopper_case(D, H_kv, causal, dq_in_dkdv, seed):
    """o, lse and (dq, dk, dv) of the Hopper kernels at (2, 200, 4, D), D contiguous, GQA to H_kv heads."""
    from kernels.flash_attention import hopper

    q, k, v, do = _inputs(B=2, T=200, H=4, HKV=H_kv, D=D, seed=seed)
    o, lse = hopper.attn_fwd_sm90(q, k, v, D ** -0.5, causal)
    return o, lse, hopper.attn_bwd_sm90(do, q, k, v, o, lse, D ** -0.5, causal, dq_in_dkdv=dq_in_dkdv)


HOPPER_CASES = [pytest.param(128, 2, True, True, id="D128-gqa-causal-dq-in-dkdv"),
                pytest.param(64, 4, False, False, id="D64-full-dq-tl")]


@sm90
@pytest.mark.parametrize("D,H_kv,causal,dq_in_dkdv", HOPPER_CASES)
def test_every_replayed_hopper_binary_is_the_one_triton_looks_up_cuda(monkeypatch, D, H_kv, causal, dq_in_dkdv):
    """The second call (new tensors, the same kind) replays each Hopper launch, descriptors included; the
    binary replayed is the one ``kernel.warmup`` returns for that launch's arguments."""
    _hopper_case(D, H_kv, causal, dq_in_dkdv, seed=0)
    launches = _hopper_launches(monkeypatch, lambda: _hopper_case(D, H_kv, causal, dq_in_dkdv, seed=1))
    assert len(launches) == (4 if dq_in_dkdv else 2)
    for replay, grid, tensors, values, options in launches:
        plan = replay.plans[replay.key((grid, *options.items()), tensors, values)]
        assert plan.binary is replay.jit.warmup(*tensors, *values, grid=grid, **options), replay.jit.fn.__name__


@sm90
@pytest.mark.parametrize("D,H_kv,causal,dq_in_dkdv", HOPPER_CASES)
def test_replayed_and_plain_hopper_launches_give_the_same_bits_cuda(monkeypatch, D, H_kv, causal, dq_in_dkdv):
    """o, lse, dk, dv bit for bit; dq too where the tl kernel writes it (added by TMA, its last bit varies)."""
    from kernels.flash_attention import hopper

    _hopper_case(D, H_kv, causal, dq_in_dkdv, seed=0)
    o, lse, (dq, dk, dv) = _hopper_case(D, H_kv, causal, dq_in_dkdv, seed=1)
    for replay in (hopper.FWD, hopper.DKDV, hopper.DELTA, hopper.DQ_OUT):
        monkeypatch.setattr(replay, "on", False)
    o_p, lse_p, (dq_p, dk_p, dv_p) = _hopper_case(D, H_kv, causal, dq_in_dkdv, seed=1)
    assert torch.equal(o, o_p) and torch.equal(lse, lse_p) and torch.equal(dk, dk_p) and torch.equal(dv, dv_p)
    if dq_in_dkdv:
        torch.testing.assert_close(dq, dq_p, atol=1e-3, rtol=0)
    else:
        assert torch.equal(dq, dq_p)
