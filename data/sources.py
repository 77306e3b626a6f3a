"""Where the documents come from: local UTF-8 text files, or a Hugging Face dataset.

source=text: every file is one document (data.path null: the embedded Tiny Shakespeare).
source=hf: every row is one document; data.path is a hub dataset name or local files, whose
builder follows the extension (.txt: "text", one document per line; .json/.jsonl: "json";
.parquet: "parquet"). A folder means all such files under it, sorted by path; a glob works too.
``datasets`` is imported only inside ``load_hf_dataset``, so text runs never import it.
"""
import glob
from pathlib import Path
from typing import List, Optional, Sequence

from data.config import DataConfig
from errors import UserError, first_line

EMBEDDED = Path(__file__).resolve().parent / "tinyshakespeare" / "input.txt"
TEXT_SUFFIXES = (".txt", ".text", ".md")
HF_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
GLOB_CHARS = "*?["


def is_glob(path: str) -> bool:
    return any(ch in path for ch in GLOB_CHARS)


def looks_local(path: str) -> bool:
    """A path the user meant as a local file (./x, /x, ~/x, x.jsonl, a glob) rather than a hub name."""
    return path.startswith((".", "/", "~")) or Path(path).suffix in HF_BUILDERS or is_glob(path)


def local_files(cfg: DataConfig) -> Optional[List[Path]]:
    """The local files the source reads, sorted; None for a hub dataset."""
    if cfg.path is None:
        return [EMBEDDED]
    p = Path(cfg.path).expanduser()
    suffixes = TEXT_SUFFIXES if cfg.source == "text" else tuple(HF_BUILDERS)
    if is_glob(cfg.path):
        files = sorted(Path(x) for x in glob.glob(str(p), recursive=True) if Path(x).is_file())
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in suffixes and f.is_file())
    elif p.is_file():
        files = [p]
    elif cfg.source == "hf" and not looks_local(cfg.path):
        return None
    else:
        kinds = "a UTF-8 text file or a folder of them" if cfg.source == "text" else \
            "a .txt/.jsonl/.parquet file, a folder of them, or a hub dataset name (owner/name)"
        raise UserError(f"data.path: {cfg.path} does not exist; point data.path at {kinds}")
    if not files:
        raise UserError(f"data.path: {cfg.path} holds no {'/'.join(suffixes)} files; "
                        "point data.path at a folder that has some")
    return files


def read_text_documents(files: Sequence[Path], max_docs: Optional[int]) -> List[str]:
    """The non-blank files (the first ``max_docs`` of them), decoded as UTF-8."""
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"data.path: {f} is not UTF-8 (invalid byte at offset {err.start}); the corpus must be "
                            "UTF-8 text: convert it, e.g. `iconv -f latin1 -t utf-8`") from err
        if text.strip():
            docs.append(text)
        if max_docs and len(docs) == max_docs:
            break
    if not docs:
        where = files[0] if len(files) == 1 else f"every file of {files[0].parent}"
        raise UserError(f"data.path: {where} holds no text; point data.path at a non-empty corpus")
    return docs


def load_hf_dataset(cfg: DataConfig, files: Optional[Sequence[Path]]):
    """(dataset, source record) for data.path: local files (``files``) or a hub dataset.

    The record names a hub dataset by name, config, split and fingerprint; local files are
    recorded by the caller. The dataset is cut to data.max_docs rows and checked for data.text_column.
    """
    try:
        import datasets
    except ImportError as err:
        raise UserError("data.source=hf needs the datasets package: `pip install datasets`") from err
    if files is not None:
        if all(f.stat().st_size == 0 for f in files):
            raise UserError(f"data.path: {cfg.path} {'is empty' if len(files) == 1 else 'holds only empty files'}; "
                            "point data.path at a non-empty corpus")
        ds = _load(datasets, cfg, builder_for(files), data_files=[str(f) for f in files], split="train")
        record = {}
    else:
        ds = _load(datasets, cfg, cfg.path, cfg.hf_config, split=cfg.split)
        record = {"hub": cfg.path, "config": cfg.hf_config, "split": cfg.split, "fingerprint": ds._fingerprint}
    if cfg.text_column not in ds.column_names:
        raise UserError(f"data.text_column={cfg.text_column!r} is not a column of {cfg.path}; "
                        f"its columns are: {', '.join(ds.column_names)}")
    kind = getattr(ds.features[cfg.text_column], "dtype", None)
    if kind not in ("string", "large_string"):
        raise UserError(f"data.text_column={cfg.text_column!r} holds {kind or ds.features[cfg.text_column]}, not text; "
                        f"choose a text column of: {', '.join(ds.column_names)}")
    if cfg.max_docs:
        ds = ds.select(range(min(cfg.max_docs, len(ds))))
    return ds, record


def _load(datasets, cfg: DataConfig, *args, **kwargs):
    """datasets.load_dataset(*args, **kwargs) with its failures turned into UserErrors."""
    try:
        return datasets.load_dataset(*args, **kwargs)
    except ConnectionError as err:
        raise UserError(f"data.path={cfg.path}: the Hugging Face Hub is unreachable ({first_line(err, 160)}); "
                        "with no network, point data.path at local .txt/.jsonl/.parquet files, or set "
                        "HF_DATASETS_OFFLINE=1 to use a copy already in the Hugging Face cache") from err
    except datasets.exceptions.DatasetNotFoundError as err:
        raise UserError(f"data.path={cfg.path} is neither a local file or folder nor a dataset on the Hugging Face "
                        "Hub; check the name (owner/name) or the path") from err
    except Exception as err:  # a bad data.hf_config or data.split, an unreadable file: datasets says which
        raise UserError(f"data.path={cfg.path} (data.hf_config={cfg.hf_config}, data.split={cfg.split}) could not "
                        f"be loaded: {type(err).__name__}: {first_line(err)}") from err


def builder_for(files: Sequence[Path]) -> str:
    """The datasets builder for local files, from their extension; they must all agree."""
    builders = {HF_BUILDERS.get(f.suffix) for f in files}
    if None in builders or len(builders) != 1:
        raise UserError(f"data.path: files must all be .txt, all .jsonl/.json or all .parquet; "
                        f"got {', '.join(sorted({f.suffix or '(no extension)' for f in files}))}")
    return builders.pop()
