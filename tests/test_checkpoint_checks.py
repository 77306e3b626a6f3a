"""A checkpoint is checked before anything of it is used (training/checkpoint.py: validate_checkpoint):
well-formed files of the wrong content, non-finite weights or optimizer state, RNG states of the wrong
size are refused in one line naming the file and the first problem, through trainer.resume=<file>,
resume=auto and scripts/sample.py alike."""
import contextlib
import copy
import functools
import importlib
import re

import pytest
import torch

from conftest import tiny_config
from errors import UserError
from training import loop
from training.checkpoint import list_checkpoints, load_checkpoint, validate_checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    """A finished two-step run and the state of its checkpoint."""
    run_dir = tmp_path_factory.mktemp("trained")
    loop.train(tiny_config(data_cache, max_steps=2, ckpt_interval=2, eval_interval=2), run_dir)
    return run_dir, load_checkpoint(list_checkpoints(run_dir)[-1])


def nan_at(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[0] = float("nan")
    return tensor


def replaced(state: dict, path: str, value) -> dict:
    """``state`` with the value at ``path`` ("optimizer/state/0/exp_avg": digits are list or dict indices)
    set to ``value`` (a function of the old value, when callable), or removed when ``value`` is DELETE."""
    *parents, last = [int(key) if key.isdigit() else key for key in path.split("/")]
    node = state
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value(node[last]) if callable(value) else value
    return state


DELETE = object()
DAMAGES = [  # (what is changed, the value, the first problem named)
    pytest.param("model", 1, "its 'model' is of type int, not dict", id="model-is-a-number"),
    pytest.param("loader", DELETE, "it has no 'loader'", id="no-loader"),
    pytest.param("corpus", DELETE, "it records its tokenizer without its corpus", id="no-corpus"),
    pytest.param("config", "hello", "its 'config' is of type str, not dict", id="config-is-text"),
    pytest.param("step", "3", "its 'step' is of type str, not int", id="step-is-text"),
    pytest.param("config/model/n_layr", 2, "its config.model has the key 'n_layr', which this version does not know", id="unknown-model-key"),
    pytest.param("config/model/n_head", "two", "its config.model.n_head is 'two', not int", id="model-key-of-another-type"),
    pytest.param("config/model/n_head", 3, "its config makes no model: model.n_embd=32 is not divisible by model.n_head=3", id="impossible-model"),
    pytest.param("vocab_size", 7, "its tokenizer has 65 tokens, more than its model's vocab_size 7", id="vocabulary-too-small"),
    pytest.param("tokenizer", {"tokenizer": "bpe"}, "its tokenizer record {'tokenizer': 'bpe'} names no tokenizer of ours", id="unknown-tokenizer"),
    pytest.param("model/wte.weight", lambda t: t[:, :8], "its weight wte.weight is (128, 8) torch.float32 where the model has (128, 32)", id="weight-of-another-shape"),
    pytest.param("model/blocks.0.attn.c_proj.weight", DELETE, "its weights lack blocks.0.attn.c_proj.weight", id="missing-weight"),
    pytest.param("model/blocks.0.extra", torch.ones(1), "its weights have 'blocks.0.extra', which the model has not", id="extra-weight"),
    pytest.param("model/ln_f.weight", nan_at, "its weight ln_f.weight holds NaN or infinity", id="nan-weight"),
    pytest.param("optimizer/state/0/exp_avg", nan_at, "its optimizer's exp_avg of parameter 0 holds NaN or infinity", id="nan-optimizer-state"),
    pytest.param("optimizer/state/0/exp_avg", lambda t: t[:1], "its optimizer's exp_avg of parameter 0 is", id="optimizer-state-of-another-shape"),
    pytest.param("optimizer/param_groups", lambda g: g[:1], "its optimizer has groups of", id="optimizer-group-missing"),
    pytest.param("rng/cpu", torch.zeros(3, dtype=torch.uint8), "its cpu RNG state is (3,) torch.uint8, not the 5056 bytes", id="three-byte-rng"),
    pytest.param("loader/batches_drawn", -1, "its loader position (batches_drawn) is -1 for 1 ranks, not a count", id="negative-loader-position"),
    pytest.param("scaler", {"scale": "big"}, "its grad scaler's scale is 'big', not a finite number", id="scaler-of-text"),
]
RESUME_ONLY = {"nan-optimizer-state", "optimizer-state-of-another-shape", "optimizer-group-missing", "three-byte-rng",
               "negative-loader-position", "scaler-of-text"}


def damaged(trained, tmp_path, where: str, value):
    state = copy.deepcopy(trained[1])
    del state["sharded"]
    path = tmp_path / "checkpoints" / "step_0000002.pt"
    path.parent.mkdir()
    torch.save(replaced(state, where, value), path)
    return path


@pytest.mark.parametrize("where,value,problem", DAMAGES)
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_problem(trained, tmp_path, data_cache, where, value,
                                                                       problem, request):
    """Each once gave a TypeError/KeyError/AttributeError/RuntimeError traceback, or loaded NaN silently."""
    path = damaged(trained, tmp_path, where, value)
    expected = re.escape(f"checkpoint {path} cannot be used: {problem}")
    cfg = tiny_config(data_cache, max_steps=4, resume=str(path))
    with pytest.raises(UserError, match=expected):
        loop.train(cfg, tmp_path / "run")
    if request.node.callspec.id not in RESUME_ONLY:  # what sampling uses too
        with pytest.raises(UserError, match=expected):
            sample_script().main([str(path), "--device", "cpu", "--tokens", "2"])


def test_resume_auto_checks_the_newest_checkpoint_too(trained, tmp_path, data_cache):
    path = damaged(trained, tmp_path, "model/ln_f.weight", nan_at)
    with pytest.raises(UserError, match=re.escape(f"checkpoint {path} cannot be used: its weight ln_f.weight holds NaN")):
        loop.train(tiny_config(data_cache, max_steps=4), tmp_path)


def test_a_sound_checkpoint_passes_and_gives_its_model(trained):
    run_dir, state = trained
    model_cfg = validate_checkpoint(list_checkpoints(run_dir)[-1], state)
    assert (model_cfg.n_layer, model_cfg.n_embd, model_cfg.vocab_size) == (2, 32, 128)


@functools.lru_cache(maxsize=None)
def sample_script():
    module = importlib.import_module("scripts.sample")
    return module


def test_the_progress_bar_counts_every_token_and_changes_none(trained, monkeypatch):
    """scripts/sample.py's progress bar is fed one update per token by generate: the same tokens as a
    call without it, and as many updates as tokens."""
    from types import SimpleNamespace

    sample = sample_script()
    updates = []
    monkeypatch.setattr(sample, "tqdm", lambda **kw: contextlib.nullcontext(SimpleNamespace(update=updates.append)))
    run_dir, _ = trained
    model, _ = sample.load_model(list_checkpoints(run_dir)[-1], torch.device("cpu"))
    args = SimpleNamespace(tokens=11, temperature=0.8, top_k=20, seed=3)
    idx = torch.zeros((2, 1), dtype=torch.long)
    shown = sample.generate(model, idx, args, 65, torch.device("cpu"))
    whole = model.generate(idx, args.tokens, temperature=0.8, top_k=20, vocab_limit=65,
                           generator=torch.Generator().manual_seed(3))
    assert shown.shape == (2, args.tokens + 1) and torch.equal(shown, whole) and updates == [1] * args.tokens


def test_sample_builds_its_model_in_its_dtype_and_initialises_nothing(trained, monkeypatch):
    """scripts/sample.py's model holds the checkpoint's weights in --dtype (bf16, on the CPU), its head tied
    to its embedding; building it calls no initialisation (the weights loaded next overwrite every one),
    and torch.nn.init is itself again afterwards."""
    sample = sample_script()
    initialised = []
    monkeypatch.setattr(torch.nn.init, "normal_", lambda tensor, *args, **kwargs: initialised.append(tensor))
    model, _ = sample.load_model(list_checkpoints(trained[0])[-1], torch.device("cpu"), torch.bfloat16)
    assert not initialised
    torch.nn.init.normal_(torch.empty(1))  # torch.nn.init is as it was before the build
    assert len(initialised) == 1
    assert model.lm_head.weight is model.wte.weight and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(torch.equal(value, trained[1]["model"][name].to(torch.bfloat16)) for name, value in model.state_dict().items())
