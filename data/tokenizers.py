"""Tokenizers: GPT-2 BPE through tiktoken, offline, and a character-level one.

Both offer ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``encode_batch(texts, num_threads)``,
``vocab_size``, ``eot_id`` (None for char), ``name`` and ``identity``: a small dict that rebuilds the
tokenizer (``load_tokenizer``) and tells it from any other, which checkpoints carry.

The GPT-2 vocabulary files ship in data/gpt2/ (byte-identical to the ones tiktoken downloads; the
sha256 of each is checked), so no network is needed. The char vocabulary is the sorted set of the
corpus' characters; it is saved in the token cache's manifest so the tokenizer can be rebuilt from
the cache alone. The char tokenizer has no end-of-text token: documents are concatenated as they are.
"""
import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import List, Optional, Sequence, Union

import tiktoken

from data.config import TOKENIZERS
from errors import UserError

GPT2_DIR = Path(__file__).resolve().parent / "gpt2"
GPT2_FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
# GPT-2's pre-tokenization pattern (tiktoken's r50k/gpt2 definition).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = "<|endoftext|>"
GPT2_FILES_SHA256 = hashlib.sha256("".join(sorted(GPT2_FILES.values())).encode()).hexdigest()  # one digest of both


def gpt2_mergeable_ranks() -> dict:
    """GPT-2's BPE ranks, {token bytes: rank}, read from encoder.json alone (its sha256 checked). The
    same dict as tiktoken's ``data_gym_to_mergeable_bpe_ranks`` of vocab.bpe and encoder.json
    (tests/test_data.py checks), which replays the 50,000 merges to build it and takes about twice
    as long. encoder.json spells each byte as
    one character: the printable ones (but space) as themselves, the others as chr(256 + n) in order."""
    path = GPT2_DIR / "encoder.json"
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != GPT2_FILES["encoder.json"]:
        raise RuntimeError(f"{path} is damaged (sha256 mismatch); restore it from the repository")
    spelt_apart = [b for b in range(256) if not chr(b).isprintable() or chr(b) == " "]
    to_latin1 = {256 + n: b for n, b in enumerate(spelt_apart)}  # then every character is its byte's code
    return {token.translate(to_latin1).encode("latin-1"): rank for token, rank in json.loads(raw).items() if token != EOT}


@lru_cache(maxsize=1)
def gpt2_encoding() -> tiktoken.Encoding:
    """tiktoken's gpt2 encoding built from the shipped files (50257 tokens, <|endoftext|> = 50256)."""
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=gpt2_mergeable_ranks(),
                             special_tokens={EOT: 50256}, explicit_n_vocab=50257)


class GPT2Tokenizer:
    name = "gpt2"
    vocab_size = 50257
    eot_id: Optional[int] = 50256
    identity = {"tokenizer": "gpt2", "files_sha256": GPT2_FILES_SHA256}

    def encode(self, text: str, allow_eot: bool = False) -> List[int]:
        """A literal "<|endoftext|>" is plain text (several tokens) unless ``allow_eot``: then it is 50256."""
        if allow_eot:
            return gpt2_encoding().encode(text, allowed_special={EOT})
        return gpt2_encoding().encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> List[List[int]]:
        """Ordinary text only, like ``encode``; ``num_threads`` tiktoken threads."""
        return gpt2_encoding().encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return gpt2_encoding().decode(list(ids))


class CharTokenizer:
    """One token per character of a fixed vocabulary ``chars`` (no end-of-text token)."""

    name = "char"
    eot_id: Optional[int] = None

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        self.index = {c: i for i, c in enumerate(chars)}

    @property
    def identity(self) -> dict:
        return {"tokenizer": "char", "chars": self.chars}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> List[int]:
        try:
            return [self.index[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the char vocabulary") from err

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)


Tokenizer = Union[GPT2Tokenizer, CharTokenizer]


def load_tokenizer(manifest_or_name: Union[dict, str]) -> Tokenizer:
    """The tokenizer of a token cache (its manifest dict), of a checkpoint (its ``identity``), or "gpt2" by name.

    "char" needs the manifest or identity: its vocabulary comes from the corpus.
    """
    if isinstance(manifest_or_name, dict):
        name = manifest_or_name["tokenizer"]
        if name == "char":
            return CharTokenizer(manifest_or_name["chars"])
        if manifest_or_name.get("files_sha256", GPT2_FILES_SHA256) != GPT2_FILES_SHA256:
            raise UserError(f"the tokenizer was made from other GPT-2 BPE files (sha256 {manifest_or_name['files_sha256'][:12]}) "
                            f"than those in {GPT2_DIR} ({GPT2_FILES_SHA256[:12]}); use the repository version it was made with")
    else:
        name = manifest_or_name
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "char":
        raise ValueError("the char tokenizer's vocabulary lives in a token cache: pass its manifest")
    raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")


def default_prompt(tokenizer: Tokenizer) -> List[int]:
    """The token ids a sample starts from when no prompt is given: a newline, or where the vocabulary has
    none (a char corpus of one line) its first token."""
    try:
        return tokenizer.encode("\n")
    except ValueError:  # the char tokenizer knows only its corpus' characters
        return [0]


def describe_tokenizer(identity: dict) -> str:
    """A tokenizer's ``identity`` in words: "the char tokenizer (65 characters)", "the gpt2 tokenizer (...)"."""
    if identity["tokenizer"] == "char":
        return f"the char tokenizer ({len(identity['chars'])} characters)"
    return f"the gpt2 tokenizer (BPE files sha256 {identity['files_sha256'][:12]})"
