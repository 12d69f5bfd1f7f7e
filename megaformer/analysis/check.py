"""``megaformer check``: a preflight check of the node(s) a long job is about to run on.

Every rank checks its own device, the results are all-gathered, and rank 0 prints one table:

    kernel NAME      each kernel's public dispatch function (whatever implementation it picks on
                     this device) against a plain torch formula evaluated in float64 on the same
                     inputs: forward output and every input gradient (for a random upstream
                     gradient), error = ||y - y_ref|| / ||y_ref||, worst over them, per dtype
                     (CUDA: bf16, fp16, fp32; CPU: fp32), against a tolerance per dtype;
                     dropout (random) by its dropped fraction and its kept values
    matmul           dense GEMM throughput, 2 n^3 FLOP per n x n by n x n product (bf16 on a GPU,
                     fp32 on CPU), against the peak table (:mod:`megaformer.accelerators`)
    attention        causal attention forward through the attention dispatch (flash-attn or
                     SDPA), 4 B H T^2 D / 2 FLOP (two GEMMs over half the query-key pairs)
    all-reduce       per rank and message size S, as nccl-tests define it (fp32 sum):
                         algbw = S / t,     busbw = algbw * 2 (n - 1) / n
                     (busbw is what each rank's links carry in a ring, comparable across n);
                     the reduced values are checked as well

Peer comparison (several ranks): a rank whose figure is more than 10 % below the median of the
other ranks' figures is flagged (:func:`slow_peers`) -- a failure on GPUs (one slow GPU or link
sets the pace of a synchronous job; the all-reduce is compared at its largest message size), a
warning on CPU (ranks on one host share its cores and memory). One GPU alone is compared with the table's peak and the ratio is
reported: achievable GEMM throughput is below the datasheet figure, so only a ratio under
:data:`LOW_PEAK_RATIO` is a warning, never a failure.

Results: ``pass``, ``FAIL`` (exit code 1), ``warn``, ``info`` (a figure without a criterion) and
``skip`` (with the reason: what needs a GPU or several ranks). The kernel checks are a table of
:class:`KernelCheck` entries in :mod:`megaformer.analysis.kernel_checks`.
"""

from __future__ import annotations

import math
import re
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megaformer.accelerators import UnknownGPUError, find_accelerator, peak_tflops
from megaformer.analysis.kernel_checks import (  # noqa: F401
    _DTYPE_NAMES,
    KERNEL_CHECKS,
    TOLERANCE,
    KernelCheck,
    KernelOutcome,
    first_line,
    has_bf16,
    run_dropout_check,
    run_kernel_check,
)
from megaformer.errors import UserError
from megaformer.kernels import attention as attention_ops

PASS, FAIL, WARN, INFO, SKIP = "pass", "FAIL", "warn", "info", "skip"

#: A rank more than this fraction below the median of its peers is flagged.
PEER_TOLERANCE = 0.10
#: A single GPU's matmul throughput under this fraction of the table's peak is a warning.
LOW_PEAK_RATIO = 0.5
#: Relative error allowed per dtype (forward output and input gradients, see the module docstring).
#: all-reduce message sizes (bytes) when none are given.
DEFAULT_SIZES = {"cuda": (1 << 20, 16 << 20, 256 << 20), "cpu": (256 << 10, 4 << 20)}


# ----------------------------------------------------------------------------- throughput


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(fn: Callable[[], Any], device: torch.device, min_seconds: float = 0.25) -> float:
    """Seconds per call of ``fn``: calls for ``min_seconds / 2`` to warm up (and to estimate a
    call), then enough calls back to back to last about ``min_seconds``, timed as one."""
    calls, t0 = 0, time.perf_counter()
    while calls == 0 or time.perf_counter() - t0 < min_seconds / 2:
        fn()
        _sync(device)
        calls += 1
    n = max(1, math.ceil(min_seconds / ((time.perf_counter() - t0) / calls)))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / n


def _seconds(device: torch.device) -> float:
    """How long a throughput is timed: longer on a GPU (clocks settle under sustained load)."""
    return 0.5 if device.type == "cuda" else 0.25


@dataclass
class Throughput:
    tflops: float
    what: str  # the measured shape, e.g. "bf16 8192x8192x8192"
    dtype: str  # peak-table column


def matmul_throughput(device: torch.device, n: Optional[int] = None) -> Throughput:
    """Throughput of C = A B, A and B n x n: 2 n^3 FLOP per product (bf16, else fp16, on a GPU;
    fp32 on CPU)."""
    if device.type == "cuda":
        dtype, n = torch.bfloat16 if has_bf16(device) else torch.float16, n or 8192
    else:
        dtype, n = torch.float32, n or 1024
    a, b, c = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
    seconds = time_per_call(lambda: torch.mm(a, b, out=c), device, _seconds(device))
    return Throughput(
        2 * n**3 / seconds / 1e12, f"{_DTYPE_NAMES[dtype]} {n}x{n}x{n}", _DTYPE_NAMES[dtype]
    )


def attention_throughput(
    device: torch.device, batch: int = 4, heads: int = 16, seq: int = 4096, head_dim: int = 128
) -> Throughput:
    """Causal self-attention forward through the attention dispatch: 4 B H T^2 D / 2 FLOP."""
    dtype = torch.bfloat16 if has_bf16(device) else torch.float16
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype) for _ in range(3)
    )
    with torch.no_grad():
        seconds = time_per_call(
            lambda: attention_ops.attention(q, k, v, causal=True), device, _seconds(device)
        )
    flops = 4 * batch * heads * seq * seq * head_dim / 2
    return Throughput(
        flops / seconds / 1e12,
        f"{_DTYPE_NAMES[dtype]} causal fwd B={batch} H={heads} T={seq} D={head_dim}",
        _DTYPE_NAMES[dtype],
    )


# ----------------------------------------------------------------------------- all-reduce


@dataclass
class AllReduceSample:
    bytes: int
    seconds: float  # per all-reduce, this rank's wall clock
    algbw: float  # GB/s
    busbw: float  # GB/s
    correct: bool  # the sum arrived


def parse_sizes(text: str) -> list[int]:
    """'1MiB,64MiB,1GB' -> bytes (KiB/MiB/GiB: powers of 1024; KB/MB/GB: of 1000; a bare number:
    bytes), each at least 4 (one fp32 element)."""
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 1 << 10,
        "MIB": 1 << 20,
        "GIB": 1 << 30,
    }
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", part)
        if m is None or m.group(2).upper() not in units:
            raise UserError(f"--sizes {text!r}: expected sizes like 1MiB,64MiB,1GiB (or bytes)")
        size = int(float(m.group(1)) * units[m.group(2).upper()])
        if size < 4:
            raise UserError(f"--sizes {text!r}: {part.strip()} is under one fp32 element (4 bytes)")
        out.append(size)
    return out


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s: algbw = S / t, busbw = algbw * 2 (n - 1) / n (nccl-tests)."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world - 1) / world


def allreduce_bandwidth(
    sizes: Sequence[int],
    device: torch.device,
    group: Optional[dist.ProcessGroup] = None,
    iters: int = 0,
) -> list[AllReduceSample]:
    """This rank's all-reduce (fp32 sum) bandwidth for each message size in ``sizes`` (bytes).

    Each rank contributes rank + 1, so every element must arrive as n (n + 1) / 2. Timed after
    a barrier over ``iters`` back-to-back all-reduces (default: enough for about 64 MiB moved,
    between 5 and 50)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = []
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        x = torch.full((numel,), float(rank + 1), device=device)
        dist.all_reduce(x, group=group)  # warm-up (connections, buffers) and the correctness check
        correct = bool((x == world * (world + 1) / 2).all().item())
        n = iters or min(50, max(5, (64 << 20) // (numel * 4)))
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x, group=group)
        _sync(device)
        seconds = (time.perf_counter() - t0) / n
        algbw, busbw = bus_bandwidth(numel * 4, seconds, world)
        out.append(AllReduceSample(numel * 4, seconds, algbw, busbw, correct))
    return out


# ----------------------------------------------------------------------------- one rank


@dataclass
class RankReport:
    """What one rank measured (gathered to every rank, so it must pickle)."""

    rank: int
    host: str
    device_type: str
    device_name: str
    kernels: dict = field(default_factory=dict)  # check name -> KernelOutcome
    matmul: Optional[Throughput] = None
    attention: Optional[Throughput] = None
    allreduce: list = field(default_factory=list)  # AllReduceSample per size
    errors: dict = field(default_factory=dict)  # measurement -> exception text


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = torch.get_num_threads()
    return f"CPU ({n} thread{'' if n == 1 else 's'})"


def _measure(report: RankReport, key: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # an error on one rank must not leave the others waiting
        report.errors[key] = f"{type(e).__name__}: {first_line(e)}"
        return None


def check_rank(
    device: torch.device,
    group: Optional[dist.ProcessGroup] = None,
    sizes: Optional[Sequence[int]] = None,
    checks: Optional[Sequence[KernelCheck]] = None,
) -> RankReport:
    """Every measurement on this rank's device; the all-reduce with the ranks of ``group`` when
    it has more than one (a collective: every rank of ``group`` must call this). ``checks``:
    these kernel checks only (default: :data:`KERNEL_CHECKS` and dropout)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    report = RankReport(rank, socket.gethostname(), device.type, device_name(device))
    for check in KERNEL_CHECKS if checks is None else checks:
        report.kernels[check.name] = run_kernel_check(check, device)
    if checks is None:
        report.kernels["dropout"] = run_dropout_check(device)
    if world > 1:
        dist.barrier(group=group)  # every rank's device busy at once, as in training
    report.matmul = _measure(report, "matmul", lambda: matmul_throughput(device))
    if device.type == "cuda":
        report.attention = _measure(report, "attention", lambda: attention_throughput(device))
        torch.cuda.empty_cache()
    if world > 1:
        sizes = sizes or DEFAULT_SIZES.get(device.type, DEFAULT_SIZES["cpu"])
        report.allreduce = (
            _measure(report, "all-reduce", lambda: allreduce_bandwidth(sizes, device, group)) or []
        )
    return report


def gather_reports(
    report: RankReport, group: Optional[dist.ProcessGroup] = None
) -> list[RankReport]:
    """Every rank's report, in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [report]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, report, group=group)
    return out


# ----------------------------------------------------------------------------- the table


@dataclass
class Row:
    check: str
    result: str
    detail: str
    values: dict = field(default_factory=dict)  # figures for --json


def slow_peers(values: Sequence[float], tolerance: float = PEER_TOLERANCE) -> list[int]:
    """Indices i with values[i] < (1 - tolerance) * median(values[j] for j != i), i.e. more than
    ``tolerance`` below the median of the other ranks (for two ranks: below the other one)."""
    values = list(values)
    if len(values) < 2:
        return []
    return [
        i
        for i, v in enumerate(values)
        if v < (1 - tolerance) * statistics.median(values[:i] + values[i + 1 :])
    ]


def _who(r: RankReport, many_hosts: bool) -> str:
    return f"rank {r.rank} ({r.host})" if many_hosts else f"rank {r.rank}"


def _kernel_row(name: str, reports: list[RankReport], many_hosts: bool) -> Row:
    outcomes = [(r, r.kernels[name]) for r in reports if name in r.kernels]
    bad = [(r, o) for r, o in outcomes if o.failure is not None]
    first = outcomes[0][1]
    errors = {dt: max(o.errors.get(dt, 0.0) for _, o in outcomes) for dt in first.errors}
    values = {"max_rel_error": errors}
    if bad:
        shown = "; ".join(
            f"{_who(r, many_hosts)}: {o.failure}" if len(reports) > 1 else o.failure
            for r, o in bad[:3]
        )
        more = f" (+{len(bad) - 3} more ranks)" if len(bad) > 3 else ""
        return Row(f"kernel {name}", FAIL, shown + more, values)
    tol = "/".join(f"{TOLERANCE[dt]:.0e}" for dt in (_dtype(n) for n in errors))
    detail = ", ".join(f"{dt} {e:.1e}" for dt, e in errors.items()) + f" (rel. error; tol {tol})"
    if first.via:
        detail += "; via " + ", ".join(dict.fromkeys(first.via))
    if len(reports) > 1:
        detail += f"; all {len(reports)} ranks"
    return Row(f"kernel {name}", PASS, detail, values)


def _dtype(name: str) -> torch.dtype:
    return {v: k for k, v in _DTYPE_NAMES.items()}[name]


def _peak(
    reports: list[RankReport], dtype: str, explicit: Optional[float]
) -> tuple[Optional[float], str]:
    """(peak TFLOP/s, its description) for the GPUs of ``reports``; (None, why) without one."""
    if explicit is not None:
        return peak_tflops(None, dtype, explicit), f"--peak-tflops {explicit:g}"
    names = sorted({r.device_name for r in reports})
    if len(names) > 1:
        return None, f"mixed GPU models ({', '.join(names)}): no single peak"
    try:
        acc = find_accelerator(names[0])
        return acc.peak(dtype), f"{acc.name} {dtype} peak {acc.peak(dtype):g}"
    except UnknownGPUError:
        return None, f"{names[0]} is not in the peak table (give --peak-tflops)"


def _throughput_row(
    check: str,
    key: str,
    reports: list[RankReport],
    peak: Optional[float],
    many_hosts: bool,
    low_ratio: Optional[float],
) -> Row:
    got = [(r, getattr(r, key)) for r in reports]
    errors = [(r, r.errors[key]) for r in reports if key in r.errors]
    if errors:
        r, e = errors[0]
        return Row(check, FAIL, (f"{_who(r, many_hosts)}: " if len(reports) > 1 else "") + e)
    if any(t is None for _, t in got):
        return Row(check, SKIP, "not measured")
    tflops = [t.tflops for _, t in got]
    what = got[0][1].what
    values: dict = {"tflops": tflops}
    gpu = reports[0].device_type == "cuda"
    peak_value, peak_text = _peak(reports, got[0][1].dtype, peak) if gpu else (None, "")
    med = statistics.median(tflops)
    if len(reports) == 1:
        detail = f"{tflops[0]:.3g} TFLOP/s ({what})"
    else:
        detail = (
            f"median {med:.3g} TFLOP/s, min {min(tflops):.3g} (rank {tflops.index(min(tflops))})"
            f" over {len(reports)} ranks ({what})"
        )
    result = INFO  # a figure without a criterion, unless one below applies
    if not gpu:
        detail += "; no peak: the table lists accelerators only"
    elif peak_value is None:
        detail += f"; {peak_text}"
    else:
        ratio = med / peak_value
        values.update(peak=peak_value, ratio=ratio)
        detail += f" = {ratio:.2f} of {peak_text}"
        if low_ratio is not None:
            result = PASS if ratio >= low_ratio else WARN
            if ratio < low_ratio:
                detail += f" (under {low_ratio:g}: check clocks, power and thermals)"
    slow = slow_peers(tflops)
    if slow:
        names = ", ".join(f"{_who(reports[i], many_hosts)} {tflops[i]:.3g}" for i in slow)
        detail = f"{names}: more than {PEER_TOLERANCE:.0%} below its peers; " + detail
        values["slow_ranks"] = [reports[i].rank for i in slow]
        result = FAIL if gpu else WARN
    elif len(reports) > 1 and result == INFO:
        result = PASS  # the peer comparison is the criterion
    return Row(check, result, detail, values)


def _allreduce_row(reports: list[RankReport], many_hosts: bool) -> Row:
    world = len(reports)
    errors = [(r, r.errors["all-reduce"]) for r in reports if "all-reduce" in r.errors]
    if errors:
        r, e = errors[0]
        return Row("all-reduce busbw", FAIL, f"{_who(r, many_hosts)}: {e}")
    wrong = [r for r in reports if not all(s.correct for s in r.allreduce)]
    sizes = [s.bytes for s in reports[0].allreduce]
    busbw = [[s.busbw for s in r.allreduce] for r in reports]  # [rank][size]
    per_size = [[b[i] for b in busbw] for i in range(len(sizes))]
    values = {"bytes": sizes, "busbw_gbps": busbw}
    detail = ", ".join(
        f"{_size(n)} {statistics.median(col):.3g}" for n, col in zip(sizes, per_size)
    )
    detail = f"median GB/s per size: {detail} ({world} ranks, {dist_backend(reports)})"
    if wrong:
        return Row(
            "all-reduce busbw",
            FAIL,
            "wrong sums on " + ", ".join(_who(r, many_hosts) for r in wrong) + "; " + detail,
            values,
        )
    largest = per_size[-1]
    slow = slow_peers(largest)
    if slow:
        names = ", ".join(f"{_who(reports[i], many_hosts)} {largest[i]:.3g} GB/s" for i in slow)
        values["slow_ranks"] = [reports[i].rank for i in slow]
        gpu = reports[0].device_type == "cuda"
        return Row(
            "all-reduce busbw",
            FAIL if gpu else WARN,
            f"{names} at {_size(sizes[-1])}: more than {PEER_TOLERANCE:.0%} below its peers; "
            + detail,
            values,
        )
    return Row("all-reduce busbw", PASS, detail, values)


def dist_backend(reports: list[RankReport]) -> str:
    return "nccl" if reports[0].device_type == "cuda" else "gloo"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def build_rows(reports: list[RankReport], peak: Optional[float] = None) -> list[Row]:
    """The table from every rank's report (``peak``: TFLOP/s instead of the table's)."""
    first, world = reports[0], len(reports)
    hosts = sorted({r.host for r in reports})
    many_hosts = len(hosts) > 1
    gpu = first.device_type == "cuda"
    models = sorted({r.device_name for r in reports})
    versions = f"torch {torch.__version__}"
    if gpu and torch.version.cuda:
        versions += f", CUDA {torch.version.cuda}"
    rows = [
        Row("device", INFO, f"{world} x {', '.join(models)} on {len(hosts)} host(s); {versions}")
    ]
    names = list(dict.fromkeys(n for r in reports for n in r.kernels))
    rows += [_kernel_row(n, reports, many_hosts) for n in names]
    if not gpu:
        rows.append(
            Row(
                "kernels bf16/fp16",
                SKIP,
                "needs a GPU: the low-precision paths (Triton kernels, flash-attn, SDPA's "
                "CUDA backends) run on CUDA only; checked here in fp32",
            )
        )
    rows.append(
        _throughput_row("matmul TFLOP/s", "matmul", reports, peak, many_hosts, LOW_PEAK_RATIO)
    )
    if gpu:
        rows.append(
            _throughput_row("attention TFLOP/s", "attention", reports, peak, many_hosts, None)
        )
    else:
        rows.append(
            Row(
                "attention TFLOP/s",
                SKIP,
                "needs a GPU: measures the flash / SDPA CUDA path against the bf16 peak",
            )
        )
    if world > 1:
        rows.append(_allreduce_row(reports, many_hosts))
    else:
        rows.append(
            Row(
                "all-reduce busbw",
                SKIP,
                "needs more than one rank: launch with torchrun or srun "
                "(e.g. torchrun --nproc_per_node 8 -m megaformer check)",
            )
        )
    return rows


def failed(rows: Sequence[Row]) -> bool:
    return any(r.result == FAIL for r in rows)


def format_table(rows: Sequence[Row]) -> str:
    """check | result | detail, one line per row."""
    w_check = max(len("check"), *(len(r.check) for r in rows))
    w_result = max(len("result"), *(len(r.result) for r in rows))
    lines = [
        f"{'check':<{w_check}} | {'result':<{w_result}} | detail",
        f"{'-' * w_check}-+-{'-' * w_result}-+-{'-' * 40}",
    ]
    lines += [f"{r.check:<{w_check}} | {r.result:<{w_result}} | {r.detail}" for r in rows]
    n_fail = sum(r.result == FAIL for r in rows)
    lines.append(
        f"{n_fail} failed" if n_fail else "all checks passed (warn/info/skip rows do not fail)"
    )
    return "\n".join(lines)


def _finite(v: Any) -> Any:
    """``v`` with non-finite floats as None (strict JSON has no Infinity/NaN)."""
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v


def to_json(rows: Sequence[Row]) -> dict:
    """{"failed": bool, "rows": [{"check", "result", "detail", "values" (figures, when any)}]}."""
    return {
        "failed": failed(rows),
        "rows": [
            {
                "check": r.check,
                "result": r.result,
                "detail": r.detail,
                **({"values": _finite(r.values)} if r.values else {}),
            }
            for r in rows
        ],
    }


def run_check(
    device: torch.device,
    group: Optional[dist.ProcessGroup] = None,
    sizes: Optional[Sequence[int]] = None,
    peak: Optional[float] = None,
) -> list[Row]:
    """All checks on this rank, gathered; the rows (the same on every rank)."""
    if peak is not None:
        peak_tflops(None, "bf16", peak)  # validates it (> 0) before any work
    return build_rows(gather_reports(check_rank(device, group, sizes), group), peak)
