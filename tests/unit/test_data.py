"""Corpus reading, tokenizers, packing, the data-parallel loader and the unigram baseline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megaformer.data.corpus import iter_documents, source_files
from megaformer.data.dataset import (
    PackedDataset,
    ShuffledOrder,
    TrainLoader,
    tokenize_corpus,
    unigram_cross_entropy,
    validation_batches,
)
from megaformer.data.tokenizer import ByteTokenizer, build_tokenizer, load_tokenizer
from megaformer.errors import DataError


@pytest.mark.slow
def test_stdlib_corpus_is_present_and_has_no_site_packages():
    files = source_files("stdlib")
    assert len(files) > 100
    assert not any("site-packages" in f.parts for f in files)
    docs = list(iter_documents("stdlib", max_bytes=50_000))
    assert sum(len(d) for d in docs) <= 50_000 and docs


def test_stdlib_files_are_walked_in_sorted_order():
    """The lazy walk (each folder's entries sorted by name) yields exactly the sorted list of the
    library's .py files outside site-packages and __pycache__, and the documents come in that
    order."""
    import sysconfig

    from megaformer.data.corpus import _SKIP_DIRS, iter_stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    rglob = sorted(
        f for f in root.rglob("*.py") if not _SKIP_DIRS.intersection(f.relative_to(root).parts)
    )
    walked = list(iter_stdlib_files())
    assert walked == rglob and len(walked) > 100
    first = next(iter_documents("stdlib"))
    assert first == rglob[0].read_text(encoding="utf-8", errors="replace")


def test_folder_txt_and_jsonl_sources(tmp_path, text_corpus):
    assert len(list(iter_documents(str(text_corpus)))) == 40
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"text": f"doc {i}", "id": i}) for i in range(5)) + "\n\n")
    assert list(iter_documents(str(jl))) == [f"doc {i}" for i in range(5)]
    js = tmp_path / "d.json"
    js.write_text(json.dumps([{"body": "a"}, {"body": "b"}]))
    assert list(iter_documents(str(js), text_field="body")) == ["a", "b"]


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda p: None, "no such file or folder"),
        (lambda p: p.mkdir(), "holds no text files"),
        (lambda p: p.with_suffix(".bin").write_bytes(b"x") or None, None),
    ],
)
def test_source_errors(tmp_path, setup, message):
    target = tmp_path / "src"
    setup(target)
    if message is None:  # unsupported file type
        with pytest.raises(DataError, match="unsupported file type"):
            list(iter_documents(str(tmp_path / "src.bin")))
        return
    with pytest.raises(DataError, match=message):
        list(iter_documents(str(target)))


def test_bad_jsonl_names_the_line(tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(DataError, match="d.jsonl:2: not valid JSON"):
        list(iter_documents(str(jl)))
    jl.write_text('{"content": "ok"}\n')
    with pytest.raises(DataError, match="no field 'text'"):
        list(iter_documents(str(jl)))


def test_empty_corpus_is_refused():
    with pytest.raises(DataError, match="empty"):
        tokenize_corpus([], ByteTokenizer(), 0.1, 0)


def test_byte_tokenizer_round_trip(tmp_path):
    tok = ByteTokenizer()
    text = "déjà vu — ok"
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 257 and tok.eod_id == 256
    tok.save(tmp_path / "tokenizer.json")
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


def test_bpe_trains_saves_and_reloads(tmp_path, text_corpus):
    docs = list(iter_documents(str(text_corpus)))
    tok = build_tokenizer("bpe:300", iter(docs))
    assert tok.vocab_size <= 300
    ids = tok.encode(docs[0])
    assert len(ids) < len(docs[0].encode())  # merges happened
    assert tok.decode(ids) == docs[0]
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert again.encode(docs[1]) == tok.encode(docs[1]) and again.eod_id == tok.eod_id
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError):
        load_tokenizer(tmp_path / "bad.json")


def test_split_and_eod():
    docs = [f"document number {i} " * 3 for i in range(50)]
    c = tokenize_corpus(docs, ByteTokenizer(), 0.1, seed=0)
    assert c.n_valid_docs == 5
    assert (c.train == 256).sum() == 45 and (c.valid == 256).sum() == 5
    assert len(c.train) + len(c.valid) == sum(len(d) + 1 for d in docs)
    again = tokenize_corpus(docs, ByteTokenizer(), 0.1, seed=0)
    assert np.array_equal(again.valid, c.valid)


def test_packed_windows_shift_labels_by_one():
    tokens = np.arange(101, dtype=np.uint16)
    ds = PackedDataset(tokens, 10)
    assert len(ds) == 10
    x, y = ds.batch(np.array([0, 3]))
    assert x[1].tolist() == list(range(30, 40)) and y[1].tolist() == list(range(31, 41))
    with pytest.raises(DataError, match="fewer than seq_len"):
        PackedDataset(np.arange(5, dtype=np.uint16), 10, "validation")


def test_shuffled_order_is_a_permutation_per_epoch():
    order = ShuffledOrder(10, seed=3)
    e0, e1 = order[np.arange(10)], order[np.arange(10, 20)]
    assert sorted(e0) == list(range(10)) and sorted(e1) == list(range(10))
    assert not np.array_equal(e0, e1)
    assert np.array_equal(ShuffledOrder(10, 3)[np.arange(5, 15)], np.concatenate([e0[5:], e1[:5]]))


def test_data_parallel_ranks_partition_the_global_batch():
    ds = PackedDataset(np.arange(2001, dtype=np.uint16), 10)
    one = TrainLoader(ds, micro_batch_size=2, grad_accum=4, dp_rank=0, dp_size=1, seed=0)
    ranks = [TrainLoader(ds, 2, 2, r, 2, seed=0) for r in range(2)]
    for _ in range(3):
        single = sorted(int(v) for x, _ in one.next_step() for v in x[:, 0])
        split = sorted(int(v) for r in ranks for x, _ in r.next_step() for v in x[:, 0])
        assert single == split and len(set(single)) == 8
    assert one.consumed_samples == ranks[0].consumed_samples == 24


def test_loader_resumes_at_the_next_sample():
    ds = PackedDataset(np.arange(2001, dtype=np.uint16), 10)
    full = TrainLoader(ds, 2, 1, 0, 1, seed=5)
    steps = [full.next_step()[0][0] for _ in range(6)]
    resumed = TrainLoader(ds, 2, 1, 0, 1, seed=5, consumed_samples=6)
    for expected in steps[3:]:
        assert np.array_equal(resumed.next_step()[0][0], expected)


def test_prefetch_thread_pins_the_batches_for_a_cuda_device(monkeypatch):
    """For a CUDA device the prefetch thread copies every batch to page-locked memory (stubbed: a
    CPU build cannot pin), so the loop's non-blocking copies are asynchronous; never on CPU, and
    never in the loop itself (prefetch=0)."""
    import threading

    import torch

    pinned = []

    def pin_memory(self):
        pinned.append(threading.current_thread().name)
        out = self.clone()
        out.was_pinned = True
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    ds = PackedDataset(np.arange(2001, dtype=np.uint16), 10)
    plain = TrainLoader(ds, 2, 3, 0, 1, seed=0)
    cuda = TrainLoader(ds, 2, 3, 0, 1, seed=0, prefetch=2, device=torch.device("cuda"))
    for _ in range(2):
        got, want = cuda.next_step(), plain.next_step()
        assert all(getattr(t, "was_pinned", False) for xy in got for t in xy)
        assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
    cuda.close()
    assert len(pinned) >= 2 * 2 * 3 and set(pinned) == {"megaformer-prefetch_0"}
    for device, prefetch in (("cpu", 2), ("cuda", 0)):
        loader = TrainLoader(ds, 2, 3, 0, 1, seed=0, prefetch=prefetch, device=torch.device(device))
        assert not any(getattr(t, "was_pinned", False) for xy in loader.next_step() for t in xy)
        loader.close()
    assert "MainThread" not in pinned


def test_validation_set_does_not_depend_on_data_parallel_size():
    ds = PackedDataset(np.arange(1001, dtype=np.uint16), 10)
    one = [int(v) for x, _ in validation_batches(ds, 2, 4, 3, 0, 1) for v in x[:, 0]]
    two = [
        int(v) for r in range(2) for x, _ in validation_batches(ds, 2, 2, 3, r, 2) for v in x[:, 0]
    ]
    assert sorted(one) == sorted(two) and len(one) == 24
    assert one == [int(v) for x, _ in validation_batches(ds, 2, 4, 3, 0, 1) for v in x[:, 0]]


def test_unigram_cross_entropy_matches_hand_count():
    train = np.array([0, 0, 0, 1], dtype=np.uint16)
    valid = np.array([9, 0, 1], dtype=np.uint16)  # the first token is never a target
    # counts+1 over vocab 2: p(0)=4/6, p(1)=2/6
    expected = -(np.log(4 / 6) + np.log(2 / 6)) / 2
    assert unigram_cross_entropy(train, valid, 2) == pytest.approx(expected)
