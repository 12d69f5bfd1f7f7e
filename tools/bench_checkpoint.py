"""Sharded checkpoints against the single-writer design, on 1, 2, 4 and 8 ranks (gloo, CPU).

    python tools/bench_checkpoint.py [--ranks 1,2,4,8] [--d-model 512] [--layers 8]
                                     [--vocab 32000] [--zero-stage 1] [--dir DIR]

For each world size the ranks (DP = world size, ZeRO ``--zero-stage``, fp32) build one Llama-style
model, take one training step (so Adam's moments exist), and each measures on the same disk,
fsync included:

* sharded save (megaformer's ``Checkpointer.save``): wall time, the bytes this rank wrote, the peak of
  this process's resident memory above its level before the save (sampled every 2 ms);
* asynchronous sharded save: the training stall (``Checkpointer.save`` returning: the host copy of the
  rank's own shard) and when the background write was done;
* sharded load (``Checkpointer.resume`` on a fresh checkpointer): reading this rank's part and
  setting master weights and Adam moments;
* the single-writer design this replaced, on the same model: DeepSpeed's engine files plus whole
  weights and whole optimizer state gathered to one writer (``full_weights`` and the layout-free
  snapshot) and written there: wall time, bytes of the busiest writer, its peak memory.

One table row per (world size, design); ratios are the single writer's over the sharded save's.
The machine's cores are shared by all ranks: with more ranks than cores wall times grow with the
rank count; the bytes and memory columns are what scale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """(seconds, peak resident bytes above the level at the start, result)."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss() - base)
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    try:
        out = fn()
    finally:
        dt = time.perf_counter() - t0
        done.set()
        t.join()
    return dt, max(peak[0], _rss() - base), out


def _written(folder: Path, names: list[str]) -> int:
    return sum((folder / n).stat().st_size for n in names if (folder / n).is_file())


def build_trainer(args: argparse.Namespace, run_dir: Path, async_save: bool):
    from megaformer.config import load_config
    from megaformer.training.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(
        root / "configs" / "quickstart.yaml",
        [
            f"model.d_model={args.d_model}",
            f"model.n_layers={args.layers}",
            "model.n_heads=8",
            "model.n_kv_heads=8",
            f"model.vocab_size={args.vocab}",
            "model.max_seq_len=64",
            "data.source=stdlib",
            "data.max_bytes=200000",
            "train.steps=8",
            "train.micro_batch_size=1",
            f"train.global_batch_size={world}",
            "eval.interval=0",
            "checkpoint.interval=0",
            "log.progress_bar=false",
            "log.tensorboard=false",
            "log.sample_tokens=0",
            f"parallel.zero_stage={args.zero_stage}",
            f"checkpoint.async_save={str(async_save).lower()}",
            "checkpoint.keep_last=null",
        ],
    )
    trainer = Trainer(cfg, run_dir)
    trainer.setup()
    trainer.train_step()
    return trainer


def single_writer_save(checkpointer, folder: Path) -> list[str]:
    """The design sharded checkpoints replaced: DeepSpeed's per-rank engine files, then whole
    weights and the whole optimizer state gathered and written by one writer (rank 0 here: one
    pipeline stage)."""
    from megaformer.checkpoint.files import write_payload
    from megaformer.checkpoint.legacy import portable
    from megaformer.training import distributed as dist

    t, rank = checkpointer.trained, checkpointer.rank
    t.engine.save_checkpoint(str(folder), tag="engine", save_latest=False)
    weights = t.full_weights()
    state = portable.snapshot_portable_state(
        t.engine, t.params(), checkpointer.topo, checkpointer.cfg.model.vocab_size
    )
    names = []
    if rank == 0:
        write_payload(
            folder / "model.safetensors",
            {k: v.detach().cpu().contiguous() for k, v in weights.items()},
        )
        write_payload(folder / portable.stage_file(0), state)
        names = ["model.safetensors", portable.stage_file(0)]
    dist.barrier()
    engine = folder / "engine"
    names += [f"engine/{f.name}" for f in engine.glob(f"*rank_{rank:02d}*") if rank > 0] + (
        [f"engine/{f.name}" for f in engine.glob("*")] if rank == 0 else []
    )
    return names


def rank_main(
    rank: int, world: int, port: int, args: argparse.Namespace, base: Path, out: Any
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import dataclasses

    from megaformer.checkpoint import sharded
    from megaformer.checkpoint.checkpointer import Checkpointer, TrainState
    from megaformer.checkpoint.files import BackgroundWriter
    from megaformer.training import distributed as dist

    run = base / f"w{world}"
    trainer = build_trainer(args, run, async_save=False)
    checkpointer = trainer.checkpointer
    state = TrainState(trainer.step, trainer.loader.consumed_samples)
    row: dict[str, Any] = {"rank": rank}
    dist.barrier()
    t, mem, ckpt = measured(lambda: checkpointer.save(state))
    row.update(
        save_s=t,
        save_mem=mem,
        save_bytes=_written(ckpt / sharded.STATE_DIR, [sharded.rank_file(rank)]),
    )
    dist.barrier()
    checkpointer.writer = BackgroundWriter()
    dist.barrier()
    t0 = time.perf_counter()
    later = dataclasses.replace(state, step=state.step + 1)
    stall, stall_mem, _ = measured(lambda: checkpointer.save(later))
    checkpointer.wait()
    row.update(stall_s=stall, stall_mem=stall_mem, async_total_s=time.perf_counter() - t0)
    checkpointer.writer = None
    dist.barrier()
    cfg = dataclasses.replace(
        trainer.cfg, checkpoint=dataclasses.replace(trainer.cfg.checkpoint, resume=True)
    )

    def load() -> None:  # a fresh checkpointer on the run: open the shards, set the state
        reader = Checkpointer(cfg, run, world, rank)
        reader.model_weights(cfg.model)
        reader.attach(cfg, checkpointer.topo, checkpointer.trained)
        rng = torch.get_rng_state()
        reader.resume()
        torch.set_rng_state(rng)

    t, mem, _ = measured(load)
    row.update(load_s=t, load_mem=mem)
    dist.barrier()
    old = run / "single_writer"
    t, mem, names = measured(lambda: single_writer_save(checkpointer, old))
    row.update(old_s=t, old_mem=mem, old_bytes=_written(old, names))
    dist.barrier()
    state_bytes = 12 * sum(p.numel() for p in trainer.plain_model.parameters())
    rows = dist.gather_to_main({**row, "state_bytes": state_bytes})
    if rank == 0:
        out.put(rows)
    dist.barrier()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--zero-stage", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    base = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    results = {}
    try:
        for world in [int(w) for w in args.ranks.split(",")]:
            ctx = mp.get_context("spawn")
            q = ctx.SimpleQueue()
            port = _port()
            procs = [
                ctx.Process(target=rank_main, args=(r, world, port, args, base, q))
                for r in range(world)
            ]
            for p in procs:
                p.start()
            results[world] = q.get()
            for p in procs:
                p.join()
            shutil.rmtree(base / f"w{world}", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mb = 1e6
    first = next(iter(results.values()))[0]
    print(
        f"model: {first['state_bytes'] / 12 / 1e6:.1f} M parameters; training state "
        f"{first['state_bytes'] / 1e9:.2f} GB (fp32 master + 2 Adam moments); ZeRO "
        f"{args.zero_stage}, fp32, DP = ranks"
    )
    print(
        f"{'ranks':>5s} {'design':>13s} {'save s':>7s} {'load s':>7s} {'max MB/rank':>11s} "
        f"{'share':>6s} {'peak RSS MB':>11s} {'stall s':>8s} {'bg write s':>10s}"
    )
    for world, rows in results.items():
        total = rows[0]["state_bytes"]
        save = max(r["save_s"] for r in rows)
        load = max(r["load_s"] for r in rows)
        wrote = max(r["save_bytes"] for r in rows)
        print(
            f"{world:>5d} {'sharded':>13s} {save:>7.2f} {load:>7.2f} {wrote / mb:>11.1f} "
            f"{wrote / total:>6.3f} {max(r['save_mem'] for r in rows) / mb:>11.1f} "
            f"{max(r['stall_s'] for r in rows):>8.2f} "
            f"{max(r['async_total_s'] for r in rows):>10.2f}"
        )
        old = max(r["old_s"] for r in rows)
        old_wrote = max(r["old_bytes"] for r in rows)
        print(
            f"{world:>5d} {'single writer':>13s} {old:>7.2f} {'':>7s} {old_wrote / mb:>11.1f} "
            f"{old_wrote / total:>6.3f} {max(r['old_mem'] for r in rows) / mb:>11.1f} "
            f"{'':>8s} {'':>10s}   save x{old / save:.2f}, busiest writer x{old_wrote / wrote:.1f}"
        )


if __name__ == "__main__":
    main()
