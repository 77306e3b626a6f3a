"""Text -> token cache: train.bin / val.bin (uint16, or uint32 for vocabularies over 65535) + manifest.json.

The cache folder is <data.cache_dir>/<data.name>-<tokenizer>-<hash of the source settings>. A cache
whose manifest no longer matches (settings, source bytes, bin sizes or checksums; see
data/manifest.py) is rebuilt, saying why. Bins are written under temporary names and renamed, the
manifest last, so a killed preparation leaves no valid-looking cache.

One process at a time prepares a cache: the others wait for its lock (data/folders.py), then find
the cache it made and reuse it.

Documents: gpt2 puts the end-of-text token (50256) after every document when the corpus has more
than one; the char tokenizer has none and concatenates them.
Validation split, without shuffling: a corpus of one document (Tiny Shakespeare) is cut at
(1 - data.val_fraction) of its characters; otherwise the last round(n * val_fraction) documents
(at least one, at most n - 1) are the validation split.
"""
import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from tqdm import tqdm

from data.config import DataConfig, validate
from data.folders import (FolderLock, check_file_paths, holder_text, lock_holder, make_folder, out_of_space,
                          remove_temporaries)
from data.manifest import FORMAT, bin_checksum, read_manifest, source_records, stale_reason, write_manifest
from data.sources import is_glob, load_hf_dataset, local_files, read_text_documents
from data.tokenizers import CharTokenizer, GPT2Tokenizer, Tokenizer
from errors import UserError

SPLITS = ("train", "val")
CACHE_FILES = ("train.bin", "val.bin", "manifest.json", ".lock")  # what a cache folder holds (and temporaries)
CHUNK_CHARS = 2**20  # long texts are encoded in pieces of about this many characters
ENCODE_BATCH = 64  # pieces per tiktoken call
PROGRESS_MIN_CHARS = 2**24  # smaller corpora tokenize in a few seconds: no progress bar
# A cut after a newline with non-space characters on both sides splits no GPT-2 pre-token, so
# the pieces encode to exactly the tokens of the whole text.
SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")


@dataclass
class PreparedData:
    dir: Path
    train_path: Path
    val_path: Path
    dtype: np.dtype  # uint16, or uint32 when the vocabulary has more than 65536 ids
    vocab_size: int
    eot_id: Optional[int]
    tokenizer: str  # gpt2 | char
    train_tokens: int
    val_tokens: int
    manifest: dict
    rebuilt: bool  # False when an existing cache was reused


def prepare_from_config(cfg_data) -> PreparedData:
    """``prepare`` for a DataConfig, an OmegaConf node of one (e.g. Hydra's cfg.data) or a plain dict."""
    if not isinstance(cfg_data, DataConfig):
        from omegaconf import DictConfig, OmegaConf

        values = OmegaConf.to_container(cfg_data, resolve=True) if isinstance(cfg_data, DictConfig) else dict(cfg_data)
        try:
            cfg_data = DataConfig(**values)
        except TypeError as err:
            raise UserError(f"data: {err}; valid keys: {', '.join(DataConfig.__dataclass_fields__)}") from err
    return prepare(cfg_data)


def prepare(cfg: DataConfig) -> PreparedData:
    """Tokenize the source ``cfg`` names into its cache folder, unless a valid cache is there already."""
    validate(cfg)
    spec = source_spec(cfg)
    folder = cache_folder(cfg)
    check_file_paths(folder, CACHE_FILES, "data.cache_dir", cfg.cache_dir)
    files = local_files(cfg)
    manifest = read_manifest(folder)
    reason = stale_reason(manifest, spec, folder, files)
    if reason:
        with locked_cache(folder, cfg.cache_dir):
            manifest = read_manifest(folder)  # another process may have made it while this one waited
            reason = stale_reason(manifest, spec, folder, files)
            if reason:
                print(f"data: tokenizing {describe(cfg)} into {folder} ({reason})", flush=True)
                manifest = build(cfg, spec, folder, files)
    return prepared(folder, manifest, rebuilt=bool(reason))


def cache_folder(cfg: DataConfig) -> Path:
    """<data.cache_dir>/<data.name>-<tokenizer>-<hash of the source settings>."""
    return Path(cfg.cache_dir).expanduser() / f"{cfg.name}-{cfg.tokenizer}-{short_hash(source_spec(cfg))}"


@contextlib.contextmanager
def locked_cache(folder: Path, cache_dir: str):
    """Hold ``folder``'s lock (creating the folder), waiting while another process prepares it."""
    make_folder(folder, "data.cache_dir", cache_dir)
    lock = FolderLock(folder)
    if not lock.try_acquire():
        print(f"data: waiting for {holder_text(lock_holder(folder))}, which is preparing {folder}", flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def describe(cfg: DataConfig) -> str:
    return f"data.path={cfg.path}" if cfg.path else "the embedded Tiny Shakespeare"


def source_spec(cfg: DataConfig) -> dict:
    """Every setting that decides the cache's contents (the source's bytes are checked separately)."""
    path = cfg.path
    if path and (Path(path).expanduser().exists() or is_glob(path)):
        path = str(Path(path).expanduser().resolve())
    return {"source": cfg.source, "path": path, "hf_config": cfg.hf_config, "split": cfg.split,
            "text_column": cfg.text_column, "tokenizer": cfg.tokenizer, "val_fraction": cfg.val_fraction,
            "max_docs": cfg.max_docs}


def short_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def prepared(folder: Path, manifest: dict, rebuilt: bool) -> PreparedData:
    return PreparedData(dir=folder, train_path=folder / "train.bin", val_path=folder / "val.bin",
                        dtype=np.dtype(manifest["dtype"]), vocab_size=manifest["vocab_size"],
                        eot_id=manifest["eot_id"], tokenizer=manifest["tokenizer"],
                        train_tokens=manifest["tokens"]["train"], val_tokens=manifest["tokens"]["val"],
                        manifest=manifest, rebuilt=rebuilt)


def corpus_identity(manifest: dict) -> dict:
    """What a checkpoint records of the text it was trained on: {"digest", "described"}. The digest
    covers the source's contents (file hashes, or the hub dataset's fingerprint) and its settings,
    not its path: a corpus moved elsewhere is the same corpus."""
    spec = manifest["spec"]
    source = dict(manifest["source"], files=[record["sha256"] for record in manifest["source"].get("files", [])])
    digest = short_hash({"spec": {k: v for k, v in spec.items() if k != "path"}, "source": source})
    return {"digest": digest, "described": f"data.path={spec['path']}" if spec["path"] else "the embedded Tiny Shakespeare"}


def build(cfg: DataConfig, spec: dict, folder: Path, files: Optional[List[Path]]) -> dict:
    """Tokenize the source into ``folder`` (which exists, and whose lock the caller holds): both bins,
    then the manifest. Returns the manifest.

    The bins are written under temporary names, removed on every way out (an error, a full disk, a
    signal: training/signals.py turns SIGTERM and the like into an exception here); a temporary file
    a killed process left is removed first."""
    remove_temporaries(folder)
    (folder / "manifest.json").unlink(missing_ok=True)
    if cfg.source == "text":
        tokenizer, streams, documents = tokenize_text(cfg, files)
        source = {}
    else:
        tokenizer, streams, documents, source = tokenize_hf(cfg, files)
    if files is not None:
        source["files"] = source_records(files)
    dtype = token_dtype(tokenizer.vocab_size)
    counts = write_bins(cfg, folder, streams, dtype)
    manifest = {
        "format": FORMAT, "spec": spec, "val_fraction": cfg.val_fraction,
        "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
        "dtype": dtype.name, "tokens": counts, "documents": documents, "source": source,
        "bins": {split: bin_checksum(folder / f"{split}.bin") for split in SPLITS},
    }
    if tokenizer.name == "char":
        manifest["chars"] = tokenizer.chars
    write_manifest(folder, manifest)
    return manifest


def write_bins(cfg: DataConfig, folder: Path, streams: dict, dtype: np.dtype) -> dict:
    """Write each split's tokens to ``folder`` (train.bin, val.bin) through temporary files that are removed
    whatever stops the writing; a full disk is one line. Returns {split: token count}."""
    temporary = {split: folder / f".{split}.bin.tmp" for split in SPLITS}
    try:
        counts = {}
        for split in SPLITS:
            counts[split] = write_bin(temporary[split], streams[split], dtype)
            if counts[split] == 0:
                raise UserError(f"{describe(cfg)} gives no {split} tokens: the corpus is too small for "
                                f"data.val_fraction={cfg.val_fraction}; give more text or change data.val_fraction")
        for split in SPLITS:
            os.replace(temporary[split], folder / f"{split}.bin")
        return counts
    except BaseException as err:
        for path in temporary.values():
            path.unlink(missing_ok=True)
        if out_of_space(err):
            raise UserError(f"no space left on {folder} while tokenizing {describe(cfg)}: the partial cache was removed; "
                            "free some space or point data.cache_dir at a disk with room, then start the same command "
                            "again") from err
        raise


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def make_tokenizer(name: str, chars: Iterable[str]) -> Tokenizer:
    """gpt2, or a char tokenizer over the characters of ``chars`` (strings; read only for char)."""
    if name == "gpt2":
        return GPT2Tokenizer()
    return CharTokenizer("".join(sorted(set().union(*map(set, chars)))))


def tokenize_text(cfg: DataConfig, files: List[Path]):
    """(tokenizer, {split: token arrays}, {split: documents}) for local text files (lazy streams)."""
    docs = read_text_documents(files, cfg.max_docs)
    tokenizer = make_tokenizer(cfg.tokenizer, docs)
    separate = tokenizer.eot_id is not None and len(docs) > 1
    parts = split_documents(docs, cfg.val_fraction)
    streams = {split: encode_documents(part, tokenizer, separate, cfg.num_proc, split) for split, part in zip(SPLITS, parts)}
    return tokenizer, streams, {split: len(part) for split, part in zip(SPLITS, parts)}


def split_documents(docs: List[str], val_fraction: float) -> Tuple[List[str], List[str]]:
    """(train, val): one document is cut by characters; of several, the last ones are held out."""
    if len(docs) == 1:
        cut = int(len(docs[0]) * (1 - val_fraction))
        return [docs[0][:cut]], [docs[0][cut:]]
    n_val = val_documents(len(docs), val_fraction)
    return docs[:-n_val], docs[-n_val:]


def val_documents(n: int, val_fraction: float) -> int:
    return max(1, min(n - 1, round(n * val_fraction)))


def text_pieces(text: str, size: int = CHUNK_CHARS) -> List[str]:
    """``text`` cut at safe points (SAFE_CUT) into pieces of about ``size`` characters or more."""
    cuts = [0]
    while cuts[-1] + size < len(text):
        found = SAFE_CUT.search(text, cuts[-1] + size)
        if found is None:
            break
        cuts.append(found.start())
    cuts.append(len(text))
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def encode_documents(docs: Sequence[str], tokenizer: Tokenizer, separate: bool, num_threads: int,
                     split: str) -> Iterator[List[int]]:
    """Token ids of ``docs`` in order, piece by piece, with the end-of-text token after each
    document when ``separate``."""
    pieces = (piece for doc in docs for piece in text_pieces(doc) + ([None] if separate else []))
    total = sum(map(len, docs))
    with tqdm(total=total, unit="char", unit_scale=True, desc=f"tokenize {split}",
              disable=total < PROGRESS_MIN_CHARS) as bar:
        while group := list(islice(pieces, ENCODE_BATCH)):
            encoded = iter(tokenizer.encode_batch([p for p in group if p is not None], num_threads=num_threads))
            for piece in group:
                yield [tokenizer.eot_id] if piece is None else next(encoded)
            bar.update(sum(len(p) for p in group if p is not None))


def write_bin(path: Path, arrays: Iterable[Union[List[int], np.ndarray]], dtype: np.dtype) -> int:
    """Append every array of token ids to ``path`` as ``dtype``, fsync it; returns the token count."""
    total = 0
    with open(path, "wb") as f:
        for ids in arrays:
            arr = np.asarray(ids, dtype=dtype)
            arr.tofile(f)
            total += arr.size
        f.flush()
        os.fsync(f.fileno())
    return total


def tokenize_hf(cfg: DataConfig, files: Optional[List[Path]]):
    """(tokenizer, {split: token arrays}, {split: documents}, source record) for a Hugging Face dataset.

    Tokenization runs in ``datasets.map`` with data.num_proc processes; rows without text are dropped
    (and counted, on stdout) and every document ends with the end-of-text token (gpt2).
    """
    ds, source = load_hf_dataset(cfg, files)
    column = cfg.text_column
    tokenizer = make_tokenizer(cfg.tokenizer, dataset_characters(ds, column, cfg.num_proc) if cfg.tokenizer == "char" else ())
    tokenized = tokenize_dataset(ds, column, tokenizer, cfg.num_proc)
    n = len(tokenized)
    if n == 0:
        raise UserError(f"data.path={cfg.path} has no text in column {column!r}; point data.path at a non-empty dataset")
    if n < len(ds):
        print(f"data: skipped {len(ds) - n:,} of {len(ds):,} rows of data.path={cfg.path} with no text in column "
              f"{column!r} (missing, empty or only whitespace)", flush=True)
    n_val = val_documents(n, cfg.val_fraction)
    parts = {"train": tokenized.select(range(n - n_val)), "val": tokenized.select(range(n - n_val, n))}
    streams = {split: dataset_token_arrays(part) for split, part in parts.items()}
    return tokenizer, streams, {split: len(part) for split, part in parts.items()}, source


def dataset_characters(ds, column: str, num_proc: int) -> List[str]:
    """The distinct characters of each batch of rows (one string per batch)."""
    def chars(batch):
        return {"chars": ["".join(set().union(*map(set, filter(has_text, batch[column]))))]}

    return ds.map(chars, batched=True, num_proc=num_proc, remove_columns=ds.column_names,
                  desc="collect characters")["chars"]


def has_text(text: Optional[str]) -> bool:
    """Whether a row's text is a document: not missing, not empty, not only whitespace (a text file of
    only whitespace is refused the same way, data/sources.py)."""
    return bool(text and text.strip())


def tokenize_dataset(ds, column: str, tokenizer: Tokenizer, num_proc: int):
    """A dataset with one "ids" row (token ids, end-of-text last for gpt2) per document that ``has_text``."""
    import datasets

    eot = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    features = datasets.Features({"ids": datasets.Sequence(datasets.Value(token_dtype(tokenizer.vocab_size).name))})

    def encode(batch):
        return {"ids": [ids + eot for ids in tokenizer.encode_batch([t for t in batch[column] if has_text(t)])]}

    return ds.map(encode, batched=True, num_proc=num_proc, remove_columns=ds.column_names,
                  features=features, desc="tokenize")


def dataset_token_arrays(ds, rows: int = 4096) -> Iterator[np.ndarray]:
    """The "ids" of ``ds`` as flat arrays, ``rows`` documents at a time."""
    import pyarrow.compute as pc

    for table in ds.with_format("arrow").iter(batch_size=rows):
        yield pc.list_flatten(table["ids"]).to_numpy()


def summary(data: PreparedData) -> str:
    m = data.manifest
    state = "tokenized now" if data.rebuilt else "cached"
    return (f"{data.dir} ({state}): tokenizer {m['tokenizer']} (vocab {m['vocab_size']}), {m['dtype']}, "
            f"train {m['tokens']['train']:,} tokens / val {m['tokens']['val']:,} tokens "
            f"({m['documents']['train']:,} / {m['documents']['val']:,} documents)")
