"""Straggler judgement without ranks: who is named from the gathered per-rank times, hosts named
in a row, what the Slurm script reads back, and the collective record's per-group counts."""

from __future__ import annotations

import json

import torch

from megaformer.comm.flight import FlightRecorder, hang_line, stragglers
from megaformer.training.loop import StepState
from megaformer.training.stragglers import StragglerDetector, flag, hosts_to_exclude


def test_flag_names_only_what_is_over_the_threshold_above_the_median():
    median, slow = flag({0: 1.0, 1: 1.05, 2: 1.0, 3: 1.5}, 0.10)
    assert median == 1.025 and list(slow) == [3]
    assert flag({0: 1.0, 1: 1.0}, 0.10)[1] == {}


def test_a_slow_host_is_counted_in_a_row_and_read_back_for_the_requeue(tmp_path):
    det = StragglerDetector(2, 0.10, FlightRecorder(), 0, torch.device("cpu"), tmp_path)
    det.who = [{"host": h, "gpu": g} for h in ("a", "b") for g in (0, 1)]
    slow_b = torch.tensor([[1.0, 0, 1], [1.0, 0, 1], [1.3, 0, 1], [1.4, 0, 1]], dtype=torch.float64)
    for step in (2, 4):
        result = det._judge(slow_b, (step - 1, step))
        det._report(result, StepState(step, 10), record := {})
    assert [s["rank"] for s in result["ranks"]] == [3, 2]
    assert result["hosts"][0]["host"] == "b" and det.in_a_row == {"a": 0, "b": 2}
    assert record["straggler/slowest_rank"] == 3 and record["straggler/count"] == 2
    assert hosts_to_exclude(tmp_path, 2) == ["b"] and hosts_to_exclude(tmp_path, 3) == []
    assert json.loads((tmp_path / "stragglers.json").read_text())["flagged"][1]["steps"] == [3, 4]
    even = torch.ones(4, 3, dtype=torch.float64)
    det._report(det._judge(even, (5, 6)), StepState(6, 10), {})
    assert (
        hosts_to_exclude(tmp_path, 1) == []
    )  # not flagged in the last interval: no longer in a row


def _dump(rank: int, entered: int, left: int, ranks=(0, 1, 2)) -> dict:
    last = {"kind": "all_reduce", "seq": entered, "bytes": 16, "since_s": 4.0, "finished": False}
    group = {"ranks": list(ranks), "entered": entered, "left": left, "last": last}
    return {"rank": rank, "host": f"node{rank}", "groups": [group]}


def test_the_rank_behind_on_a_group_others_wait_in_is_named():
    dumps = {0: _dump(0, 5, 4), 1: _dump(1, 5, 4), 2: _dump(2, 4, 4)}
    (found,) = stragglers(dumps)
    assert found["missing"] == [2] and found["waiting"] == [0, 1] and found["seq"] == 5
    line = hang_line(dumps)
    assert "all_reduce #5 on ranks 0-2" in line and "did not arrive: rank 2 (node2, at #4)" in line
    del dumps[2]  # rank 2 left no dump (dead)
    assert "rank 2 (no dump: dead?)" in hang_line(dumps)
    assert "no collective is waiting" in hang_line({0: _dump(0, 5, 5), 1: _dump(1, 5, 5)})
