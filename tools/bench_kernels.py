"""Kernel micro-benchmarks: each fast path beside the unfused torch version, forward + backward.

    python tools/bench_kernels.py [--device cpu|cuda] [--dtype fp32|bf16] [--tokens 4096]
                                  [--d-model 1024] [--d-ffn 2816] [--heads 16] [--seq 1024]
                                  [--vocab 32000] [--ce-chunk 1024] [--repeat 5]

Rows (best of --repeat timed runs after 2 warm-up runs, the two versions alternating, which one
goes first alternating too):

Every "dispatch" row names, in brackets, the implementation that ran (recorded by
megaformer.kernels.selection.track while it ran).

* RMSNorm, LayerNorm      unfused torch (fp32 statistics, as written in the model) vs megaformer's
                          dispatch and torch's native op. GB/s = bytes moved (x, y, dy, dx:
                          4 x tokens x d_model x element size) / time.
* SwiGLU, bias-GELU       unfused torch (separate elementwise ops) vs the dispatch, SwiGLU on
                          separate g, u and on the packed [g | u]. GB/s over 8 (SwiGLU) or 6 (GELU)
                          tokens x d_ffn tensors read or written once.
* attention               the written-out reference (scores materialised) vs the dispatch, causal,
                          B x seq / seq rows; TFLOP/s = 3.5 x 2 x 2 B h s^2 d_k / 2 / time (forward
                          + backward = 2.5 x forward, causal = half the square).
* cross-entropy           logits [tokens, vocab] then F.cross_entropy vs the chunked fused head
                          (--ce-chunk tokens at a time): time, TFLOP/s of the 6 N d V useful
                          FLOPs, and peak memory of loss + backward (CUDA: max_memory_allocated;
                          CPU: the allocator's own record, megaformer.analysis.measure).

Ceilings printed beside the achieved numbers on CUDA: dense TFLOP/s from the peak table
(megaformer/accelerators.py) and the HBM bandwidth below; on CPU there is no ceiling.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# HBM bandwidth, GB/s (vendor datasheets), keyed by the peak table's names.
HBM_GBPS = {
    "A100-SXM": 2039,
    "A100-PCIe": 1935,
    "H100-SXM": 3350,
    "H100-PCIe": 2000,
    "H100-NVL": 3900,
    "H200": 4800,
    "H200-NVL": 4800,
    "GH200": 4000,
    "B200": 8000,
    "MI300X": 5300,
    "MI325X": 6000,
    "L40S": 864,
    "L4": 300,
    "A10": 600,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(fn: Callable, inputs: list[torch.Tensor]) -> Callable[[], None]:
    """One forward + backward of fn on fresh-gradient leaves."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]

    def run() -> None:
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        out.backward(torch.ones_like(out) if out.dim() else None)

    return run


def time_pair(
    a: Callable[[], None], b: Callable[[], None], repeat: int, device: torch.device
) -> tuple[float, float]:
    """Best (minimum) seconds of a and b over ``repeat`` runs each, alternating: on a shared
    machine the least-disturbed run is the cost of the code; a median measures the neighbours."""
    ta, tb = [], []
    for _ in range(2):
        a(), b()
    for i in range(repeat):
        pair = ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta))  # no first-runner bias
        for f, acc in pair:
            _sync(device)
            t0 = time.perf_counter()
            f()
            _sync(device)
            acc.append(time.perf_counter() - t0)
    return min(ta), min(tb)


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from megaformer.analysis.measure import measure

    return measure(fn).peak


def _row(
    name: str,
    unfused: float,
    fused: float,
    work: float,
    unit: str,
    ceiling: float | None,
    extra: str = "",
) -> str:
    ratio = unfused / fused
    ceil = f"{ceiling:>9,.0f}" if ceiling else f"{'-':>9s}"
    return (
        f"{name:34s} {1e3 * unfused:>10.3f} {1e3 * fused:>10.3f} {ratio:>7.2f}x "
        f"{work / unfused:>10.2f} {work / fused:>10.2f} {unit:>7s} {ceil} {extra}"
    )


def _ran(fn: Callable, inputs: list) -> str:
    """The implementations megaformer's dispatch ran for ``fn(*inputs)`` forward + backward."""
    from megaformer.kernels.selection import track

    with track() as ran:
        _fwd_bwd(fn, inputs)()
    return "/".join(sorted({i for impls in ran.values() for i in impls})) or "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", choices=("fp32", "bf16"), default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument(
        "--ce-tokens", type=int, default=None, help="tokens of the CE rows (default --tokens)"
    )
    p.add_argument("--ce-chunk", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()

    from megaformer.accelerators import find_accelerator
    from megaformer.errors import UserError
    from megaformer.kernels import activations as A
    from megaformer.kernels import norm as N
    from megaformer.kernels.attention import attention
    from megaformer.kernels.cross_entropy import chunked_cross_entropy

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_kernels: --device cuda but no CUDA device is available")
    dtype_name = args.dtype or ("bf16" if dev.type == "cuda" else "fp32")
    from megaformer.config import precision_dtype

    dtype = precision_dtype(dtype_name)
    tflops_ceiling = gbps_ceiling = None
    label = f"{dev.type} ({torch.get_num_threads()} threads)"
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        label = name
        try:
            acc = find_accelerator(name)
            tflops_ceiling, gbps_ceiling = acc.peak(dtype_name), HBM_GBPS.get(acc.name)
        except UserError:
            pass
    elem = torch.finfo(dtype).bits // 8
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    M, D, Fd = args.tokens, args.d_model, args.d_ffn
    print(f"bench_kernels: {label}, {dtype_name}, forward + backward, best of {args.repeat}")
    print(
        f"{'kernel':34s} {'unfused ms':>10s} {'fused ms':>10s} {'speedup':>8s} "
        f"{'unfused':>10s} {'fused':>10s} {'unit':>7s} {'ceiling':>9s}"
    )
    x, w, b = randn(M, D), randn(D), randn(D)
    norm_bytes = 4 * M * D * elem / 1e9
    ref_rms = _fwd_bwd(lambda x_, w_: N.rms_norm_reference(x_, w_, 1e-5), [x, w])
    rms = lambda x_, w_: N.rms_norm(x_, w_, 1e-5)  # noqa: E731
    for name, fn in (
        (f"RMSNorm: dispatch [{_ran(rms, [x, w])}]", rms),
        ("RMSNorm: torch native F.rms_norm", lambda x_, w_: F.rms_norm(x_, (D,), w_, 1e-5)),
    ):
        t_ref, t = time_pair(ref_rms, _fwd_bwd(fn, [x, w]), args.repeat, dev)
        print(_row(name, t_ref, t, norm_bytes, "GB/s", gbps_ceiling))
    ref_ln = _fwd_bwd(lambda x_, w_, b_: N.layer_norm_reference(x_, w_, b_, 1e-5), [x, w, b])
    ln = lambda x_, w_, b_: N.layer_norm(x_, w_, b_, 1e-5)  # noqa: E731
    for name, fn in (
        (f"LayerNorm: dispatch [{_ran(ln, [x, w, b])}]", ln),
        ("LayerNorm: torch native", lambda x_, w_, b_: F.layer_norm(x_, (D,), w_, b_, 1e-5)),
    ):
        t_ref, t = time_pair(ref_ln, _fwd_bwd(fn, [x, w, b]), args.repeat, dev)
        print(_row(name, t_ref, t, norm_bytes, "GB/s", gbps_ceiling))

    g, u, bf = randn(M, Fd), randn(M, Fd), randn(Fd)
    t_ref, t = time_pair(
        _fwd_bwd(A.swiglu_reference, [g, u]), _fwd_bwd(A.swiglu, [g, u]), args.repeat, dev
    )
    print(
        _row(
            f"SwiGLU: dispatch [{_ran(A.swiglu, [g, u])}]",
            t_ref,
            t,
            8 * M * Fd * elem / 1e9,
            "GB/s",
            gbps_ceiling,
        )
    )
    gu = torch.cat((g, u), dim=-1)
    packed_ref = _fwd_bwd(lambda y_: A.swiglu_reference(*y_.chunk(2, dim=-1)), [gu])
    t_ref, t = time_pair(packed_ref, _fwd_bwd(A.swiglu_packed, [gu]), args.repeat, dev)
    print(
        _row(
            f"SwiGLU [g|u]: dispatch [{_ran(A.swiglu_packed, [gu])}]",
            t_ref,
            t,
            8 * M * Fd * elem / 1e9,
            "GB/s",
            gbps_ceiling,
        )
    )
    t_ref, t = time_pair(
        _fwd_bwd(A.bias_gelu_reference, [g, bf]), _fwd_bwd(A.bias_gelu, [g, bf]), args.repeat, dev
    )
    print(
        _row(
            f"bias-GELU: dispatch [{_ran(A.bias_gelu, [g, bf])}]",
            t_ref,
            t,
            6 * M * Fd * elem / 1e9,
            "GB/s",
            gbps_ceiling,
        )
    )

    H, dk, S = args.heads, D // args.heads, args.seq
    B = max(1, M // S)
    q, k, v = (randn(B, H, S, dk) for _ in range(3))
    att_flops = 3.5 * 2 * 2 * B * H * S * S * dk / 2 / 1e12
    att = lambda *a: attention(*a, causal=True, backend="auto")  # noqa: E731
    t_ref, t = time_pair(
        _fwd_bwd(lambda *a: attention(*a, causal=True, backend="reference"), [q, k, v]),
        _fwd_bwd(att, [q, k, v]),
        args.repeat,
        dev,
    )
    print(
        _row(
            f"attention {B}x{H}x{S}x{dk}: dispatch [{_ran(att, [q, k, v])}]",
            t_ref,
            t,
            att_flops,
            "TFLOP/s",
            tflops_ceiling,
        )
    )

    Nt, V = args.ce_tokens or M, args.vocab
    h, wv = randn(Nt, D, scale=0.1), randn(V, D, scale=0.02)
    y = torch.randint(0, V, (Nt,), generator=gen).to(dev)
    plain = _fwd_bwd(lambda h_, w_: F.cross_entropy((h_ @ w_.t()).float(), y), [h, wv])
    chunked = _fwd_bwd(lambda h_, w_: chunked_cross_entropy(h_, w_, y, args.ce_chunk), [h, wv])
    t_ref, t = time_pair(plain, chunked, args.repeat, dev)
    mem_plain, mem_chunked = peak_bytes(plain, dev), peak_bytes(chunked, dev)
    print(
        _row(
            f"cross-entropy {Nt}x{V}: chunks of {args.ce_chunk}",
            t_ref,
            t,
            6 * Nt * D * V / 1e12,
            "TFLOP/s",
            tflops_ceiling,
            f"peak memory {mem_plain / 2**20:,.0f} -> {mem_chunked / 2**20:,.0f} MiB "
            f"({mem_plain / mem_chunked:.1f}x less)",
        )
    )
    print("speedup = unfused time / fused time (> 1: the fast path is faster); [..] = what ran")


if __name__ == "__main__":
    main()
