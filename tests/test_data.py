"""Tokenizers, the token cache and its manifest, local Hugging Face files, and the batch loader."""
import json

import numpy as np
import pytest
import torch

from data.config import DataConfig
from data.loader import BatchLoader
from data.prepare import prepare
from data.tokenizers import CharTokenizer, GPT2Tokenizer, load_tokenizer
from training.errors import UserError


def test_gpt2_ids_match_tiktoken():
    tok = GPT2Tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode([15496, 995]) == "Hello world"
    assert tok.vocab_size == 50257 and tok.eot_id == 50256


def test_gpt2_pattern_is_tiktokens_own():
    from tiktoken_ext.openai_public import r50k_pat_str

    from data.tokenizers import GPT2_PATTERN

    assert GPT2_PATTERN == r50k_pat_str


def test_char_tokenizer_round_trip():
    tok = CharTokenizer.from_text("hello world")
    assert tok.vocab_size == 8 and tok.decode(tok.encode("world hello")) == "world hello"
    with pytest.raises(ValueError, match="not in the char vocabulary"):
        tok.encode("xyz")


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    return prepare(DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache"))))


def test_tiny_shakespeare_token_counts(shakespeare):
    m = shakespeare.manifest
    assert m["tokens"] == {"train": 301_966, "val": 36_059}
    assert m["tokenizer"] == "gpt2" and m["dtype"] == "uint16" and m["vocab_size"] == 50257
    tokens = np.memmap(shakespeare.train_path, dtype=np.uint16, mode="r")
    assert len(tokens) == 301_966
    assert load_tokenizer(m).decode(tokens[:4].tolist()) == "First Citizen:\n"


def test_char_level_shakespeare_has_65_symbols(tmp_path):
    data = prepare(DataConfig(name="sc", tokenizer="char", cache_dir=str(tmp_path)))
    assert data.vocab_size == 65 and len(data.manifest["chars"]) == 65
    assert data.eot_id is None


def test_cache_is_reused_then_rebuilt_when_anything_changes(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 50)
    cfg = DataConfig(name="c", path=str(corpus), cache_dir=str(tmp_path / "cache"))
    first = prepare(cfg)
    assert "no cache yet" in capsys.readouterr().out
    prepare(cfg)
    assert "tokenizing" not in capsys.readouterr().out

    corpus.write_text("Whether 'tis nobler in the mind to suffer. " * 50)
    prepare(cfg)
    assert "the source files changed" in capsys.readouterr().out

    with open(first.train_path, "r+b") as f:
        f.truncate(10)
    prepare(cfg)
    assert "train.bin is missing or truncated" in capsys.readouterr().out

    raw = bytearray(first.val_path.read_bytes())
    raw[0] ^= 0xFF
    first.val_path.write_bytes(bytes(raw))
    prepare(cfg)
    assert "val.bin was altered" in capsys.readouterr().out

    prepare(DataConfig(name="c", path=str(corpus), cache_dir=str(tmp_path / "cache"), tokenizer="char"))
    assert "no cache yet" in capsys.readouterr().out  # another tokenizer, another folder


def test_a_folder_of_text_files_gives_documents_separated_by_end_of_text(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(10):
        (folder / f"{i:02d}.txt").write_text(f"document number {i} " * 20)
    data = prepare(DataConfig(name="f", path=str(folder), cache_dir=str(tmp_path / "cache")))
    assert data.manifest["documents"] == {"train": 9, "val": 1}
    train = np.memmap(data.train_path, dtype=np.uint16, mode="r")
    assert int((train == 50256).sum()) == 9 and train[-1] == 50256


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "folder"])
def test_hf_path_reads_local_files(tmp_path, kind):
    pytest.importorskip("datasets")
    rows = [{"body": f"story {i}: once upon a time there was a tiny model. " * 3} for i in range(40)]
    target = tmp_path / f"corpus.{kind}"
    if kind == "txt":
        target.write_text("".join(r["body"] + "\n" for r in rows))
        column = "text"
    elif kind == "jsonl":
        write_jsonl(target, rows)
        column = "body"
    elif kind == "parquet":
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(target))
        column = "body"
    else:
        target = tmp_path / "shards"
        target.mkdir()
        write_jsonl(target / "a.jsonl", rows[:20])
        write_jsonl(target / "b.jsonl", rows[20:])
        column = "body"
    cfg = DataConfig(name="hf", source="hf", path=str(target), text_column=column, num_proc=2,
                     cache_dir=str(tmp_path / "cache"))
    data = prepare(cfg)
    assert data.manifest["documents"]["train"] + data.manifest["documents"]["val"] == 40
    assert data.manifest["tokens"]["train"] > 1000


def test_hf_wrong_text_column_lists_the_columns(tmp_path):
    pytest.importorskip("datasets")
    write_jsonl(tmp_path / "c.jsonl", [{"body": "hello there"}] * 10)
    cfg = DataConfig(source="hf", path=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match="its columns are: body"):
        prepare(cfg)


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    (b"", "holds no text"),
    (b"caf\xe9 au lait", "is not UTF-8"),
])
def test_unusable_corpus_is_named(tmp_path, content, message):
    corpus = tmp_path / "corpus.txt"
    if content is not None:
        corpus.write_bytes(content)
    with pytest.raises(UserError, match=message):
        prepare(DataConfig(path=str(corpus), cache_dir=str(tmp_path / "cache")))


def make_bin(tmp_path, tokens, dtype="uint16"):
    path = tmp_path / "tokens.bin"
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def test_loader_is_reproducible_resumable_and_shifted(tmp_path):
    path = make_bin(tmp_path, np.arange(5000) % 1000)
    make = lambda rank=0: BatchLoader(path, "uint16", block_size=16, batch_size=4, seed=7, device="cpu", rank=rank)
    a, b = make(), make()
    first = [a.next_batch()[0] for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(first, [b.next_batch()[0] for _ in range(3)]))
    x, y, doc_ids = a.next_batch()
    assert x.shape == (4, 16) and x.dtype == torch.int64 and doc_ids is None
    assert torch.equal(x[:, 1:], y[:, :-1])
    resumed = make()
    resumed.load_state_dict({"batches_drawn": 3})
    assert torch.equal(resumed.next_batch()[0], x)
    assert not torch.equal(make(rank=1).next_batch()[0], first[0])


def test_document_ids_count_end_of_text_tokens_before_each_position(tmp_path):
    eot = 9
    path = make_bin(tmp_path, [1, 2, eot, 3, eot, 4, 5, 6, eot, 7, 8])
    loader = BatchLoader(path, "uint16", block_size=10, batch_size=1, seed=0, device="cpu", eot_id=eot, document_mask=True)
    x, _, doc_ids = loader.next_batch()
    assert x[0].tolist() == [1, 2, eot, 3, eot, 4, 5, 6, eot, 7]
    assert doc_ids[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]


def test_uint32_tokens_for_large_vocabularies(tmp_path):
    path = make_bin(tmp_path, np.arange(100) + 70_000, dtype="uint32")
    x, _, _ = BatchLoader(path, "uint32", block_size=8, batch_size=2, seed=0, device="cpu").next_batch()
    assert int(x.min()) >= 70_000


def test_loader_rejects_a_block_longer_than_the_data(tmp_path):
    path = make_bin(tmp_path, range(10))
    with pytest.raises(UserError, match="model.block_size"):
        BatchLoader(path, "uint16", block_size=64, batch_size=1, seed=0, device="cpu")
