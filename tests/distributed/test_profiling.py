"""Profiler traces and memory snapshots on request: a 2-step profile of a one-process run writes a
trace that torch.profiler's own trace reader loads, with one span per profiled step; a memory
snapshot on CPU is one notice line; ``megaformer report`` lists what the run wrote."""

from __future__ import annotations

import pytest
from torch.profiler._trace_validator import _load_events, validate_trace

from tests.helpers import cli_main, run_cli, tiny_overrides


@pytest.mark.slow
def test_a_two_step_profile_is_a_trace_torch_profiler_reads_and_report_lists_it(tmp_path):
    run = tmp_path / "run"
    asked = {"log.profile_steps": "[2,3]", "log.memory_snapshot_step": 2}
    overrides = tiny_overrides(**{"train.steps": 4, "eval.interval": 0, **asked})
    proc = run_cli("train", "configs/quickstart.yaml", *overrides, "--run-dir", str(run))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    (trace,) = (run / "profile" / "rank_0").glob("rank_0.*.pt.trace.json")
    assert f"profile of steps 2-3 (rank 0): {trace}" in out
    notice = [line for line in out.splitlines() if "log.memory_snapshot_step=2" in line]
    assert notice == [
        "log.memory_snapshot_step=2: a memory snapshot needs CUDA (this run is on cpu): "
        "none is written"
    ]
    passed, violations = validate_trace(str(trace))
    assert passed, violations
    steps = sorted(
        e["name"] for e in _load_events(str(trace)) if e["name"].startswith("megaformer step")
    )
    assert steps == ["megaformer step 2", "megaformer step 3"]  # the two profiled steps, in order
    names = {e["name"] for e in _load_events(str(trace))}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)  # the model's matmuls
    report = cli_main("report", str(run))
    assert report.returncode == 0, report.stderr
    rel = str(trace.relative_to(run))
    assert f"{rel}: profiler trace" in report.stdout
    assert f"`{rel}`" in (run / "report" / "summary.md").read_text()
