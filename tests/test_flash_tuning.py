"""Choosing the flash kernels' configs: the short lists per (GPU family, dtype, D), the tuning of
the few that have more than one candidate, the picks kept on disk between processes, the console
notices of a long tune or compilation, and the tuning key.

The CPU tests drive a ``tuning.Tuner`` of their own with stand-ins: a kernel that records its
warm-ups, a timer that records what it was asked to time, and an H100's description. The GPU
tests run the real kernels with the consumer-card configs, and a real tune read back from disk.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.flash_attention import backward, configs, forward, tune_cache, tuning  # noqa: E402
from kernels.flash_attention.configs import Device, TileConfig  # noqa: E402

H100 = Device("NVIDIA H100 80GB HBM3", "hopper", configs.SMEM_HOPPER)
FAMILIES = ("hopper", "ampere", "consumer")
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _block_d(D: int) -> int:
    return max(16, tuning.next_power_of_2(D))


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


def test_cpu_tensors_and_an_interpreted_kernel_get_the_interpreter_configs():
    cpu = torch.device("cpu")
    for kind in configs.KINDS:
        assert _tuner(None, _RecordingTimer(), kind=kind).pick(cpu, torch.float16, 64, (1, 1), (), _constexprs(64)) \
            == configs.INTERPRET_CONFIGS[kind]
    if not CUDA:
        assert forward.FWD.interpreted and backward.DQ.interpreted and backward.DKDV.interpreted


# ---------------------------------------------------------------------------------------------
# A tuner with stand-ins: tuning, the disk cache, the notices.
class _StandInJit:
    """A JIT function's stand-in: records each warm-up (compilation) as its config."""

    def __init__(self, cache_key="source-v1"):
        self.cache_key = cache_key
        self.warmed = []

    def warmup(self, *args, grid, BLOCK_M, BLOCK_N, num_warps, num_stages, **constexprs):
        self.warmed.append(TileConfig(BLOCK_M, BLOCK_N, num_warps, num_stages))


class _RecordingTimer:
    """Stands in for ``tuning.time_configs``: records the candidates it was asked to time and
    times the ``best`` one fastest (by default the last candidate, so the pick is not the first)."""

    def __init__(self, best=-1):
        self.best = best
        self.calls = []

    def __call__(self, tuner, candidates, rows, grid_yz, args, constexprs):
        self.calls.append(list(candidates))
        return {c: (0.5 if i == self.best % len(candidates) else 1.0) for i, c in enumerate(candidates)}


def _constexprs(D: int) -> dict:
    return dict(HEAD_DIM=D, BLOCK_D=_block_d(D), IS_CAUSAL=True)


def _tuner(cache_dir, timer, jit=None, gpu=H100, kind="fwd", **kw) -> tuning.Tuner:
    """A fresh tuner (what a new process starts with) on a stand-in ``gpu``."""
    return tuning.Tuner(kind, jit or _StandInJit(), "BLOCK_M", describe=lambda index: gpu, timer=timer,
                        cache_dir=cache_dir, **kw)


def _pick(tuner, D=128, T=1000, dtype=torch.bfloat16) -> TileConfig:
    """The config ``tuner`` gives a forward-like launch on CUDA device 0."""
    return tuner.pick(torch.device("cuda", 0), dtype, T, (2, 4), (), _constexprs(D))


def test_a_tuned_pick_is_read_back_by_a_new_process_without_tuning(tmp_path):
    jit, first = _StandInJit(), _RecordingTimer()
    candidates = configs.HALF_CONFIGS[("hopper", 128)]["fwd"]
    tuner = _tuner(tmp_path, first, jit)
    assert _pick(tuner) == candidates[-1] and jit.warmed == [candidates[-1]]
    assert first.calls == [candidates]
    assert _pick(tuner) == candidates[-1] and len(first.calls) == 1  # remembered in memory
    [entry] = tmp_path.iterdir()
    stored = json.loads(entry.read_text())
    assert stored["pick"] == {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    assert stored["key"]["gpu"] == H100.name and stored["key"]["T_BUCKET"] == 1024
    assert stored["key"]["constexprs"] == _constexprs(128)

    second = _RecordingTimer(best=0)
    assert _pick(_tuner(tmp_path, second, jit)) == candidates[-1]
    assert second.calls == []


def test_a_single_candidate_is_launched_without_tuning_or_files(tmp_path):
    timer = _RecordingTimer()
    assert _pick(_tuner(tmp_path, timer), D=64) == configs.HALF_CONFIGS[("hopper", 64)]["fwd"][0]
    assert _pick(_tuner(tmp_path, timer), D=64, dtype=torch.float32) == configs.FP32_CONFIGS[64]["fwd"][0]
    assert timer.calls == [] and list(tmp_path.iterdir()) == []


def test_a_new_tuning_key_tunes_again(tmp_path):
    """The T bucket, the dtype and every constexpr's value are in the key."""
    timer = _RecordingTimer()
    tuner = _tuner(tmp_path, timer)
    keys = [dict(T=1000), dict(T=1024), dict(T=1025), dict(T=1000, dtype=torch.float16)]
    for kw in keys:
        _pick(tuner, **kw)
    assert len(timer.calls) == 3  # 1000 and 1024 share the bucket
    tuner.pick(torch.device("cuda", 0), torch.bfloat16, 1000, (2, 4), (), {**_constexprs(128), "IS_CAUSAL": False})
    assert len(timer.calls) == 4


def _disk_key(jit=None, gpu=H100, T=1000, D=128, constexprs=None):
    cands = configs.shortlist("fwd", gpu, 2, _block_d(D))
    return _tuner(None, None, jit).disk_key(gpu, torch.bfloat16, cands, T, constexprs or _constexprs(D))


def test_the_disk_key_changes_with_gpu_triton_source_shape_constexprs_and_candidates(monkeypatch, tmp_path):
    import triton

    base = tune_cache.entry_path(tmp_path, _disk_key())
    assert tune_cache.entry_path(tmp_path, _disk_key()) == base
    others = [_disk_key(gpu=replace(H100, name="NVIDIA H200")),
              _disk_key(jit=_StandInJit(cache_key="source-v2")),
              _disk_key(T=3000),
              _disk_key(constexprs={**_constexprs(128), "IS_CAUSAL": False}),
              _disk_key(gpu=H100.as_family("consumer"))]  # another family: other candidates
    monkeypatch.setattr(triton, "__version__", "9.9.9")
    others.append(_disk_key())
    paths = {tune_cache.entry_path(tmp_path, key) for key in others}
    assert base not in paths and len(paths) == len(others)


def _launch_constexprs(monkeypatch, *calls) -> list[dict]:
    """Per call of ``calls``: {kind: constexprs} of the tile kernels' launches it makes, as the
    tuner reads them from the last of the values a launch function hands it (and keys its pick
    on), after checking that the tensors and values are all the kernel's parameters but the tiles."""
    seen = []
    for tuner in (forward.FWD, backward.DQ, backward.DKDV):
        def record(rows, grid_yz, tensors, values, cfg=None, tuner=tuner, launch=tuner.launch):
            names = tuner.constexpr_names
            assert len(tensors) + len(values) == len(_params(tuner.jit)) - 2
            seen[-1][tuner.kind] = dict(zip(names, values[len(values) - len(names):]))
            return launch(rows, grid_yz, tensors, values, cfg)

        monkeypatch.setattr(tuner, "launch", record)
    for call in calls:
        seen.append({})
        call()
    return seen


def _params(jit) -> list:
    """A Triton kernel's parameters (``KernelParam``: name, is_constexpr) from its JIT signature."""
    from triton.runtime.jit import JITFunction

    return (jit if hasattr(jit, "params") else JITFunction(jit.fn)).params  # the interpreter's has no list


def _constexpr_params(jit) -> list[str]:
    """The names of a Triton kernel's constexpr parameters, in signature order."""
    return [p.name for p in _params(jit) if p.is_constexpr]


def test_the_tuning_key_holds_every_constexpr_but_the_tiles(monkeypatch):
    """Each launch hands its tuner every argument of the kernel but BLOCK_M and BLOCK_N, the
    constexprs last, and the tuner keys its pick on all of those constexprs (named by the kernel's
    signature, as Triton reads them), so a constexpr the kernel gains cannot be left out of the
    key. A gated call's differ from a plain one's in HAS_GATE only."""
    B, T, H, D = 1, 8, 2, 16
    device = "cuda" if CUDA else "cpu"
    q = torch.zeros(B, T, H, D, device=device)
    lse = torch.zeros(B, H, T, device=device)
    g = torch.zeros(B, T, H, device=device)

    def run(gate):
        return lambda: (forward.attn_fwd(q, q, q, 0.25, True, g=gate),
                        backward.attn_bwd(q, q, q, q, q, lse, 0.25, True, g=gate))

    plain, gated = _launch_constexprs(monkeypatch, run(None), run(g))
    assert set(plain) == set(gated) == {"fwd", "dq", "dkdv"}
    for tuner in (forward.FWD, backward.DQ, backward.DKDV):
        assert list(plain[tuner.kind]) == _constexpr_params(tuner.jit)[:-2] and _constexpr_params(tuner.jit)[-2:] \
            == ["BLOCK_M", "BLOCK_N"]
        differ = {n for n in plain[tuner.kind] if plain[tuner.kind][n] != gated[tuner.kind][n]}
        assert differ == {"HAS_GATE"}


def test_another_gpu_or_kernel_source_tunes_again(tmp_path):
    first = _RecordingTimer()
    _pick(_tuner(tmp_path, first))
    edited = _RecordingTimer()
    _pick(_tuner(tmp_path, edited, _StandInJit(cache_key="source-v2")))
    other_gpu = _RecordingTimer()
    _pick(_tuner(tmp_path, other_gpu, gpu=replace(H100, name="NVIDIA H200")))
    assert len(first.calls) == len(edited.calls) == len(other_gpu.calls) == 1
    assert len(list(tmp_path.iterdir())) == 3


@pytest.mark.parametrize("content", ["corrupt", "not-an-entry", "foreign-key", "stray-pick"])
def test_a_corrupt_or_foreign_cache_file_is_ignored_with_a_warning(tmp_path, content):
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
    timer = _RecordingTimer()
    with pytest.warns(UserWarning, match=re.escape(f"ignoring the tuning cache file {path}")):
        picked = _pick(_tuner(tmp_path, timer, jit))
    assert len(timer.calls) == 1
    assert json.loads(path.read_text())["pick"] == {"BLOCK_M": picked.BLOCK_M, "BLOCK_N": picked.BLOCK_N,
                                                    "num_warps": picked.num_warps, "num_stages": picked.num_stages}


def test_an_unwritable_cache_folder_warns_and_keeps_the_pick_for_the_process(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    timer = _RecordingTimer()
    tuner = _tuner(blocker / "autotune", timer)
    with pytest.warns(UserWarning) as record:
        picked = _pick(tuner)
    assert any("cannot write the tuning cache" in str(w.message) for w in record)
    assert _pick(tuner) == picked and len(timer.calls) == 1


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


def test_a_long_tune_says_what_and_where_once_per_key(tmp_path, capsys):
    tuner = _tuner(tmp_path, _RecordingTimer(), notice_after_s=0.0)
    _pick(tuner)
    _pick(tuner)
    [line] = _notices(capsys.readouterr().err, "tuning")
    path = next(tmp_path.iterdir())
    assert line == (f"nanoflash: tuning the forward kernel for bfloat16, D=128, T<=1024: compiling and timing 2 "
                    f"configs, once per GPU and shape; the pick will be cached at {path}")
    _pick(tuner, T=3000)
    assert len(_notices(capsys.readouterr().err, "tuning")) == 1  # a new key: one more line


def test_a_quick_tune_or_compile_says_nothing(tmp_path, capsys):
    _pick(_tuner(tmp_path, _RecordingTimer()))
    assert _notices(capsys.readouterr().err, "") == []


def test_a_long_first_compile_says_so_once_per_key(tmp_path, capsys):
    tuner = _tuner(tmp_path, _RecordingTimer(), notice_after_s=0.0)
    _pick(tuner, D=64)
    _pick(tuner, D=64)
    assert _notices(capsys.readouterr().err, "compiling") == [
        "nanoflash: compiling the forward kernel for bfloat16, D=64 (64x64, 4 warps, 3 stages); "
        "once per shape, Triton keeps the binary"]
    _pick(tuner, D=32)
    assert len(_notices(capsys.readouterr().err, "compiling")) == 1


@pytest.mark.parametrize("after_s,said", [(0.0, True), (60.0, False)])
def test_slow_notice_speaks_once_and_only_when_slow(capsys, after_s, said):
    with tuning.SlowNotice(after_s, "nanoflash: slow") as notice:
        pass
    assert notice.said is said
    if said:
        notice.say()  # a second call (a timer firing late) adds nothing
    assert capsys.readouterr().err == ("nanoflash: slow\n" if said else "")


def test_a_consumer_card_gets_the_consumer_configs(tmp_path):
    timer = _RecordingTimer()
    assert _pick(_tuner(tmp_path, timer, gpu=H100.as_family("consumer"))) == \
        configs.HALF_CONFIGS[("consumer", 128)]["fwd"][0]
    assert timer.calls == []


# ---------------------------------------------------------------------------------------------
# GPU: the consumer-card configs on this GPU, and a real tune read back from disk.
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("D", [32, 64, 80, 128, 256])
def test_consumer_configs_on_this_gpu_are_correct_cuda(dtype, D):
    """What a ~100 KB card launches (its first candidates), launched here."""
    from test_flash_kernel import Case, check_case

    consumer = configs.describe_device(torch.cuda.current_device()).as_family("consumer")
    tiles = {kind: configs.shortlist(kind, consumer, dtype.itemsize, _block_d(D))[0] for kind in configs.KINDS}
    check_case(Case(2, 300, 4, 2, D, dtype), tiles=tiles)


@gpu
@pytest.mark.gpu
def test_a_real_tune_is_read_back_without_timing_cuda(monkeypatch, tmp_path):
    """Fresh tuners with the real kernels (what a new process has): the first tunes and stores,
    the second reads the picks back and times nothing. The `tl` kernels: on an H100 `auto` runs the
    Hopper forward and dK/dV kernels there, which take no tuning."""
    from test_flash_kernel import BF16, Case, check_case

    def fresh(timer=tuning.time_configs):
        made = {}
        for module, name in ((forward, "FWD"), (backward, "DQ"), (backward, "DKDV")):
            old = getattr(module, name)
            made[name] = tuning.Tuner(old.kind, old.jit, old.resident, timer=timer, cache_dir=tmp_path)
            monkeypatch.setattr(module, name, made[name])
        return made

    def no_timing(*args):
        raise AssertionError("timed although the pick was on disk")

    first = fresh()
    check_case(Case(2, 300, 4, 2, 128, BF16), kernel="tl")
    assert len(list(tmp_path.iterdir())) == 2  # forward and dQ have two candidates at D=128
    second = fresh(no_timing)
    check_case(Case(2, 300, 4, 2, 128, BF16), kernel="tl")
    assert all(second[name].picks == first[name].picks for name in first)
