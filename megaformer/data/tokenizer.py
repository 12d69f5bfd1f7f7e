"""Tokenizers: a built-in byte tokenizer and Hugging Face ``tokenizers`` (trained BPE or a file).

Every tokenizer has ``vocab_size``, an end-of-document id ``eod_id`` (appended once per document),
``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``save(path)``; ``load_tokenizer`` reads
what ``save`` wrote, so a checkpoint carries its tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np

from megaformer.errors import DataError

EOD_TOKEN = "<|endoftext|>"
# End-of-document tokens of released tokenizers, tried in order before EOD_TOKEN is added to a
# tokenizer that has none (a Llama tokenizer ends documents with </s>, Llama 3 with <|end_of_text|>).
EOD_FALLBACKS = ("</s>", "<|end_of_text|>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int
    name: str

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def save(self, path: Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, end-of-document = 256; vocab_size = 257."""

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"megaformer_tokenizer": "byte"}))


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with an end-of-document token: ``<|endoftext|>``, else
    the first of :data:`EOD_FALLBACKS` it has, else ``<|endoftext|>`` added as a special token."""

    def __init__(self, tok, name: str = "hf") -> None:
        self.tok = tok
        self.name = name
        eod = tok.token_to_id(EOD_TOKEN)
        for candidate in EOD_FALLBACKS:
            if eod is None:
                eod = tok.token_to_id(candidate)
        if eod is None:
            tok.add_special_tokens([EOD_TOKEN])
            eod = tok.token_to_id(EOD_TOKEN)
        self.eod_id = int(eod)
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, path: Path) -> None:
        self.tok.save(str(path))


def train_bpe(documents: Iterator[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE with ``vocab_size`` tokens (EOD included) on ``documents``."""
    from tokenizers import Tokenizer as _Tok, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"data.tokenizer=bpe:{vocab_size}: a byte-level BPE needs at least 257 tokens")
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(documents, trainer=trainer)
    return HFTokenizer(tok, name=f"bpe:{vocab_size}")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a tokenizer.json file or a folder holding one."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise DataError(f"tokenizer not found: {p}")
    try:
        head = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"{p}: not a tokenizer.json file") from None
    if isinstance(head, dict) and head.get("megaformer_tokenizer") == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer as _Tok
    try:
        return HFTokenizer(_Tok.from_file(str(p)), name=str(p))
    except Exception as e:  # tokenizers raises plain Exceptions on malformed files
        raise DataError(f"{p}: cannot load tokenizer ({str(e).splitlines()[0][:200]})") from None


def build_tokenizer(spec: str, documents: Iterator[str], option: str = "data.tokenizer") -> Tokenizer:
    """Resolve a tokenizer spec: 'byte', 'bpe:N' (trained on ``documents``) or a path.

    ``option`` names where the spec came from in error messages (a config key or a CLI flag)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        try:
            n = int(spec[4:])
        except ValueError:
            raise DataError(f"{option}={spec!r}: expected bpe:VOCAB_SIZE, e.g. bpe:4096") from None
        return train_bpe(documents, n)
    return load_tokenizer(spec)
