"""Text -> token cache: train.bin / val.bin (uint16, or uint32 for vocabularies over 65535) + manifest.json.

The cache folder is <data.cache_dir>/<data.name>-<tokenizer>-<hash of the source settings>. Its
manifest records the tokenizer, the token counts, a digest of the source files and of both bins;
a changed source, tokenizer or a damaged bin is noticed on the next run and the cache is rebuilt
(saying why). Files are written under temporary names and renamed, manifest last, so a killed
preparation never leaves a cache that looks valid.
"""
import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from data.config import DataConfig, validate
from data.tokenizers import CharTokenizer, GPT2Tokenizer
from training.errors import UserError

FORMAT = 1
EMBEDDED = Path(__file__).resolve().parent / "tinyshakespeare" / "input.txt"
FULL_DIGEST_LIMIT = 256 * 2**20  # larger files are digested from their size and two 16 MiB samples
TEXT_SUFFIXES = (".txt", ".text", ".md")
HF_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class PreparedData:
    dir: Path
    train_path: Path
    val_path: Path
    dtype: str  # "uint16" | "uint32"
    vocab_size: int
    eot_id: Optional[int]
    manifest: dict


def prepare(cfg: DataConfig) -> PreparedData:
    """Tokenize the source ``cfg`` names into its cache folder, unless a valid cache is there already."""
    validate(cfg)
    spec = source_spec(cfg)
    folder = Path(cfg.cache_dir).expanduser() / f"{cfg.name}-{cfg.tokenizer}-{_short_hash(spec)}"
    manifest = _read_manifest(folder)
    local_files = _local_files(cfg)
    reason = stale_reason(manifest, spec, folder, local_files)
    if reason:
        print(f"data: tokenizing {describe(cfg)} into {folder} ({reason})", flush=True)
        manifest = build(cfg, spec, folder, local_files)
    return _prepared(folder, manifest)


def describe(cfg: DataConfig) -> str:
    return f"data.path={cfg.path}" if cfg.path else "the embedded Tiny Shakespeare"


def source_spec(cfg: DataConfig) -> dict:
    """Everything that decides the cache's contents except the bytes of the source itself."""
    path = cfg.path
    if path and (Path(path).expanduser().exists() or any(ch in path for ch in "*?[")):
        path = str(Path(path).expanduser().resolve())
    return {"source": cfg.source, "path": path, "hf_config": cfg.hf_config, "split": cfg.split,
            "text_column": cfg.text_column, "tokenizer": cfg.tokenizer, "val_fraction": cfg.val_fraction,
            "max_docs": cfg.max_docs}


def _short_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def file_digest(path: Path) -> str:
    """sha256 of the file, or of its size and two 16 MiB samples when it is over 256 MiB."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= FULL_DIGEST_LIMIT:
            for chunk in iter(lambda: f.read(2**20), b""):
                h.update(chunk)
        else:
            h.update(f.read(16 * 2**20))
            f.seek(size - 16 * 2**20)
            h.update(f.read())
    return h.hexdigest()


def _local_files(cfg: DataConfig) -> Optional[List[Path]]:
    """The local files the source reads, or None for a hub dataset."""
    if cfg.path is None:
        return [EMBEDDED] if cfg.source == "text" else None
    p = Path(cfg.path).expanduser()
    suffixes = TEXT_SUFFIXES if cfg.source == "text" else tuple(HF_BUILDERS)
    if any(ch in cfg.path for ch in "*?["):
        files = sorted(Path(x) for x in glob.glob(str(p)))
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in suffixes and f.is_file())
    elif p.is_file():
        files = [p]
    elif cfg.source == "hf":
        return None  # a hub dataset name
    else:
        raise UserError(f"data.path={cfg.path} does not exist; point data.path at a UTF-8 text file or a folder of them")
    if not files:
        raise UserError(f"data.path={cfg.path} holds no {'/'.join(suffixes)} files")
    return files


def stale_reason(manifest: Optional[dict], spec: dict, folder: Path, local_files) -> str:
    """Why the cache in ``folder`` cannot be used as it is; empty when it can."""
    if manifest is None:
        return "no cache yet"
    if manifest.get("format") != FORMAT or manifest.get("spec") != spec:
        return "the cache was made with other settings"
    if local_files is not None and manifest.get("source_digest") != _sources_digest(local_files):
        return "the source files changed"
    for split in ("train", "val"):
        path = folder / f"{split}.bin"
        expected = manifest["tokens"][split] * np.dtype(manifest["dtype"]).itemsize
        if not path.is_file() or path.stat().st_size != expected:
            return f"{split}.bin is missing or truncated"
        if file_digest(path) != manifest["bin_digest"][split]:
            return f"{split}.bin was altered"
    return ""


def _sources_digest(files: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f).encode())
        h.update(file_digest(f).encode())
    return h.hexdigest()


def _read_manifest(folder: Path) -> Optional[dict]:
    try:
        return json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _prepared(folder: Path, manifest: dict) -> PreparedData:
    return PreparedData(dir=folder, train_path=folder / "train.bin", val_path=folder / "val.bin",
                        dtype=manifest["dtype"], vocab_size=manifest["vocab_size"],
                        eot_id=manifest["eot_id"], manifest=manifest)


def build(cfg: DataConfig, spec: dict, folder: Path, local_files) -> dict:
    """Tokenize the source into ``folder`` and write its manifest last."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").unlink(missing_ok=True)
    if cfg.source == "text":
        docs = read_text_documents(local_files, cfg.max_docs)
        source_digest = _sources_digest(local_files)
    else:
        docs, source_digest = read_hf_documents(cfg, local_files)
    tokenizer = GPT2Tokenizer() if cfg.tokenizer == "gpt2" else CharTokenizer.from_text("".join(docs))
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    counts = {}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        counts[split] = write_tokens(folder / f".{split}.bin.tmp", split_docs, tokenizer, dtype, cfg.num_proc, split)
        if counts[split] == 0:
            raise UserError(f"{describe(cfg)} gives no {split} tokens; the corpus is empty or too small "
                            f"(data.val_fraction={cfg.val_fraction})")
    for split in ("train", "val"):
        os.replace(folder / f".{split}.bin.tmp", folder / f"{split}.bin")
    manifest = {
        "format": FORMAT, "spec": spec, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id, "dtype": np.dtype(dtype).name, "tokens": counts,
        "documents": {"train": len(train_docs), "val": len(val_docs)}, "source_digest": source_digest,
        "bin_digest": {s: file_digest(folder / f"{s}.bin") for s in ("train", "val")},
    }
    if tokenizer.name == "char":
        manifest["chars"] = tokenizer.chars
    tmp = folder / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / "manifest.json")
    return manifest


def read_text_documents(files: Sequence[Path], max_docs: Optional[int]) -> List[str]:
    """One document per file, decoded as UTF-8."""
    docs = []
    for f in files[:max_docs] if max_docs else files:
        try:
            docs.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise UserError(f"{f} is not UTF-8 text (byte {err.start}); convert it, e.g. `iconv -t UTF-8`") from err
    if not any(d.strip() for d in docs):
        raise UserError(f"{files[0] if len(files) == 1 else 'the data.path files'} holds no text; point data.path at a non-empty corpus")
    return docs


def split_documents(docs: List[str], val_fraction: float) -> Tuple[List[str], List[str]]:
    """Hold out the last ``val_fraction`` of the documents; a single document is split by characters."""
    if len(docs) == 1:
        cut = int(len(docs[0]) * (1 - val_fraction))
        return [docs[0][:cut]], [docs[0][cut:]]
    n_val = max(1, round(len(docs) * val_fraction))
    return docs[:-n_val], docs[-n_val:]


def write_tokens(path: Path, docs: List[str], tokenizer, dtype, num_proc: int, split: str) -> int:
    """Encode ``docs`` (an end-of-text token after each when there are several) into ``path``.

    Returns the number of tokens written.
    """
    sep = [tokenizer.eot_id] if tokenizer.eot_id is not None and len(docs) > 1 else []
    total = 0
    batch = 256
    with open(path, "wb") as f, tqdm(total=len(docs), unit="doc", desc=f"tokenize {split}",
                                     disable=len(docs) < 10_000, leave=False) as bar:
        for i in range(0, len(docs), batch):
            for ids in tokenizer.encode_batch(docs[i:i + batch], num_threads=num_proc):
                arr = np.asarray(ids + sep, dtype=dtype)
                arr.tofile(f)
                total += arr.size
            bar.update(min(batch, len(docs) - i))
        f.flush()
        os.fsync(f.fileno())
    return total


def read_hf_documents(cfg: DataConfig, local_files) -> Tuple[List[str], str]:
    """Documents of a Hugging Face dataset (hub name or local files) and a digest of the source."""
    try:
        import datasets
    except ImportError as err:
        raise UserError("data=hf needs the datasets package: `pip install datasets`") from err
    try:
        if local_files is not None:
            builder = _builder_for(local_files)
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in local_files], split="train")
            digest = _sources_digest(local_files)
        else:
            ds = datasets.load_dataset(cfg.path, cfg.hf_config, split=cfg.split)
            digest = f"hub:{cfg.path}:{cfg.hf_config}:{cfg.split}:{ds._fingerprint}"
    except UserError:
        raise
    except (ConnectionError, OSError) as err:
        raise UserError(f"data.path={cfg.path}: the dataset could not be loaded ({type(err).__name__}: "
                        f"{str(err).splitlines()[0][:200]}); without network access use local files "
                        "(data.path=./corpus.jsonl)") from err
    except Exception as err:  # DatasetNotFoundError, bad config name, unreadable file
        raise UserError(f"data.path={cfg.path}: {type(err).__name__}: {str(err).splitlines()[0][:300]}") from err
    if cfg.text_column not in ds.column_names:
        raise UserError(f"data.text_column={cfg.text_column!r} is not a column of {cfg.path}; "
                        f"its columns are: {', '.join(ds.column_names)}")
    if cfg.max_docs:
        ds = ds.select(range(min(cfg.max_docs, len(ds))))
    docs = [t for t in ds[cfg.text_column] if t]
    if not docs:
        raise UserError(f"data.path={cfg.path} has no text in column {cfg.text_column!r}")
    return docs, digest


def _builder_for(files: Sequence[Path]) -> str:
    builders = {HF_BUILDERS.get(f.suffix) for f in files}
    if None in builders or len(builders) != 1:
        raise UserError(f"data.path: files must all be one of .txt, .jsonl/.json or .parquet; "
                        f"got {', '.join(sorted({f.suffix for f in files}))}")
    return builders.pop()


def summary(data: PreparedData) -> str:
    m = data.manifest
    return (f"{data.dir}: tokenizer {m['tokenizer']} (vocab {m['vocab_size']}), {m['dtype']}, "
            f"train {m['tokens']['train']:,} tokens / val {m['tokens']['val']:,} tokens "
            f"({m['documents']['train']:,} / {m['documents']['val']:,} documents)")
