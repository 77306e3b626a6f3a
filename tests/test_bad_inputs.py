"""The rest of the bad-input catalogue (test_errors.py holds the first 15 command-line cases).

Each wrong option or input stops with one clear line that names it, a non-zero exit and no traceback.
"""
import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO, run_env, tiny_config
from training import loop
from training.errors import UserError

QUICK = ["model=tiny", "data=shakespeare_char", "trainer.max_steps=2", "trainer.sample_tokens=0",
         "logger.progress=false", "trainer.eval_iters=1"]


def run_train(args, tmp_path):
    cmd = [sys.executable, "train.py", *QUICK, f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", *args]
    return subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)


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
    pytest.param(lambda t: ["logger=wandb", "logger.mode=disabled"], "logger=wandb needs the wandb package", id="wandb-missing"),
    pytest.param(lambda t: ["data.document_mask=true"], "data.document_mask=true needs document separators", id="doc-mask-char"),
    pytest.param(lambda t: [f"trainer.resume={corpus(t, b'not a checkpoint')}"], "is corrupt or not a nanoflash checkpoint", id="resume-garbage"),
    pytest.param(lambda t: ["trainer.vram_budget_gb=-2"], "trainer.vram_budget_gb=-2.0 must be a positive number", id="negative-budget"),
]


@pytest.mark.parametrize("make_args,message", CLI_CASES)
def test_wrong_input_fails_with_one_clear_line(tmp_path, make_args, message):
    if "wandb" in message and importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed here")
    proc = run_train(make_args(tmp_path), tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error:")]) == 1


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
