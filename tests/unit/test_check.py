"""``megaformer check``: the CPU table, a failing kernel, the peer comparison and the gloo all-reduce."""

from __future__ import annotations

import json
import re

import pytest
import torch

from megaformer.analysis import check
from megaformer.analysis.check import AllReduceSample, KernelOutcome, RankReport, Throughput
from megaformer.kernels import activations, norm
from tests.dist_harness import run_ranks
from tests.helpers import assert_one_line_error, cli_main

KERNEL_NAMES = [c.name for c in check.KERNEL_CHECKS] + ["dropout"]


def _rows(stdout: str) -> dict[str, tuple[str, str]]:
    """check -> (result, detail) from the printed table."""
    rows = {}
    for line in stdout.splitlines():
        parts = [p.strip() for p in line.split(" | ")]
        if len(parts) == 3 and parts[0] != "check":
            rows[parts[0]] = (parts[1], parts[2])
    return rows


def test_check_on_cpu_passes_and_says_what_needs_a_gpu():
    proc = cli_main("check", "--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    for name in KERNEL_NAMES:
        result, detail = rows[f"kernel {name}"]
        assert result == "pass", (name, detail)
        err = float(re.search(r"fp32 ([0-9.e+-]+) ", detail).group(1))
        assert 0 < err <= check.TOLERANCE[torch.float32], (name, detail)
    for name in ("kernels bf16/fp16", "attention TFLOP/s"):
        assert rows[name][0] == "skip" and "needs a GPU" in rows[name][1], rows[name]
    assert (
        rows["all-reduce busbw"][0] == "skip"
        and "more than one rank" in rows["all-reduce busbw"][1]
    )
    result, detail = rows["matmul TFLOP/s"]
    assert result == "info" and "no peak" in detail, detail
    assert float(detail.split(" TFLOP/s")[0]) > 0


def test_a_wrong_kernel_fails_the_check(monkeypatch):
    monkeypatch.setattr(activations, "swiglu", lambda g, u: g * u)  # SiLU missing

    def broken_layer_norm(x, w, b, eps):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(norm, "layer_norm", broken_layer_norm)
    proc = cli_main("check", "--device", "cpu", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    rows = {r["check"]: r for r in out["rows"]}
    assert out["failed"] is True
    assert rows["kernel swiglu"]["result"] == "FAIL"
    assert re.match(r"fp32: .+ rel\. error [0-9.e+-]+ > 1e-04$", rows["kernel swiglu"]["detail"])
    assert rows["kernel swiglu"]["values"]["max_rel_error"]["fp32"] > 0.1
    assert rows["kernel layer_norm"]["result"] == "FAIL"
    assert "RuntimeError: no kernel image is available" in rows["kernel layer_norm"]["detail"]
    assert rows["kernel rms_norm"]["result"] == "pass"
    table = check.format_table(
        [check.Row(r["check"], r["result"], r["detail"]) for r in out["rows"]]
    )
    assert _rows(table)["kernel swiglu"][0] == "FAIL" and table.endswith("2 failed")


def test_bad_arguments_are_user_errors():
    assert_one_line_error(cli_main("check", "--sizes", "64MiB,lots"), "--sizes")
    assert_one_line_error(cli_main("check", "--sizes", "2"), "under one fp32 element")
    assert_one_line_error(cli_main("check", "--peak-tflops", "0"), "--peak-tflops")
    assert check.parse_sizes("1KiB, 2MB,64") == [1024, 2_000_000, 64]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_a_gpu_is_a_user_error():
    assert_one_line_error(cli_main("check", "--device", "cuda"), "no CUDA device")


def test_slow_peers_flags_ranks_more_than_10_percent_below_the_others():
    assert check.slow_peers([100, 98, 85, 101]) == [2]  # median of the others 100 -> 85 < 90
    assert check.slow_peers([100, 98, 91, 101]) == []
    assert check.slow_peers([100, 89]) == [1]
    assert check.slow_peers([100, 91]) == []
    assert check.slow_peers([50, 100, 100, 40]) == [0, 3]
    assert check.slow_peers([7.0]) == []


def _gpu_report(
    rank: int,
    matmul: float,
    attention: float = 400.0,
    busbw: float = 150.0,
    name: str = "NVIDIA H100 80GB HBM3",
    correct: bool = True,
) -> RankReport:
    r = RankReport(rank, f"node{rank // 8}", "cuda", name)
    r.kernels["swiglu"] = KernelOutcome({"bf16": 3e-3, "fp32": 1e-7})
    r.matmul = Throughput(matmul, "bf16 8192x8192x8192", "bf16")
    r.attention = Throughput(attention, "bf16 causal fwd", "bf16")
    nbytes = 256 << 20
    r.allreduce = [AllReduceSample(nbytes, nbytes / (busbw * 1e9), busbw, busbw, correct)]
    return r


def _by_check(rows):
    return {r.check: r for r in rows}


def test_gpu_rows_from_synthetic_ranks():
    # 16 GPUs on two hosts: rank 5's matmul 16 % below, rank 9's link 20 % below the others
    reports = [
        _gpu_report(i, 700.0 if i != 5 else 590.0, busbw=150.0 if i != 9 else 120.0)
        for i in range(16)
    ]
    rows = _by_check(check.build_rows(reports))
    mm = rows["matmul TFLOP/s"]
    assert mm.result == "FAIL" and mm.values["slow_ranks"] == [5]
    assert "rank 5 (node0) 590" in mm.detail
    assert mm.values["ratio"] == pytest.approx(700.0 / 989.5)
    assert "= 0.71 of H100-SXM bf16 peak 989.5" in mm.detail
    ar = rows["all-reduce busbw"]
    assert ar.result == "FAIL" and ar.values["slow_ranks"] == [9] and "rank 9 (node1)" in ar.detail
    assert rows["attention TFLOP/s"].result == "pass"  # peers agree; no ratio criterion
    assert rows["kernel swiglu"].result == "pass" and "all 16 ranks" in rows["kernel swiglu"].detail
    assert "kernels bf16/fp16" not in rows
    assert check.failed(list(rows.values()))

    # one GPU: the ratio to the peak is reported; far below it is a warning, never a failure
    for tflops, expected in ((700.0, "pass"), (300.0, "warn")):
        row = _by_check(check.build_rows([_gpu_report(0, tflops)]))["matmul TFLOP/s"]
        assert row.result == expected and f"= {tflops / 989.5:.2f} of H100-SXM" in row.detail
    unknown = _by_check(check.build_rows([_gpu_report(0, 50.0, name="Imaginary GPU 9000")]))
    assert unknown["matmul TFLOP/s"].result == "info"
    assert "not in the peak table" in unknown["matmul TFLOP/s"].detail
    explicit = _by_check(
        check.build_rows([_gpu_report(0, 50.0, name="Imaginary GPU 9000")], peak=100.0)
    )
    assert explicit["matmul TFLOP/s"].values["ratio"] == pytest.approx(0.5)

    # a wrong all-reduce sum fails whatever the bandwidth
    wrong = [_gpu_report(0, 700.0), _gpu_report(1, 700.0, correct=False)]
    row = _by_check(check.build_rows(wrong))["all-reduce busbw"]
    assert row.result == "FAIL" and "wrong sums on rank 1" in row.detail


def _allreduce_rank(rank: int, world: int, sizes: list[int]) -> tuple[list, list]:
    report = RankReport(rank, "localhost", "cpu", check.device_name(torch.device("cpu")))
    report.allreduce = check.allreduce_bandwidth(sizes, torch.device("cpu"), iters=3)
    rows = check.build_rows(check.gather_reports(report))
    return report.allreduce, [(r.check, r.result, r.detail) for r in rows]


@pytest.mark.multiprocess
def test_allreduce_bandwidth_on_two_gloo_ranks():
    sizes = [4096, 1 << 16]
    results = run_ranks(2, _allreduce_rank, sizes, timeout=120)
    for samples, _ in results:
        assert [s.bytes for s in samples] == sizes
        for s in samples:
            assert s.correct and s.seconds > 0
            assert s.algbw == pytest.approx(s.bytes / s.seconds / 1e9)
            assert s.busbw == pytest.approx(s.algbw * 2 * (2 - 1) / 2)
    rows = {c: (res, d) for c, res, d in results[0][1]}
    assert rows == {c: (res, d) for c, res, d in results[1][1]}  # the same table on every rank
    result, detail = rows["all-reduce busbw"]
    assert result in ("pass", "warn") and "(2 ranks, gloo)" in detail
    assert "4 KiB" in detail and "64 KiB" in detail
