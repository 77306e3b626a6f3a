"""Choosing the flash kernels' configs: the short lists per (GPU family, dtype, D), the tuning of
the few that have more than one candidate, the picks kept on disk between processes, and the
console notices of a long tune or compilation.

The CPU tests drive ``launch.Launcher`` with stand-ins: a kernel whose "compiled binary" records
its launches, a tuner that records what it was asked to time, and a fake H100. The GPU tests run
the real kernels with the consumer-card configs forced, and a real tune read back from disk.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.flash_attention import configs, launch, tune_cache  # noqa: E402
from kernels.flash_attention.configs import Device, TileConfig  # noqa: E402

H100 = Device("NVIDIA H100 80GB HBM3", "hopper", configs.SMEM_HOPPER)
FAMILIES = ("hopper", "ampere", "consumer")
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _block_d(D: int) -> int:
    return max(16, launch.next_power_of_2(D))


# ---------------------------------------------------------------------------------------------
# The short lists.
def _lists(family: str, elem_bytes: int, D: int) -> dict[str, list[TileConfig]]:
    device = Device("card", family, configs.FAMILY_SMEM[family])
    return {kind: configs.shortlist(kind, device, elem_bytes, _block_d(D)) for kind in configs.KINDS}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("elem_bytes", [2, 4], ids=["16bit", "fp32"])
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_one_candidate_except_where_the_h100_picked_by_length(family, elem_bytes, D):
    """Tuning runs only for the forward and dQ kernels of fp16/bf16 at 64 < D <= 128 on Hopper."""
    sizes = {kind: len(cands) for kind, cands in _lists(family, elem_bytes, D).items()}
    tuned = family == "hopper" and elem_bytes == 2 and 64 < D <= 128
    assert sizes == ({"fwd": 2, "dkdv": 1, "dq": 2} if tuned else {"fwd": 1, "dkdv": 1, "dq": 1})


def test_hopper_half_precision_lists_are_the_measured_winners():
    t = TileConfig
    assert _lists("hopper", 2, 64) == {"fwd": [t(64, 64, 4, 3)], "dkdv": [t(32, 64, 4, 3)], "dq": [t(64, 64, 4, 3)]}
    assert _lists("hopper", 2, 128) == {"fwd": [t(64, 64, 4, 3), t(128, 64, 8, 3)], "dkdv": [t(64, 128, 8, 3)],
                                        "dq": [t(128, 64, 8, 3), t(64, 32, 4, 3)]}


@pytest.mark.parametrize("elem_bytes", [2, 4], ids=["16bit", "fp32"])
def test_head_dims_share_the_row_of_their_padded_size(elem_bytes):
    for family in FAMILIES:
        assert _lists(family, elem_bytes, 16) == _lists(family, elem_bytes, 32)
        assert _lists(family, elem_bytes, 80) == _lists(family, elem_bytes, 96) == _lists(family, elem_bytes, 128)


@pytest.mark.parametrize("D", HEAD_DIMS)
def test_fp32_lists_are_small_single_stage_and_the_same_on_every_family(D):
    """fp32 dots are FMA loops unrolled per thread: at most 512 FMAs per thread per dot (256 in
    the four-dot dK/dV kernel) keeps the code, and ptxas's time, small; the earlier defaults did
    up to 8192."""
    rows = [_lists(family, 4, D) for family in FAMILIES]
    assert rows[0] == rows[1] == rows[2]
    for kind, cands in rows[0].items():
        for cfg in cands:
            assert cfg.num_stages == 1
            fmas = cfg.BLOCK_M * cfg.BLOCK_N * _block_d(D) // (32 * cfg.num_warps)
            assert fmas <= (256 if kind == "dkdv" else 512), (kind, cfg, fmas)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_fits_its_own_family(family):
    """On its family's card no listed config is dropped: the shared-memory estimate and the
    register check pass for every row, so the table is what runs."""
    budget = configs.FAMILY_SMEM[family]
    rows = [(2, bd, configs.HALF_CONFIGS[(family, bd)]) for bd in (32, 64, 128, 256)]
    rows += [(4, bd, row) for bd, row in configs.FP32_CONFIGS.items()]
    for elem, bd, row in rows:
        for kind, cands in row.items():
            for cfg in cands:
                assert configs.smem_estimate(kind, cfg, bd, elem) <= budget, (family, elem, bd, kind, cfg)
                assert configs.registers_ok(kind, cfg, bd), (family, elem, bd, kind, cfg)


def test_forcing_the_consumer_family_on_an_h100():
    consumer = H100.as_family("consumer")
    assert consumer == Device(H100.name, "consumer", configs.SMEM_CONSUMER)
    assert H100.as_family(None) is H100 and H100.as_family("hopper") is H100
    assert configs.shortlist("dkdv", consumer, 2, 128) == configs.HALF_CONFIGS[("consumer", 128)]["dkdv"]
    with pytest.raises(ValueError, match="unknown GPU family 'turing'"):
        H100.as_family("turing")


def test_the_interpreter_and_cpu_tensors_get_the_interpreter_configs():
    for kind in configs.KINDS:
        assert configs.default_config(kind, torch.device("cpu"), 64, 2) == configs.INTERPRET_CONFIGS[kind]


# ---------------------------------------------------------------------------------------------
# The launcher with stand-ins: tuning, the disk cache, the notices.
class _Binary:
    """A compiled kernel's stand-in: ``binary[grid](*args)``."""

    def __getitem__(self, grid):
        return lambda *args: None


class _StandInJit:
    """A JIT function's stand-in with a forward-like signature: records each Triton launch as
    (grid, BLOCK_M, BLOCK_N, num_warps, num_stages)."""

    arg_names = ["Q", "O", "T", "T_BUCKET", "HEAD_DIM", "BLOCK_D", "IS_CAUSAL", "BLOCK_M", "BLOCK_N"]
    params = [types.SimpleNamespace(name=n, is_constexpr=n not in ("Q", "O", "T", "T_BUCKET")) for n in arg_names]

    def __init__(self, cache_key="source-v1"):
        self.cache_key = cache_key
        self.launches = []

    def __getitem__(self, grid):
        def run(num_warps, num_stages, **kwargs):
            assert set(kwargs) == set(self.arg_names)
            self.launches.append((grid, kwargs["BLOCK_M"], kwargs["BLOCK_N"], num_warps, num_stages))
            return _Binary()

        return run


class _RecordingTuner:
    """Stands in for ``launch.time_configs``: records the candidates it was asked to time and
    times the ``best`` one fastest (by default the last candidate, so the pick is not the default)."""

    def __init__(self, best=-1):
        self.best = best
        self.calls = []

    def __call__(self, kernel, candidates, grid_rows, grid_yz, args):
        self.calls.append(list(candidates))
        return {c: (0.5 if i == self.best % len(candidates) else 1.0) for i, c in enumerate(candidates)}


@pytest.fixture
def fake_h100(monkeypatch):
    """Launches as on an H100 (no interpreter, a CUDA device described as an H100)."""
    gpu = {"device": H100}
    monkeypatch.setattr(launch, "is_interpreter", lambda: False)
    monkeypatch.setattr(launch, "describe_device", lambda index: gpu["device"])
    monkeypatch.setattr(configs, "is_interpreter", lambda: False)
    monkeypatch.setattr(configs, "describe_device", lambda index: gpu["device"])
    return gpu


def _launch(launcher, jit, D=128, T=1000, dtype=torch.bfloat16):
    """One forward-like launch through ``launcher``; the config it launched."""
    q = torch.zeros(16, dtype=dtype)
    kernel = launch.Kernel("fwd", jit, "BLOCK_M")
    ints = dict(T=T, T_BUCKET=launch.next_power_of_2(T), HEAD_DIM=D, BLOCK_D=_block_d(D), IS_CAUSAL=True)
    launcher.launch(kernel, T, (2, 4), {"Q": q, "O": q}, {}, ints, torch.device("cuda", 0))
    _, bm, bn, w, s = jit.launches[-1]
    return TileConfig(bm, bn, w, s)


def _launcher(tmp_path, tuner, **kw):
    """A fresh launcher: what a new process starts with."""
    return launch.Launcher(autotune=True, replay=False, cache_dir=tmp_path, tuner=tuner, **kw)


def test_a_tuned_pick_is_read_back_by_a_new_process_without_tuning(fake_h100, tmp_path):
    jit, first = _StandInJit(), _RecordingTuner()
    candidates = configs.HALF_CONFIGS[("hopper", 128)]["fwd"]
    launcher = _launcher(tmp_path, first)
    assert _launch(launcher, jit) == candidates[-1]
    assert first.calls == [candidates]
    assert _launch(launcher, jit) == candidates[-1] and len(first.calls) == 1  # remembered in memory
    [entry] = tmp_path.iterdir()
    stored = json.loads(entry.read_text())
    assert stored["pick"] == {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    assert stored["key"]["gpu"] == H100.name and stored["key"]["args"]["T_BUCKET"] == 1024

    second = _RecordingTuner(best=0)
    assert _launch(_launcher(tmp_path, second), jit) == candidates[-1]
    assert second.calls == []


def test_a_single_candidate_is_launched_without_tuning_or_files(fake_h100, tmp_path):
    jit, tuner = _StandInJit(), _RecordingTuner()
    assert _launch(_launcher(tmp_path, tuner), jit, D=64) == configs.HALF_CONFIGS[("hopper", 64)]["fwd"][0]
    assert _launch(_launcher(tmp_path, tuner), jit, D=64, dtype=torch.float32) == configs.FP32_CONFIGS[64]["fwd"][0]
    assert tuner.calls == [] and list(tmp_path.iterdir()) == []


def test_autotune_off_launches_the_first_candidate(fake_h100, tmp_path):
    jit, tuner = _StandInJit(), _RecordingTuner()
    launcher = launch.Launcher(autotune=False, replay=False, cache_dir=tmp_path, tuner=tuner)
    assert _launch(launcher, jit) == configs.HALF_CONFIGS[("hopper", 128)]["fwd"][0]
    assert tuner.calls == []


def _disk_key(jit=None, gpu=H100, T=1000, D=128):
    kernel = launch.Kernel("fwd", jit or _StandInJit(), "BLOCK_M")
    q = torch.zeros(16, dtype=torch.bfloat16)
    args = dict(Q=q, O=q, T=T, T_BUCKET=launch.next_power_of_2(T), HEAD_DIM=D, BLOCK_D=_block_d(D), IS_CAUSAL=True)
    cands = configs.shortlist("fwd", gpu, 2, _block_d(D))
    return launch.Launcher(autotune=True, replay=False).disk_key(kernel, gpu, cands, args)


def test_the_disk_key_changes_with_gpu_triton_source_shape_and_candidates(monkeypatch, tmp_path):
    import triton

    base = tune_cache.entry_path(tmp_path, _disk_key())
    assert tune_cache.entry_path(tmp_path, _disk_key()) == base
    others = [_disk_key(gpu=replace(H100, name="NVIDIA H200")),
              _disk_key(jit=_StandInJit(cache_key="source-v2")),
              _disk_key(T=3000),
              _disk_key(gpu=H100.as_family("consumer"))]  # another family: other candidates
    monkeypatch.setattr(triton, "__version__", "9.9.9")
    others.append(_disk_key())
    paths = {tune_cache.entry_path(tmp_path, key) for key in others}
    assert base not in paths and len(paths) == len(others)


def _launches_of(monkeypatch, call) -> dict:
    """{kind: (kernel, pointers, args)} of the tile kernels' launches ``call()`` makes through
    ``launch.LAUNCHER`` (recorded, not run), each kernel with its JIT function as on a GPU: the
    interpreter's stand-in has no parameter list to read the key's names from. The gate's scan
    kernels (``launch_fixed``) are not run either: the CPU tensors here launch nothing on a GPU box."""
    from triton.runtime.jit import JITFunction

    launches = {}

    def record(kernel, grid_rows, grid_yz, pointers, scales, ints, device, plan=None):
        jit = kernel.jit if hasattr(kernel.jit, "params") else JITFunction(kernel.jit.fn)
        launches[kernel.kind] = (launch.Kernel(kernel.kind, jit, kernel.resident), pointers,
                                 {**pointers, **scales, **ints})

    monkeypatch.setattr(launch.LAUNCHER, "launch", record)
    monkeypatch.setattr(launch.LAUNCHER, "launch_fixed", lambda *args, **kwargs: None)
    monkeypatch.setattr(launch.LAUNCHER, "replay", False)
    call()
    return launches


def test_the_tuning_key_holds_the_gate_flag_and_the_gate_pointers_dtypes(monkeypatch):
    """A gated call tunes apart from a plain one, through the launcher's own key (every constexpr,
    every pointer's dtype): the keys differ in HAS_GATE and in the gate's pointers only."""
    from kernels.flash_attention.backward import attn_bwd
    from kernels.flash_attention.forward import attn_fwd

    B, T, H, D = 1, 8, 2, 16
    q = torch.zeros(B, T, H, D)
    lse = torch.zeros(B, H, T)
    g = torch.zeros(B, T, H)

    def calls(gate):
        return _launches_of(monkeypatch, lambda: (attn_fwd(q, q, q, 0.25, True, 0, None, g=gate),
                                                  attn_bwd(q, q, q, q, q, lse, 0.25, True, 0, None, g=gate)))

    plain, gated = calls(None), calls(g)
    assert set(plain) == set(gated) == {"fwd", "dq", "dkdv"}
    launcher, cuda = launch.Launcher(autotune=True, replay=False), torch.device("cuda", 0)
    for kind, (kernel, pointers, args) in plain.items():
        assert "HAS_GATE" in kernel.key_names and not set(launch.TILE_NAMES) & set(kernel.key_names)
        _, gated_pointers, gated_args = gated[kind]
        key, gated_key = (launcher.tuning_key(kernel, p, a, cuda) for p, a in ((pointers, args),
                                                                               (gated_pointers, gated_args)))
        values, gated_values = (dict(zip(kernel.key_names, k[3:-1])) for k in (key, gated_key))
        assert {n for n in values if values[n] != gated_values[n]} == {"HAS_GATE"}
        assert not values["HAS_GATE"] and gated_values["HAS_GATE"]
        changed = {n for n, a, b in zip(pointers, key[-1], gated_key[-1]) if a != b}
        assert changed == ({"C_HI", "C_LO"} if kind == "fwd" else {"C_HI", "C_LO", "DC"})
        assert all(gated_key[-1][list(pointers).index(n)] == torch.float32 for n in changed)


def test_another_gpu_or_kernel_source_tunes_again(fake_h100, tmp_path):
    first = _RecordingTuner()
    _launch(_launcher(tmp_path, first), _StandInJit())
    edited = _RecordingTuner()
    _launch(_launcher(tmp_path, edited), _StandInJit(cache_key="source-v2"))
    fake_h100["device"] = replace(H100, name="NVIDIA H200")
    other_gpu = _RecordingTuner()
    _launch(_launcher(tmp_path, other_gpu), _StandInJit())
    assert len(first.calls) == len(edited.calls) == len(other_gpu.calls) == 1
    assert len(list(tmp_path.iterdir())) == 3


@pytest.mark.parametrize("content", ["corrupt", "not-an-entry", "foreign-key", "stray-pick"])
def test_a_corrupt_or_foreign_cache_file_is_ignored_with_a_warning(fake_h100, tmp_path, content):
    jit = _StandInJit()
    key = _disk_key(jit)
    path = tune_cache.entry_path(tmp_path, key)
    candidate = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    path.write_text({
        "corrupt": '{"key": {"kernel": "fwd", "gpu": "NVIDIA H1',
        "not-an-entry": '["a list"]',
        "foreign-key": json.dumps({"key": {**key, "gpu": "NVIDIA H200"}, "pick": candidate}),
        "stray-pick": json.dumps({"key": key, "pick": {**candidate, "BLOCK_M": 256}}),
    }[content])
    tuner = _RecordingTuner()
    with pytest.warns(UserWarning, match=re.escape(f"ignoring the tuning cache file {path}")):
        picked = _launch(_launcher(tmp_path, tuner), jit)
    assert len(tuner.calls) == 1
    assert json.loads(path.read_text())["pick"] == {"BLOCK_M": picked.BLOCK_M, "BLOCK_N": picked.BLOCK_N,
                                                    "num_warps": picked.num_warps, "num_stages": picked.num_stages}


def test_an_unwritable_cache_folder_warns_and_keeps_the_pick_for_the_process(fake_h100, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    jit, tuner = _StandInJit(), _RecordingTuner()
    launcher = _launcher(blocker / "autotune", tuner)
    with pytest.warns(UserWarning) as record:
        picked = _launch(launcher, jit)
    assert any("cannot write the tuning cache" in str(w.message) for w in record)
    assert _launch(launcher, jit) == picked and len(tuner.calls) == 1


def test_the_cache_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune_cache.default_folder() == tmp_path / "nanoflash" / "autotune"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tune_cache.default_folder() == tmp_path / "home" / ".cache" / "nanoflash" / "autotune"


_WRITER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("tune_cache", sys.argv[1])
tune_cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tune_cache)
key = {"kernel": "fwd", "gpu": "test"}
for i in range(int(sys.argv[3])):
    tune_cache.store(sys.argv[2], key, {"pick": {"writer": int(sys.argv[4]), "i": i, "pad": "x" * 20000}})
"""


def test_concurrent_writers_never_leave_a_partial_entry(tmp_path):
    """Four processes rewrite one entry 200 times each while this one reads it: every read is
    one writer's whole entry (or nothing yet), and no temporary file is left behind."""
    key = {"kernel": "fwd", "gpu": "test"}
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, tune_cache.__file__, str(tmp_path), "200", str(w)])
               for w in range(4)]
    reads = []
    while any(p.poll() is None for p in writers):
        reads.append(_read_whole(tmp_path, key))
    assert all(p.returncode == 0 for p in writers)
    assert sum(r is not None for r in reads) > 0
    assert all(r is None or (r["writer"] in range(4) and len(r["pad"]) == 20000) for r in reads)
    assert [p.name for p in tmp_path.iterdir()] == [tune_cache.entry_path(tmp_path, key).name]


def _read_whole(folder, key):
    """The pick of ``key`` as written (any pick accepted), or None when no file exists yet."""
    path = tune_cache.entry_path(folder, key)
    if not path.exists():
        return None
    entry = json.loads(path.read_text())
    assert entry["key"] == key
    return entry["pick"]


def _notices(text: str, what: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"nanoflash: {what}")]


def test_a_long_tune_says_what_and_where_once_per_key(fake_h100, tmp_path, capsys):
    jit = _StandInJit()
    launcher = _launcher(tmp_path, _RecordingTuner(), notice_after_s=0.0)
    _launch(launcher, jit)
    _launch(launcher, jit)
    [line] = _notices(capsys.readouterr().err, "tuning")
    path = next(tmp_path.iterdir())
    assert line == (f"nanoflash: tuning the forward kernel for bfloat16, D=128, T<=1024: compiling and timing 2 "
                    f"configs, once per GPU and shape; the pick will be cached at {path}")
    _launch(launcher, jit, T=3000)
    assert len(_notices(capsys.readouterr().err, "tuning")) == 1  # a new key: one more line


def test_a_quick_tune_or_compile_says_nothing(fake_h100, tmp_path, capsys):
    _launch(_launcher(tmp_path, _RecordingTuner()), _StandInJit())
    assert _notices(capsys.readouterr().err, "") == []


def test_a_long_first_compile_says_so_once_per_variant(fake_h100, tmp_path, capsys):
    jit = _StandInJit()
    launcher = launch.Launcher(autotune=False, replay=False, notice_after_s=0.0)
    _launch(launcher, jit, D=64)
    _launch(launcher, jit, D=64)
    assert _notices(capsys.readouterr().err, "compiling") == [
        "nanoflash: compiling the forward kernel for bfloat16, D=64 (64x64, 4 warps, 3 stages); "
        "once per shape, Triton keeps the binary"]
    _launch(launcher, jit, D=32)
    assert len(_notices(capsys.readouterr().err, "compiling")) == 1


@pytest.mark.parametrize("after_s,said", [(0.0, True), (60.0, False)])
def test_slow_notice_speaks_once_and_only_when_slow(capsys, after_s, said):
    with launch.SlowNotice(after_s, "nanoflash: slow") as notice:
        pass
    assert notice.said is said
    if said:
        notice.say()  # a second call (a timer firing late) adds nothing
    assert capsys.readouterr().err == ("nanoflash: slow\n" if said else "")


def test_a_forced_family_launches_and_keys_its_own_configs(fake_h100, tmp_path):
    jit, tuner = _StandInJit(), _RecordingTuner()
    launcher = _launcher(tmp_path, tuner, family="consumer")
    assert _launch(launcher, jit) == configs.HALF_CONFIGS[("consumer", 128)]["fwd"][0]
    assert tuner.calls == []
    launcher.family = None
    _launch(launcher, jit)
    assert len(tuner.calls) == 1  # the H100's own two candidates, under another key


def test_a_forced_family_has_plans_of_its_own():
    buf = torch.zeros(16)
    launcher = launch.Launcher(autotune=True, replay=True)
    own = launcher.plan_key("fwd", (buf, None), (2, 8))
    launcher.family = "consumer"
    assert launcher.plan_key("fwd", (buf, None), (2, 8)) != own


# ---------------------------------------------------------------------------------------------
# GPU: the consumer-card configs forced on this GPU, and a real tune read back from disk.
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("D", [32, 64, 80, 128, 256])
def test_consumer_configs_forced_on_this_gpu_are_correct_cuda(monkeypatch, tmp_path, dtype, D):
    """What a ~100 KB card launches, launched here through the ordinary (autotuned) path."""
    from test_flash_kernel import Case, check_case

    monkeypatch.setattr(launch.LAUNCHER, "autotune", True)
    monkeypatch.setattr(launch.LAUNCHER, "family", "consumer")
    monkeypatch.setattr(launch.LAUNCHER, "cache_dir", tmp_path)
    monkeypatch.setattr(launch.LAUNCHER, "tuned", {})
    monkeypatch.setattr(launch.LAUNCHER, "plans", {})
    check_case(Case(2, 300, 4, 2, D, dtype))
    consumer = configs.describe_device(torch.cuda.current_device()).as_family("consumer")
    for key, cfg in launch.LAUNCHER.tuned.items():
        assert cfg in configs.shortlist(key[0], consumer, dtype.itemsize, _block_d(D))


@gpu
@pytest.mark.gpu
def test_a_real_tune_is_read_back_without_timing_cuda(monkeypatch, tmp_path):
    from test_flash_kernel import BF16, Case, check_case

    def no_tuning(*args):
        raise AssertionError("tuned although the pick was on disk")

    for attr, value in (("autotune", True), ("cache_dir", tmp_path), ("tuned", {}), ("plans", {})):
        monkeypatch.setattr(launch.LAUNCHER, attr, value)
    check_case(Case(2, 300, 4, 2, 128, BF16))
    picks = dict(launch.LAUNCHER.tuned)
    assert len(list(tmp_path.iterdir())) == 2  # forward and dQ have two candidates at D=128
    for attr, value in (("tuned", {}), ("plans", {}), ("tuner", no_tuning)):
        monkeypatch.setattr(launch.LAUNCHER, attr, value)
    check_case(Case(2, 300, 4, 2, 128, BF16))
    assert launch.LAUNCHER.tuned == picks
