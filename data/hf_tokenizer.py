"""Our tokenizers as Hugging Face tokenizer files, and which of ours a Hugging Face folder's tokenizer is.

GPT-2 BPE: data/gpt2's files are GPT-2's vocab.json and merges.txt. They are written under those
names beside a tokenizer.json (the same byte-level BPE) and a tokenizer_config.json naming
GPT2TokenizerFast, as GPT-2's own folder has them. The char tokenizer: a tokenizer.json whose
WordLevel vocabulary is the characters, split one at a time and joined back with nothing between,
under PreTrainedTokenizerFast, so ``decode(encode(text)) == text``. Writing needs the tokenizers
package (transformers brings it); telling a folder's tokenizer only reads JSON.
"""
import json
import shutil
from functools import lru_cache
from pathlib import Path
from typing import List, Optional

from data.tokenizers import EOT, GPT2_DIR, CharTokenizer, GPT2Tokenizer, Tokenizer
from errors import import_optional

PIP = "pip install transformers safetensors"
FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def write_tokenizer(tokenizer: Tokenizer, folder: Path, max_length: int) -> None:
    """The Hugging Face tokenizer files of ``tokenizer`` into ``folder``; ``max_length``: the model's context."""
    tk = import_optional("tokenizers", "writing a Hugging Face tokenizer", PIP)
    config = {"model_max_length": max_length, "clean_up_tokenization_spaces": False}
    if tokenizer.name == "gpt2":
        merges = [tuple(m.split(" ")) for m in gpt2_merges()]
        backend = tk.Tokenizer(tk.models.BPE(vocab=gpt2_vocab(), merges=merges, fuse_unk=False))
        backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tk.decoders.ByteLevel()
        backend.post_processor = tk.processors.ByteLevel(trim_offsets=False)
        backend.add_special_tokens([tk.AddedToken(EOT, special=True)])
        shutil.copyfile(GPT2_DIR / "encoder.json", folder / "vocab.json")
        shutil.copyfile(GPT2_DIR / "vocab.bpe", folder / "merges.txt")
        config.update(tokenizer_class="GPT2TokenizerFast", bos_token=EOT, eos_token=EOT, unk_token=EOT,
                      add_prefix_space=False)
    else:
        vocab = {c: i for i, c in enumerate(tokenizer.chars)}
        backend = tk.Tokenizer(tk.models.WordLevel(vocab=vocab, unk_token=None))
        backend.pre_tokenizer = tk.pre_tokenizers.Split(tk.Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = tk.decoders.Fuse()
        config.update(tokenizer_class="PreTrainedTokenizerFast")
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


@lru_cache(maxsize=1)
def gpt2_vocab() -> dict:
    return json.loads((GPT2_DIR / "encoder.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def gpt2_merges() -> List[str]:
    """The merges of data/gpt2/vocab.bpe, "a b" each, without its #version line."""
    return merge_lines((GPT2_DIR / "vocab.bpe").read_text(encoding="utf-8"))


def merge_lines(text: str) -> List[str]:
    return [line for line in text.split("\n") if line and not line.startswith("#version")]


def folder_tokenizer(folder: Path) -> Optional[dict]:
    """Which of our tokenizers the Hugging Face tokenizer of ``folder`` is: its ``identity`` (as our
    tokenizers' ``identity``), {"tokenizer": "other", "described": ...} for one we do not have, or None
    when the folder holds no tokenizer."""
    if (folder / "tokenizer.json").is_file():
        spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        model = spec.get("model") or {}
        vocab = model.get("vocab") or {}
        if model.get("type") == "BPE" and (spec.get("pre_tokenizer") or {}).get("type") == "ByteLevel":
            merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
            if vocab == gpt2_vocab() and merges == gpt2_merges():
                return GPT2Tokenizer.identity
        if model.get("type") == "WordLevel" and sorted(vocab.values()) == list(range(len(vocab))):
            chars = sorted(vocab, key=vocab.get)
            if all(len(c) == 1 for c in chars):
                return CharTokenizer("".join(chars)).identity
        return other(f"its tokenizer.json: {model.get('type')}, {len(vocab)} tokens")
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        if vocab == gpt2_vocab() and merge_lines((folder / "merges.txt").read_text(encoding="utf-8")) == gpt2_merges():
            return GPT2Tokenizer.identity
        return other(f"its vocab.json and merges.txt: a BPE of {len(vocab)} tokens")
    if (folder / "tokenizer.model").is_file():
        return other("its tokenizer.model (SentencePiece)")
    return None


def other(described: str) -> dict:
    return {"tokenizer": "other", "described": f"a tokenizer nanoflash does not have ({described})"}
