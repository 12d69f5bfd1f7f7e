"""Checkpoint save/load throughput beside raw writes of the same tensors, and the training stall.

    python tools/bench_checkpoint.py [--d-model 768] [--layers 6] [--vocab 32000] [--dir DIR]

One process (DeepSpeed on CPU, ZeRO-0, fp32) builds a Llama-style model of a few hundred MB, takes
one training step (so Adam's moments exist), and times on the same disk, fsync included everywhere:

* raw ``torch.save`` and ``safetensors.save_file`` of the tensors a checkpoint holds (weights,
  fp32 master weights, both Adam moments), and loading them back (``torch.load(weights_only=True)``,
  ``safetensors.torch.load`` of the file's bytes: ``load_file`` maps lazily and reads nothing);
* megaformer's full synchronous save (``Trainer.save``: DeepSpeed's engine files + RNG +
  ``model.safetensors`` + the layout-free ``optimizer/`` state + config/tokenizer/meta, sealed);
* the layout-free part alone (snapshot + write of ``optimizer/stage_00.safetensors``);
* loads: DeepSpeed's exact resume (``load_engine_state``) and the layout-free one (read every
  tensor + set master weights and moments);
* the training stall of a save: ``Trainer.save`` returning, with ``checkpoint.async_save`` off and on
  (and, for async, how long the background write took).

GB/s counts the bytes each path writes/reads; ratios are megaformer's GB/s over raw safetensors'.
Loads read from the page cache (the files were just written); a cold-cache load is disk-bound.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() \
        else path.stat().st_size


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def build_trainer(args: argparse.Namespace, run_dir: Path, async_save: bool):
    from megaformer.config import load_config
    from megaformer.training.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "quickstart.yaml", [
        f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", "model.n_heads=12",
        "model.n_kv_heads=12", f"model.vocab_size={args.vocab}", "model.max_seq_len=64",
        "data.source=stdlib", "data.max_bytes=200000", "train.steps=2",
        "train.micro_batch_size=1", "train.global_batch_size=1", "eval.interval=0",
        "checkpoint.interval=0", "log.progress_bar=false", "log.tensorboard=false",
        "log.sample_tokens=0", f"checkpoint.async_save={str(async_save).lower()}"])
    trainer = Trainer(cfg, run_dir)
    trainer.setup()
    trainer.train_step()
    return trainer


def raw_tensors(trainer) -> dict[str, torch.Tensor]:
    """What a checkpoint holds: weights, masters, both moments (fp32, whole)."""
    from megaformer.checkpoint import portable

    out = {f"weights/{k}": v.detach().clone() for k, v in trainer.full_weights().items()}
    out.update(portable.snapshot_portable_state(trainer.engine, trainer._local_params(),
                                                trainer.topo, trainer.cfg.model.vocab_size))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    base = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    from safetensors.torch import load as safetensors_load
    from safetensors.torch import save_file

    from megaformer.checkpoint import io as ckpt_io
    from megaformer.checkpoint import portable

    rows: list[tuple[str, float, int]] = []  # (what, seconds, bytes)
    try:
        trainer = build_trainer(args, base / "sync", async_save=False)
        tensors = raw_tensors(trainer)
        n_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"model: {sum(p.numel() for p in trainer.plain_model.parameters()) / 1e6:.1f} M "
              f"parameters; checkpoint tensors {n_bytes / 1e9:.2f} GB (weights + master + 2 moments)")

        raw_pt, raw_st = base / "raw.pt", base / "raw.safetensors"
        t, _ = _timed(lambda: (torch.save(tensors, raw_pt), _fsync(raw_pt)))
        rows.append(("save: raw torch.save", t, _size(raw_pt)))
        t, _ = _timed(lambda: (save_file(tensors, str(raw_st)), _fsync(raw_st)))
        rows.append(("save: raw safetensors", t, _size(raw_st)))
        raw_save = rows[-1]

        t, ckpt = _timed(trainer.save)
        rows.append(("save: megaformer full (sync)", t, _size(ckpt)))
        lf_dir = base / "layout_free"

        def layout_free_save() -> None:
            state = portable.snapshot_portable_state(trainer.engine, trainer._local_params(),
                                                     trainer.topo, trainer.cfg.model.vocab_size)
            ckpt_io.write_payload(lf_dir / portable.stage_file(0), state)

        t, _ = _timed(layout_free_save)
        rows.append(("save: megaformer layout-free part", t, _size(lf_dir)))

        t, _ = _timed(lambda: torch.load(raw_pt, weights_only=True))
        rows.append(("load: raw torch.load(weights_only)", t, _size(raw_pt)))
        # safetensors.load_file maps the file lazily (nothing read until used): read every byte
        t, _ = _timed(lambda: safetensors_load(raw_st.read_bytes()))
        rows.append(("load: raw safetensors", t, _size(raw_st)))
        raw_load = rows[-1]
        ds_bytes = sum(_size(f) for f in ckpt.glob("*.pt")) + _size(ckpt / "rng")
        t, _ = _timed(lambda: ckpt_io.load_engine_state(trainer.engine, ckpt, 0))
        rows.append(("load: megaformer DeepSpeed exact", t, ds_bytes))

        def layout_free_load() -> None:
            state = portable.PortableState(ckpt)
            portable.restore_portable_state(trainer.engine, trainer._local_params(), trainer.topo,
                                            trainer.plain_model.padded_vocab_size, state, ckpt)

        t, _ = _timed(layout_free_load)
        rows.append(("load: megaformer layout-free", t, _size(ckpt / portable.STATE_DIR)))

        trainer.step += 1
        stall_sync, _ = _timed(trainer.save)
        trainer.writer = ckpt_io.BackgroundWriter()
        trainer.step += 1
        stall_async, _ = _timed(trainer.save)
        t0 = time.perf_counter()
        trainer.writer.wait()
        background = time.perf_counter() - t0 + stall_async
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(f"\n{'path':40s} {'GB':>6s} {'s':>7s} {'GB/s':>6s} {'vs raw safetensors':>19s}")
    for what, t, b in rows:
        ref = raw_save if what.startswith("save") else raw_load
        ratio = (b / t) / (ref[2] / ref[1])
        print(f"{what:40s} {b / 1e9:6.2f} {t:7.2f} {b / 1e9 / t:6.2f} {ratio:19.2f}")
    print(f"\ntraining stall of one save: sync {stall_sync:.2f} s | async {stall_async:.2f} s "
          f"(background write done after {background:.2f} s) | stall ratio async/sync "
          f"{stall_async / stall_sync:.2f}")


if __name__ == "__main__":
    main()
