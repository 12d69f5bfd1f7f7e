"""Tokenizer files of a Hugging Face model folder, from megaformer's tokenizer and back.

Export writes ``tokenizer.json`` (the ``tokenizers`` serialisation ``AutoTokenizer`` reads as a fast
tokenizer) and ``tokenizer_config.json`` naming the end-of-document token as eos/bos. megaformer's
built-in byte tokenizer (ids 0..255 = byte values, 256 = end of document) becomes an equivalent
byte-level BPE with no merges: its vocabulary maps the byte-level alphabet character of byte b to
id b, so every id and every decoded string is the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from megaformer.data.tokenizer import EOD_TOKEN, ByteTokenizer, Tokenizer


def byte_level_alphabet() -> list[str]:
    """The printable character standing for each byte 0..255 in byte-level BPE (GPT-2's scheme):
    bytes that are printable Latin-1 stand for themselves, the others are shifted to 256, 257, ..."""
    printable = (
        set(range(ord("!"), ord("~") + 1))
        | set(range(ord("\xa1"), ord("\xac") + 1))
        | set(range(ord("\xae"), ord("\xff") + 1))
    )
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def byte_tokenizer_as_hf() -> Any:
    """A ``tokenizers.Tokenizer`` with the ids of :class:`ByteTokenizer` (EOD = 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(byte_level_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOD_TOKEN])
    assert tok.token_to_id(EOD_TOKEN) == ByteTokenizer.eod_id
    return tok


def write_hf_tokenizer(tokenizer: Tokenizer, folder: Path, max_len: int) -> dict[str, Any]:
    """tokenizer.json (or a SentencePiece tokenizer.model) + tokenizer_config.json in ``folder``;
    returns the special ids for config.json."""
    from megaformer.data.tokenizer import SentencePieceTokenizer

    if isinstance(tokenizer, SentencePieceTokenizer):
        (folder / "tokenizer.model").write_bytes(tokenizer.model)
        eod, cls = tokenizer.sp.IdToPiece(tokenizer.eod_id), "LlamaTokenizer"
    else:
        tok = byte_tokenizer_as_hf() if isinstance(tokenizer, ByteTokenizer) else tokenizer.tok
        tok.save(str(folder / "tokenizer.json"))
        eod, cls = tok.id_to_token(tokenizer.eod_id), "PreTrainedTokenizerFast"
    config = {
        "tokenizer_class": cls,
        "bos_token": eod,
        "eos_token": eod,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"bos_token_id": tokenizer.eod_id, "eos_token_id": tokenizer.eod_id}


def read_hf_tokenizer(folder: Path, explicit: Optional[Path] = None) -> Optional[Tokenizer]:
    """The tokenizer of a Hugging Face model folder: ``explicit`` (--tokenizer: a tokenizer.json,
    a SentencePiece tokenizer.model, or a folder with either) when given, else the folder's
    tokenizer.json, else its tokenizer.model; None when it has neither (weights only). The
    end-of-document token follows the tokenizer's own configuration (eos_token) where it has one."""
    from megaformer.data.tokenizer import SENTENCEPIECE_FILE, TOKENIZER_FILE, load_tokenizer
    from megaformer.errors import ConversionError, DataError

    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.exists():
            raise ConversionError(f"--tokenizer {explicit}: no such file or folder")
    elif (folder / TOKENIZER_FILE).exists() or (folder / SENTENCEPIECE_FILE).exists():
        path = folder
    else:
        return None
    try:
        return load_tokenizer(path)
    except DataError as e:
        raise ConversionError(str(e)) from None
