"""DataConfig: where the text comes from, how it is tokenized, and where the token cache lives."""
from dataclasses import dataclass
from typing import Optional

from errors import UserError, check_choice

SOURCES = ("text", "hf")
TOKENIZERS = ("gpt2", "char")


@dataclass
class DataConfig:
    name: str = "shakespeare"  # label of the token cache folder
    source: str = "text"  # text: local UTF-8 file(s) | hf: Hugging Face datasets (hub name or local files)
    path: Optional[str] = None  # text: file or folder (null: the embedded Tiny Shakespeare); hf: dataset name or local file/folder/glob
    hf_config: Optional[str] = None  # hub dataset configuration, e.g. sample-10BT
    text_column: str = "text"
    split: str = "train"  # hub datasets: the split read (local files are one split); validation is carved out of it
    val_fraction: float = 0.1  # held out: by characters for one text, by documents otherwise
    tokenizer: str = "gpt2"  # gpt2 (tiktoken BPE, offline) | char
    cache_dir: str = "data/cache"  # holds <name>-<tokenizer>-<hash of the source settings>/{train.bin,val.bin,manifest.json}
    num_proc: int = 1  # tokenization workers
    max_docs: Optional[int] = None  # only the first N documents (quick experiments)
    document_mask: bool = False  # attention stops at end-of-text tokens (documents packed in a row)


def validate(cfg: DataConfig) -> None:
    """Raise UserError naming the first option whose value cannot work, and how to fix it."""
    if not cfg.name or any(ch in cfg.name for ch in "/\\"):
        raise UserError(f"data.name={cfg.name!r} names the cache folder: give a non-empty label without slashes")
    check_choice("data.source", cfg.source, SOURCES)
    check_choice("data.tokenizer", cfg.tokenizer, TOKENIZERS)
    if cfg.source == "hf" and not cfg.path:
        raise UserError("data=hf needs data.path: a hub dataset name (e.g. roneneldan/TinyStories) "
                        "or local .txt/.jsonl/.parquet files or a folder of them")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise UserError(f"data.val_fraction={cfg.val_fraction} must be between 0 and 1 (e.g. 0.1)")
    if not cfg.text_column:
        raise UserError("data.text_column is empty; give the dataset column that holds the text (e.g. text)")
    if cfg.num_proc < 1:
        raise UserError(f"data.num_proc={cfg.num_proc} must be at least 1")
    if cfg.max_docs is not None and cfg.max_docs < 1:
        raise UserError(f"data.max_docs={cfg.max_docs} must be positive (or null for all)")
    if cfg.document_mask and cfg.tokenizer == "char":
        raise UserError("data.document_mask=true needs document separators; the char tokenizer has none "
                        "(use data.tokenizer=gpt2)")
