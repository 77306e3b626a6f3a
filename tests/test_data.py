"""Tokenizers, the token cache and its manifest, local Hugging Face files, the batch loader, errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from data.config import DataConfig
from data.loader import BatchLoader
from data.manifest import write_manifest
from data.prepare import prepare, prepare_from_config, prepared, text_pieces
from data.sources import EMBEDDED
from data.tokenizers import CharTokenizer, GPT2Tokenizer, gpt2_encoding, load_tokenizer
from errors import UserError

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- tokenizers

def test_gpt2_ids_match_tiktoken():
    tok = GPT2Tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode([15496, 995]) == "Hello world"
    assert tok.vocab_size == 50257 and tok.eot_id == 50256 and tok.name == "gpt2"


def test_gpt2_end_of_text_only_when_allowed():
    tok = GPT2Tokenizer()
    assert tok.encode("<|endoftext|>", allow_eot=True) == [50256]
    plain = tok.encode("<|endoftext|>")
    assert 50256 not in plain and tok.decode(plain) == "<|endoftext|>"


def test_gpt2_pattern_is_tiktokens_own():
    from tiktoken_ext.openai_public import r50k_pat_str

    from data.tokenizers import GPT2_PATTERN

    assert GPT2_PATTERN == r50k_pat_str


def test_char_tokenizer_round_trip():
    tok = CharTokenizer.from_text("hello world")
    assert tok.vocab_size == 8 and tok.eot_id is None
    assert tok.decode(tok.encode("world hello")) == "world hello"
    with pytest.raises(ValueError, match="not in the char vocabulary"):
        tok.encode("xyz")


def test_load_tokenizer_by_name_or_manifest():
    assert load_tokenizer("gpt2").encode("Hello world") == [15496, 995]
    assert load_tokenizer({"tokenizer": "char", "chars": "ab"}).encode("ba") == [1, 0]
    with pytest.raises(ValueError, match="manifest"):
        load_tokenizer("char")


def test_the_gpt2_ranks_read_from_encoder_json_are_tiktokens_from_both_files():
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    from data.tokenizers import GPT2_DIR, gpt2_mergeable_ranks

    want = data_gym_to_mergeable_bpe_ranks(str(GPT2_DIR / "vocab.bpe"), str(GPT2_DIR / "encoder.json"))
    assert gpt2_mergeable_ranks() == want and len(want) == 50256


def test_long_text_pieces_encode_like_the_whole_text():
    text = EMBEDDED.read_text()[:200_000]
    pieces = text_pieces(text, size=5_000)
    assert len(pieces) > 30 and "".join(pieces) == text
    enc = gpt2_encoding()
    assert [i for p in enc.encode_ordinary_batch(pieces) for i in p] == enc.encode_ordinary(text)


# ---------------------------------------------------------------- the token cache

@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    return prepare(DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache"))))


def test_tiny_shakespeare_token_counts(shakespeare):
    assert (shakespeare.train_tokens, shakespeare.val_tokens) == (301_966, 36_059)
    assert shakespeare.train_tokens + shakespeare.val_tokens == 338_025
    tokens = np.memmap(shakespeare.train_path, dtype=shakespeare.dtype, mode="r")
    assert len(tokens) == 301_966 and shakespeare.dtype == np.uint16
    assert load_tokenizer(shakespeare.manifest).decode(tokens[:4].tolist()) == "First Citizen:\n"


def test_manifest_records_what_the_cache_was_made_from(shakespeare):
    m = json.loads((shakespeare.dir / "manifest.json").read_text())
    assert m == shakespeare.manifest
    assert m["tokenizer"] == "gpt2" and m["vocab_size"] == 50257 and m["eot_id"] == 50256
    assert m["dtype"] == "uint16" and m["tokens"] == {"train": 301_966, "val": 36_059}
    assert m["val_fraction"] == 0.1 and m["spec"]["source"] == "text" and m["spec"]["path"] is None
    [source] = m["source"]["files"]
    assert source["path"] == str(EMBEDDED) and source["bytes"] == 1_115_394 and len(source["sha256"]) == 64
    assert set(m["bins"]) == {"train", "val"} and m["format"] >= 2
    assert not list(shakespeare.dir.glob(".*.tmp"))


def test_a_second_prepare_reuses_the_cache(shakespeare, capsys):
    again = prepare(DataConfig(cache_dir=str(shakespeare.dir.parent)))
    assert shakespeare.rebuilt and not again.rebuilt
    assert "tokenizing" not in capsys.readouterr().out
    assert again.train_path.stat().st_mtime_ns == shakespeare.train_path.stat().st_mtime_ns


def test_char_level_shakespeare_has_65_symbols_and_nanogpts_split(tmp_path):
    """nanoGPT's data/shakespeare_char/prepare.py: ids are the sorted characters, train is the first
    int(n * 0.9) characters and val the rest (1,003,854 and 111,540 tokens)."""
    data = prepare(DataConfig(name="sc", tokenizer="char", cache_dir=str(tmp_path)))
    text = EMBEDDED.read_text(encoding="utf-8")
    assert data.vocab_size == 65 and data.manifest["chars"] == "".join(sorted(set(text)))
    assert data.eot_id is None and (data.train_tokens, data.val_tokens) == (1_003_854, 111_540)
    tokenizer = load_tokenizer(data.manifest)
    cut = int(len(text) * 0.9)
    assert tokenizer.decode(np.fromfile(data.train_path, np.uint16).tolist()) == text[:cut]
    assert tokenizer.decode(np.fromfile(data.val_path, np.uint16).tolist()) == text[cut:]


def rebuild_reason(cfg, capsys) -> str:
    data = prepare(cfg)
    out = capsys.readouterr().out
    assert data.rebuilt == ("tokenizing" in out)
    return out


def test_cache_is_rebuilt_when_anything_changes(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 50)
    cfg = DataConfig(name="c", path=str(corpus), cache_dir=str(tmp_path / "cache"))
    first = prepare(cfg)
    assert "no cache yet" in capsys.readouterr().out

    os.utime(corpus, ns=(1, 1))  # touched, same bytes: read again, not rebuilt
    assert rebuild_reason(cfg, capsys) == ""

    corpus.write_text("Whether 'tis nobler in the mind to suffer.\n" * 50)
    assert "the source file" in rebuild_reason(cfg, capsys)

    with open(first.train_path, "r+b") as f:
        f.truncate(10)
    assert "train.bin is missing or truncated" in rebuild_reason(cfg, capsys)

    raw = bytearray(first.val_path.read_bytes())
    raw[0] ^= 0xFF
    first.val_path.write_bytes(bytes(raw))
    assert "val.bin was altered" in rebuild_reason(cfg, capsys)

    char = DataConfig(name="c", path=str(corpus), cache_dir=str(tmp_path / "cache"), tokenizer="char")
    assert "no cache yet" in rebuild_reason(char, capsys)  # another tokenizer, another folder
    assert prepare(char).dir != first.dir


def test_a_killed_prepare_leaves_no_valid_looking_cache(tmp_path, monkeypatch, capsys):
    import data.prepare as prep

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A short corpus.\n" * 100)
    cfg = DataConfig(name="k", path=str(corpus), cache_dir=str(tmp_path / "cache"))
    prepare(cfg)
    corpus.write_text("Another short corpus.\n" * 100)
    real_write = prep.write_bin

    def killed(path, arrays, dtype):
        if path.name.startswith(".val"):
            raise KeyboardInterrupt
        return real_write(path, arrays, dtype)

    monkeypatch.setattr(prep, "write_bin", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    monkeypatch.undo()
    assert "no cache yet" in rebuild_reason(cfg, capsys)


def test_a_folder_of_text_files_gives_documents_separated_by_end_of_text(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(10):
        (folder / f"{i:02d}.txt").write_text(f"document number {i} " * 20)
    (folder / "blank.txt").write_text("\n")
    data = prepare(DataConfig(name="f", path=str(folder), cache_dir=str(tmp_path / "cache")))
    assert data.manifest["documents"] == {"train": 9, "val": 1}
    train = np.memmap(data.train_path, dtype=np.uint16, mode="r")
    assert int((train == 50256).sum()) == 9 and train[-1] == 50256
    assert GPT2Tokenizer().decode(np.fromfile(data.val_path, np.uint16).tolist()).startswith("document number 9 ")


def test_prepare_from_config_takes_a_hydra_node_or_a_dict(shakespeare):
    node = OmegaConf.structured(DataConfig(cache_dir=str(shakespeare.dir.parent)))
    assert prepare_from_config(node).dir == shakespeare.dir
    assert prepare_from_config({"cache_dir": str(shakespeare.dir.parent)}).dir == shakespeare.dir
    with pytest.raises(UserError, match="valid keys"):
        prepare_from_config({"paht": "x"})


def test_text_source_never_imports_datasets(tmp_path):
    code = (f"import sys; from data.prepare import prepare, DataConfig; "
            f"prepare(DataConfig(tokenizer='char', cache_dir={str(tmp_path)!r})); "
            f"assert 'datasets' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)


# ---------------------------------------------------------------- Hugging Face datasets from local files

@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return datasets


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


STORIES = [{"body": f"story {i}: once upon a time there was a tiny model. " * 3, "id": i} for i in range(40)]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "folder"])
def test_hf_source_reads_local_files(tmp_path, hf_cache, kind):
    target = tmp_path / f"corpus.{kind}"
    column = "body"
    if kind == "txt":
        target.write_text("".join(r["body"] + "\n" for r in STORIES))  # one document per line
        column = "text"
    elif kind == "jsonl":
        write_jsonl(target, STORIES)
    elif kind == "parquet":
        hf_cache.Dataset.from_list(STORIES).to_parquet(str(target))
    else:
        target = tmp_path / "shards"
        target.mkdir()
        write_jsonl(target / "a.jsonl", STORIES[:20])
        write_jsonl(target / "b.jsonl", STORIES[20:])
    cfg = DataConfig(name="hf", source="hf", path=str(target), text_column=column, num_proc=2,
                     cache_dir=str(tmp_path / "cache"))
    data = prepare(cfg)
    assert data.manifest["documents"] == {"train": 36, "val": 4}
    train = np.fromfile(data.train_path, np.uint16)
    assert int((train == 50256).sum()) == 36 and train[-1] == 50256
    val_text = GPT2Tokenizer().decode(np.fromfile(data.val_path, np.uint16).tolist())
    assert val_text.startswith("story 36: once upon a time")
    assert not prepare(cfg).rebuilt


def test_hf_char_tokenizer_and_max_docs(tmp_path, hf_cache):
    write_jsonl(tmp_path / "c.jsonl", STORIES)
    data = prepare(DataConfig(source="hf", path=str(tmp_path / "c.jsonl"), text_column="body", tokenizer="char",
                              max_docs=10, cache_dir=str(tmp_path / "cache")))
    assert data.manifest["documents"] == {"train": 9, "val": 1}
    assert data.manifest["chars"] == "".join(sorted(set("".join(r["body"] for r in STORIES[:10]))))


def test_hf_wrong_text_column_lists_the_columns(tmp_path, hf_cache):
    write_jsonl(tmp_path / "c.jsonl", STORIES)
    cfg = DataConfig(source="hf", path=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"data.text_column='text' .* its columns are: body, id"):
        prepare(cfg)
    with pytest.raises(UserError, match="data.text_column='id' holds int64, not text"):
        prepare(DataConfig(source="hf", path=str(tmp_path / "c.jsonl"), text_column="id", cache_dir=str(tmp_path)))


def test_hf_without_the_hub_says_so(tmp_path, hf_cache, monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'roneneldan/TinyStories' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(hf_cache, "load_dataset", offline)
    with pytest.raises(UserError, match="Hub is unreachable.*local"):
        prepare(DataConfig(source="hf", path="roneneldan/TinyStories", cache_dir=str(tmp_path)))


def test_hf_without_the_datasets_package_says_how_to_install_it(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "c.jsonl", STORIES)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError, match="pip install datasets"):
        prepare(DataConfig(source="hf", path=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path)))


# ---------------------------------------------------------------- errors a user can fix

@pytest.mark.parametrize("content,message", [
    (None, "data.path: .*corpus.txt does not exist"),
    (b"", "data.path: .*corpus.txt holds no text"),
    (b"caf\xe9 au lait", r"data.path: .*corpus.txt is not UTF-8 .*must be UTF-8"),
], ids=["missing", "empty", "latin1"])
def test_unusable_corpus_is_named(tmp_path, content, message):
    corpus = tmp_path / "corpus.txt"
    if content is not None:
        corpus.write_bytes(content)
    with pytest.raises(UserError, match=message):
        prepare(DataConfig(path=str(corpus), cache_dir=str(tmp_path / "cache")))


@pytest.mark.parametrize("option,value", [
    ("source", "web"), ("tokenizer", "bpe"), ("val_fraction", 1.0), ("num_proc", 0), ("max_docs", 0), ("name", "a/b"),
])
def test_bad_settings_name_the_option(tmp_path, option, value):
    with pytest.raises(UserError, match=f"data.{option}"):
        prepare(DataConfig(cache_dir=str(tmp_path), **{option: value}))


def test_a_local_looking_hf_path_that_is_missing_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        prepare(DataConfig(source="hf", path=str(tmp_path / "stories.jsonl"), cache_dir=str(tmp_path)))


def test_prepare_script_takes_hydra_overrides(tmp_path):
    script = [sys.executable, "-m", "scripts.prepare_data", f"hydra.run.dir={tmp_path}/run"]
    ok = subprocess.run(script + ["data=shakespeare_char", f"data.cache_dir={tmp_path}"], cwd=REPO,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "tokenizer char (vocab 65)" in ok.stdout
    bad = subprocess.run(script + ["data.path=/no/such/file.txt"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "data.path: /no/such/file.txt does not exist" in bad.stderr


# ---------------------------------------------------------------- the batch loader

def make_bin(tmp_path, tokens, dtype="uint16"):
    path = tmp_path / "tokens.bin"
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def test_loader_is_reproducible_resumable_and_shifted(tmp_path):
    path = make_bin(tmp_path, np.arange(5000) % 1000)

    def make(rank=0):
        return BatchLoader(path, "uint16", block_size=16, batch_size=4, seed=7, device="cpu", rank=rank, world_size=2)

    a, b = make(), make()
    first = [a.next_batch()[0] for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(first, [b.next_batch()[0] for _ in range(3)]))
    x, y, doc_ids = a.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64 and doc_ids is None
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal((x[:, -1] + 1) % 1000, y[:, -1])
    assert a.state_dict() == {"batches_drawn": 4, "ranks": 2}
    resumed = make()
    resumed.load_state_dict({"batches_drawn": 3})
    assert torch.equal(resumed.next_batch()[0], x)
    other_rank = make(rank=1)
    assert not any(torch.equal(other_rank.next_batch()[0], f) for f in first)


def test_document_ids_count_end_of_text_tokens_before_each_position(tmp_path):
    eot = 9
    path = make_bin(tmp_path, [1, 2, eot, 3, eot, 4, 5, 6, eot, 7, 8])
    loader = BatchLoader(path, "uint16", block_size=10, batch_size=1, seed=0, device="cpu", eot_id=eot, document_mask=True)
    x, _, doc_ids = loader.next_batch()
    assert x[0].tolist() == [1, 2, eot, 3, eot, 4, 5, 6, eot, 7]
    assert doc_ids.dtype == torch.int32 and doc_ids[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]


def test_uint32_tokens_for_vocabularies_over_65536(tmp_path):
    tokens = np.arange(100, dtype=np.uint32) + 70_000
    tokens.tofile(tmp_path / "train.bin")
    tokens[:20].tofile(tmp_path / "val.bin")
    manifest = {"tokenizer": "fake", "vocab_size": 100_000, "eot_id": None, "dtype": "uint32",
                "tokens": {"train": 100, "val": 20}}
    write_manifest(tmp_path, manifest)
    data = prepared(tmp_path, manifest, rebuilt=False)
    assert data.dtype == np.uint32
    x, y, _ = BatchLoader(data.train_path, data.dtype, block_size=8, batch_size=2, seed=0, device="cpu").next_batch()
    assert int(x.min()) >= 70_000 and torch.equal(y, x + 1)


def test_loader_rejects_a_block_longer_than_the_data(tmp_path):
    path = make_bin(tmp_path, range(10))
    with pytest.raises(UserError, match=r"10 tokens.*model.block_size"):
        BatchLoader(path, "uint16", block_size=64, batch_size=1, seed=0, device="cpu")


@pytest.mark.parametrize("damaged,why", [
    (lambda m: "[]", "not a cache manifest"),
    (lambda m: json.dumps({k: v for k, v in m.items() if k != "bins"}), "not a cache manifest"),
    (lambda m: json.dumps({**m, "tokens": [1, 2]}), "not a cache manifest"),
    (lambda m: '{"format": 2}', "not a cache manifest"),
    (lambda m: "{not json", "not JSON"),
], ids=["a-list", "without-bins", "tokens-a-list", "only-format", "not-json"])
def test_a_damaged_manifest_is_rebuilt_saying_why(tmp_path, capsys, damaged, why):
    """Valid JSON of the wrong shape once gave a traceback on every run until deleted by hand."""
    cfg = DataConfig(name="m", tokenizer="char", cache_dir=str(tmp_path / "cache"))
    first = prepare(cfg)
    (first.dir / "manifest.json").write_text(damaged(first.manifest))
    capsys.readouterr()
    again = prepare(cfg)
    assert f"manifest.json is damaged ({why})" in capsys.readouterr().out
    assert again.rebuilt and again.manifest == first.manifest
