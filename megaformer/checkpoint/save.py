"""The collective save protocol: every rank writes its share into ``.tmp-step_N``, rank 0 seals.

Checkpoints hold the sharded training state (:mod:`.sharded`); fp16 runs also write DeepSpeed's own
files (its loss scaler lives there), loaded back only at the saved layout
(:mod:`.legacy.engine_files`). DeepSpeed's unpickling recovery scripts are not left in the folder.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megaformer import deepspeed_attrs
from megaformer.checkpoint.files import flush_own_files, seal, wait_for, write_payload
from megaformer.checkpoint.layout import (
    CHECKPOINTS,
    README,
    README_TEXT,
    RECOVERY_SCRIPTS,
    TMP_PREFIX,
    tag_for,
)
from megaformer.checkpoint.rng import rng_file, save_rng_state
from megaformer.errors import CheckpointError
from megaformer.runtime.collectives import collective_device
from megaformer.safe_files import make_dir, refuse_link

log = logging.getLogger("megaformer")


def save_checkpoint(
    engine: Any,
    run_dir: Path,
    step: int,
    *,
    rank: int,
    world_size: int,
    client_state: dict,
    snapshot: Callable[[Path, Optional[dict]], dict[str, Any]],
    keep_last: Optional[int],
    barrier: Any,
    extra_rng: Optional[dict] = None,
    background: Any = None,
    wait_timeout_s: float = 1800.0,
    before_commit: Optional[Callable[[], None]] = None,
    engine_files: bool = True,
    before_seal: Optional[Callable[[Path], None]] = None,
    group: Any = None,
    thread_sync: Optional[Callable[[bool], bool]] = None,
) -> Optional[Path]:
    """Collective: every rank calls it. Returns the checkpoint path (None if it already existed).

    Synchronous on every rank: DeepSpeed's ``engine.save_checkpoint``, the RNG files, and
    ``snapshot(tmp_dir, memo)`` -> {relative path: tensors (on the host) or text}, this rank's
    share of the remaining files (``memo``: None for a synchronous save, else the host copies
    already taken, by tensor view, to share instead of copying twice). Those are then written,
    flushed and renamed into place; rank 0 seals the checkpoint (fsync, rename, ``latest``,
    keep-last) once every rank is done.

    With ``background`` (a :class:`BackgroundWriter`) the writing runs on its thread and training
    continues: DeepSpeed's files too, when its checkpoint engine is megaformer's (it then keeps a
    host copy of each state instead of writing it); each rank's thread ends by writing
    ``.rank_N.done``, and rank 0's thread seals once all of them exist. Without it, in line,
    with barriers.

    ``before_commit`` runs on every rank once its files are written, before the checkpoint is
    sealed (the fault-injection tests kill a rank there). ``engine_files=False``: DeepSpeed's own
    files are not written (the state is all in ``snapshot``'s files). ``before_seal(tmp)`` runs on
    rank 0 once every rank's files exist, before the seal (it writes what describes them all).
    ``group``: the process group of the save's own collectives (default: the default group);
    ``barrier`` must be a barrier on it. ``thread_sync(ok)``: a collective of the writer threads
    (on a group of their own) that is True when every rank's ``ok`` is: with it, the background
    threads meet once instead of rank 0 polling every rank's done-marker."""
    if background is not None:
        background.wait()  # the previous save is sealed (or its failure raised) first
    root = run_dir / CHECKPOINTS
    tag = tag_for(step)
    final = root / tag
    tmp = root / f"{TMP_PREFIX}{tag}"
    # rank 0's answer for all: on the group's device (NCCL takes no host tensor)
    exists = torch.tensor([1 if final.exists() else 0], device=collective_device(group))
    if torch.distributed.is_initialized():
        torch.distributed.broadcast(exists, src=0, group=group)
    if exists.item():
        if rank == 0:
            log.warning("checkpoint %s already exists; not overwriting it", final)
        return None
    if rank == 0:
        make_dir(root)
        refuse_link(tmp)
        if tmp.exists():  # left by an interrupted save of ours: never a complete checkpoint
            shutil.rmtree(tmp)
    barrier()
    ds_files = deepspeed_attrs.checkpoint_engine(engine)
    defer = engine_files and background is not None and hasattr(ds_files, "take_pending")
    memo: Optional[dict] = {} if background is not None else None
    if defer:
        ds_files.deferring = True
        ds_files.memo = memo
    if engine_files:
        try:
            engine.save_checkpoint(
                str(root), tag=tmp.name, client_state=client_state, save_latest=False
            )
        finally:
            if defer:
                ds_files.deferring = False
    pending = ds_files.take_pending() if defer else []
    tmp.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        for script in RECOVERY_SCRIPTS:  # in case DeepSpeed copied them (they unpickle)
            (tmp / script).unlink(missing_ok=True)
        (tmp / README).write_text(README_TEXT)
    save_rng_state(tmp, rank, extra_rng)
    files = snapshot(tmp, memo)

    def write() -> None:
        for state, path in pending:
            ds_files.write_now(state, path)
        for rel, payload in files.items():
            if isinstance(payload, tuple):  # (tensors, safetensors metadata)
                write_payload(tmp / rel, *payload)
            else:
                write_payload(tmp / rel, payload)
        flush_own_files(tmp, rank, world_size, [rng_file(tmp, rank)], shared_tree=engine_files)

    if background is None:
        write()
        barrier()
        if before_commit is not None:
            before_commit()
        if rank == 0:
            if before_seal is not None:
                before_seal(tmp)
            seal(tmp, final, keep_last)
        barrier()
        return final

    def write_and_meet() -> None:
        try:
            write()
            if before_commit is not None:
                before_commit()
        except BaseException:
            thread_sync(False)  # type: ignore[misc]  # the other ranks must not wait in vain
            raise
        if not thread_sync(True):  # type: ignore[misc]
            if rank == 0:
                raise CheckpointError(
                    f"{tmp}: another rank failed to write its files; the checkpoint is not sealed"
                )
            return
        if rank == 0:
            if before_seal is not None:
                before_seal(tmp)
            seal(tmp, final, keep_last)
            log.info("saved checkpoint %s (in the background)", final)

    if thread_sync is not None:
        background.submit(write_and_meet, f"checkpoint {final}")
        return final

    markers = [f".rank_{r}.done" for r in range(world_size)]

    def write_and_seal() -> None:
        write()
        if before_commit is not None:
            before_commit()
        write_payload(tmp / markers[rank], "")
        if rank == 0:
            wait_for(tmp, markers, wait_timeout_s)
            for m in markers:
                (tmp / m).unlink()
            if before_seal is not None:
                before_seal(tmp)
            seal(tmp, final, keep_last)
            log.info("saved checkpoint %s (in the background)", final)

    background.submit(write_and_seal, f"checkpoint {final}")
    return final
