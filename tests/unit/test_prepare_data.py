"""prepare-data: sources, tokenizers round-tripping text, workers, atomic outputs, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megaformer.data.indexed import IndexedDataset, tokenizer_path
from megaformer.data.prepare import prepare
from megaformer.data.tokenizer import load_tokenizer
from megaformer.errors import DataError
from tests.helpers import assert_one_line_error, cli_main

DOCS = ["déjà vu — the first document\nwith two lines", "second ✓", "x" * 3000, "last one"]


def documents(ds: IndexedDataset, eod: int) -> list[np.ndarray]:
    out = []
    for i in range(len(ds)):
        seq = ds.get(i)
        assert seq[-1] == eod and eod not in seq[:-1].tolist()  # exactly one EOD, at the end
        out.append(seq[:-1])
    return out


@pytest.fixture
def jsonl(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return p


def test_byte_tokenizer_round_trips_every_document(tmp_path, jsonl):
    r = prepare(str(jsonl), "byte", tmp_path / "out", progress=False)
    ds = IndexedDataset(tmp_path / "out")
    assert (r.documents, r.dtype, ds.dtype) == (4, "uint16", np.uint16)
    tok = load_tokenizer(tokenizer_path(tmp_path / "out"))
    assert [tok.decode(d.tolist()) for d in documents(ds, 256)] == DOCS
    assert r.tokens == ds.n_tokens == sum(len(d.encode()) + 1 for d in DOCS)


def test_max_chars_keeps_a_prefix_of_the_text(tmp_path, jsonl):
    """data.max_bytes on the data.paths route: the first N characters, the last document cut."""
    limit = len(DOCS[0]) + len(DOCS[1]) + 100
    prepare(str(jsonl), "byte", tmp_path / "out", progress=False, max_chars=limit)
    ds = IndexedDataset(tmp_path / "out")
    tok = load_tokenizer(tokenizer_path(tmp_path / "out"))
    assert [tok.decode(d.tolist()) for d in documents(ds, 256)] == [*DOCS[:2], DOCS[2][:100]]


def test_bpe_is_trained_saved_and_workers_agree(tmp_path, jsonl):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(jsonl.read_text())
    (folder / "b.txt").write_text("a text file is one document\n\nwith a paragraph")
    one = prepare(str(folder), "bpe:300", tmp_path / "one", progress=False)
    tok = load_tokenizer(tokenizer_path(tmp_path / "one"))
    assert one.vocab_size == tok.vocab_size <= 300 and one.documents == 5
    ds = IndexedDataset(tmp_path / "one")
    texts = [tok.decode(d.tolist()) for d in documents(ds, tok.eod_id)]
    assert texts == DOCS + ["a text file is one document\n\nwith a paragraph"]
    assert ds.n_tokens < sum(len(t.encode()) + 1 for t in texts)  # merges happened
    # the saved tokenizer file, two worker processes, small chunks: the same bytes
    prepare(
        str(folder),
        str(tokenizer_path(tmp_path / "one")),
        tmp_path / "two",
        workers=2,
        chunk_chars=500,
        progress=False,
    )
    assert (tmp_path / "two.bin").read_bytes() == (tmp_path / "one.bin").read_bytes()
    assert (tmp_path / "two.idx").read_bytes() == (tmp_path / "one.idx").read_bytes()


def test_parquet_glob_and_hub_code_path_on_local_files(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network: fail fast instead of retrying
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    for i in range(2):
        pq.write_table(
            pa.table({"body": [f"row {i}.{j}" for j in range(3)]}), tmp_path / f"p{i}.parquet"
        )
    r = prepare(
        str(tmp_path / "p*.parquet"), "byte", tmp_path / "pq", text_field="body", progress=False
    )
    ds = IndexedDataset(tmp_path / "pq")
    assert r.documents == 6 and bytes(ds.get(4)[:-1].astype(np.uint8)).decode() == "row 1.1"
    # 'hf:' forces the hub reader (load_dataset(NAME, CONFIG, split=..., streaming=True)); a local
    # folder is a valid NAME for it, so the streaming hub path runs offline here.
    hub = tmp_path / "hubdir"
    hub.mkdir()
    (hub / "train.jsonl").write_text('{"text": "from the hub path"}\n{"text": "two"}\n')
    r = prepare(f"hf:{hub}@train", "byte", tmp_path / "hub", progress=False)
    assert r.documents == 2
    with pytest.raises(
        DataError, match="no-such/dataset-xyz@train: cannot load from the Hugging Face hub"
    ):
        prepare("hf:no-such/dataset-xyz", "byte", tmp_path / "nohub", progress=False)


def test_empty_documents_are_skipped_with_one_warning(tmp_path, capsys):
    p = tmp_path / "e.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a", "", "   \n", "b"]))
    r = prepare(str(p), "byte", tmp_path / "e", progress=False)
    assert (r.documents, r.empty) == (2, 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megaformer: warning: {p}: skipped 2 empty or whitespace-only documents"]
    p.write_text('{"text": " "}\n')
    with pytest.raises(DataError, match="no non-empty documents"):
        prepare(str(p), "byte", tmp_path / "e2", progress=False)
    assert not list(tmp_path.glob("e2*"))


def test_a_failure_midway_leaves_no_output(tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "fine"}\n' * 100)
    (folder / "b.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match="b.jsonl: not valid JSON"):
        prepare(str(folder), "byte", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(
    "make,args,needles",
    [
        (
            lambda p: p.joinpath("d.jsonl").write_text('{"content": "x"}\n'),
            ["--input", "{d}/d.jsonl"],
            ["d.jsonl: no field 'text' (fields: content)"],
        ),
        (
            lambda p: p.joinpath("bad.txt").write_bytes(b"ok \xff\xfe not utf-8"),
            ["--input", "{d}/bad.txt"],
            ["bad.txt: invalid UTF-8"],
        ),
        (
            lambda p: p.joinpath("d.jsonl").write_text('{"text": "x"}\n'),
            ["--input", "{d}/d.jsonl", "--dtype", "uint8"],
            ["257 token ids do not fit uint8"],
        ),
        (
            lambda p: (
                p.joinpath("out.bin").write_bytes(b""),
                p.joinpath("d.jsonl").write_text('{"text": "x"}\n'),
            ),
            ["--input", "{d}/d.jsonl"],
            ["out.bin: already exists; pass --overwrite"],
        ),
        (
            lambda p: (
                p.joinpath("m.idx").write_bytes(b"MMIDIDX\x00\x00\x01"),
                p.joinpath("m.bin").write_bytes(b""),
            ),
            ["--merge", "{d}/m"],
            ["m.idx: truncated"],
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_file(tmp_path, make, args, needles):
    make(tmp_path)
    argv = [a.format(d=tmp_path) for a in args]
    if "--merge" not in argv:
        argv += ["--tokenizer", "byte"]
    proc = cli_main("prepare-data", *argv, "--output-prefix", str(tmp_path / "out"))
    assert_one_line_error(proc, *needles)
    assert not list(tmp_path.glob("*.tmp-*"))
