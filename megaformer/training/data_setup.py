"""From ``cfg.data`` to a tokenizer and train/validation token streams, on every rank.

A tokenizer that must be trained (``bpe:N``) is trained once by rank 0 and saved to
``RUN_DIR/tokenizer.json``; the other ranks wait and load it. A resumed run takes the tokenizer from
its checkpoint, so token ids never change under a running model.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional

from megaformer.config import Config
from megaformer.data.corpus import iter_documents
from megaformer.data.dataset import TokenizedCorpus, tokenize_corpus
from megaformer.data.tokenizer import Tokenizer, build_tokenizer, load_tokenizer
from megaformer.errors import DataError

log = logging.getLogger("megaformer")


def prepare_data(cfg: Config, run_dir: Path, rank: int, barrier: Callable[[], None],
                 checkpoint: Optional[Path]) -> tuple[Tokenizer, TokenizedCorpus]:
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
    log.info("data: %d documents (%d held out), %s train / %s validation tokens, tokenizer %s "
             "(vocab %d), %.1fs", corpus.n_docs, corpus.n_valid_docs, f"{len(corpus.train):,}",
             f"{len(corpus.valid):,}", tokenizer.name, tokenizer.vocab_size,
             time.perf_counter() - t0)
    return tokenizer, corpus
