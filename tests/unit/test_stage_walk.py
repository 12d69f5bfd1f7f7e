"""The walk through the pipeline stages in order (megaformer.parallel.stage_walk), for every
schedule: each stage runs once, on its holder, with the output of the stage before; one transfer
per boundary between two ranks, none where a rank holds both; every send meets its receive."""

from __future__ import annotations

import queue
import threading

import pytest

from megaformer.parallel.pipeline import rank_stages
from megaformer.parallel.stage_walk import StageWalk

LAYOUTS = [
    ("1f1b", 1, 1),
    ("1f1b", 4, 1),
    ("interleaved", 2, 2),
    ("interleaved", 3, 3),
    ("dualpipev", 2, 1),
    ("dualpipev", 3, 1),
    ("dualpipev", 4, 1),
]


def _walk_every_rank(schedule: str, pp: int, v: int) -> tuple[list, dict, list]:
    """Every pipeline rank's walk in its own thread, the transfers through blocking queues: (each
    rank's result, the transfers per (src, dst), the stages each rank ran as (stage, chunk))."""
    boxes = {(a, b): queue.Queue() for a in range(pp) for b in range(pp)}
    sent: dict = {}
    ran: list = [[] for _ in range(pp)]
    results: list = [None] * pp
    lock = threading.Lock()

    def rank_main(r: int) -> None:
        walk = StageWalk.of(schedule, pp, r, v)

        def run(stage: int, chunk: int, x: list) -> list:
            ran[r].append((stage, chunk))
            return [*x, stage]

        def send(x: list, dst: int) -> None:
            assert dst != r
            with lock:
                sent.setdefault((r, dst), []).append(list(x))
            boxes[(r, dst)].put(list(x))

        def recv(src: int) -> list:
            return boxes[(src, r)].get(timeout=10)

        results[r] = walk.walk(run, [], send, recv)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "a walk waits for ever"
    assert all(b.empty() for b in boxes.values()), "a send nobody received"
    return results, sent, ran


@pytest.mark.parametrize("schedule,pp,v", LAYOUTS)
def test_every_stage_runs_once_in_order_on_its_holder(schedule, pp, v):
    results, sent, ran = _walk_every_rank(schedule, pp, v)
    stages = pp * {"1f1b": 1, "interleaved": v, "dualpipev": 2}[schedule]
    walk = StageWalk.of(schedule, pp, 0, v)
    assert walk.stages == stages
    last = walk.last
    assert results[last] == list(range(stages))  # the stages in order, each once
    assert all(results[r] is None for r in range(pp) if r != last)
    for r in range(pp):  # each rank ran exactly its chunks, in chunk order
        held = rank_stages(schedule, pp, r, v)
        assert sorted(ran[r]) == sorted((s, c) for c, s in enumerate(held))
        assert StageWalk.of(schedule, pp, r, v).mine() == sorted(held)
    holders = walk.holders
    crossing = sum(holders[s] != holders[s + 1] for s in range(stages - 1))
    assert sum(len(v) for v in sent.values()) == crossing


def test_dualpipev_turns_around_on_the_last_rank_without_a_send():
    """p = 2: rank 0 holds stages 0 and 3 (the embedding and the head), rank 1 stages 1 and 2;
    the activations cross 0 -> 1 once and 1 -> 0 once, 1 -> 2 stays on rank 1."""
    results, sent, _ = _walk_every_rank("dualpipev", 2, 1)
    assert StageWalk.of("dualpipev", 2, 0).holders == (0, 1, 1, 0)
    assert sent == {(0, 1): [[0]], (1, 0): [[0, 1, 2]]}
    assert results[0] == [0, 1, 2, 3]


def test_interleaved_wraps_around_from_the_last_rank_to_the_first():
    assert StageWalk.of("interleaved", 2, 1, 2).holders == (0, 1, 0, 1)
    assert StageWalk.of("interleaved", 2, 1, 2).chunks == (0, 0, 1, 1)
    _, sent, _ = _walk_every_rank("interleaved", 2, 2)
    assert sent == {(0, 1): [[0], [0, 1, 2]], (1, 0): [[0, 1]]}
