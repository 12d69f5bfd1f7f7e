"""The communication layer: the public byte counter, the uneven all-to-all, shaped send/receive and
the whole-group helpers, checked against hand-computed values."""

from __future__ import annotations

import torch

from megaformer.comm import CommCounter, no_counting, record, record_collective
from tests.dist_harness import run_ranks


def test_counters_record_exact_and_ring_volumes_and_skip_hidden_regions():
    with CommCounter() as outer:
        record("all_to_all", 10)
        with no_counting():
            record("all_to_all", 1000)
        with CommCounter() as inner:
            record_collective("all_reduce", 100, 4)  # 2 (p-1)/p N = 150
            record_collective("all_gather", 100, 4)  # (p-1)/p N = 75
    assert dict(outer.bytes) == {"all_to_all": 10, "all_reduce": 150, "all_gather": 75}
    assert dict(inner.bytes) == {"all_reduce": 150, "all_gather": 75}
    assert dict(outer.calls) == {"all_to_all": 1, "all_reduce": 1, "all_gather": 1}
    assert outer.total_bytes == 235
    record("all_to_all", 5)  # no counter open: nothing to record into
    assert outer.bytes["all_to_all"] == 10


def _exchanges(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megaformer import comm

    g = dist.group.WORLD
    # rank r sends r + q + 1 rows to rank q; each row is [r, q, i] (float32, 3 values: 12 bytes)
    sends = [rank + q + 1 for q in range(world)]
    x = torch.tensor(
        [[rank, q, i] for q in range(world) for i in range(sends[q])], dtype=torch.float32
    )
    recvs = [q + rank + 1 for q in range(world)]
    with comm.CommCounter() as c:
        y = comm.all_to_all(x, recvs, sends, g)
        equal = comm.all_to_all(torch.arange(4.0) + 10 * rank, None, None, g, kind="equal")
    back = comm.AllToAll.apply(x.clone().requires_grad_(True), recvs, sends, g)
    back.sum().backward()
    if rank == 0:
        comm.send_with_shape(torch.arange(24.0).view(2, 3, 4), 1, g)
        got = None
    else:
        got = comm.recv_with_shape(0, g, torch.float32, torch.device("cpu"))
    comm.barrier()
    return {
        "y": y.tolist(),
        "bytes": dict(c.bytes),
        "equal": equal.tolist(),
        "shape": None if got is None else list(got.shape),
        "values_ok": got is None or torch.equal(got, torch.arange(24.0).view(2, 3, 4)),
        "mean": float(comm.all_reduce_mean(torch.tensor(float(rank)))),
        "objects": comm.all_gather_objects({"rank": rank}, g),
    }


def test_uneven_all_to_all_shaped_send_and_group_helpers():
    results = run_ranks(2, _exchanges)
    for rank, r in enumerate(results):
        expected = [[q, rank, i] for q in range(2) for i in range(q + rank + 1)]
        assert r["y"] == expected
        sent_elsewhere = (rank + (1 - rank) + 1) * 12  # rows to the other rank, 12 bytes each
        assert r["bytes"] == {"all_to_all": sent_elsewhere, "equal": 2 * 4}
        assert r["equal"] == [
            0.0 + 10 * 0 + 2 * rank,
            1.0 + 2 * rank,
            10.0 + 2 * rank,
            11.0 + 2 * rank,
        ]
        assert r["mean"] == 0.5 and r["objects"] == [{"rank": 0}, {"rank": 1}]
    assert results[1]["shape"] == [2, 3, 4] and results[1]["values_ok"]
