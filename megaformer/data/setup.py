"""From ``cfg.data`` to a tokenizer and train/validation datasets, on every rank.

Two paths. With ``data.paths`` empty: ``data.source`` is read and tokenized in memory
(:func:`prepare_data`). With ``data.paths``: each entry is a prepared ``.bin``/``.idx`` prefix or a
source that rank 0 prepares once into ``data.cache_dir``; each is split by ``data.split`` and packed
into shuffled samples (:mod:`megaformer.data.gpt_dataset`), and several are blended by
``data.weights`` (:mod:`megaformer.data.blend`). Rank 0 builds and caches every index; the other
ranks wait and read the cache; an error on rank 0 is raised on every rank.

A tokenizer that must be trained (``bpe:N``) is trained once by rank 0 and saved to
``RUN_DIR/tokenizer.json``; the other ranks wait and load it. A resumed run takes the tokenizer from
its checkpoint, so token ids never change under a running model.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from megaformer.config import Config
from megaformer.data.corpus import iter_documents
from megaformer.data.dataset import (
    PackedDataset,
    TokenizedCorpus,
    tokenize_corpus,
    unigram_cross_entropy,
)
from megaformer.data.tokenizer import Tokenizer, build_tokenizer, load_tokenizer
from megaformer.data.wait import wait_barrier, wait_group
from megaformer.errors import ConfigError, DataError, UserError
from megaformer.safe_files import make_dir

log = logging.getLogger("megaformer")


def prepare_data(
    cfg: Config, run_dir: Path, rank: int, barrier: Callable[[], None], checkpoint: Optional[Path]
) -> tuple[Tokenizer, TokenizedCorpus]:
    t0 = time.perf_counter()
    d = cfg.data
    documents = list(iter_documents(d.source, d.text_field, d.max_bytes))
    if not documents:
        raise DataError(f"data.source={d.source!r}: the corpus is empty (no non-empty documents)")
    if checkpoint is not None and (checkpoint / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
    elif d.tokenizer.startswith("bpe:"):
        shared = run_dir / "tokenizer.json"
        if rank == 0:
            tokenizer = build_tokenizer(d.tokenizer, iter(documents))
            tokenizer.save(shared)
        barrier()
        if rank != 0:
            tokenizer = load_tokenizer(shared)
    else:
        tokenizer = build_tokenizer(d.tokenizer, iter(documents))
    corpus = tokenize_corpus(documents, tokenizer, d.valid_fraction, cfg.train.seed)
    log.info(
        "data: %d documents (%d held out), %s train / %s validation tokens, tokenizer %s "
        "(vocab %d), %.1fs",
        corpus.n_docs,
        corpus.n_valid_docs,
        f"{len(corpus.train):,}",
        f"{len(corpus.valid):,}",
        tokenizer.name,
        tokenizer.vocab_size,
        time.perf_counter() - t0,
    )
    return tokenizer, corpus


@dataclass
class DataBundle:
    """What the trainer reads: ``train``/``valid`` datasets (``len``, ``batch(indices)``) and the
    unigram baseline as a function of the model's vocabulary size."""

    train: Any
    valid: Any
    unigram: Callable[[int], float]


def setup_data(
    cfg: Config,
    run_dir: Path,
    rank: int,
    barrier: Callable[[], None],
    checkpoint: Optional[Path],
    share: Optional[Callable[[Any], Any]] = None,
) -> tuple[Tokenizer, DataBundle]:
    """The tokenizer and datasets of ``cfg.data``, by the in-memory path or the indexed pipeline.
    ``share``: rank 0's (small, picklable) object on every rank, a collective; with it the other
    ranks trust rank 0's index validation instead of repeating it."""
    barrier = wait_barrier(barrier)  # rank 0's builds may outlast the collective timeout
    if not cfg.data.paths:
        tokenizer, corpus = prepare_data(cfg, run_dir, rank, barrier, checkpoint)
        bundle = DataBundle(
            PackedDataset(corpus.train, cfg.seq_len, "train"),
            PackedDataset(corpus.valid, cfg.seq_len, "validation"),
            lambda vocab: unigram_cross_entropy(corpus.train, corpus.valid, vocab),
        )
        return tokenizer, bundle
    return _setup_indexed(cfg, run_dir, rank, barrier, checkpoint, share)


def _rank0_first(rank: int, barrier: Callable[[], None], work: Callable[[], None]) -> None:
    """Run ``work`` on rank 0 while the others wait; a user error there is raised on every rank."""
    import torch.distributed as tdist

    error: Optional[tuple[str, str]] = None
    if rank == 0:
        try:
            work()
        except UserError as e:
            error = (type(e).__name__, str(e))
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        box = [error]
        tdist.broadcast_object_list(box, src=0, group=wait_group())
        error = box[0]
    else:
        barrier()
    if error is not None:
        raise (ConfigError if error[0] == "ConfigError" else DataError)(error[1])


def _tokenizer_digest(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's saved form, written in a private temporary folder (never a fixed
    name in a cache another user could plant a link at)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="megaformer-tok-") as scratch:
        path = Path(scratch) / "tokenizer.json"
        tokenizer.save(path)
        return hashlib.sha256(path.read_bytes()).hexdigest()


def _indexed_tokenizer(
    cfg: Config,
    run_dir: Path,
    rank: int,
    barrier: Callable[[], None],
    checkpoint: Optional[Path],
    sources: list[str],
) -> Tokenizer:
    from megaformer.data.prepare import limit_chars
    from megaformer.data.sources import open_source

    d = cfg.data
    if checkpoint is not None and (checkpoint / "tokenizer.json").is_file():
        return load_tokenizer(checkpoint / "tokenizer.json")
    if not d.tokenizer.startswith("bpe:"):
        return build_tokenizer(d.tokenizer, iter(()))
    if not sources:
        raise _no_tokenizer_training(d.tokenizer)
    shared = run_dir / "tokenizer.json"

    def train() -> None:
        opened = [open_source(s, d.text_field) for s in sources]
        seen = [0]

        def documents() -> Iterator[str]:
            for doc in itertools.chain.from_iterable(
                itertools.chain.from_iterable(limit_chars(o.batches(), d.max_bytes)) for o in opened
            ):
                seen[0] += 1
                yield doc

        tokenizer = build_tokenizer(d.tokenizer, documents())
        if seen[0] == 0:
            raise DataError(
                f"data.paths={sources}: no non-empty documents to train the tokenizer on"
            )
        tokenizer.save(shared)

    _rank0_first(rank, barrier, train)
    return load_tokenizer(shared)


def _prepare_sources(
    cfg: Config, cache: Path, rank: int, barrier: Callable[[], None], tokenizer: Tokenizer
) -> list[Path]:
    """data.paths -> prefixes; sources are prepared by rank 0 into CACHE/prepared/<hash>/data."""
    from megaformer.data.indexed import is_prefix
    from megaformer.data.prepare import prepare
    from megaformer.data.sources import open_source

    d = cfg.data
    prefixes: list[Path] = []
    todo: list[tuple[str, Path]] = []
    tok_digest = None
    for spec in d.paths or []:
        if is_prefix(spec):
            prefixes.append(Path(spec))
            continue
        src = open_source(spec, d.text_field)  # every rank: resolves files, fails alike
        if tok_digest is None:
            make_dir(cache, mode=0o700, error=DataError)
            tok_digest = _tokenizer_digest(tokenizer)
        key = hashlib.sha256(
            json.dumps(
                {
                    "v": 1,
                    "spec": spec,
                    "content": src.fingerprint(),
                    "text_field": d.text_field,
                    "tokenizer": tok_digest,
                    **({"max_chars": d.max_bytes} if d.max_bytes else {}),
                },
                sort_keys=True,
            ).encode()
        ).hexdigest()[:20]
        out = cache / "prepared" / key / "data"
        prefixes.append(out)
        if not is_prefix(out):
            todo.append((spec, out))
        else:
            _check_own_prepared(out)

    def work() -> None:
        for spec, out in todo:
            make_dir(out.parent.parent, mode=0o700, error=DataError)  # CACHE/prepared
            make_dir(out.parent, mode=0o700, error=DataError)
            r = prepare(
                spec,
                d.tokenizer,
                out,
                text_field=d.text_field,
                overwrite=True,
                tokenizer=tokenizer,
                progress=None,
                max_chars=d.max_bytes,
            )
            log.info(
                "data: prepared %s -> %s: %s documents, %s tokens in %.1fs",
                spec,
                out,
                f"{r.documents:,}",
                f"{r.tokens:,}",
                r.seconds,
            )

    if todo:
        _rank0_first(rank, barrier, work)
    return prefixes


def _check_own_prepared(prefix: Path) -> None:
    """A prepared dataset found in the cache is reused only when its files are this user's own and
    not writable by group or others (a shared cache could hold files someone else planted)."""
    from megaformer.data.indexed import bin_path, idx_path, tokenizer_path
    from megaformer.safe_files import owned_by_me

    side = tokenizer_path(prefix)
    for p in [bin_path(prefix), idx_path(prefix)] + (
        [side] if side.exists() or side.is_symlink() else []
    ):
        if not owned_by_me(p):
            raise DataError(
                f"{p}: a prepared dataset in data.cache_dir that is not this user's own "
                "regular file (or is writable by group or others), so it is not reused; "
                f"remove {prefix.parent}, use a data.cache_dir private to you, or list "
                f"{prefix} in data.paths to use it as it is"
            )


def check_data_paths(cfg: Config) -> None:
    """What ``train --dry-run`` can check of ``data.paths`` without reading the data: every entry
    resolves (a prepared PREFIX.bin/.idx pair, or files / a folder / a glob; ``hf:`` datasets are
    not fetched), and a prepared prefix was prepared with the run's tokenizer (same vocabulary
    size and EOD id as its PREFIX.tokenizer.json)."""
    from megaformer.data.indexed import is_prefix, tokenizer_path
    from megaformer.data.sources import open_source

    d = cfg.data
    prefixes = [Path(p) for p in d.paths or [] if is_prefix(p)]
    for spec in d.paths or []:
        if not is_prefix(spec):
            open_source(spec, d.text_field)
    if not prefixes:
        return
    if d.tokenizer.startswith("bpe:"):  # trained at launch on the sources, checked then
        if len(prefixes) == len(d.paths or []):
            raise _no_tokenizer_training(d.tokenizer)
        return
    tokenizer = build_tokenizer(d.tokenizer, iter(()))
    for p in prefixes:
        side = tokenizer_path(p)
        if side.is_file():
            _check_same_tokenizer(p, side, tokenizer)


def _no_tokenizer_training(spec: str) -> ConfigError:
    return ConfigError(
        f"data.tokenizer={spec}: cannot train a tokenizer on prepared .bin/.idx "
        "data; set data.tokenizer to the tokenizer.json the data was prepared with "
        "(PREFIX.tokenizer.json)"
    )


def _check_same_tokenizer(prefix: Path, side: Path, tokenizer: Tokenizer) -> None:
    """DataError unless the tokenizer ``side`` that ``prefix`` was prepared with has the vocabulary
    size and EOD id of the run's ``tokenizer``."""
    other = load_tokenizer(side)
    if (other.vocab_size, other.eod_id) != (tokenizer.vocab_size, tokenizer.eod_id):
        raise DataError(
            f"{prefix}: prepared with {side} (vocab {other.vocab_size}, EOD "
            f"{other.eod_id}) but the run's tokenizer has vocab "
            f"{tokenizer.vocab_size}, EOD {tokenizer.eod_id}; set "
            f"data.tokenizer={side}"
        )


def _check_tokenizer_matches(prefixes: list[Path], tokenizer: Tokenizer, vocab_limit: int) -> list:
    """The prefixes opened (:class:`IndexedDataset`, each checked once), after checking that they
    were prepared with this tokenizer."""
    from megaformer.data.indexed import IndexedDataset, bin_path, check_token_ids, tokenizer_path

    opened = []
    for p in prefixes:
        side = tokenizer_path(p)
        if side.is_file():
            _check_same_tokenizer(p, side, tokenizer)
        data = IndexedDataset(p)
        check_token_ids(data.tokens, vocab_limit, bin_path(p))
        opened.append(data)
    return opened


def _setup_indexed(
    cfg: Config,
    run_dir: Path,
    rank: int,
    barrier: Callable[[], None],
    checkpoint: Optional[Path],
    share: Optional[Callable[[Any], Any]] = None,
) -> tuple[Tokenizer, DataBundle]:
    from megaformer.data.blend import BlendedDataset, normalise
    from megaformer.data.gpt_dataset import build_many_split_datasets, parse_split, split_ranges
    from megaformer.data.indexed import is_prefix

    t0 = time.perf_counter()
    d, t = cfg.data, cfg.train
    cache = Path(d.cache_dir).expanduser() if d.cache_dir else run_dir / "data_cache"
    ratios = parse_split(d.split, d.valid_fraction)
    if ratios[1] <= 0:
        raise ConfigError(
            f"data.split={d.split!r}: the validation share must be > 0 (evaluation reads it)"
        )
    sources = [p for p in d.paths or [] if not is_prefix(p)]
    tokenizer = _indexed_tokenizer(cfg, run_dir, rank, barrier, checkpoint, sources)
    prefixes = _prepare_sources(cfg, cache, rank, barrier, tokenizer)
    datasets = _check_tokenizer_matches(
        prefixes, tokenizer, max(tokenizer.vocab_size, cfg.model.vocab_size or 0)
    )

    if d.weights is not None:
        weights = normalise(d.weights)
    else:  # proportional to each dataset's training tokens
        sizes = []
        for data in datasets:
            a, b = split_ranges(len(data), ratios)[0]
            sizes.append(max(1, int(data.lengths[a:b].sum(dtype=np.int64))))
        weights = normalise(sizes)
    G = t.global_batch_size
    n_train, n_valid = t.steps * G, cfg.eval.iters * G
    parts = build_many_split_datasets(
        datasets,
        ratios,
        cfg.seq_len,
        t.seed,
        [
            (
                math.ceil(w * n_train) + 1 if w > 0 else 0,
                math.ceil(w * n_valid) + 1 if w > 0 else 0,
                0,
            )
            for w in weights
        ],
        cache,
        rank,
        barrier,
        share,
    )
    if len(parts) == 1:
        train, valid = parts[0][0], parts[0][1]
    else:

        def blends(build: bool) -> tuple[BlendedDataset, BlendedDataset]:
            return (
                BlendedDataset([p[0] for p in parts], weights, n_train, cache, build),
                BlendedDataset([p[1] for p in parts], weights, n_valid, cache, build),
            )

        built = blends(True) if rank == 0 else None
        barrier()
        train, valid = built if built is not None else blends(False)
    log.info(
        "data: %d dataset(s) [%s], weights [%s], split %s, tokenizer %s (vocab %d), "
        "index cache %s, %.1fs",
        len(prefixes),
        ", ".join(str(p) for p in prefixes),
        ", ".join(f"{w:.3f}" for w in weights),
        "/".join(f"{r:.3f}" for r in ratios),
        tokenizer.name,
        tokenizer.vocab_size,
        cache,
        time.perf_counter() - t0,
    )
    return tokenizer, DataBundle(
        train, valid, lambda vocab: sampled_unigram(train, valid, vocab, cfg.seq_len)
    )


def sampled_unigram(
    train: Any, valid: Any, vocab_size: int, seq_len: int, max_tokens: int = 1 << 20
) -> float:
    """The unigram baseline (see ``unigram_cross_entropy``) on the first ~``max_tokens`` tokens of
    training samples and the validation samples' labels, for datasets too big to count fully."""
    k = max(1, min(len(train), max_tokens // (seq_len + 1)))
    counts_from = np.concatenate([train.sample(g) for g in range(k)])
    kv = max(1, min(len(valid), max_tokens // (seq_len + 1)))
    targets = np.concatenate([valid.sample(g)[1:] for g in range(kv)])
    counts = (
        np.bincount(counts_from.astype(np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    )
    logp = np.log(counts / counts.sum())
    return float(-logp[targets.astype(np.int64)].mean())
