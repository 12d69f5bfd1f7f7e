"""Benchmark of the data pipeline (a script, not a test); prints Markdown tables.

    python tools/bench_prepare_data.py [--mb 100] [--small-mb 25] [--vocab 8192] [--workdir DIR]

1. Throughput: ``prepare-data`` tokens/s on a synthetic --mb MB .jsonl corpus, next to the raw rate of
   the same tokenizer's ``encode_batch`` over the same texts (already in memory), with one thread
   and with all cores; target: prepare-data on all cores >= 0.8 x raw all cores.
2. Peak memory (max RSS of the main process and of the largest worker) for two corpus sizes: it must
   not grow with the corpus.
3. Time to build the document/sample/shuffle index for 10^9 tokens (a synthetic .idx with a sparse
   .bin): target under 10 s.

Each measurement runs in a fresh subprocess, so imports, caches and RSS do not leak between them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_corpus(path: Path, megabytes: int, seed: int = 0) -> None:
    """Zipf-distributed words from a 30k-word random vocabulary, documents of 1,000-3,000 words.

    The vocabulary is the same for every corpus (fixed seed) and only the documents depend on
    ``seed``, so corpora of different sizes have the same tokens per character and their memory
    peaks compare like for like."""
    import numpy as np

    vrng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    vocab = ["".join(vrng.choice(letters, vrng.integers(1, 11))) for _ in range(30000)]
    rng = np.random.default_rng(seed)
    vocab = np.array(vocab, dtype=object)
    target, written = megabytes * 1_000_000, 0
    with open(path, "w") as fh:
        while written < target:
            n_words = rng.integers(1000, 3000, 200)
            ids = np.minimum(rng.zipf(1.3, n_words.sum()) - 1, len(vocab) - 1)
            words = vocab[ids]
            pos = 0
            for n in n_words:
                text = " ".join(words[pos : pos + n])
                pos += n
                line = json.dumps({"text": text}) + "\n"
                fh.write(line)
                written += len(line)


CHILD_RAW = r"""
import json, os, sys, time, resource
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(l)["text"] for l in open(sys.argv[2])]
method = getattr(tok, sys.argv[3])
t0 = time.perf_counter(); n = 0
for i in range(0, len(texts), 1000):
    n += sum(len(e.ids) for e in method(texts[i:i + 1000], add_special_tokens=False))
dt = time.perf_counter() - t0
print(json.dumps({"tokens": n + len(texts), "seconds": dt}))
"""

CHILD_PREPARE = r"""
import json, sys, resource
from megaformer.data.prepare import prepare
r = prepare(sys.argv[1], sys.argv[2], sys.argv[3], workers=int(sys.argv[4]), overwrite=True,
            progress=False)
print(json.dumps({"tokens": r.tokens, "seconds": r.seconds,
                  "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""

CHILD_INDEX = r"""
import json, sys, time, numpy as np
from megaformer.data.indexed import IndexedDataset, index_bytes
from megaformer.data.gpt_dataset import GPTDataset
prefix, mean_len, seq_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
total = 10**9
rng = np.random.default_rng(0)
lengths = rng.integers(1, 2 * mean_len, total // mean_len + 10).astype(np.int32)
lengths = lengths[:np.searchsorted(np.cumsum(lengths, dtype=np.int64), total) + 1]
with open(prefix + ".idx", "wb") as fh:
    fh.write(index_bytes(lengths, np.arange(len(lengths) + 1), np.uint16))
with open(prefix + ".bin", "wb") as fh:
    fh.truncate(int(lengths.sum(dtype=np.int64)) * 2)  # sparse: the index never reads tokens
t0 = time.perf_counter()
data = IndexedDataset(prefix)
t_open = time.perf_counter() - t0
t0 = time.perf_counter()
ds = GPTDataset(data, "train", (0, len(data)), seq_len, 1234, n_samples=1, cache_dir=None)
t_build = time.perf_counter() - t0
print(json.dumps({"tokens": data.n_tokens, "docs": len(data), "samples": ds.n_built,
                  "open_s": t_open, "build_s": t_build}))
"""


def child(code: str, *args: str, env: dict | None = None) -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=e)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=100, help="corpus size for throughput (MB)")
    ap.add_argument("--small-mb", type=int, default=25, help="smaller corpus for the memory check")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--skip-index", action="store_true")
    args = ap.parse_args()
    from megaformer.data.prepare import default_workers

    cores = default_workers()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_prepare_"))
    work.mkdir(parents=True, exist_ok=True)
    big, small = work / f"corpus_{args.mb}mb.jsonl", work / f"corpus_{args.small_mb}mb.jsonl"
    for path, mb in ((big, args.mb), (small, args.small_mb)):
        if not path.exists():
            t0 = time.perf_counter()
            make_corpus(path, mb, seed=mb)
            print(
                f"# wrote {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f}s"
            )
    tok = work / f"bpe{args.vocab}.json"
    if not tok.exists():
        from megaformer.data.sources import open_source
        from megaformer.data.tokenizer import train_bpe

        t0 = time.perf_counter()
        docs = (d for i, d in enumerate(open_source(str(small)).documents()) if i < 2000)
        train_bpe(docs, args.vocab).save(tok)
        print(f"# trained bpe:{args.vocab} on 2000 documents in {time.perf_counter() - t0:.0f}s")

    one = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    allc = {"TOKENIZERS_PARALLELISM": "true"}
    rows = []
    raw1 = child(CHILD_RAW, str(tok), str(big), "encode_batch", env=one)
    rawN = child(CHILD_RAW, str(tok), str(big), "encode_batch", env=allc)
    fastN = child(CHILD_RAW, str(tok), str(big), "encode_batch_fast", env=allc)
    prep1 = child(CHILD_PREPARE, str(big), str(tok), str(work / "out1"), "1", env=one)
    prepN = child(CHILD_PREPARE, str(big), str(tok), str(work / "outN"), str(cores))
    prep_small = child(CHILD_PREPARE, str(small), str(tok), str(work / "outS"), str(cores))
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    print(f"\n### prepare-data throughput ({args.mb} MB .jsonl, bpe:{args.vocab}, {cores} cores)\n")
    print("| measurement | tokens | seconds | tokens/s | vs raw all cores |")
    print("|---|---|---|---|---|")
    for name, r in [
        ("raw encode_batch, 1 thread", raw1),
        (f"raw encode_batch, {cores} threads", rawN),
        (f"raw encode_batch_fast, {cores} threads", fastN),
        ("prepare-data --workers 1 (1 thread)", prep1),
        (f"prepare-data --workers {cores}", prepN),
    ]:
        rows.append((name, r))
        print(
            f"| {name} | {r['tokens']:,} | {r['seconds']:.1f} | {rate(r):,.0f} | "
            f"{rate(r) / rate(rawN):.2f} |"
        )
    print(f"\n### peak memory (max RSS, prepare-data --workers {cores})\n")
    print("| corpus | main process MB | largest worker MB |")
    print("|---|---|---|")
    for mb, r in ((args.small_mb, prep_small), (args.mb, prepN)):
        print(f"| {mb} MB | {r['rss_main_mb']:.0f} | {r['rss_worker_mb']:.0f} |")
    if not args.skip_index:
        print("\n### sample index for 10^9 tokens (synthetic .idx, sparse .bin)\n")
        print("| documents (mean length) | seq_len | samples | open + validate s | build s |")
        print("|---|---|---|---|---|")
        for mean_len, seq_len in ((1000, 2048), (100, 2048), (1000, 128)):
            r = child(CHILD_INDEX, str(work / f"synthetic{mean_len}"), str(mean_len), str(seq_len))
            print(
                f"| {r['docs']:,} ({mean_len}) | {seq_len} | {r['samples']:,} | {r['open_s']:.2f} | "
                f"{r['build_s']:.2f} |"
            )
            for suffix in (".bin", ".idx"):
                (work / f"synthetic{mean_len}{suffix}").unlink()
    print(f"\n# files in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
