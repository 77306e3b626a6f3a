"""The rest of the bad-input catalogue (test_errors.py holds the first 15 command-line cases).

Each wrong option or input stops with one clear line that names it, a non-zero exit and no traceback.
"""
import importlib
import importlib.util
import re

import pytest

from conftest import assert_one_error_line, indexed, tiny_config, walk_train
from errors import UserError
from training import loop


def corpus(tmp_path, content: bytes) -> str:
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    return str(path)


CLI_CASES = [
    pytest.param(lambda t: ["trainer.max_steps=abc"], "trainer.max_steps=abc has the wrong type", id="int-given-text"),
    pytest.param(lambda t: ["model.bias=maybe"], "takes true or false", id="bool-given-text"),
    pytest.param(lambda t: ["optim.lr=fast"], "optim.lr=fast has the wrong type", id="float-given-text"),
    pytest.param(lambda t: ["data=hf"], "data=hf needs data.path", id="hf-without-path"),
    pytest.param(lambda t: [f"data.path={t}/nope.txt"], "does not exist", id="missing-corpus"),
    pytest.param(lambda t: [f"data.path={corpus(t, b'')}"], "holds no text", id="empty-corpus"),
    pytest.param(lambda t: [f"data.path={corpus(t, bytes([0xff, 0xfe, 0x41]))}"], "is not UTF-8", id="non-utf8-corpus"),
    pytest.param(lambda t: ["model.block_size=200000"], "fewer than model.block_size + 1", id="block-longer-than-data"),
    pytest.param(lambda t: ["model.dropout=1.5"], "model.dropout=1.5 must be in [0, 1)", id="dropout-range"),
    pytest.param(lambda t: ["optim.betas=[0.9]"], "optim.betas=[0.9] must be two numbers", id="betas-length"),
    pytest.param(lambda t: ["trainer.grad_clip=-1"], "trainer.grad_clip=-1.0 must be >= 0", id="negative-clip"),
    pytest.param(lambda t: ["data.val_fraction=0"], "data.val_fraction=0.0 must be between 0 and 1", id="val-fraction"),
    pytest.param(lambda t: ["model.norm=batchnorm"], "model.norm='batchnorm' is not one of layernorm, rmsnorm", id="bad-norm"),
    pytest.param(lambda t: ["data.tokenizer=bpe"], "data.tokenizer='bpe' is not one of gpt2, char", id="bad-tokenizer"),
    pytest.param(lambda t: ["model.pos=rope", "model.n_embd=36", "model.n_head=4"], "model.pos=rope needs an even head size", id="rope-odd-head"),
    pytest.param(lambda t: ["trainer.batch_size=auto"], "trainer.batch_size=auto measures GPU memory", id="auto-batch-on-cpu"),
    pytest.param(lambda t: ["trainer.batch_size=lots"], "trainer.batch_size='lots' must be a positive integer or auto", id="batch-text"),
    pytest.param(lambda t: ["logger=wandb", "logger.mode=disabled"], "logger=wandb needs the wandb package", id="wandb-missing",
                 marks=pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")),
    pytest.param(lambda t: ["data.document_mask=true"], "data.document_mask=true needs document separators", id="doc-mask-char"),
    pytest.param(lambda t: [f"trainer.resume={corpus(t, b'not a checkpoint')}"], "is corrupt or not a nanoflash checkpoint", id="resume-garbage"),
    pytest.param(lambda t: ["trainer.vram_budget_gb=-2"], "trainer.vram_budget_gb=-2.0 must be a positive number", id="negative-budget"),
]


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    """Every case of CLI_CASES, then of MORE_CLI_CASES, its `python train.py` (its arguments made in its own
    folder) in one process (conftest.walk_train): [status, stderr, stdout] each."""
    cases = CLI_CASES + MORE_CLI_CASES
    tmp_root = tmp_path_factory.mktemp("bad-inputs")
    folders = [tmp_root / str(i) for i in range(len(cases))]
    for folder in folders:
        folder.mkdir()
    return walk_train([case.values[0](folder) for case, folder in zip(cases, folders)], tmp_root / "runs")


@pytest.mark.parametrize("case", indexed(CLI_CASES))
def test_wrong_input_fails_with_one_clear_line(walked, case):
    code, stderr, _ = walked[case]
    assert code != 0
    assert_one_error_line(stderr, CLI_CASES[case].values[1])


def test_resume_from_another_models_checkpoint_names_the_difference(tmp_path, data_cache):
    cfg = tiny_config(data_cache, max_steps=5, ckpt_interval=5)
    loop.train(cfg, tmp_path)
    cfg.model.n_layer = 3
    with pytest.raises(UserError, match=r"made with model.n_layer=2 but this run has model.n_layer=3.*trainer.resume=none"):
        loop.train(cfg, tmp_path)


def test_resume_with_another_tokenizer_names_the_vocabulary_mismatch(tmp_path, data_cache):
    cfg = tiny_config(data_cache, max_steps=5, ckpt_interval=5)
    loop.train(cfg, tmp_path)
    cfg.data.tokenizer, cfg.data.name = "gpt2", "shakespeare"
    with pytest.raises(UserError, match="model.vocab_size=128 but this run has model.vocab_size=50304"):
        loop.train(cfg, tmp_path)


def test_model_vocab_smaller_than_the_tokenizer(tmp_path, data_cache):
    cfg = tiny_config(data_cache, max_steps=2)
    cfg.model.vocab_size = 10
    with pytest.raises(UserError, match="model.vocab_size=10 is smaller than the tokenizer's 65 tokens"):
        loop.train(cfg, tmp_path)


MORE_CLI_CASES = [
    pytest.param(lambda t: ["optim.lr=nan"], "optim.lr=nan is not a finite number", id="nan-lr"),
    pytest.param(lambda t: ["optim.eps=-1"], "optim.eps=-1.0 must be a positive number", id="negative-eps"),
    pytest.param(lambda t: ["trainer.seed=-1"], "trainer.seed=-1 must be >= 0", id="negative-seed"),
    pytest.param(lambda t: ["~model.n_layer"], "options of the schema cannot be removed", id="delete-a-schema-key"),
    pytest.param(lambda t: [f"data.cache_dir={corpus(t, b'')}"], "corpus.txt is a file, not a folder", id="cache-dir-is-a-file"),
    pytest.param(lambda t: ["trainer.run_name=${eval:1+1}"], "'eval' is not a config resolver", id="unknown-resolver"),
    pytest.param(lambda t: ["trainer.run_name=\\${eval:1}"], "a literal '${' cannot be kept", id="escaped-interpolation"),
    pytest.param(lambda t: ["trainer.run_name=${oc.env:NANOFLASH_UNSET_VARIABLE}"], "Environment variable 'NANOFLASH_UNSET_VARIABLE' not found", id="missing-env-var"),
    pytest.param(lambda t: ["data=hf", f"data.path={jsonl(t)}", "data.text_column=body"], "data.text_column='body' is not a column", id="hf-wrong-column",
                 marks=pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="datasets is not installed")),
]


def jsonl(tmp_path) -> str:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(f'{{"text": "document number {i}"}}\n' for i in range(50)))
    return str(path)


@pytest.mark.parametrize("case", indexed(MORE_CLI_CASES))
def test_more_wrong_inputs_fail_with_one_clear_line(walked, case):
    code, stderr, _ = walked[len(CLI_CASES) + case]
    assert code == 2
    assert_one_error_line(stderr, MORE_CLI_CASES[case].values[1])


OVERRIDE_CASES = [  # checked before Hydra runs: in-process, no subprocess needed
    pytest.param(["optim.betas=0.9"], "optim.betas=0.9 has the wrong type: it takes a list", id="list-given-number"),
    pytest.param(["model.n_layer=1.5"], "model.n_layer=1.5 has the wrong type: it takes an integer", id="int-given-float"),
    pytest.param(["trainer.keep_best=maybe"], "trainer.keep_best=maybe has the wrong type: it takes true or false", id="bool-given-word"),
    pytest.param(["trainer.max_steps=null"], "trainer.max_steps cannot be null", id="null-int"),
    pytest.param(["data.path=__import__('os').system('x')"], "cannot parse the overrides", id="python-in-a-value"),
    pytest.param(["optim=sgd"], "optim=sgd is not a config; choose one of: adamw, muon", id="unknown-optimizer"),
    pytest.param(["logger=tensorboard"], "logger=tensorboard is not a config; choose one of: default, wandb", id="unknown-logger"),
    pytest.param(["-m", "attention=naive,flsh"], "attention=flsh is not a config", id="unknown-choice-in-a-sweep"),
    pytest.param(["+trainer.lr=1"], "trainer has no key 'lr'", id="appended-unknown-key"),
    pytest.param(["~model.n_layer"], "~model.n_layer: options of the schema cannot be removed; set a value instead", id="delete-a-schema-key"),
    pytest.param(["-m", "trainer.max_steps=3,abc"], "trainer.max_steps=abc has the wrong type: it takes an integer", id="int-sweep-given-text"),
    pytest.param(["-m", "optim.lr=1e-3,fast"], "optim.lr=fast has the wrong type: it takes a number", id="float-sweep-given-text"),
    pytest.param(["-m", "trainer.keep_best=range(0,2)"], "trainer.keep_best=0 has the wrong type: it takes true or false", id="bool-sweep-given-range"),
]


@pytest.mark.parametrize("args,message", OVERRIDE_CASES)
def test_wrong_overrides_fail_before_hydra_in_one_line(args, message, capsys):
    from training.cli import check_overrides

    with pytest.raises(SystemExit) as exited:
        check_overrides(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_interpolations_are_resolved_by_omegaconf_never_evaluated(capsys):
    from training.cli import check_overrides

    check_overrides(["trainer.run_name=${oc.env:HOME}-${model.name}", "trainer.log_interval=${trainer.eval_interval}"])
    assert capsys.readouterr().err == ""


VALIDATION_CASES = [  # values the schema accepts but validate() must reject
    pytest.param("trainer", "keep_checkpoints", 0, "trainer.keep_checkpoints=0 must be a positive number", id="keep-zero"),
    pytest.param("trainer", "max_bad_steps", 0, "trainer.max_bad_steps=0 must be a positive number", id="bad-steps-zero"),
    pytest.param("trainer", "grad_accum", -2, "trainer.grad_accum=-2 must be a positive number", id="negative-accum"),
    pytest.param("trainer", "profile_steps", -1, "trainer.profile_steps=-1 must be >= 0", id="negative-profile"),
    pytest.param("trainer", "device", "tpu", "trainer.device='tpu' is not one of auto, cpu, cuda", id="unknown-device"),
    pytest.param("optim", "lr", -1.0, "optim.lr=-1.0 must be a positive number", id="negative-lr"),
    pytest.param("optim", "decay_fraction", 0.0, "optim.decay_fraction=0.0 must be in (0, 1]", id="decay-fraction"),
    pytest.param("attention", "window", 0, "attention.window=0 must be a positive number of keys", id="zero-window"),
    pytest.param("attention", "name", "flsh", "attention='flsh' is not a backend", id="backend-by-key"),
    pytest.param("data", "num_proc", 0, "data.num_proc=0 must be at least 1", id="zero-workers"),
    pytest.param("data", "max_docs", 0, "data.max_docs=0 must be positive", id="zero-docs"),
    pytest.param("data", "source", "s3", "data.source='s3' is not one of text, hf", id="unknown-source"),
    pytest.param("logger", "mode", "loud", "logger.mode='loud' is not one of online, offline, disabled", id="wandb-mode"),
    pytest.param("optim", "lr", float("nan"), "optim.lr=nan is not a finite number", id="nan-lr"),
    pytest.param("optim", "eps", -1.0, "optim.eps=-1.0 must be a positive number", id="negative-eps"),
    pytest.param("trainer", "seed", -1, "trainer.seed=-1 must be >= 0", id="negative-seed"),
    pytest.param("trainer", "seed", 2**64, f"trainer.seed={2**64} must be below 2**64", id="huge-seed"),
    pytest.param("trainer", "compile", "maybe", "trainer.compile='maybe' must be true, false or blocks", id="compile-word"),
    pytest.param("model", "mlp", "relu", "model.mlp='relu' is not one of gelu, swiglu, relu2", id="unknown-mlp"),
    pytest.param("model", "skips", "dense", "model.skips='dense' is not one of none, unet", id="unknown-skips"),
    pytest.param("model", "logit_softcap", 0.0, "model.logit_softcap=0.0 must be a positive number", id="zero-softcap"),
    pytest.param("model", "value_embeds", 2, "model.value_embeds=2 must be between 0 (none) and n_layer/2 = 1", id="ve-too-many"),
    pytest.param("model", "recompute_attention", True, "model.recompute_attention=true acts on activation "
                 "checkpointing's recompute: add model.activation_checkpointing=true", id="recompute-without-checkpoints"),
    pytest.param("optim", "name", "sgd", "optim='sgd' is not one of adamw, muon", id="unknown-optimizer-by-key"),
    pytest.param("optim", "muon_momentum", 1.0, "optim.muon_momentum=1.0 must be in [0, 1)", id="muon-momentum"),
    pytest.param("optim", "muon_coefficients", "cubic", "optim.muon_coefficients='cubic' is not one of polar_express, "
                 "jordan", id="muon-coefficients"),
    pytest.param("optim", "head_lr", -1.0, "optim.head_lr=-1.0 must be a positive number", id="negative-head-lr"),
]


@pytest.mark.parametrize("group,key,value,message", VALIDATION_CASES)
def test_wrong_values_are_rejected_when_the_config_is_built(data_cache, group, key, value, message):
    from training.config import validate

    cfg = tiny_config(data_cache)
    setattr(getattr(cfg, group), key, value)
    with pytest.raises(UserError, match=re.escape(message)):
        validate(cfg)


def test_resume_from_a_folder_or_a_foreign_torch_file(tmp_path, data_cache):
    import torch

    cfg = tiny_config(data_cache, max_steps=2, resume=str(tmp_path / "missing.pt"))
    with pytest.raises(UserError, match="no such checkpoint; use trainer.resume=auto or none"):
        loop.train(cfg, tmp_path / "run")
    cfg.trainer.resume = str(tmp_path)
    with pytest.raises(UserError, match="is a folder but not a complete sharded checkpoint"):
        loop.train(cfg, tmp_path / "run")
    foreign = tmp_path / "weights.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, foreign)
    cfg.trainer.resume = str(foreign)
    with pytest.raises(UserError, match="is not a nanoflash checkpoint .no model or step inside"):
        loop.train(cfg, tmp_path / "run")


def test_a_folder_without_text_files(tmp_path, data_cache):
    from data.prepare import prepare

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "notes.pdf").write_bytes(b"%PDF")
    cfg = tiny_config(str(tmp_path / "cache")).data
    cfg.path = str(tmp_path / "corpus")
    with pytest.raises(UserError, match="holds no .txt/.text/.md files"):
        prepare(cfg)


def test_deleting_a_group_choice_is_still_allowed(capsys):
    from training.cli import check_overrides

    check_overrides(["~local", "~experiment"])
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def char_run(tmp_path_factory, data_cache):
    """A finished two-step run of the char model, its checkpoint and metrics."""
    run_dir = tmp_path_factory.mktemp("char-run")
    loop.train(tiny_config(data_cache, max_steps=2, ckpt_interval=2, log_interval=1), run_dir)
    return run_dir


def script(name: str):
    return importlib.import_module(f"scripts.{name}")


SAMPLE_CASES = [
    pytest.param(["--prompt", "caf\u00e9"], "--prompt has the character '\u00e9', which the char vocabulary of this checkpoint lacks", id="prompt-outside-the-vocabulary"),
    pytest.param(["--samples", "0"], "--samples=0 must be a positive integer", id="zero-samples"),
    pytest.param(["--top-k", "0"], "--top-k=0 must be a positive integer", id="zero-top-k"),
    pytest.param(["--tokens", "-5"], "--tokens=-5 must be >= 0", id="negative-tokens"),
    pytest.param(["--temperature", "nan"], "--temperature=nan is not a finite number", id="nan-temperature"),
]


@pytest.mark.parametrize("args,message", SAMPLE_CASES)
def test_sample_script_wrong_inputs_are_one_line(char_run, args, message):
    with pytest.raises(UserError, match=re.escape(message)):
        script("sample").main([str(char_run), "--device", "cpu", "--tokens", "3", *args])


def test_compare_runs_skips_a_half_written_last_line_with_a_note(char_run, tmp_path, capsys):
    import shutil

    run_dir = tmp_path / "killed"
    shutil.copytree(char_run, run_dir)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 2.4')  # what a SIGKILL in the middle of a write leaves
    script("compare_runs").main([str(run_dir)])
    out, err = capsys.readouterr()
    assert "| killed |" in out and "| 2 |" in out
    assert err.strip() == f"note: {run_dir / 'metrics.jsonl'}: skipped 1 line cut short (a run killed while writing it)"
