"""A checkpoint carries its tokenizer and the identity of its corpus: a resume refuses another
tokenizer, says once that the corpus changed, and scripts/sample.py needs neither corpus nor cache."""
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, run_env, tiny_config
from data.tokenizers import CharTokenizer, GPT2Tokenizer, load_tokenizer
from errors import UserError
from training import loop
from training.checkpoint import list_checkpoints, load_checkpoint

SHAKESPEARE = (REPO / "data" / "tinyshakespeare" / "input.txt").read_text()


def test_resume_refuses_a_changed_character_vocabulary(tmp_path, data_cache):
    """Shakespeare has 65 characters and a corpus of 105 pads to the same model.vocab_size (128):
    the shapes match, but token ids would mean other characters."""
    cfg = tiny_config(data_cache, max_steps=5, ckpt_interval=5)
    loop.train(cfg, tmp_path / "run")
    wider = tmp_path / "wider.txt"
    wider.write_text(SHAKESPEARE + "".join(chr(0xC0 + i) for i in range(40)) * 5)
    cfg.data.path, cfg.trainer.max_steps = str(wider), 10
    with pytest.raises(UserError, match=r"step_0000005.pt was trained with the char tokenizer \(65 characters\) but "
                                        r"this run's data gives the char tokenizer \(105 characters\).*trainer.resume=none"):
        loop.train(cfg, tmp_path / "run")


def test_a_changed_corpus_with_the_same_tokenizer_resumes_and_says_so_once(tmp_path, capsys):
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text(SHAKESPEARE[:30000])
    second.write_text(SHAKESPEARE[-30000:])
    cfg = tiny_config(str(tmp_path / "cache"), max_steps=3, ckpt_interval=3)
    cfg.data.tokenizer, cfg.data.name, cfg.data.path = "gpt2", "bpe", str(first)
    loop.train(cfg, tmp_path / "run")
    capsys.readouterr()
    cfg.data.path, cfg.trainer.max_steps = str(second), 6
    loop.train(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    assert out.count("this run continues it on") == 1, out
    assert f"trained on data.path={first}" in out and f"continues it on data.path={second}" in out
    cfg.trainer.max_steps = 8  # its own checkpoints now carry the new corpus: nothing more to say
    loop.train(cfg, tmp_path / "run")
    assert "continues it on" not in capsys.readouterr().out


def test_a_checkpoint_rebuilds_its_tokenizer():
    chars = CharTokenizer("abc\n")
    assert load_tokenizer(chars.identity).encode("cab\n") == [2, 0, 1, 3]
    assert load_tokenizer(GPT2Tokenizer().identity).encode("Hello") == GPT2Tokenizer().encode("Hello")
    with pytest.raises(UserError, match="other GPT-2 BPE files"):
        load_tokenizer({**GPT2Tokenizer().identity, "files_sha256": "0" * 64})


def test_sample_works_from_any_folder_without_the_corpus_or_its_cache(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SHAKESPEARE[:20000])
    cfg = tiny_config(str(tmp_path / "cache"), max_steps=2, ckpt_interval=2)
    cfg.data.path = str(corpus)
    loop.train(cfg, tmp_path / "run")
    assert load_checkpoint(list_checkpoints(tmp_path / "run")[-1])["tokenizer"]["tokenizer"] == "char"
    corpus.unlink()
    shutil.rmtree(tmp_path / "cache")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-m", "scripts.sample", str(tmp_path / "run"), "--tokens", "20",
                           "--prompt", "ROMEO:", "--device", "cpu"],
                          cwd=elsewhere, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout.split("---")[0]) > len("ROMEO:")
    assert list(elsewhere.iterdir()) == []  # no token cache made here
