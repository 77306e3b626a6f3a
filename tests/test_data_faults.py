"""The token cache and its sources under faults: a full disk while tokenizing, a cache truncated under a
running run, rows without text, a corpus whose vocabulary has no newline."""
import errno
import importlib.util
import os

import numpy as np
import pytest

from conftest import tiny_config
from data.config import DataConfig
from data.loader import BatchLoader, TokenCacheChanged
from data.prepare import prepare
from errors import UserError
import training.run
import training.step
from training import loop
from training.checkpoint import list_checkpoints

HAS_DATASETS = importlib.util.find_spec("datasets") is not None


def test_a_full_disk_while_tokenizing_is_one_line_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The OSError once left a 3 MB .train.bin.tmp that kept the disk full."""
    import data.prepare

    def fills_up(path, arrays, dtype):
        with open(path, "wb") as f:
            f.write(b"\0" * 3000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data.prepare, "write_bin", fills_up)
    cfg = DataConfig(name="full", tokenizer="char", cache_dir=str(tmp_path))
    with pytest.raises(UserError, match=r"no space left on .*full-char-\w+ while tokenizing the embedded Tiny "
                                        r"Shakespeare: the partial cache was removed"):
        prepare(cfg)
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]


def test_a_temporary_file_a_killed_preparation_left_is_removed(tmp_path):
    cfg = DataConfig(name="killed", tokenizer="char", cache_dir=str(tmp_path))
    folder = prepare(cfg).dir
    (folder / "manifest.json").unlink()
    (folder / ".val.bin.tmp").write_bytes(b"\0" * 100)  # what a SIGKILL while writing val.bin leaves
    prepare(cfg)
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "manifest.json", "train.bin", "val.bin"]


def test_a_cache_file_that_is_a_folder_fails_in_one_line(tmp_path):
    cfg = DataConfig(name="dir", tokenizer="char", cache_dir=str(tmp_path))
    folder = prepare(cfg).dir
    (folder / "train.bin").unlink()
    (folder / "train.bin").mkdir()
    with pytest.raises(UserError, match="train.bin is a folder, but it is where a file goes; remove it or point "
                                        "data.cache_dir at another folder"):
        prepare(cfg)


def test_a_loader_whose_file_shrinks_raises_instead_of_dying(tmp_path):
    """A memory map of a file truncated under it killed the process with SIGBUS (status 135, no message)."""
    path = tmp_path / "train.bin"
    np.arange(10_000, dtype=np.uint16).tofile(path)
    loader = BatchLoader(path, "uint16", block_size=16, batch_size=4, seed=0, device="cpu")
    x, y, _ = loader.next_batch()
    assert (y[:, :-1] == x[:, 1:]).all() and (x[:, 1:] - x[:, :-1] == 1).all()
    os.truncate(path, 100)
    with pytest.raises(TokenCacheChanged, match=r"train.bin shrank while this run read it \(from 10,000 to 50 tokens\)"):
        for _ in range(20):
            drawn = loader.batches_drawn
            loader.next_batch()
    assert loader.batches_drawn == drawn  # the batch that failed is not counted: a resume draws it again


def test_a_cache_truncated_during_a_run_saves_the_last_step_and_the_next_run_resumes(tmp_path, monkeypatch):
    cache, corpus = tmp_path / "cache", tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    cfg = tiny_config(str(cache), max_steps=8, ckpt_interval=100, eval_interval=100)
    cfg.data.path = str(corpus)
    real_step = training.step.train_step
    calls = {"n": 0}

    def truncates_after_three(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            (train_bin,) = cache.glob("*/train.bin")
            os.truncate(train_bin, 64)  # another process rewriting the cache in place
        return real_step(*args, **kwargs)

    monkeypatch.setattr(training.run, "train_step", truncates_after_three)
    with pytest.raises(TokenCacheChanged, match=r"shrank while this run read it .* at step 4; step 3 is saved in "
                                                r".*step_0000003.pt; start the same command again to resume"):
        loop.train(cfg, tmp_path / "run")
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_0000003.pt"]
    assert loop.train(cfg, tmp_path / "run")["step"] == 8  # the cache is rebuilt, the run resumes


def test_a_char_corpus_without_a_newline_samples_at_the_end(tmp_path):
    """The end-of-run sample encoded "\\n" and crashed (status 1) after training had finished."""
    corpus = tmp_path / "one-line.txt"
    corpus.write_text("abcdefgh " * 400)
    cfg = tiny_config(str(tmp_path / "cache"), max_steps=2, sample_tokens=8)
    cfg.data = DataConfig(name="oneline", path=str(corpus), tokenizer="char", cache_dir=str(tmp_path / "cache"))
    summary = loop.train(cfg, tmp_path / "run")
    assert len(summary["sample"]) == 8 and (tmp_path / "run" / "sample.txt").read_text() == summary["sample"]


@pytest.mark.skipif(not HAS_DATASETS, reason="datasets is not installed")
def test_rows_without_text_are_counted_and_whitespace_is_no_text(tmp_path, capsys):
    """data=hf dropped rows whose text was missing without a word, and trained on rows of spaces."""
    rows = ['{"text": "document %d"}' % i for i in range(8)] + ['{"other": 1}', '{"text": ""}', '{"text": "   \\n "}']
    (tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n")
    data = prepare(DataConfig(name="rows", source="hf", path=str(tmp_path / "rows.jsonl"), cache_dir=str(tmp_path / "c")))
    assert "skipped 3 of 11 rows of data.path=" in capsys.readouterr().out
    assert data.manifest["documents"] == {"train": 7, "val": 1}
    (tmp_path / "blank.txt").write_text("   \n\t\n  \n")
    with pytest.raises(UserError, match=r"blank.txt has no text in column 'text'"):
        prepare(DataConfig(name="blank", source="hf", path=str(tmp_path / "blank.txt"), cache_dir=str(tmp_path / "c")))


@pytest.mark.skipif(not HAS_DATASETS, reason="datasets is not installed")
def test_an_empty_jsonl_is_one_line(tmp_path):
    """An IndexError from str(err).splitlines()[0] on an empty message."""
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match=r"data.path: .*empty.jsonl is empty; point data.path at a non-empty corpus"):
        prepare(DataConfig(name="empty", source="hf", path=str(tmp_path / "empty.jsonl"), cache_dir=str(tmp_path)))
