"""The attention backend table: configs, README and validation follow it; options reach the backends."""
import re
import warnings

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO
from errors import UserError
from model import attention
from model.attention import BACKENDS, Backend, build_attention, naive, validate_attention
from model.config import AttentionConfig
from training.config import register_configs

CPU = torch.device("cpu")


def test_every_backend_has_a_config_and_every_config_a_backend():
    files = sorted(p.stem for p in (REPO / "configs" / "attention").glob("*.yaml"))
    assert files == sorted(BACKENDS)
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        for name in files:
            assert OmegaConf.to_object(compose(config_name="train", overrides=[f"attention={name}"])).attention.name == name


def test_readme_lists_every_backend():
    row = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `attention=`"))
    choices = row.split("|")[2]
    assert sorted(re.findall(r"`([\w-]+)`", choices)) == sorted(BACKENDS)


def recording_attend(q, k, v, doc_ids=None, window=None, g=None):
    """A backend for these tests: returns q and says what it was given."""
    recording_attend.calls.append({"window": window, "g": g})
    return q


recording_attend.calls = []


@pytest.fixture
def recording_backend(monkeypatch):
    """``recording`` (takes window and a per-call gate) and ``plain`` (takes nothing) in the table."""
    table = dict(BACKENDS)
    table["recording"] = Backend("recording", f"{__name__}:recording_attend", window=True, gate=True)
    table["plain"] = Backend("plain", f"{__name__}:recording_attend")
    monkeypatch.setattr(attention, "BACKENDS", table)
    recording_attend.calls.clear()


def test_config_options_are_bound_and_call_options_pass_through(recording_backend):
    attend, name = build_attention(AttentionConfig(name="recording", window=5), CPU)
    q = torch.randn(1, 4, 2, 8)
    assert name == "recording" and attend.packed is None
    assert attend(q, q, q) is q and attend(q, q, q, g="g") is q
    assert recording_attend.calls == [{"window": 5, "g": None}, {"window": 5, "g": "g"}]


def test_a_feature_the_backend_cannot_compute_fails_when_the_config_is_checked(recording_backend):
    validate_attention(AttentionConfig(name="plain"))  # no window: fine
    able = ", ".join(name for name, row in attention.BACKENDS.items() if row.window)
    assert able.endswith("flash, recording")
    with pytest.raises(UserError, match=rf"^attention=plain cannot run with attention.window=8; backends that can: {able}$"):
        validate_attention(AttentionConfig(name="plain", window=8))
    with pytest.raises(UserError, match="attention=plain cannot run with attention.window=8"):
        build_attention(AttentionConfig(name="plain", window=8), CPU)


def test_a_tuning_key_is_ignored_by_the_backends_that_do_not_take_it(recording_backend):
    validate_attention(AttentionConfig(name="plain", block_size=16))
    attend, _ = build_attention(AttentionConfig(name="plain", block_size=16), CPU)
    q = torch.randn(1, 4, 2, 8)
    assert attend(q, q, q) is q


def no_such_chip(device) -> str:
    return "no such chip"


def test_a_backend_that_cannot_run_and_has_no_fallback_fails(monkeypatch):
    table = dict(BACKENDS, plain=Backend("plain", f"{__name__}:recording_attend", unavailable=f"{__name__}:no_such_chip"),
                 gpu_only=Backend("gpu_only", f"{__name__}:recording_attend", devices=("cuda",)))
    monkeypatch.setattr(attention, "BACKENDS", table)
    with pytest.raises(UserError, match=r"^attention=plain cannot run: no such chip$"):
        build_attention(AttentionConfig(name="plain"), CPU)
    with pytest.raises(UserError, match=r"^attention=gpu_only cannot run: it runs on cuda and this run uses cpu$"):
        build_attention(AttentionConfig(name="gpu_only"), CPU)


def test_the_packed_variant_is_there_exactly_when_the_table_names_one():
    for name in BACKENDS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a backend that cannot run here falls back
            attend, ran = build_attention(AttentionConfig(name=name), CPU)
        assert (attend.packed is not None) == (BACKENDS[ran].packed is not None), name


@pytest.mark.parametrize("capability,runs", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_flash_says_why_an_old_gpu_cannot_run_it(monkeypatch, capability, runs):
    """Triton 3.3 dropped Turing (sm75): on a T4 flash falls back and says why."""
    import triton

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    reason = attention.unavailable_reason("flash", torch.device("cuda", 0))
    assert (reason == "") == runs
    if not runs:
        assert reason == "triton 3.6.0 does not compile for compute capability 7.5 (Turing and older; it needs 8.0, Ampere, or newer)"


def test_an_old_gpu_runs_sdpa_and_says_why_up_front(monkeypatch):
    """On compute capability 7.5 (T4, RTX 20xx) attention=flash warns with the reason and runs sdpa;
    attention.strict=true refuses with the same reason."""
    import triton

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    gpu = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match=r"attention=flash cannot run \(triton 3.6.0 does not compile for compute "
                                         r"capability 7.5 .*\); using attention=sdpa instead"):
        attend, ran = build_attention(AttentionConfig(name="flash"), gpu)
    assert ran == "sdpa" and attend.name == "sdpa"
    with pytest.raises(UserError, match="attention=flash cannot run: triton 3.6.0 does not compile for compute capability 7.5"):
        build_attention(AttentionConfig(name="flash", strict=True), gpu)


def einsum_attend(q, k, v, doc_ids=None, window=None):
    """README's example backend ("Adding a backend"): causal attention in two einsums, with a window."""
    B, T, H, D = q.shape
    k, v = (x.repeat_interleave(H // x.shape[2], dim=2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / D ** 0.5
    i, j = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)
    visible = (j <= i) if window is None else (j <= i) & (i - j < window)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v)


def test_a_new_row_is_validated_and_trains(monkeypatch, tmp_path, data_cache):
    """One row makes a backend: validation reads what it can do, and the loop trains with it."""
    from conftest import tiny_config
    from training.config import validate
    from training.loop import train

    monkeypatch.setattr(attention, "BACKENDS", dict(BACKENDS, einsum=Backend("einsum", f"{__name__}:einsum_attend",
                                                                             window=True)))
    cfg = tiny_config(data_cache, max_steps=4, log_interval=2, eval_interval=4, eval_iters=1)
    cfg.attention.name, cfg.attention.window = "einsum", 8
    with pytest.raises(UserError, match=r"^attention=einsum cannot run with model.dropout=0.1 \(attention dropout\); "
                                        r"backends that can: naive, hybrid, tiled, sdpa, flash$"):
        validate(cfg)
    cfg.model.attention_dropout = 0.0
    validate(cfg)
    assert train(cfg, tmp_path)["backend"] == "einsum"
    q, k, v = (torch.randn(2, 12, h, 8, generator=torch.Generator().manual_seed(h)) for h in (4, 2, 2))
    torch.testing.assert_close(einsum_attend(q, k, v, window=5), naive.attend(q, k, v, window=5))
