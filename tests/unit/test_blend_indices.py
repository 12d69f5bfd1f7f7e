"""Index arrays in the smallest integer types that hold them, built in bounded chunks, and the blend
index cached as memory-mapped .npy files (a malformed cache is rebuilt, not used)."""

from __future__ import annotations

import json

import numpy as np

from megaformer.data.blend import BlendedDataset, blend_index
from megaformer.data.gpt_dataset import build_sample_index
from megaformer.data.indexed import smallest_int


def test_smallest_int():
    assert [smallest_int(v) for v in (0, 127, 128, 32767, 32768, 2**31 - 1, 2**31)] == [
        np.int8,
        np.int8,
        np.int16,
        np.int16,
        np.int32,
        np.int32,
        np.int64,
    ]


def test_sample_index_is_int32_and_independent_of_the_chunk():
    lengths = np.random.default_rng(0).integers(1, 50, 5000).astype(np.int32)
    L, n = 16, (int(lengths.sum()) - 1) // 16
    # the plain formula, in int64
    ends = np.cumsum(lengths, dtype=np.int64)
    targets = np.arange(n + 1, dtype=np.int64) * L
    pos = np.searchsorted(ends, targets, side="right")
    expected = np.stack([pos, targets - (ends[pos] - lengths[pos])], axis=1)
    for chunk in (1, 7, 1000, 1 << 22):
        got = build_sample_index(lengths, L, n, chunk=chunk)
        assert got.dtype == np.int32 and np.array_equal(got, expected)


def test_blend_index_dtypes_and_cache(tmp_path):
    which, offset = blend_index([1, 2, 3], 200_000)
    assert which.dtype == np.int8 and offset.dtype == np.int32
    parts = [
        type(
            "Part",
            (),
            {"sample": lambda self, k: np.array([k]), "ensure": lambda *a, **k: None, "seq_len": i},
        )()
        for i in range(3)
    ]
    built = BlendedDataset(parts, [1, 2, 3], 5000, tmp_path)
    assert isinstance(built.which, np.memmap)  # rank 0 keeps the saved arrays mapped, not in memory
    assert sorted(p.name.rsplit("-", 1)[-1] for p in tmp_path.glob("blend-*")) == [
        f"{built._key().rsplit('-', 1)[-1]}.json",
        "offset.npy",
        "which.npy",
    ]
    again = BlendedDataset(parts, [1, 2, 3], 4000, tmp_path, build=False)
    assert isinstance(again.which, np.memmap) and np.array_equal(again.which, built.which)
    # a malformed cache (a dataset number out of range) is ignored and rebuilt
    paths = built._paths()
    bad = np.array(built.which)
    bad[10] = 7
    np.save(paths["which"], bad)
    fixed = BlendedDataset(parts, [1, 2, 3], 5000, tmp_path)
    assert (
        np.array_equal(fixed.which, which_ref := blend_index([1, 2, 3], 5000)[0])
        and which_ref[10] != 7
    )
    assert json.loads(paths["meta"].read_text())["samples"] == 5000
