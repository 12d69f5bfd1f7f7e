"""Data-index build time and peak memory for 10^9, 10^10 and 10^12 tokens (a benchmark, not a test).

    python tools/bench_indices.py [--datasets 8] [--docs 10000000] [--mean-doc-tokens 2000]
                                  [--tokens 1e9,1e10,1e12] [--seq-len 4096] [--dir DIR]

A synthetic corpus stands in for real data: ``--datasets`` datasets of ``--docs`` documents each,
document lengths drawn from a lognormal distribution (sigma 1) of mean ``--mean-doc-tokens``,
written as real ``.idx`` files beside sparse ``.bin`` files (the right size, no token data), so the
indices are built by the same code as in training. For each token count, a fresh process does what
rank 0 does before training (train/valid/test split, per dataset the document, sample and shuffle
indices for its share of the samples, cached; then the blends of the training and validation
samples, cached) on ``--threads`` threads (default: the usable cores) and reports the wall and CPU
time of each part, the peak of the arrays it allocates (``tracemalloc``, which numpy reports to,
from every thread) and its peak resident memory (``ru_maxrss``, also above the process's baseline
after its imports; it counts the pages of the memory-mapped ``.idx`` files that were read, about 12
bytes per document). Then it does what every other rank does once rank 0 is done (read the cached
indices and check them, the cores shared by ``--ranks-per-node`` ranks) and reports its time.

Beside it: the previous design, where the blend was a Python heap loop (its time is extrapolated from
runs of ``--loop-samples`` samples measured here) and where rank 0 kept every index in memory with
int64 sample indices and blend offsets (its resident index bytes are computed from the array
sizes). The cache folder of each size is deleted after it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_corpus(folder: Path, datasets: int, docs: int, mean: float, seed: int = 0) -> list[Path]:
    from megaformer.data.indexed import bin_path, idx_path, index_bytes

    prefixes = []
    for d in range(datasets):
        prefix = folder / f"synthetic{d}"
        prefixes.append(prefix)
        if idx_path(prefix).exists():
            continue
        rng = np.random.default_rng([seed, d])
        sigma = 1.0
        lengths = np.clip(rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, docs), 1, 2**30)
        lengths = lengths.astype(np.int32)
        with open(bin_path(prefix), "wb") as fh:  # sparse: the size the .idx promises, no data
            fh.truncate(int(lengths.sum(dtype=np.int64)) * 2)
        idx_path(prefix).write_bytes(index_bytes(lengths, np.arange(docs + 1), np.uint16))
    return prefixes


def build_once(
    prefixes: list[Path],
    tokens: float,
    seq_len: int,
    cache: Path,
    threads: Optional[int],
    ranks_per_node: int,
) -> dict:
    """Rank 0's index build for ``tokens`` training tokens (run in a fresh process), then another
    rank's read of the cache."""
    from megaformer.data import gpt_dataset
    from megaformer.data.blend import BlendedDataset, normalise, scheduler
    from megaformer.data.gpt_dataset import build_many_split_datasets, parse_split, split_ranges
    from megaformer.data.indexed import IndexedDataset

    gpt_dataset.THREADS = threads
    scheduler()  # compiled (or found in its cache) before the clock starts
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    tracemalloc.start()
    n_train = int(tokens) // seq_len
    n_valid = 64 * 1024  # eval.iters x global batch of a large run
    ratios = parse_split(None, 0.001)
    sizes = []
    for p in prefixes:
        data = IndexedDataset(p)
        a, b = split_ranges(len(data), ratios)[0]
        sizes.append(int(data.lengths[a:b].sum(dtype=np.int64)))
    weights = normalise(sizes)
    t0 = time.perf_counter()
    splits = [(math.ceil(w * n_train) + 1, math.ceil(w * n_valid) + 1, 0) for w in weights]
    parts = build_many_split_datasets(prefixes, ratios, seq_len, 1234, splits, cache)
    t_datasets = time.perf_counter() - t0
    t1 = time.perf_counter()
    train = BlendedDataset([p[0] for p in parts], weights, n_train, cache)
    valid = BlendedDataset([p[1] for p in parts], weights, n_valid, cache)
    t_blend = time.perf_counter() - t1
    heap_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime
    peak_kb = usage.ru_maxrss
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)  # another rank: read and check the cache
    t2 = time.perf_counter()
    others = build_many_split_datasets(prefixes, ratios, seq_len, 1234, splits, cache, rank=1)
    BlendedDataset([p[0] for p in others], weights, n_train, cache, build=False)
    BlendedDataset([p[1] for p in others], weights, n_valid, cache, build=False)
    t_other = time.perf_counter() - t2
    epochs = max(len(p[0].doc_idx) / p[0].n_docs for p in parts)
    new_bytes = sum(f.stat().st_size for f in cache.iterdir() if f.suffix == ".npy")
    old_bytes = 0  # the previous design's resident indices on rank 0
    for p in parts:
        for ds in p:
            if ds is not None:
                old_bytes += (
                    ds.doc_idx.size * 4 + ds.sample_idx.shape[0] * 16 + ds.shuffle_idx.size * 4
                )
                old_bytes += ds.n_docs * 8  # its int64 copy of the lengths
    old_bytes += (len(train) + len(valid)) * (2 + 8)  # which int16, offset int64
    return {
        "tokens": tokens,
        "samples": n_train,
        "epochs": epochs,
        "datasets_s": t_datasets,
        "blend_s": t_blend,
        "other_rank_s": t_other,
        "threads": threads or gpt_dataset.usable_cores(),
        "total_s": t_datasets + t_blend,
        "cpu_s": cpu_s,
        "heap_gb": heap_peak / 2**30,
        "peak_gb": peak_kb / 2**20,
        "above_base_gb": (peak_kb - base_kb) / 2**20,
        "cache_gb": new_bytes / 2**30,
        "old_resident_gb": old_bytes / 2**30,
        "blend_samples": len(train) + len(valid),
    }


def loop_seconds_per_sample(weights: list[float], sizes: list[int]) -> float:
    from megaformer.data.blend import blend_index

    per = []
    for n in sizes:
        t0 = time.perf_counter()
        blend_index(weights, n, native=False)
        per.append((time.perf_counter() - t0) / n)
        print(f"  Python loop: {n:,} samples in {per[-1] * n:.1f}s ({per[-1] * 1e6:.2f} us/sample)")
    return per[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", type=int, default=8)
    ap.add_argument("--docs", type=int, default=10_000_000, help="documents per dataset")
    ap.add_argument("--mean-doc-tokens", type=float, default=2000.0)
    ap.add_argument("--tokens", default="1e9,1e10,1e12", help="training tokens, comma-separated")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument(
        "--loop-samples",
        default="1e6,1e7",
        help="sample counts for timing the Python loop (the largest sets the rate)",
    )
    ap.add_argument("--dir", default=None, help="where the synthetic corpus and caches go")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for the index build (default: the usable cores)",
    )
    ap.add_argument(
        "--ranks-per-node",
        type=int,
        default=8,
        help="ranks sharing a node's cores when they read the cached indices",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    folder = (
        Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / "megaformer_bench_indices"
    )
    folder.mkdir(parents=True, exist_ok=True)
    if args.child is not None:  # one size in this fresh process; JSON on the last line
        prefixes = write_corpus(folder, args.datasets, args.docs, args.mean_doc_tokens)
        cache = Path(tempfile.mkdtemp(prefix="cache-", dir=folder))
        try:
            print(
                json.dumps(
                    build_once(
                        prefixes,
                        float(args.child),
                        args.seq_len,
                        cache,
                        args.threads,
                        args.ranks_per_node,
                    )
                )
            )
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        return

    t0 = time.perf_counter()
    write_corpus(folder, args.datasets, args.docs, args.mean_doc_tokens)
    corpus_tokens = sum(
        int(
            np.fromfile(
                f"{folder}/synthetic{d}.idx", dtype=np.int32, offset=34, count=args.docs
            ).sum(dtype=np.int64)
        )
        for d in range(args.datasets)
    )
    print(
        f"corpus: {args.datasets} datasets x {args.docs:,} documents, mean {args.mean_doc_tokens:,.0f} "
        f"tokens/document, {corpus_tokens:.3g} tokens ({time.perf_counter() - t0:.0f}s to write); "
        f"seq_len {args.seq_len}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    weights = [1.0] * args.datasets
    rate = loop_seconds_per_sample(weights, [int(float(x)) for x in args.loop_samples.split(",")])
    rows = []
    for tokens in args.tokens.split(","):
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                tokens,
                "--dir",
                str(folder),
                "--datasets",
                str(args.datasets),
                "--docs",
                str(args.docs),
                "--mean-doc-tokens",
                str(args.mean_doc_tokens),
                "--seq-len",
                str(args.seq_len),
                "--ranks-per-node",
                str(args.ranks_per_node),
            ]
            + (["--threads", str(args.threads)] if args.threads else []),
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            print(done.stderr[-3000:])
            raise SystemExit(f"the build for {tokens} tokens failed")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"  {float(tokens):.0e} tokens: {r['total_s']:.1f}s (indices {r['datasets_s']:.1f}s, "
            f"blend {r['blend_s']:.1f}s), peak arrays {r['heap_gb']:.2f} GB, RSS {r['peak_gb']:.2f} GB; "
            f"another rank {r['other_rank_s']:.1f}s",
            flush=True,
        )

    head = (
        "tokens",
        "samples",
        "epochs",
        "threads",
        "indices s",
        "blend s",
        "total s",
        "CPU s",
        "peak arrays GB",
        "peak RSS GB",
        "RSS above base GB",
        "cache GB",
        "other rank s",
        "old blend loop s",
        "old resident GB",
    )
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print(
            f"| {r['tokens']:.0e} | {r['samples']:,} | {r['epochs']:.2f} | {r['threads']} | "
            f"{r['datasets_s']:.1f} | {r['blend_s']:.1f} | {r['total_s']:.1f} | {r['cpu_s']:.1f} | "
            f"{r['heap_gb']:.2f} | {r['peak_gb']:.2f} | {r['above_base_gb']:.2f} | "
            f"{r['cache_gb']:.2f} | {r['other_rank_s']:.1f} | {rate * r['blend_samples']:.0f} | "
            f"{r['old_resident_gb']:.2f} |"
        )


if __name__ == "__main__":
    main()
