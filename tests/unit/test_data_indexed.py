"""The Megatron-LM indexed format (.bin/.idx): byte layout, reading foreign files, corruption, merge."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from megaformer.data.indexed import IndexedDataset, IndexedWriter, merge
from megaformer.errors import DataError

# The layout, written down from the public description of Megatron-LM's MMIDIDX index
# (megatron/core/datasets/indexed_dataset.py), independently of megaformer's writer:
#   9 bytes magic b"MMIDIDX\x00\x00" | <Q version = 1 | <B dtype code | <Q sequence count S |
#   <Q document count D | int32[S] lengths | int64[S] byte pointers | int64[D] document indices
# dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.


def parse_idx(raw: bytes) -> dict:
    magic = raw[:9]
    (version,) = struct.unpack("<Q", raw[9:17])
    (code,) = struct.unpack("<B", raw[17:18])
    S, D = struct.unpack("<QQ", raw[18:34])
    off = 34
    lengths = list(struct.unpack(f"<{S}i", raw[off : off + 4 * S]))
    off += 4 * S
    pointers = list(struct.unpack(f"<{S}q", raw[off : off + 8 * S]))
    off += 8 * S
    docs = list(struct.unpack(f"<{D}q", raw[off : off + 8 * D]))
    assert off + 8 * D == len(raw)
    return dict(
        magic=magic, version=version, code=code, lengths=lengths, pointers=pointers, docs=docs
    )


def write(prefix, docs, dtype=np.uint16):
    w = IndexedWriter(prefix, dtype)
    for d in docs:
        w.add(np.asarray(d), [len(d)])
    w.finish()
    return prefix


def test_bytes_follow_the_published_layout(tmp_path):
    docs = [[1, 2, 3], [65535], [7, 8]]
    write(tmp_path / "d", docs)
    idx = parse_idx((tmp_path / "d.idx").read_bytes())
    assert idx == dict(
        magic=b"MMIDIDX\x00\x00",
        version=1,
        code=8,
        lengths=[3, 1, 2],
        pointers=[0, 6, 8],
        docs=[0, 1, 2, 3],
    )
    assert (tmp_path / "d.bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 65535, 7, 8)
    write(tmp_path / "w", [[70000, 1]], dtype=np.int32)
    idx = parse_idx((tmp_path / "w.idx").read_bytes())
    assert idx["code"] == 4 and idx["pointers"] == [0]
    assert (tmp_path / "w.bin").read_bytes() == struct.pack("<2i", 70000, 1)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_reads_a_file_written_by_hand(tmp_path):
    """A Megatron-style file with sentence-split documents (two sequences in document 0), int32."""
    seqs = [[10, 11], [12], [13, 14, 15]]
    head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 3, 3)
    body = struct.pack("<3i", 2, 1, 3) + struct.pack("<3q", 0, 8, 12) + struct.pack("<3q", 0, 2, 3)
    (tmp_path / "m.idx").write_bytes(head + body)
    (tmp_path / "m.bin").write_bytes(struct.pack("<6i", *sum(seqs, [])))
    ds = IndexedDataset(tmp_path / "m")
    assert len(ds) == 3 and ds.dtype == np.int32 and ds.doc_indices.tolist() == [0, 2, 3]
    assert [ds.get(i).tolist() for i in range(3)] == seqs
    assert ds.get(2, 1, 2).tolist() == [14, 15]


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda p: (p / "d.idx").write_bytes((p / "d.idx").read_bytes()[:40]), "d.idx: truncated"),
        (
            lambda p: (p / "d.idx").write_bytes(b"NOTMAGIC!" + (p / "d.idx").read_bytes()[9:]),
            "magic",
        ),
        (
            lambda p: (p / "d.idx").write_bytes(
                (p / "d.idx").read_bytes()[:9]
                + struct.pack("<Q", 2)
                + (p / "d.idx").read_bytes()[17:]
            ),
            "version 2",
        ),
        (lambda p: (p / "d.bin").write_bytes((p / "d.bin").read_bytes()[:-2]), "d.bin: 10 bytes"),
        (lambda p: (p / "d.bin").write_bytes((p / "d.bin").read_bytes() + b"xx"), "mismatched"),
        (lambda p: (p / "d.bin").unlink(), "d.bin: no such file"),
    ],
)
def test_damaged_files_are_named(tmp_path, damage, needle):
    write(tmp_path / "d", [[1, 2, 3], [4, 5, 6]])
    damage(tmp_path)
    with pytest.raises(DataError) as e:
        IndexedDataset(tmp_path / "d")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_merge_concatenates_and_shifts_document_indices(tmp_path):
    write(tmp_path / "a", [[1, 2], [3]])
    write(tmp_path / "b", [[4, 5, 6]])
    out = merge([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    assert out.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert out.doc_indices.tolist() == [0, 1, 2, 3] and out.lengths.tolist() == [2, 1, 3]
    assert parse_idx((tmp_path / "ab.idx").read_bytes())["pointers"] == [0, 4, 6]
    write(tmp_path / "c", [[1]], dtype=np.int32)
    with pytest.raises(DataError, match="c.idx: dtype int32 differs"):
        merge([tmp_path / "a", tmp_path / "c"], tmp_path / "ac")
    with pytest.raises(DataError, match="already exists"):
        merge([tmp_path / "a"], tmp_path / "ab")
