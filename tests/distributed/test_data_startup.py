"""Data start-up on several ranks: rank 0 alone hashes the ``.idx`` files and checks the index
cache; the other ranks take its verdict through one broadcast and read the same samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.dist_harness import run_ranks


def _start(rank: int, world: int, prefixes: list[str], cache: str, warm: bool) -> dict:
    """One rank's data start-up: how many times it hashed an ``.idx`` and checked a cached index
    in full, and the first samples of every split."""
    from megaformer.comm import barrier, broadcast_from_main
    from megaformer.data import gpt_dataset, indexed

    counts = {"hash": 0, "check": 0}
    real_sha, real_check = indexed.IndexedDataset.idx_sha256, gpt_dataset.GPTDataset.check_indices

    def sha(self):
        counts["hash"] += self._sha256 is None  # read and hashed the file
        return real_sha(self)

    def check(self, *args, **kwargs):
        counts["check"] += 1
        return real_check(self, *args, **kwargs)

    indexed.IndexedDataset.idx_sha256 = sha
    gpt_dataset.GPTDataset.check_indices = check
    for _ in range(2 if warm else 1):  # warm: a second start-up finds rank 0's cache
        parts = gpt_dataset.build_many_split_datasets(
            prefixes,
            [0.9, 0.1],
            5,
            0,
            [(40, 8)] * len(prefixes),
            Path(cache),
            rank,
            barrier,
            share=broadcast_from_main,
        )
    samples = [ds.sample(g).tolist() for split in parts for ds in split for g in range(3)]
    return {**counts, "samples": samples}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_only_rank0_hashes_and_checks_the_index_cache(tmp_path, world):
    from tests.unit.test_data_gpt import unique_tokens

    prefixes = [str(tmp_path / f"d{j}") for j in range(2)]
    for j, p in enumerate(prefixes):
        unique_tokens(p, n_docs=120, seed=j)
    out = run_ranks(world, _start, prefixes, str(tmp_path / "cache"), True)
    # rank 0: 2 .idx hashed once per start-up; 2 datasets x 2 splits checked on the second start-up
    assert (out[0]["hash"], out[0]["check"]) == (4, 4)
    for r in range(1, world):  # every rank hashed 4 and checked 4 before
        assert (out[r]["hash"], out[r]["check"]) == (0, 0), (r, out[r])
        assert out[r]["samples"] == out[0]["samples"]
    assert len(np.unique(out[0]["samples"])) > 10


def _read_at_tp2(rank: int, world: int, path: str, prefetch: int) -> dict:
    """Two ranks of one model-parallel group (TP2 x DP1) read 3 steps of 2 micro-batches."""
    import torch.distributed as dist

    from megaformer.data.dataset import PackedDataset, TrainLoader

    data = PackedDataset(np.load(path), 8, "train")
    reads = []
    real = data.batch
    data.batch = lambda idx: (reads.append(len(idx)), real(idx))[1]  # type: ignore[method-assign]
    loader = TrainLoader(
        data, 2, 2, 0, 1, seed=3, prefetch=prefetch, readers=dist.new_group([0, 1], backend="gloo")
    )
    steps = [[(x.tolist(), y.tolist()) for x, y in loader.next_step()] for _ in range(3)]
    loader.close()
    alone = TrainLoader(PackedDataset(np.load(path), 8, "train"), 2, 2, 0, 1, seed=3)
    return {
        "reads": len(reads),
        "steps": steps,
        "alone": [[(x.tolist(), y.tolist()) for x, y in alone.next_step()] for _ in range(3)],
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", [0, 2])
def test_at_tp2_only_the_first_tp_rank_reads_and_both_get_its_batches(tmp_path, prefetch):
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(5000, dtype=np.int64) % 251)
    out = run_ranks(2, _read_at_tp2, str(path), prefetch)
    # 3 steps x 2 micro-batches read by TP rank 0 (prefetch reads up to 2 steps ahead); none by 1
    assert out[0]["reads"] >= 6 and out[1]["reads"] == 0  # each read them all before
    assert out[0]["steps"] == out[1]["steps"] == out[0]["alone"]  # the batches one process reads
