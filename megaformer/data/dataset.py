"""Packed token windows and the data-parallel loader.

Documents are tokenized, each followed by one end-of-document token, and concatenated into one
stream per split. Sample i of a stream is the window ``tokens[i*L : i*L + L + 1]`` (L = seq_len), so
inputs are its first L tokens and labels its last L: packing across document boundaries, no padding.

Order: sample g of the global sequence is ``perm_e[g mod n]`` with e = g div n and ``perm_e`` a
permutation seeded by (seed, e): every epoch is a fresh shuffle, and the data never "runs out".
The global batch of an optimizer step is the next ``global_batch_size`` samples after
``consumed_samples``; data-parallel rank r takes micro-batch slices of it. Because the order does not
depend on the number of ranks, resuming with a different DP degree continues exactly, and the only
loader state saved in a checkpoint is ``consumed_samples``.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from megaformer import comm
from megaformer.data.tokenizer import Tokenizer
from megaformer.errors import DataError


@dataclass
class TokenizedCorpus:
    """Train and validation token streams (EOD after each document)."""

    train: np.ndarray
    valid: np.ndarray
    n_docs: int
    n_valid_docs: int


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _concat(token_lists: Sequence[Sequence[int]], eod: int, dtype: np.dtype) -> np.ndarray:
    total = sum(len(t) + 1 for t in token_lists)
    out = np.empty(total, dtype=dtype)
    pos = 0
    for toks in token_lists:
        out[pos : pos + len(toks)] = toks
        out[pos + len(toks)] = eod
        pos += len(toks) + 1
    return out


def tokenize_corpus(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    valid_fraction: float,
    seed: int,
    batch: int = 256,
) -> TokenizedCorpus:
    """Tokenize ``documents`` and split them into train/validation streams.

    A seeded ``valid_fraction`` of the documents (at least one) goes to validation. A corpus of a
    single document is split inside its token stream instead.
    """
    n = len(documents)
    if n == 0:
        raise DataError("the corpus is empty: no non-empty documents were found")
    tokens: list[Sequence[int]] = []
    for i in range(0, n, batch):
        tokens.extend(tokenizer.encode_batch(list(documents[i : i + batch])))
    dtype = token_dtype(tokenizer.vocab_size)
    if n == 1:
        stream = _concat(tokens, tokenizer.eod_id, dtype)
        cut = int(len(stream) * (1 - valid_fraction))
        return TokenizedCorpus(stream[:cut], stream[cut:], 1, 0)
    n_valid = min(n - 1, max(1, round(valid_fraction * n)))
    perm = np.random.default_rng(seed).permutation(n)
    valid_ids = set(perm[:n_valid].tolist())
    train = _concat(
        [t for i, t in enumerate(tokens) if i not in valid_ids], tokenizer.eod_id, dtype
    )
    valid = _concat([t for i, t in enumerate(tokens) if i in valid_ids], tokenizer.eod_id, dtype)
    return TokenizedCorpus(train, valid, n, n_valid)


class PackedDataset:
    """Windows of ``seq_len + 1`` tokens over one token stream; sample i starts at i * seq_len."""

    def __init__(self, tokens: np.ndarray, seq_len: int, split: str = "train") -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.n_samples = (len(tokens) - 1) // seq_len
        if self.n_samples < 1:
            raise DataError(
                f"the {split} split has {len(tokens)} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}: use more data or a shorter data.seq_len"
            )

    def __len__(self) -> int:
        return self.n_samples

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each [len(indices), seq_len] int64."""
        L = self.seq_len
        rows = np.stack([self.tokens[i * L : i * L + L + 1] for i in indices]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class ShuffledOrder:
    """Maps a global sample number g to a dataset index: ``perm_{g div n}[g mod n]``."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self._epoch = -1
        self._perm = np.arange(0)

    def _perm_for(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = epoch
        return self._perm

    def __getitem__(self, globals_: np.ndarray) -> np.ndarray:
        out = np.empty(len(globals_), dtype=np.int64)
        epochs = globals_ // self.n
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm_for(int(e))[globals_[sel] % self.n]
        return out


class IdentityOrder:
    """For datasets that shuffle themselves (``dataset.shuffled``): global sample g is index g."""

    def __getitem__(self, globals_: np.ndarray) -> np.ndarray:
        return globals_


class TrainLoader:
    """Yields, per optimizer step, this DP rank's ``grad_accum`` micro-batches of the global batch.

    Global batch = samples ``[c, c + G)`` of the shuffled order, c = consumed_samples,
    G = micro_batch_size * grad_accum * dp_size. Micro-batch j of rank r holds the samples
    ``c + (j * dp_size + r) * mbs + [0, mbs)``: the ranks' slices are disjoint and cover the batch,
    and the order of samples does not depend on G or the DP size, so a resume with another global
    batch size or DP degree continues exactly at sample c.

    ``prefetch`` > 0 reads that many steps ahead in one background thread (never past ``stop_at``
    samples); the batches and ``consumed_samples`` are the same as without it. For a CUDA
    ``device`` (where the batches go) that thread also copies each batch into page-locked memory,
    so the training loop's ``x.to(device, non_blocking=True)`` is an asynchronous copy instead of
    one staged through pageable memory that waits for the stream.

    ``part`` (context parallelism): the context ranks of a DP rank read the same samples and each
    keeps its part of every sequence, ``part(t)`` of inputs and labels
    (:func:`megaformer.parallel.context.split_sequence`).

    ``readers`` (a gloo group of the ranks that take the same batches: the model-parallel ranks
    of one data-parallel rank): its first rank alone reads from the filesystem and broadcasts each
    step's micro-batches to the others (one exchange per step, on the reading thread).
    """

    def __init__(
        self,
        dataset: PackedDataset,
        micro_batch_size: int,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        consumed_samples: int = 0,
        prefetch: int = 0,
        stop_at: Optional[int] = None,
        part: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        device: Optional[torch.device] = None,
        readers: Any = None,
    ) -> None:
        self.dataset = dataset
        self.readers = readers if readers is not None and comm.size(readers) > 1 else None
        self.source = comm.ranks(self.readers)[0] if self.readers is not None else None
        self.reads = self.readers is None or comm.rank(self.readers) == 0
        self.mbs = micro_batch_size
        self.grad_accum = grad_accum
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.order = (
            IdentityOrder()
            if getattr(dataset, "shuffled", False)
            else ShuffledOrder(len(dataset), seed)
        )
        self.consumed_samples = consumed_samples
        self.prefetch = prefetch
        self.stop_at = stop_at
        self._pending: deque = deque()
        self._pool: Optional[ThreadPoolExecutor] = None
        self.part = part
        # pinned in the prefetch thread only: pinning in the loop would stall it as long as the copy
        self.pin = device is not None and device.type == "cuda" and prefetch > 0

    @property
    def global_batch_size(self) -> int:
        return self.mbs * self.grad_accum * self.dp_size

    def read_step(self, consumed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of the global batch that starts at sample ``consumed``."""
        batches = (
            [
                self.dataset.batch(self.order[np.arange(start, start + self.mbs)])
                for start in (
                    consumed + (j * self.dp_size + self.dp_rank) * self.mbs
                    for j in range(self.grad_accum)
                )
            ]
            if self.reads
            else None
        )
        if self.readers is not None:  # [grad_accum, 2, mbs, seq] from the group's reader
            both = torch.stack([torch.stack(b) for b in batches]) if batches is not None else None
            both = comm.broadcast_with_shape(both, self.source, self.readers, torch.int64)
            batches = [(b[0], b[1]) for b in both]
        out = []
        for x, y in batches:  # type: ignore[union-attr]
            if self.part is not None:
                x, y = self.part(x), self.part(y)
            out.append((x.pin_memory(), y.pin_memory()) if self.pin else (x, y))
        return out

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c, G = self.consumed_samples, self.global_batch_size
        if self.prefetch <= 0:
            out = self.read_step(c)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="megaformer-prefetch")
            if self._pending and self._pending[0][0] != c:  # position moved: drop stale reads
                self._pending.clear()
            if not self._pending:
                self._pending.append((c, self._pool.submit(self.read_step, c)))
            while len(self._pending) <= self.prefetch:
                nxt = self._pending[-1][0] + G
                if self.stop_at is not None and nxt >= self.stop_at:
                    break
                self._pending.append((nxt, self._pool.submit(self.read_step, nxt)))
            out = self._pending.popleft()[1].result()
        self.consumed_samples = c + G
        return out

    def close(self) -> None:
        """Stop the prefetch thread (pending reads are dropped; with ``readers`` they finish
        first: each is an exchange the group's other ranks take part in too)."""
        if self.readers is not None:
            for _, future in self._pending:
                future.exception()  # waits; an error there no longer matters
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=self.readers is not None, cancel_futures=self.readers is None)
            self._pool = None


def validation_batches(
    dataset: PackedDataset,
    micro_batch_size: int,
    grad_accum: int,
    iters: int,
    dp_rank: int,
    dp_size: int,
    part: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of ``iters`` global batches of validation windows, in fixed order.

    Global batch ``it`` holds windows ``[it*G, (it+1)*G)`` (cycled if the split is small), split into
    micro-batches exactly like training batches, so the mean over all ranks and micro-batches is the
    same whatever the data-parallel size. ``part``: as in :class:`TrainLoader`.
    """
    G = micro_batch_size * grad_accum * dp_size
    for it in range(iters):
        for j in range(grad_accum):
            start = it * G + (j * dp_size + dp_rank) * micro_batch_size
            x, y = dataset.batch(np.arange(start, start + micro_batch_size) % len(dataset))
            yield (x, y) if part is None else (part(x), part(y))


def unigram_cross_entropy(train: np.ndarray, valid: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of ``valid`` under add-one-smoothed unigram counts of ``train``.

    The loss a model reaches by predicting token frequencies and ignoring context; a language model
    that learnt anything sits clearly below it.
    """
    counts = np.bincount(train.astype(np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[valid[1:].astype(np.int64)].mean())
