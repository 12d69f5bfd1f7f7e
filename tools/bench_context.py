#!/usr/bin/env python
"""Context parallelism on CPU: memory, communication and throughput per rank at CP 1 / 2 / 4.

    python tools/bench_context.py [--lengths 4096,16384,65536] [--attention-only-from 65536]
                                  [--degrees 1,2,4] [--modes ring,all_to_all] [--dtype fp32]

For each sequence length, one training step (forward + backward, batch 1) of a small model
(1 block, d_model 64, 4 heads of 16, vocabulary 256) on N gloo processes of this machine:
CP 1 (one process, the plain model), and ring and all-to-all at CP 2 and 4. From
``--attention-only-from`` on, only the attention core runs (forward + backward of q, k, v of the
same shape), since the rest of the model is per-token work that CP splits trivially.
``--dtype bf16`` runs the model (or q, k, v) in bf16: the ring's kernels then run in bf16 too.

Columns, per rank (the busiest):
  mem MiB    peak resident memory of the step above the resident memory before it (VmHWM after
             resetting it through /proc/self/clear_refs; large tensors are mmap-ed and returned
             on free, so the resident set follows the live tensors)
  est MiB    the memory estimator's activations + backward transient for this layout
             (megaformer.analysis.memory; attention-only rows: q, k, v, o and the fp32
             log-sum-exp of the block, and the ring's K/V blocks in flight)
  sent MiB   bytes this rank sent for context parallelism in the step (counted at each send)
  model MiB  the analytical volume (module docstring of megaformer.parallel.context):
             ring (N-1) n 2 h_kv d e forward and backward plus N n 2 h_kv d 4 (the fp32 dK/dV
             accumulators going home); all-to-all 2 (N-1)/N n (2 h + 2 h_kv) d e; n = T / N
  tok/s      T / step time (all ranks share this machine's cores: compare within a length)

Figures are measured, not asserted; the estimator is the analysis module's, printed next to it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

D_MODEL, HEADS, HEAD_DIM, VOCAB = 64, 4, 16, 256
MiB = 2**20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _fixed_mmap_threshold() -> None:
    """glibc: allocations over 256 KiB are mmap-ed (and unmapped when freed), always."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD (also turns off its dynamic adjustment)


def _model_cfg(T: int):
    from megaformer.config import ModelConfig

    return ModelConfig(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        n_layers=1,
        n_heads=HEADS,
        max_seq_len=T,
        d_ffn=4 * D_MODEL,
    )


def estimate_mib(T: int, cp: int, mode: str, attention_only: bool, dtype: str = "fp32") -> float:
    from megaformer.analysis.memory import (
        Layout,
        activation_bytes,
        context_transient_bytes,
        layer_activation_bytes,
    )

    cfg = _model_cfg(T)
    layout = Layout(cp=cp, cp_mode=mode, device="cpu", precision=dtype)
    if attention_only:
        return (
            layer_activation_bytes(cfg, T, layout)["attention"]
            + context_transient_bytes(cfg, T, layout)
        ) / MiB
    act = activation_bytes(cfg, T, layout, VOCAB)
    return (act["total"] + act["backward_transient"]) / MiB


def analytic_mib(T: int, cp: int, mode: str, dtype: str = "fp32") -> float:
    if cp == 1:
        return 0.0
    n, e = T / cp, 4 if dtype == "fp32" else 2
    if mode == "ring":
        return (
            (cp - 1) * n * 2 * HEADS * HEAD_DIM * 2 * e + cp * n * 2 * HEADS * HEAD_DIM * 4
        ) / MiB
    return 2 * (cp - 1) / cp * n * 4 * HEADS * HEAD_DIM * e / MiB


def _step(rank: int, world: int, T: int, mode: str, attention_only: bool, dtype: str) -> dict:
    import torch

    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    import torch.distributed as dist

    from megaformer.comm import CommCounter
    from megaformer.kernels.attention import attention

    torch.manual_seed(0)
    cp = None
    if world > 1:
        from megaformer.parallel.context import ContextParallel

        cp = ContextParallel(dist.group.WORLD, world, rank, mode)
    tl = T // world
    if attention_only:
        q, k, v = (
            torch.randn(1, HEADS, tl, HEAD_DIM, dtype=dt, requires_grad=True) for _ in range(3)
        )

        def run() -> None:
            if cp is None:
                y = attention(q, k, v, causal=True)
            else:
                y = cp.attention(
                    attention,
                    q,
                    k,
                    v,
                    causal=True,
                    dropout_p=0.0,
                    backend="auto",
                    doc_ids=None,
                    window=None,
                )
            y.sum().backward()
    else:
        from megaformer.model.transformer import Transformer
        from megaformer.parallel.topology import build_topology

        model = Transformer(_model_cfg(T)).to(dt)
        if cp is not None:
            from megaformer.parallel.context import apply_context

            apply_context(model, build_topology(world, rank, cp=world), mode)
        ids = torch.randint(0, VOCAB, (1, tl))

        def run() -> None:
            model(ids, ids).backward()
            model.zero_grad(set_to_none=True)

    if world > 1:
        dist.barrier()
    base = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    with CommCounter() as counter:
        run()
    if world > 1:
        dist.barrier()
    wall = time.perf_counter() - t0
    return {"mem": (_status("VmHWM") - base) / MiB, "sent": counter.total_bytes / MiB, "wall": wall}


def _worker(rank: int, world: int, port: int, args: tuple, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    _fixed_mmap_threshold()
    import torch
    import torch._dynamo  # noqa: F401  (as the trainer and the rank spawner have it imported:
    # the context-parallel operators' first call would import it, ~150 MiB once per process)

    torch.set_num_threads(1 if world > 1 else 2)
    try:
        if world > 1:
            torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        out.put((rank, _step(rank, world, *args)))
    except BaseException as e:  # report it to the parent
        out.put((rank, repr(e)))
    finally:
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def measure(
    world: int, T: int, mode: str, attention_only: bool, timeout: float, dtype: str = "fp32"
) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, port, (T, mode, attention_only, dtype), out),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(world):
            rank, res = out.get(timeout=timeout)
            if not isinstance(res, dict):
                raise RuntimeError(f"rank {rank}: {res}")
            results.append(res)
    except queue.Empty:
        raise RuntimeError(f"T={T} CP={world} {mode}: no result within {timeout:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return {
        "mem": max(r["mem"] for r in results),
        "sent": max(r["sent"] for r in results),
        "wall": max(r["wall"] for r in results),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,16384,65536")
    ap.add_argument("--attention-only-from", type=int, default=65536)
    ap.add_argument("--degrees", default="1,2,4")
    ap.add_argument("--modes", default="ring,all_to_all")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    a = ap.parse_args(argv)
    header = (
        f"{'T':>6} {'what':>9} {'CP':>2} {'mode':>10} {'mem MiB':>8} {'est MiB':>8} "
        f"{'sent MiB':>8} {'model MiB':>9} {'tok/s':>8}"
    )
    print(header)
    print("-" * len(header))
    for T in (int(x) for x in a.lengths.split(",")):
        attn = T >= a.attention_only_from
        for cp in (int(x) for x in a.degrees.split(",")):
            for mode in ("ring",) if cp == 1 else a.modes.split(","):
                r = measure(cp, T, mode, attn, a.timeout, a.dtype)
                print(
                    f"{T:>6} {'attention' if attn else 'model':>9} {cp:>2} "
                    f"{'-' if cp == 1 else mode:>10} {r['mem']:>8.1f} "
                    f"{estimate_mib(T, cp, mode, attn, a.dtype):>8.1f} {r['sent']:>8.2f} "
                    f"{analytic_mib(T, cp, mode, a.dtype):>9.2f} {T / r['wall']:>8.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
