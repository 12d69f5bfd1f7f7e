"""Packed samples, cached indices, splits, blending, and the loader over them (resume, DP slices)."""

from __future__ import annotations

import numpy as np
import pytest

from megaformer.data.blend import BlendedDataset, blend_index
from megaformer.data.dataset import TrainLoader, validation_batches
from megaformer.data.gpt_dataset import GPTDataset, build_split_datasets, split_ranges
from megaformer.data.indexed import IndexedDataset, IndexedWriter
from megaformer.errors import DataError


def unique_tokens(prefix, n_docs=37, seed=0, base=0):
    """Documents of random lengths whose tokens are their global positions (+ base): every token
    is unique, so a sample tells exactly which tokens of the corpus it holds."""
    lengths = np.random.default_rng(seed).integers(1, 25, n_docs)
    w = IndexedWriter(prefix, np.int32)
    w.add(base + np.arange(lengths.sum()), lengths)
    w.finish()
    return IndexedDataset(prefix)


def test_every_token_of_an_epoch_is_in_exactly_one_sample(tmp_path):
    data = unique_tokens(tmp_path / "u")
    L = 7
    ds = GPTDataset(data, "train", (0, len(data)), L, seed=3, n_samples=60, cache_dir=None)
    T = data.n_tokens
    n = -(-T // L) + 1  # samples reaching past the first epoch's end
    ds.ensure(n)
    samples = [ds.stream_sample(i) for i in range(n)]
    assert all(len(s) == L + 1 for s in samples)
    for a, b in zip(samples, samples[1:]):
        assert a[-1] == b[0]  # labels = inputs shifted by one, packed across documents
    inputs = np.concatenate([s[:L] for s in samples])
    epoch0 = inputs[:T]
    assert np.array_equal(np.sort(epoch0), np.arange(T))  # every token exactly once
    # documents are whole and shuffled: the epoch is the documents in a permuted order
    order = [int(d) for d in ds.doc_idx[: len(data)]]
    assert sorted(order) == list(range(len(data))) and order != list(range(len(data)))
    assert np.array_equal(epoch0, np.concatenate([data.get(d) for d in order]))
    # training order: each block of len(ds) samples is a permutation of that block
    block = [int(ds.shuffle_idx[g]) for g in range(len(ds))]
    assert sorted(block) == list(range(len(ds)))


def test_indices_are_prefixes_cached_and_split(tmp_path):
    data = unique_tokens(tmp_path / "u", n_docs=200)
    cache = tmp_path / "cache"
    small = GPTDataset(data, "train", (0, 150), 5, 1, 10, cache)
    big = GPTDataset(data, "train", (0, 150), 5, 1, 5 * len(small), None)
    assert all(np.array_equal(small.sample(g), big.sample(g)) for g in range(len(small)))
    assert len(list(cache.glob("*.npy"))) == 3
    # a second build reads the cache (memory-mapped) instead of computing
    again = GPTDataset.__new__(GPTDataset)
    again.__dict__.update(small.__dict__, n_built=0)
    again._compute = None  # would fail if called
    again.ensure(10)
    assert isinstance(again.shuffle_idx, np.memmap)
    # beyond what was built: more epochs, the same stream
    assert np.array_equal(small.sample(3 * len(small)), big.sample(3 * len(small)))
    # splits: contiguous document ranges, disjoint tokens
    assert split_ranges(200, [0.9, 0.05, 0.05]) == [(0, 180), (180, 190), (190, 200)]
    tr, va, te = build_split_datasets(tmp_path / "u", [0.9, 0.05, 0.05], 5, 0, (10, 10, 10), cache)
    seen = [
        set(np.concatenate([d.sample(g) for g in range(len(d))]).tolist()) for d in (tr, va, te)
    ]
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])
    with pytest.raises(DataError, match="the valid split has .* fewer than seq_len"):
        build_split_datasets(tmp_path / "u", [0.999, 0.001], 64, 0, (10, 10), cache)


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 1], [0.7, 0.01, 0.19, 0.1], [5, 0, 1]])
def test_blend_shares_stay_within_one_sample(weights):
    which, offset = blend_index(weights, 5000)
    w = np.asarray(weights, float) / sum(weights)
    counts = np.cumsum(np.eye(len(w))[which], axis=0)
    n = np.arange(1, 5001)[:, None]
    assert np.abs(counts - w * n).max() < 1.0
    for d in range(len(w)):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert offset[which == d].tolist() == list(range(int((which == d).sum())))
    again, _ = blend_index(weights, 1234)
    assert np.array_equal(again, which[:1234])  # online: a prefix never changes


def test_blended_samples_come_from_their_dataset(tmp_path):
    parts = [
        GPTDataset(
            unique_tokens(tmp_path / f"d{i}", seed=i, base=10_000 * i),
            "train",
            (0, 37),
            6,
            0,
            100,
            None,
        )
        for i in range(2)
    ]
    blend = BlendedDataset(parts, [0.25, 0.75], 400, tmp_path / "cache")
    x, _ = blend.batch(np.arange(400))
    source = (x[:, 0] // 10_000).numpy()
    assert np.array_equal(source, blend.which[:400])
    assert blend.counts(400).tolist() == [100, 300]
    again = BlendedDataset(parts, [0.25, 0.75], 100, tmp_path / "cache")  # from the cache
    assert np.array_equal(again.which[:400], blend.which)


def _stream(loaders, steps):
    """The global sample stream: first-token ids of every rank's micro-batches, batch by batch."""
    out = []
    for _ in range(steps):
        per_rank = [[x[:, 0].tolist() for x, _ in ld.next_step()] for ld in loaders]
        batch = []
        for j in range(len(per_rank[0])):  # micro-batch j of rank r = slice j*dp + r
            for r in range(len(loaders)):
                batch += per_rank[r][j]
        out.append(batch)
    return out


@pytest.fixture
def gpt(tmp_path):
    return GPTDataset(unique_tokens(tmp_path / "u", n_docs=300), "train", (0, 300), 4, 0, 200, None)


def test_dp_slices_are_disjoint_and_complete(gpt):
    one = _stream([TrainLoader(gpt, 2, 4, 0, 1, seed=0)], 5)
    two = _stream([TrainLoader(gpt, 2, 2, r, 2, seed=0) for r in range(2)], 5)
    four = _stream([TrainLoader(gpt, 2, 1, r, 4, seed=0, prefetch=2) for r in range(4)], 5)
    assert one == two == four
    flat = sum(one, [])
    assert len(set(flat)) == len(flat) == 40


def test_resume_continues_with_exactly_the_next_sample(gpt):
    full = sum(_stream([TrainLoader(gpt, 2, 2, 0, 1, seed=0, prefetch=1)], 6), [])  # 24 samples
    first = sum(_stream([TrainLoader(gpt, 2, 2, 0, 1, seed=0)], 2), [])
    # resume at 8 consumed samples with another global batch (DP 2 x mbs 1 x accumulation 3 = 6)
    rest = sum(
        _stream(
            [
                TrainLoader(gpt, 1, 3, r, 2, seed=0, consumed_samples=8, prefetch=3)
                for r in range(2)
            ],
            16 // 6 + 1,
        ),
        [],
    )
    assert first + rest[:16] == full


def test_prefetch_reads_the_same_batches_and_stops(gpt):
    plain = TrainLoader(gpt, 3, 2, 0, 1, seed=0)
    ahead = TrainLoader(gpt, 3, 2, 0, 1, seed=0, prefetch=2, stop_at=18)
    for _ in range(3):
        for (a, b), (c, d) in zip(plain.next_step(), ahead.next_step()):
            assert a.equal(c) and b.equal(d)
    assert ahead.consumed_samples == 18 and not ahead._pending
    ahead.close()
    va = [x[:, 0].tolist() for x, _ in validation_batches(gpt, 2, 1, 3, 0, 1)]
    assert va == [x[:, 0].tolist() for x, _ in validation_batches(gpt, 2, 1, 3, 0, 1)]
