"""The document/sample/shuffle indices built in units (an epoch, a shuffle block) on threads and
written straight into their files: the same arrays, and the same file bytes, as the whole-array
formulas; a cached index checked unit by unit; each ``.idx`` hashed once."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from megaformer.data import gpt_dataset, indexed
from megaformer.data.blend import BlendedDataset, blend_index
from megaformer.data.gpt_dataset import (
    GPTDataset,
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    build_split_datasets,
)
from megaformer.data.indexed import IndexedDataset, IndexedWriter
from megaformer.data.npy_files import NpyWriter


def corpus(prefix, n_docs, seed, max_len=60, zeros=0.1):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, n_docs)
    lengths[rng.random(n_docs) < zeros] = 0  # empty documents are skipped by the packing
    w = IndexedWriter(prefix, np.uint16)
    w.add(rng.integers(0, 500, int(lengths.sum())), lengths)
    w.finish()
    return IndexedDataset(prefix)


def reference(data, a, b, L, seed, n_blocks):
    """The indices by the whole-array formulas (one permutation per epoch, one cumulative sum and
    searchsorted over the whole stream, one permutation per block)."""
    lengths = data.lengths[a:b]
    T = int(lengths.sum(dtype=np.int64))
    block = T // L
    n = n_blocks * block
    n_epochs = -(-(n * L + 1) // T)
    doc = build_document_index(b - a, a, n_epochs, seed)
    sample = build_sample_index(data.lengths[doc], L, n)
    return doc, sample, build_shuffle_index(block, n_blocks, seed)


@pytest.mark.parametrize(
    "threads,doc_chunk,row_chunk", [(1, 1 << 20, 1 << 20), (3, 7, 5), (2, 64, 3)]
)
def test_units_build_the_whole_array_indices_and_files(
    tmp_path, monkeypatch, threads, doc_chunk, row_chunk
):
    monkeypatch.setattr(gpt_dataset, "THREADS", threads)
    monkeypatch.setattr(gpt_dataset, "DOC_CHUNK", doc_chunk)
    monkeypatch.setattr(gpt_dataset, "ROW_CHUNK", row_chunk)
    data = corpus(tmp_path / "d", 400, seed=threads)
    for (a, b), L, seed, n_samples in (
        ((0, 400), 16, 3, 1500),
        ((37, 311), 5, 0, 4000),
        ((300, 400), 64, 9, 80),
    ):
        ref = reference(
            data,
            a,
            b,
            L,
            seed,
            GPTDataset(data, "train", (a, b), L, seed, 1, None)._blocks_for(n_samples),
        )
        memory = GPTDataset(data, "train", (a, b), L, seed, n_samples, None)
        cache = tmp_path / f"cache-{a}"
        cached = GPTDataset(data, "train", (a, b), L, seed, n_samples, cache)
        assert memory.n_built >= n_samples and len(ref[0]) > b - a  # several epochs
        for got, want, name in zip(
            (memory.doc_idx, memory.sample_idx, memory.shuffle_idx),
            ref,
            ("doc", "sample", "shuffle"),
        ):
            assert got.dtype == want.dtype == np.int32 and np.array_equal(got, want), name
            path = cache / f"{cached.key()}-{name}.npy"
            ref_file = tmp_path / "ref.npy"
            np.save(ref_file, want)
            assert path.read_bytes() == ref_file.read_bytes(), name  # caches stay valid
        assert isinstance(cached.sample_idx, np.memmap)
        assert not list(cache.glob(".tmp-*"))


def test_cached_index_is_checked_unit_by_unit(tmp_path, monkeypatch):
    monkeypatch.setattr(gpt_dataset, "DOC_CHUNK", 16)
    monkeypatch.setattr(gpt_dataset, "ROW_CHUNK", 8)
    data, cache = corpus(tmp_path / "d", 120, seed=1), tmp_path / "cache"
    built = GPTDataset(data, "train", (10, 110), 8, 5, 700, cache)
    key, blocks = built.key(), built._blocks_for(700)
    arrays = [np.array(a) for a in (built.doc_idx, built.sample_idx, built.shuffle_idx)]
    built.check_indices(*arrays, blocks)

    def refused(name, change, match):
        bad = [a.copy() for a in arrays]
        change(bad[("doc", "sample", "shuffle").index(name)])
        with pytest.raises(ValueError, match=match):
            built.check_indices(*bad, blocks)

    def swap_across_epochs(doc):  # every value in range, but epoch 0 holds one document twice
        doc[0], doc[100] = doc[100], doc[0]
        doc[1] = doc[0] if doc[1] != doc[0] else doc[2]

    refused("doc", swap_across_epochs, "epoch 0 of the document index is not a permutation")
    refused("doc", lambda d: d.__setitem__(5, 110), "not a permutation")  # outside the split
    refused("sample", lambda s: s.__setitem__((40, 1), s[40, 1] + 1), "does not match")
    refused("sample", lambda s: s.__setitem__((-1, 0), 10**9), "does not match")
    n = len(arrays[2])
    refused(
        "shuffle",
        lambda s: s.__setitem__(slice(0, n), np.arange(n)[::-1]),
        "permutation of each block",
    )
    refused("shuffle", lambda s: s.__setitem__(3, s[4]), "permutation of each block")
    with pytest.raises(ValueError, match="shape"):
        built.check_indices(arrays[0][:-1], arrays[1], arrays[2], blocks)
    # the cache is read back, checked, and used; a poisoned one is rebuilt
    assert GPTDataset(data, "train", (10, 110), 8, 5, 700, cache)._load_cached(key, blocks)
    np.save(cache / f"{key}-sample.npy", arrays[1] + np.array([0, 1], dtype=np.int32))
    again = GPTDataset(data, "train", (10, 110), 8, 5, 700, cache)
    assert np.array_equal(again.sample_idx, arrays[1])


def test_each_idx_is_hashed_once(tmp_path, monkeypatch):
    corpus(tmp_path / "d", 300, seed=2)
    reads = []
    real = hashlib.sha256

    class Counting:
        def __init__(self, data=b""):
            self.h = real(data)

        def update(self, chunk):
            reads.append(len(chunk))
            self.h.update(chunk)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(indexed.hashlib, "sha256", Counting)
    train, valid, _ = build_split_datasets(
        tmp_path / "d", [0.8, 0.2, 0], 8, 0, (500, 50, 0), tmp_path / "cache"
    )
    assert sum(reads) == (tmp_path / "d.idx").stat().st_size  # train and valid keys: one read
    assert train.key() != valid.key()


@pytest.mark.parametrize(
    "dtype,shape", [(np.int8, (0,)), (np.int32, (1000, 2)), (np.int64, (77,)), (np.int16, (5,))]
)
def test_npy_writer_writes_numpy_save_bytes(tmp_path, dtype, shape):
    want = np.random.default_rng(0).integers(-100, 100, shape).astype(dtype)
    path = tmp_path / "x.npy"
    w = NpyWriter(path, dtype, shape)
    for a in reversed(range(0, shape[0], 13)):  # pieces in any order
        w.put(a, want[a : a + 13])
    assert not path.exists()  # published only when complete
    w.commit()
    np.save(tmp_path / "ref.npy", want)
    assert path.read_bytes() == (tmp_path / "ref.npy").read_bytes()
    aborted = NpyWriter(tmp_path / "y.npy", dtype, shape)
    aborted.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.npy", "x.npy"]


def test_cached_blend_is_written_in_chunks_as_numpy_saves_it(tmp_path, monkeypatch):
    from megaformer.data import blend

    monkeypatch.setattr(blend, "CHUNK", 1000)
    parts = [
        type(
            "Part",
            (),
            {"sample": lambda self, k: np.array([k]), "ensure": lambda *a, **k: None, "seq_len": i},
        )()
        for i in range(5)
    ]
    weights = [0.4, 0.3, 0.2, 0.05, 0.05]
    built = BlendedDataset(parts, weights, 12_345, tmp_path)
    which, offset = blend_index(weights, 12_345)
    for name, want in (("which", which), ("offset", offset)):
        np.save(tmp_path / "ref.npy", want)
        assert built._paths()[name].read_bytes() == (tmp_path / "ref.npy").read_bytes()
    assert built.counts(12_345).tolist() == np.bincount(which, minlength=5).tolist()
    assert built._counts.tolist() == np.bincount(which, minlength=5).tolist()
    assert built.counts(1001).tolist() == np.bincount(which[:1001], minlength=5).tolist()
    one = BlendedDataset(parts, [0, 1, 0, 0, 0], 1000, tmp_path / "one")
    assert one._counts.tolist() == [0, 1000, 0, 0, 0] and (np.asarray(one.which) == 1).all()


def test_prepared_data_in_a_shared_cache_is_reused_only_when_our_own(tmp_path):
    import os

    from megaformer.config import Config
    from megaformer.data.setup import _prepare_sources
    from megaformer.data.tokenizer import build_tokenizer
    from megaformer.errors import DataError

    source = tmp_path / "docs.jsonl"
    source.write_text("".join(f'{{"text": "document number {i} says hello"}}\n' for i in range(50)))
    cfg = Config()
    cfg.data.paths = [str(source)]
    cfg.data.tokenizer = "byte"
    tokenizer, cache = build_tokenizer("byte", iter(())), tmp_path / "cache"
    (out,) = _prepare_sources(cfg, cache, 0, lambda: None, tokenizer)
    assert indexed.is_prefix(out)
    assert _prepare_sources(cfg, cache, 0, lambda: None, tokenizer) == [out]  # ours: reused
    planted = indexed.idx_path(out)
    os.chmod(planted, 0o664)  # another member of the group could have written it
    with pytest.raises(
        DataError, match=f"{planted}: a prepared dataset in data.cache_dir that is not"
    ):
        _prepare_sources(cfg, cache, 0, lambda: None, tokenizer)
    os.chmod(planted, 0o644)
    if os.getuid() == 0:  # another user's file
        os.chown(indexed.bin_path(out), 4321, -1)
        with pytest.raises(DataError, match="data.bin: a prepared dataset"):
            _prepare_sources(cfg, cache, 0, lambda: None, tokenizer)


def test_units_share_one_budget_of_threads_and_memory(monkeypatch):
    import threading
    import time

    running, peak, lock = [0], [0], threading.Lock()

    def unit():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.1)
        with lock:
            running[0] -= 1

    def two_builds_at_once(unit_bytes):
        peak[0] = 0
        calls = [
            threading.Thread(target=gpt_dataset.run_units, args=([unit] * 6, unit_bytes))
            for _ in range(2)
        ]
        for c in calls:
            c.start()
        for c in calls:
            c.join()
        return peak[0]

    monkeypatch.setattr(gpt_dataset, "THREADS", 3)
    monkeypatch.setattr(gpt_dataset, "BUILD_MEMORY", 1000)
    assert two_builds_at_once(100) == 3  # the thread limit, over both calls together
    assert two_builds_at_once(400) == 2  # the memory limit
    assert two_builds_at_once(5000) == 1  # a unit larger than the budget still runs, alone
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert gpt_dataset.processes_per_node() == 3


def test_compiled_walk_and_numpy_give_the_same_rows(tmp_path, monkeypatch):
    from megaformer.data.blend import scheduler

    assert scheduler() is not None  # the test machines have a C compiler
    monkeypatch.setattr(gpt_dataset, "ROW_CHUNK", 7)
    monkeypatch.setattr(gpt_dataset, "DOC_CHUNK", 5)
    data = corpus(tmp_path / "d", 300, seed=4)
    built = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(gpt_dataset, "_native_rows", lambda: None)
        ds = GPTDataset(data, "train", (20, 280), 16, 2, 3000, None)
        built[native] = ds.sample_idx
        ref = reference(data, 20, 280, 16, 2, ds._blocks_for(3000))[1]
        assert np.array_equal(ds.sample_idx, ref)
        ds.check_indices(ds.doc_idx, ds.sample_idx, ds.shuffle_idx, ds._blocks_for(3000))
    assert np.array_equal(built[True], built[False])


@pytest.mark.parametrize("n", [0, 1, 2, 33, 34, 1000, 100_003])
def test_compiled_shuffle_is_numpys(monkeypatch, n):
    from megaformer.data.gpt_dataset import shuffled_range

    for dtype in (np.int32, np.int64):
        for seed in ([1234, 3], [0, 5, 1], [7]):
            want = 5 + np.random.default_rng(seed).permutation(n)
            got = shuffled_range(5, 5 + n, np.dtype(dtype), seed)
            assert got.dtype == dtype and np.array_equal(got, want)
    monkeypatch.setattr(gpt_dataset, "_native_rows", lambda: None)
    assert np.array_equal(
        shuffled_range(5, 5 + n, np.dtype(np.int32), [1234, 3]),
        5 + np.random.default_rng([1234, 3]).permutation(n),
    )
