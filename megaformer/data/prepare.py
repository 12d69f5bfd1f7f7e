"""``megaformer prepare-data``: documents -> token ids + one EOD each -> ``PREFIX.bin`` / ``PREFIX.idx``.

Pipeline: the source (:mod:`megaformer.data.sources`) streams batches of documents; the main process
cuts them into chunks of about ``chunk_chars`` characters and hands them to ``workers`` tokenizer
processes (spawned, one thread each), at most ``2 * workers`` chunks in flight; results come back in
order and go straight to the ``.bin`` file. Memory is therefore O(workers * chunk) plus 4 bytes per
document, whatever the corpus size. With one worker the main process tokenizes itself, letting HF
``tokenizers`` use its own thread pool.

The tokenizer is saved beside the output as ``PREFIX.tokenizer.json`` (megaformer reads it; Megatron-LM
and GPT-NeoX ignore it). Outputs are written under temporary names and renamed only when complete.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from megaformer.data.indexed import (
    IndexedWriter,
    check_output_prefix,
    dtype_holds,
    token_dtype,
    tokenizer_path,
)
from megaformer.data.sources import Source, open_source
from megaformer.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer
from megaformer.errors import DataError
from megaformer.safe_files import current_umask, temp_path

log = logging.getLogger("megaformer")

SMALL_INPUT_BYTES = 8 << 20  # below this, auto workers = 1 (starting processes costs more)


@dataclass
class PrepareResult:
    prefix: Path
    documents: int
    tokens: int
    empty: int
    seconds: float
    tokenizer: str
    vocab_size: int
    dtype: str
    workers: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def resolve_tokenizer(spec: str, source: Source) -> Tokenizer:
    """``byte``, ``bpe:N`` (byte-level BPE trained on ``source``) or a tokenizer.json / folder."""
    tok = build_tokenizer(spec, source.batches(), option="--tokenizer")  # type: ignore[arg-type]
    if spec.startswith("bpe:") and source.stats.documents == 0:
        raise DataError(f"{source.spec}: no non-empty documents to train the tokenizer on")
    return tok


# ----------------------------------------------------------------------------- encoding


def append_eod(flat: np.ndarray, lengths: np.ndarray, eod: int, dtype: np.dtype) -> np.ndarray:
    """Interleave: doc_0, EOD, doc_1, EOD, ... given the concatenated docs and their lengths."""
    ends = np.cumsum(lengths.astype(np.int64) + 1) - 1
    out = np.empty(int(ends[-1]) + 1 if len(ends) else 0, dtype=dtype)
    keep = np.ones(len(out), dtype=bool)
    keep[ends] = False
    out[keep] = flat
    out[ends] = eod
    return out


class BatchEncoder:
    """texts -> (tokens with one EOD per document, int32 lengths including the EOD)."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype) -> None:
        self.tokenizer = tokenizer
        self.dtype = np.dtype(dtype)
        self.limit = np.iinfo(self.dtype).max
        tok = getattr(tokenizer, "tok", None)
        self._fast = getattr(tok, "encode_batch_fast", None) if tok is not None else None

    def __call__(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        eod = self.tokenizer.eod_id
        if isinstance(self.tokenizer, ByteTokenizer):
            raw = [t.encode("utf-8", "replace") for t in texts]
            lengths = np.fromiter(map(len, raw), np.int64, len(raw))
            flat = np.frombuffer(b"".join(raw), dtype=np.uint8)
        else:
            if self._fast is not None:
                encs = self._fast(list(texts), add_special_tokens=False)
            else:
                encs = self.tokenizer.tok.encode_batch(list(texts), add_special_tokens=False)  # type: ignore[attr-defined]
            ids = [e.ids for e in encs]
            lengths = np.fromiter(map(len, ids), np.int64, len(ids))
            flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum()))
            if len(flat) and int(flat.max()) > self.limit:
                raise DataError(
                    f"tokenizer {self.tokenizer.name}: token id {int(flat.max())} does "
                    f"not fit {self.dtype}; use --dtype int32"
                )
        return append_eod(flat, lengths, eod, self.dtype), (lengths + 1).astype(np.int32)


_WORKER: dict = {}


def _init_worker(tokenizer_json: Optional[str], dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    os.environ["RAYON_NUM_THREADS"] = "1"
    if tokenizer_json is None:
        tok: Tokenizer = ByteTokenizer()
    else:
        from tokenizers import Tokenizer as _Tok

        tok = HFTokenizer(_Tok.from_str(tokenizer_json))
    _WORKER["encode"] = BatchEncoder(tok, np.dtype(dtype))


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _WORKER["encode"](texts)


def _chunks(batches: Iterator[list[str]], chunk_chars: int) -> Iterator[list[str]]:
    buf: list[str] = []
    size = 0
    for batch in batches:
        for t in batch:
            buf.append(t)
            size += len(t)
            if size >= chunk_chars:
                yield buf
                buf, size = [], 0
    if buf:
        yield buf


def limit_chars(batches: Iterator[list[str]], max_chars: Optional[int]) -> Iterator[list[str]]:
    """The documents of ``batches`` up to ``max_chars`` characters in all (the last one cut), as
    ``data.max_bytes`` does for ``data.source``; everything when ``max_chars`` is None."""
    if max_chars is None:
        yield from batches
        return
    left = max_chars
    for batch in batches:
        out = []
        for t in batch:
            if len(t) >= left:
                if left > 0:
                    out.append(t[:left])
                yield out
                return
            out.append(t)
            left -= len(t)
        yield out


def encode_stream(
    chunks: Iterator[list[str]], tokenizer: Tokenizer, dtype: np.dtype, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """(tokens, lengths, characters) per chunk, in input order, tokenized by ``workers`` processes."""
    if workers <= 1:
        encode = BatchEncoder(tokenizer, dtype)
        for chunk in chunks:
            yield (*encode(chunk), sum(map(len, chunk)))
        return
    tok_json = None if isinstance(tokenizer, ByteTokenizer) else tokenizer.tok.to_str()  # type: ignore[attr-defined]
    # fork: workers need only numpy + tokenizers, and spawn would re-run an unguarded __main__
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # children: one thread each, and no fork warning
    try:
        yield from _pool_stream(ctx, chunks, tok_json, dtype, workers)
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _pool_stream(
    ctx, chunks: Iterator[list[str]], tok_json: Optional[str], dtype: np.dtype, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    with ctx.Pool(
        workers, initializer=_init_worker, initargs=(tok_json, np.dtype(dtype).str)
    ) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append((pool.apply_async(_encode_in_worker, (chunk,)), sum(map(len, chunk))))
            while len(pending) >= 2 * workers:
                res, n = pending.popleft()
                yield (*res.get(), n)
        while pending:
            res, n = pending.popleft()
            yield (*res.get(), n)


# ----------------------------------------------------------------------------- the command


def prepare(
    input_spec: str,
    tokenizer_spec: str,
    output_prefix: str | Path,
    *,
    text_field: str = "text",
    workers: Optional[int] = None,
    overwrite: bool = False,
    dtype: str = "auto",
    sample_by: str = "document",
    streaming: bool = True,
    chunk_chars: int = 1 << 20,
    progress: Optional[bool] = None,
    tokenizer: Optional[Tokenizer] = None,
    max_chars: Optional[int] = None,
) -> PrepareResult:
    """Tokenize ``input_spec`` into ``output_prefix``.bin/.idx (+ ``.tokenizer.json``).

    ``progress=None`` shows a bar only on a terminal. ``tokenizer`` overrides ``tokenizer_spec``.
    ``max_chars`` stops after that many characters of text (``data.max_bytes``).
    """
    t0 = time.perf_counter()
    prefix = check_output_prefix(output_prefix, overwrite)
    source = open_source(input_spec, text_field, sample_by, streaming)
    if tokenizer is None:
        tokenizer = resolve_tokenizer(tokenizer_spec, source)
    if dtype == "auto":
        np_dtype = token_dtype(tokenizer.vocab_size)
    else:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            raise DataError(
                f"--dtype {dtype}: not a numpy dtype (use auto, uint16 or int32)"
            ) from None
    if not dtype_holds(np_dtype, tokenizer.vocab_size):
        raise DataError(
            f"tokenizer {tokenizer.name}: its {tokenizer.vocab_size:,} token ids do not fit "
            f"{np_dtype} (max {np.iinfo(np_dtype).max if np.issubdtype(np_dtype, np.integer) else 'n/a'}); "
            "use --dtype int32 or auto"
        )
    if workers is None:
        total = source.total_bytes
        workers = 1 if total is not None and total < SMALL_INPUT_BYTES else default_workers()
    if workers < 1:
        raise DataError(f"--workers {workers}: must be >= 1")

    writer = IndexedWriter(prefix, np_dtype)
    side_tmp = temp_path(tokenizer_path(prefix))  # random exclusive name beside the output
    bar = _bar(source, progress)
    try:
        for tokens, lengths, chars in encode_stream(
            _chunks(limit_chars(source.batches(), max_chars), chunk_chars),
            tokenizer,
            np_dtype,
            workers,
        ):
            writer.add(tokens, lengths)
            if bar is not None:
                bar.update(chars)
                bar.set_postfix(
                    docs=f"{writer.n_docs:,}", tokens=f"{writer.n_tokens:,}", refresh=False
                )
        if writer.n_docs == 0:
            raise DataError(
                f"{input_spec}: no non-empty documents"
                + (
                    f" ({source.stats.empty} empty or whitespace-only)"
                    if source.stats.empty
                    else ""
                )
            )
        tokenizer.save(side_tmp)
        os.chmod(side_tmp, 0o666 & ~current_umask())  # an ordinary file's mode, not mkstemp's 0600
        os.replace(side_tmp, tokenizer_path(prefix))
        writer.finish()
    except BaseException:
        writer.abort()
        side_tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    if source.stats.empty:
        where = source.stats.empty_where[0] if len(source.stats.empty_where) == 1 else input_spec
        print(
            f"megaformer: warning: {where}: skipped {source.stats.empty:,} empty or whitespace-only "
            "documents",
            file=sys.stderr,
        )
    return PrepareResult(
        prefix,
        writer.n_docs,
        writer.n_tokens,
        source.stats.empty,
        time.perf_counter() - t0,
        tokenizer.name,
        tokenizer.vocab_size,
        str(np_dtype),
        workers,
    )


def _bar(source: Source, progress: Optional[bool]):
    if progress is False:
        return None
    from tqdm import tqdm

    return tqdm(
        total=source.total_bytes,
        unit="char",
        unit_scale=True,
        desc="prepare-data",
        dynamic_ncols=True,
        mininterval=0.5,
        file=sys.stderr,
        disable=None if progress is None else False,
    )
