"""Tokenizers: a built-in byte tokenizer, Hugging Face ``tokenizers`` (trained BPE or a file) and
SentencePiece models (``tokenizer.model``, through the ``sentencepiece`` library when installed).

Every tokenizer has ``vocab_size``, an end-of-document id ``eod_id`` (appended once per document),
``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``save(path)``; ``load_tokenizer`` reads
what ``save`` wrote, so a checkpoint carries its tokenizer.

The end-of-document token of a Hugging Face tokenizer is the ``eos_token`` its own configuration
names (``tokenizer_config.json``, else ``generation_config.json``'s ``eos_token_id``, beside the
tokenizer file), else ``<|endoftext|>``, else the first of :data:`EOD_FALLBACKS` it has.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence

import numpy as np

from megaformer.errors import DataError, UserError
from megaformer.safe_files import read_bounded

EOD_TOKEN = "<|endoftext|>"
# End-of-document tokens of released tokenizers, tried in order before EOD_TOKEN is added to a
# tokenizer that has none (a Llama tokenizer ends documents with </s>, Llama 3 with <|end_of_text|>).
EOD_FALLBACKS = ("</s>", "<|end_of_text|>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
MAX_TOKENIZER_BYTES = 1 << 30
MAX_TOKENIZER_CONFIG_BYTES = 16 * 1024 * 1024
NONE = "none"  # data.tokenizer of a model converted without one: asks for one by name


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
    """A Hugging Face ``tokenizers.Tokenizer`` with an end-of-document token: ``eos_token`` (the
    tokenizer configuration's, when it has that token), else ``<|endoftext|>``, else the first of
    :data:`EOD_FALLBACKS` it has, else ``<|endoftext|>`` added as a special token."""

    def __init__(self, tok, name: str = "hf", eos_token: Optional[str] = None) -> None:
        self.tok = tok
        self.name = name
        eod = tok.token_to_id(eos_token) if eos_token else None
        self.eos_token = eos_token if eod is not None else None
        if eod is None:
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
        """tokenizer.json; a configured eos_token is kept beside it in tokenizer_config.json."""
        self.tok.save(str(path))
        if self.eos_token is not None and Path(path).name == TOKENIZER_FILE:
            (Path(path).parent / TOKENIZER_CONFIG).write_text(
                json.dumps({"eos_token": self.eos_token}, indent=2) + "\n"
            )


class SentencePieceTokenizer:
    """A SentencePiece model (``tokenizer.model``: Llama 2, Mistral) run by the ``sentencepiece``
    library; end of document = its eos piece (or ``eos_token`` when configured). Saved as a JSON
    file holding the model bytes, so a checkpoint's tokenizer.json carries it."""

    def __init__(
        self, model: bytes, name: str = "sentencepiece", eos_token: Optional[str] = None
    ) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise DataError(
                f"{name}: a SentencePiece tokenizer.model needs the sentencepiece "
                "library (pip install 'megaformer[hf]')"
            ) from None
        self.model, self.name = model, name
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError on malformed files
            raise DataError(
                f"{name}: not a SentencePiece model ({str(e).splitlines()[0][:120]})"
            ) from None
        self.vocab_size = int(self.sp.GetPieceSize())
        eod = self.sp.PieceToId(eos_token) if eos_token else -1
        if eod >= 0 and self.sp.IdToPiece(eod) != eos_token:  # unknown pieces map to <unk>
            eod = -1
        self.eos_token = eos_token if eod >= 0 else None
        if eod < 0:
            eod = self.sp.eos_id()
        if eod < 0:
            raise DataError(
                f"{name}: the SentencePiece model has no end-of-sequence piece; name "
                "one in tokenizer_config.json (eos_token)"
            )
        self.eod_id = int(eod)

    def encode(self, text: str) -> list[int]:
        return list(self.sp.EncodeAsIds(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.sp.EncodeAsIds(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def save(self, path: Path) -> None:
        Path(path).write_text(
            json.dumps(
                {
                    "megaformer_tokenizer": "sentencepiece",
                    "eod_id": self.eod_id,
                    "eos_token": self.eos_token,
                    "model": base64.b64encode(self.model).decode(),
                }
            )
        )


def train_bpe(documents: Iterator[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE with ``vocab_size`` tokens (EOD included) on ``documents``."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(
            f"data.tokenizer=bpe:{vocab_size}: a byte-level BPE needs at least 257 tokens"
        )
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return HFTokenizer(tok, name=f"bpe:{vocab_size}")


def _read(path: Path, limit: int) -> bytes:
    try:
        return read_bounded(path, limit, DataError)
    except UserError as e:
        raise DataError(str(e)) from None


def configured_eos(folder: Path) -> Optional[Any]:
    """The end-of-sequence token a Hugging Face folder's own configuration names: ``eos_token`` of
    tokenizer_config.json (a string, or an object with ``content``), else ``eos_token_id`` of
    generation_config.json (an id, or the first of a list); None when neither says."""
    for fname, key in ((TOKENIZER_CONFIG, "eos_token"), (GENERATION_CONFIG, "eos_token_id")):
        path = folder / fname
        if not path.is_file():
            continue
        try:
            value = json.loads(_read(path, MAX_TOKENIZER_CONFIG_BYTES)).get(key)
        except (ValueError, AttributeError, RecursionError):
            raise DataError(f"{path}: not a JSON object") from None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return value
    return None


def _eos_piece(eos: Optional[Any], id_to_token) -> Optional[str]:
    if isinstance(eos, int):
        return id_to_token(eos)
    return eos


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a tokenizer.json file, a SentencePiece tokenizer.model, or a folder
    holding either (tokenizer.json first); the end-of-document token as the module docstring says.
    Files larger than 1 GiB are refused."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = (
            p / TOKENIZER_FILE
            if (p / TOKENIZER_FILE).exists() or not (p / SENTENCEPIECE_FILE).exists()
            else p / SENTENCEPIECE_FILE
        )
    if not p.is_file():
        raise DataError(f"tokenizer not found: {p}")
    data = _read(p, MAX_TOKENIZER_BYTES)
    eos = configured_eos(p.parent) if p.name in (TOKENIZER_FILE, SENTENCEPIECE_FILE) else None
    if p.suffix == ".model":
        return SentencePieceTokenizer(data, name=str(p), eos_token=_eos_piece(eos, _sp_piece(data)))
    try:
        head = json.loads(data)
    except (ValueError, RecursionError):  # not JSON/UTF-8, nested too deeply, an over-long int
        raise DataError(f"{p}: not a tokenizer.json file") from None
    if isinstance(head, dict) and head.get("megaformer_tokenizer") == "byte":
        return ByteTokenizer()
    if isinstance(head, dict) and head.get("megaformer_tokenizer") == "sentencepiece":
        try:
            model = base64.b64decode(head["model"], validate=True)
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{p}: a SentencePiece tokenizer file without its model") from None
        return SentencePieceTokenizer(model, name=str(p), eos_token=head.get("eos_token"))
    from tokenizers import Tokenizer as _Tok

    try:
        tok = _Tok.from_str(data.decode())
    except Exception as e:  # tokenizers raises plain Exceptions on malformed files
        raise DataError(f"{p}: cannot load tokenizer ({str(e).splitlines()[0][:200]})") from None
    return HFTokenizer(tok, name=str(p), eos_token=_eos_piece(eos, tok.id_to_token))


def _sp_piece(model: bytes):
    """id -> piece of a SentencePiece model (for an eos_token_id), loaded only when asked."""

    def piece(i: int) -> Optional[str]:
        sp = SentencePieceTokenizer(model).sp
        return sp.IdToPiece(i) if 0 <= i < sp.GetPieceSize() else None

    return piece


def build_tokenizer(
    spec: str, documents: Iterator[str], option: str = "data.tokenizer"
) -> Tokenizer:
    """Resolve a tokenizer spec: 'byte', 'bpe:N' (trained on ``documents``) or a path.

    ``option`` names where the spec came from in error messages (a config key or a CLI flag)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == NONE:
        raise DataError(
            f"{option}={NONE}: this model was converted without a tokenizer; set "
            f"{option} to its tokenizer.json or SentencePiece tokenizer.model"
        )
    if spec.startswith("bpe:"):
        try:
            n = int(spec[4:])
        except ValueError:
            raise DataError(f"{option}={spec!r}: expected bpe:VOCAB_SIZE, e.g. bpe:4096") from None
        return train_bpe(documents, n)
    return load_tokenizer(spec)
