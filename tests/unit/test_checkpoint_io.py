"""Checkpoint writing without a model: background saves equal synchronous ones, failures surface,
keep-last, and truncated/tampered safetensors files are refused by name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megaformer.checkpoint import files as ckpt_files
from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import save as ckpt_save
from megaformer.checkpoint import weights as ckpt_weights
from megaformer.checkpoint.safe_load import install_safe_checkpoint_engine, safe_torch_load
from megaformer.checkpoint.safetensors_check import read_header
from megaformer.errors import CheckpointError


class FakeEngine:
    """Stands in for DeepSpeed's engine: a text file, and a state with tied (shared) tensors
    through megaformer's checkpoint engine, as DeepSpeed writes its files."""

    def __init__(self) -> None:
        install_safe_checkpoint_engine(self)
        self.weight = torch.arange(6.0)

    def save_checkpoint(self, root: str, tag: str, client_state: dict, save_latest: bool) -> None:
        (Path(root) / tag).mkdir(parents=True, exist_ok=True)
        (Path(root) / tag / "engine.txt").write_text(json.dumps(client_state))
        state = {"module": {"a": self.weight, "tied": self.weight}, "step": client_state}
        self.checkpoint_engine.save(state, str(Path(root) / tag / "states.pt"))
        self.weight.add_(1)  # the next step changes the live tensor: the save must not see it


def snapshot(step: int):
    def files(tmp: Path, memo) -> dict:
        g = torch.Generator().manual_seed(step)
        return {
            "model.safetensors": {"w": torch.randn(64, 32, generator=g)},
            "optimizer/stage_00.safetensors": {"w/master": torch.randn(64, 32, generator=g)},
            "meta.json": json.dumps({"step": step}),
        }

    return files


def save(run: Path, step: int, background=None, keep_last=None) -> Path:
    return ckpt_save.save_checkpoint(
        FakeEngine(),
        run,
        step,
        rank=0,
        world_size=1,
        client_state={"step": step},
        snapshot=snapshot(step),
        keep_last=keep_last,
        barrier=lambda: None,
        background=background,
    )


def digest(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file() and "rng" not in f.parts
    }


def test_background_save_writes_what_a_synchronous_save_writes(tmp_path):
    sync_ckpt = save(tmp_path / "sync", 3)
    writer = ckpt_files.BackgroundWriter()
    bg = [save(tmp_path / "bg", step, background=writer, keep_last=2) for step in (1, 2, 3)]
    writer.wait()
    assert not writer.busy()
    # torch's legacy pickle format names storages by address: compare states.pt by content
    # 6 files: engine.txt, states.pt, model.safetensors, optimizer/, meta.json and the README
    assert digest(bg[-1]).keys() == digest(sync_ckpt).keys() and len(digest(sync_ckpt)) == 6
    assert all(digest(bg[-1])[k] == v for k, v in digest(sync_ckpt).items() if k != "states.pt")
    state, ref = (safe_torch_load(str(c / "states.pt")) for c in (bg[-1], sync_ckpt))
    assert torch.equal(state["module"]["a"], ref["module"]["a"]) and state["step"] == {"step": 3}
    assert state["module"]["a"].data_ptr() == state["module"]["tied"].data_ptr()  # still tied
    root = tmp_path / "bg" / "checkpoints"
    assert [p.name for p in ckpt_layout.complete_checkpoints(root)] == [
        "step_0000002",
        "step_0000003",
    ]
    assert (root / "latest").read_text().strip() == "step_0000003"
    assert not list(root.glob(".tmp-*")) and not list(root.rglob("*.partial"))


def test_background_failure_surfaces_at_the_next_check(tmp_path):
    writer = ckpt_files.BackgroundWriter()

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(fail, "checkpoint X")
    writer._thread.join()
    with pytest.raises(
        CheckpointError, match="writing checkpoint X failed: OSError.*No space left"
    ):
        writer.check()
    writer.check()  # reported once


def test_background_seal_waits_for_other_ranks_files(tmp_path):
    """Rank 0 seals only when every rank's thread is done (rank 1 never is here)."""
    writer = ckpt_files.BackgroundWriter()
    ckpt = ckpt_save.save_checkpoint(
        FakeEngine(),
        tmp_path,
        5,
        rank=0,
        world_size=2,
        client_state={},
        snapshot=snapshot(5),
        keep_last=None,
        barrier=lambda: None,
        background=writer,
        wait_timeout_s=0.3,
    )
    with pytest.raises(CheckpointError, match=r"did not write.*\.rank_1\.done"):
        writer.wait()
    assert not ckpt.exists()  # never sealed: not a checkpoint


def test_truncated_and_tampered_files_are_named(tmp_path):
    f = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(3)}, str(f))
    assert set(read_header(f)) >= {"a", "b"}
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    cases = {
        "truncated": data[:-4],
        "grown": data + b"\0" * 8,
        "shape edited": data[:8] + data[8 : 8 + n].replace(b"[4,4]", b"[4,5]") + data[8 + n :],
        "header cut": data[:20],
        "empty": b"",
    }
    for why, bad in cases.items():
        f.write_bytes(bad)
        with pytest.raises(CheckpointError, match=r"x.safetensors: truncated or tampered"):
            read_header(f)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated or tampered"):
        ckpt_weights.load_weights(ckpt)


def rank0_fsyncs(tmp_path: Path, monkeypatch, world: int, background: bool) -> int:
    """os.fsync calls on rank 0 during a sharded save of ``world`` ranks (the other ranks'
    shard and RNG files appear, already flushed by their writers, while rank 0 waits)."""
    run = tmp_path / f"w{world}-{background}"

    def others_write() -> None:
        tmp = run / "checkpoints" / ".tmp-step_0000001"
        if (tmp / "state").is_dir():
            for r in range(1, world):
                (tmp / "state" / f"rank_{r:05d}.safetensors").write_bytes(b"x")
                (tmp / "rng" / f"rank_{r}.pt").write_bytes(b"x")

    def files(tmp: Path, memo) -> dict:
        return {
            "state/rank_00000.safetensors": {"w/master/0": torch.ones(4)},
            "meta.json": json.dumps({"step": 1}),
        }

    calls = []
    real = ckpt_files.os.fsync
    monkeypatch.setattr(ckpt_files.os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])

    def agree(ok: bool) -> bool:
        others_write()
        return ok

    writer = ckpt_files.BackgroundWriter() if background else None
    ckpt = ckpt_save.save_checkpoint(
        FakeEngine(),
        run,
        1,
        rank=0,
        world_size=world,
        client_state={},
        snapshot=files,
        keep_last=None,
        barrier=others_write,
        engine_files=False,
        background=writer,
        thread_sync=agree if background else None,
    )
    if writer is not None:
        writer.wait()
    assert ckpt.is_dir() and len(list((ckpt / "state").iterdir())) == world
    return len(calls)


@pytest.mark.parametrize("background", [False, True])
def test_rank0_fsyncs_per_save_do_not_grow_with_the_world(tmp_path, monkeypatch, background):
    """Each rank flushes its own files; rank 0 flushes its files and the folders: the same
    count at 2, 4 and 512 ranks (it was 2 per rank, 1,033 at 512 ranks)."""
    counts = [rank0_fsyncs(tmp_path, monkeypatch, w, background) for w in (2, 4, 512)]
    assert counts[0] == counts[1] == counts[2] <= 12, counts
