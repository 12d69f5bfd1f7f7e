"""One object in front of saving and resuming a run: :class:`Checkpointer`.

A run resumes from the checkpoint ``RUN_DIR/checkpoints/latest`` names, in one of four ways, chosen
once when the checkpointer is made:

=============  =====================================================  ==========================
kind           what it restores                                       from
=============  =====================================================  ==========================
``weights``    the weights only: fresh optimizer, step 0              ``model.safetensors``
                                                                      (``megaformer convert``)
``sharded``    weights, optimizer state, schedule, data position, RNG ``state/`` (:mod:`.sharded`),
               (RNG only at the saved layout); at any layout          any layout
``portable``   the same, at a layout other than the saved one         first release's ``optimizer/``
                                                                      (:mod:`.legacy.portable`)
``engine``     everything, at the saved layout                        DeepSpeed's files
                                                                      (:mod:`.legacy.engine_files`)
=============  =====================================================  ==========================

The model is built from the checkpoint's weights (each rank reads only its shard), so resuming
has two halves around building the model and the engine::

    ckpt = Checkpointer(cfg, run_dir, world_size, rank)     # which checkpoint, which kind, checks
    model = build_model(..., *ckpt.model_weights())         # weights (None: from the seed)
    ckpt.attach(cfg, topo, Trained(engine, scheduler, ...)) # collective
    state = ckpt.resume()                                   # TrainState | None (a fresh run)
    ...
    ckpt.save(TrainState(step, consumed_samples, skipped))  # collective; per checkpoint.interval
    ckpt.wait()                                             # the background write, if any

Saving writes the sharded format (fp16: DeepSpeed's files, whose loss scaler lives there), with
``checkpoint.async_save`` on a background thread after a synchronous host copy of each rank's shard
(on an accelerator into one pinned arena per rank, :mod:`.staging`). The save's own collectives run
on a group that takes host tensors (:func:`megaformer.runtime.collectives.host_group`).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megaformer import __version__
from megaformer.checkpoint import sharded
from megaformer.checkpoint.compat import (
    check_resume_compatible,
    layout_changes,
    optimizer_changed,
)
from megaformer.checkpoint.files import BackgroundWriter
from megaformer.checkpoint.index_checks import check_data_position
from megaformer.checkpoint.layout import (
    CHECKPOINTS,
    CONFIG,
    META,
    WEIGHTS,
    half_written,
    is_weights_only,
    latest_checkpoint,
    read_meta,
)
from megaformer.checkpoint.legacy import portable
from megaformer.checkpoint.legacy.engine_files import load_engine_state
from megaformer.checkpoint.optimizer_state import OptimizerAccess, restore_schedule
from megaformer.checkpoint.rng import load_rng_state
from megaformer.checkpoint.router_state import load_router_state, router_files, set_router_state
from megaformer.checkpoint.save import save_checkpoint
from megaformer.checkpoint.sliced import SlicedWeights
from megaformer.checkpoint.staging import HostStaging
from megaformer.checkpoint.weights import expected_shapes
from megaformer.errors import CheckpointError
from megaformer.runtime.collectives import host_group

log = logging.getLogger("megaformer")


@dataclass
class TrainState:
    """Where training stands, beside the weights and the optimizer: optimizer steps taken,
    samples consumed (the data position), steps skipped as non-finite, FP8-demoted blocks."""

    step: int
    consumed_samples: int
    skipped_steps: int = 0
    fp8_demoted: tuple[int, ...] = ()  # blocks per-layer FP8 demotion switched to high precision


@dataclass
class Trained:
    """What a save reads and a resume fills, once the engine exists.

    ``params()``: this rank's parameters once each under their plain-model names;
    ``full_weights()``: the whole weights on rank 0 (collective; for ``checkpoint.export_weights``);
    ``before_commit(step)``: runs on every rank once its files are written (fault injection)."""

    engine: Any
    scheduler: Any
    params: Callable[[], list[tuple[str, torch.nn.Parameter]]]
    padded_vocab: int
    tokenizer: Any = None
    tp_rng: Any = None
    full_weights: Optional[Callable[[], Optional[dict[str, torch.Tensor]]]] = None
    before_commit: Optional[Callable[[int], None]] = None


def resume_kind(ckpt: Optional[Path]) -> Optional[str]:
    """``weights``, ``sharded`` or the first release's format (``portable`` / ``engine``, told
    apart by the layout): see the module docstring. None without a checkpoint."""
    if ckpt is None:
        return None
    if is_weights_only(ckpt):
        return "weights"
    return "sharded" if sharded.has_sharded_state(ckpt) else "engine"


class Checkpointer:
    """Saves and resumes one run in ``run_dir`` (see the module docstring). Making one reads only
    files; :meth:`attach`, :meth:`resume` and :meth:`save` are collective."""

    def __init__(self, cfg: Any, run_dir: Path, world_size: int, rank: int) -> None:
        self.cfg, self.run_dir, self.world_size, self.rank = cfg, Path(run_dir), world_size, rank
        self.root = self.run_dir / CHECKPOINTS
        self.source = latest_checkpoint(self.root)
        if self.source is not None and not cfg.checkpoint.resume:
            raise CheckpointError(
                f"{run_dir} already holds checkpoints (latest "
                f"{self.source.name}); resume with checkpoint.resume=true "
                "or choose another --run-dir"
            )
        if self.source is not None:
            check_resume_compatible(cfg, self.source)
        self.kind = resume_kind(self.source)
        if self.kind == "engine" and cfg.train.optimizer != "adamw":
            raise CheckpointError(
                f"{self.source}: holds DeepSpeed's AdamW files, train.optimizer="
                f"{cfg.train.optimizer} cannot resume from them; start a new run from its "
                "weights (model.init_from or a weights-only checkpoint)"
            )
        if self.kind == "engine" and cfg.parallel.expert > 1:
            raise CheckpointError(
                f"{self.source}: parallel.expert={cfg.parallel.expert} "
                "resumes from a sharded checkpoint only (this one holds "
                "DeepSpeed's per-rank files); resume with parallel.expert=1"
            )
        # what about the layout changed in a way DeepSpeed's per-rank files cannot load
        self.changes: list[str] = []
        if self.kind == "sharded":
            self.changes = layout_changes(cfg, self.source, world_size)
        elif self.kind == "engine":
            self.changes = portable.relayout_changes(cfg, self.source, world_size)
            if self.changes:
                self.kind = "portable"
        self.writer = BackgroundWriter() if cfg.checkpoint.async_save else None
        self._saved: Any = None  # the opened state the model was built from, until resume()
        self.topo: Any = None
        self.trained: Optional[Trained] = None
        self.group: Any = None
        self.thread_group: Any = None
        self.staging: Optional[HostStaging] = None

    # ------------------------------------------------------------------------- resume

    def half_written(self) -> list[Path]:
        """Saves that did not complete (``.tmp-`` folders; never loaded)."""
        return half_written(self.root)

    def latest(self) -> Optional[Path]:
        return latest_checkpoint(self.root)

    def model_weights(self, model_cfg: Any, topo: Any = None) -> tuple[Any, Any]:
        """(weights, where they come from) to build this rank's model from: None for a fresh
        run; else a reader of this rank's shards of the checkpoint's ``model.safetensors`` or
        sharded state (each rank reads only its own; with ``topo``, a sharded state's shards once
        per replica group, exchanged within it: :meth:`ShardedState.share`), or of the Hugging Face
        folder ``model.init_from`` (a fresh run), or the first release's layout-free masters."""
        ckpt = self.source
        if self.kind is None and model_cfg.init_from is not None:
            from megaformer.checkpoint.hf.init_from import hf_weights

            return hf_weights(model_cfg)
        if self.kind == "weights":
            return SlicedWeights.checkpoint(ckpt, model_cfg), ckpt
        if self.kind == "sharded":
            self._saved = sharded.ShardedState(ckpt)
            self._saved.check_model(expected_shapes(model_cfg))
            if topo is not None:  # experts are identical only within an expert-data group
                self._saved.share(topo.groups.edp if topo.ep > 1 else topo.groups.replica)
            return self._saved, self._saved.folder
        if self.kind == "portable":
            self._saved = portable.PortableState(ckpt)
            return self._saved.masters(), ckpt / portable.STATE_DIR
        return None, None

    def attach(self, cfg: Any, topo: Any, trained: Trained) -> None:
        """Collective: the engine and what goes with it, the config as resolved once the data is
        known (the vocabulary size), and the group of the save's collectives."""
        self.cfg, self.topo, self.trained = cfg, topo, trained
        minutes = self.cfg.parallel.collective_timeout_minutes
        self.group = host_group(datetime.timedelta(minutes=minutes))
        dist = torch.distributed
        if self.writer is not None and dist.is_initialized() and dist.get_world_size() > 1:
            # the writer threads' own group: they meet once per save while training goes on
            self.thread_group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(minutes=minutes)
            )
        if trained.engine is not None and _on_accelerator(trained.engine):
            self.staging = HostStaging()

    def resume(self) -> Optional[TrainState]:
        """Restore the run's state into the attached engine (and the RNG streams when the layout
        is the saved one). None for a fresh run or one seeded with weights only (step 0)."""
        if self.kind is None:
            if self.cfg.model.init_from is not None:
                log.info(
                    "starting from the weights of %s (fresh optimizer, step 0)",
                    self.cfg.model.init_from,
                )
                from megaformer.checkpoint.hf.init_from import hf_router_state

                set_router_state(  # the expert biases stored with the weights (DeepSeek-V3)
                    self.trained.engine.module,
                    hf_router_state(self.cfg.model),
                    self.cfg.model.init_from,
                )
            return None
        if self.kind == "weights":
            log.info("starting from the weights of %s (fresh optimizer, step 0)", self.source)
            load_router_state(self.trained.engine.module, self.source)  # converted expert biases
            return None
        state = {
            "sharded": self._resume_sharded,
            "portable": self._resume_portable,
            "engine": self._resume_engine,
        }[self.kind]()
        self._saved = None  # the readers' open files are released
        load_router_state(self.trained.engine.module, self.source)  # MoE aux-loss-free biases
        return state

    def _restore_rng(self, rng: dict) -> None:
        if self.trained.tp_rng is not None and "tensor_parallel" in rng:
            self.trained.tp_rng.load_state_dict(rng["tensor_parallel"])

    def _resumed(self, state: TrainState, how: str) -> TrainState:
        if self.changes:
            log.warning(
                "resumed from %s at a new layout (%s; step %d, %s samples consumed)%s; RNG "
                "streams are per rank and do not carry over, so dropout masks differ from "
                "the saved layout's continuation",
                self.source,
                ", ".join(self.changes),
                state.step,
                f"{state.consumed_samples:,}",
                how,
            )
        else:
            log.info(
                "resumed from %s (step %d, %s samples consumed)",
                self.source,
                state.step,
                f"{state.consumed_samples:,}",
            )
        return state

    def _resume_sharded(self) -> TrainState:
        """Master weights (already in the model), the optimizer's state (Adam's moments, Muon's
        momentum; none with ``train.optimizer_reset``) and step count from this rank's part of
        the sharded state, at whatever layout this run has; the LR schedule and data position from
        meta.json; every rank's RNG streams when the layout is the saved one."""
        ckpt, saved, t = self.source, self._saved, self.trained
        state = self._position(read_meta(ckpt), ckpt / META)
        access = OptimizerAccess(t.engine, self.topo)
        params = t.params()
        if not access.covered(params):
            raise CheckpointError(
                f"{ckpt}: its sharded state cannot be loaded into this "
                f"optimizer ({type(t.engine.optimizer).__name__}); resume "
                "with train.precision bf16 or fp32"
            )
        reset = self.cfg.train.optimizer_reset
        if saved.optimizer != access.name and not reset:
            raise CheckpointError(optimizer_changed(ckpt, saved.optimizer, access.name))
        access.prepare(0.0 if reset else saved.adam_step)
        # ZeRO 1/2/3: the moments' owned ranges are disjoint over the replica group, read as
        # they are; the master weights' pieces were read for the model build, exchanged again.
        # ZeRO-0 holds whole shards: each is read once per group and exchanged. Muon under
        # ZeRO-1/2: each parameter's state is read by its owner alone.
        owned = access.owned(params, self.cfg.model.vocab_size, for_save=False)
        for o in owned:
            for key in ("master",) if reset else ("master", *access.keys(o.param)):
                if key != "master" and not access.holds(o.param):
                    continue
                if key not in saved.keys_of(o.name):
                    raise CheckpointError(
                        f"{ckpt}: {o.name} was saved without {key} (another split between "
                        "Muon and AdamW?); resume with the checkpoint's train settings or "
                        "train.optimizer_reset=true"
                    )
                shared = key == "master" or (access.plain and not access.distributed)
                access.set_owned(
                    o, key, saved.fill_shared(o, key) if shared else saved.fill(o, key)
                )
        if reset:
            log.warning(
                "%s: optimizer state not loaded (train.optimizer_reset=true): %s starts from zero",
                ckpt,
                access.name,
            )
        self._log_reads(saved, owned)
        restore_schedule(t.engine, t.scheduler, state.step, self.cfg.train.global_batch_size)
        if not self.changes:
            self._restore_rng(load_rng_state(ckpt, self.rank))
        return self._resumed(state, "")

    def _log_reads(self, saved: sharded.ShardedState, owned: list[sharded.Owned]) -> None:
        """Rank 0 logs the largest share of the saved state one rank read (ideal: 1 / world) and
        the largest ratio of a rank's read to its fair share: the state of the shards it holds
        (``owned``: whole for ZeRO-0, else its ranges, whose shards are whole on the
        :meth:`ShardedState.share` group) over the group's size, or 1 when it reads alone."""
        from megaformer.comm import size

        held = sum(
            math.prod(box[1])
            for o in owned
            for box, _, _ in replace(o, start=0, stop=math.prod(o.local_shape)).boxes()
        )
        per_element = saved.state_bytes() / max(sum(map(math.prod, saved.shapes.values())), 1)
        fair = per_element * held / (size(saved.group) if saved.group else 1)
        reads = self._gather_to_main((saved.bytes_read, saved.bytes_read / max(fair, 1.0)))
        if self.rank == 0:
            total = max(saved.state_bytes(), 1)
            log.info(
                "sharded state read per rank: at most %.1f%%, at least %.1f%% of %.1f MB "
                "(1/world = %.1f%%); at most %.3fx its shards' state over its replica group",
                100 * max(r for r, _ in reads) / total,
                100 * min(r for r, _ in reads) / total,
                total / 1e6,
                100 / len(reads),
                max(x for _, x in reads),
            )

    def _resume_portable(self) -> TrainState:
        """Master weights, Adam moments, LR schedule and data position from the first release's
        layout-free state (another layout than the saved one)."""
        ckpt, t = self.source, self.trained
        state = self._position(read_meta(ckpt), ckpt / META)
        portable.restore_portable_state(
            t.engine, t.params(), self.topo, t.padded_vocab, self._saved, ckpt
        )
        restore_schedule(t.engine, t.scheduler, state.step, self.cfg.train.global_batch_size)
        return self._resumed(state, " from its layout-free state")

    def _resume_engine(self) -> TrainState:
        """Everything from DeepSpeed's own files, at the saved layout."""
        client, rng = load_engine_state(self.trained.engine, self.source, self.rank)
        state = self._position(client, self.source)
        self._restore_rng(rng)
        return self._resumed(state, "")

    def _position(self, record: dict, where: Path) -> TrainState:
        """Step, samples consumed and skipped steps as saved, checked before they are used: a
        crafted record cannot move the data position beyond what the saved steps read."""
        step, skipped = record.get("step"), record.get("skipped_steps", 0)
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, skipped)
        ):
            raise CheckpointError(
                f"{where}: step {str(step)[:40]!r} / skipped_steps "
                f"{str(skipped)[:40]!r} are not non-negative integers"
            )
        consumed = check_data_position(
            step, record.get("consumed_samples"), self.cfg.train.global_batch_size, self.source
        )
        demoted = record.get("fp8_demoted", [])
        n = self.cfg.model.n_layers
        if not (
            isinstance(demoted, list)
            and len(demoted) <= n
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in demoted)
        ):
            raise CheckpointError(
                f"{where}: fp8_demoted {str(demoted)[:60]!r} is not a list of block indices"
            )
        return TrainState(step, consumed, skipped, tuple(sorted(set(demoted))))

    # ------------------------------------------------------------------------- save

    def save(self, state: TrainState) -> Optional[Path]:
        """Collective: checkpoint ``state`` with the attached engine's weights and optimizer.
        Returns the checkpoint's path (None when one of that step already exists). With
        ``checkpoint.async_save`` the files are written on a background thread after a
        synchronous host copy of each rank's shard."""
        cfg, t = self.cfg, self.trained
        if self.writer is not None:
            self.writer.wait()  # one save in flight at a time; raises if the last one failed
        consumed = state.consumed_samples
        meta = {
            "consumed_samples": consumed,
            "consumed_tokens": consumed * cfg.seq_len,
            "parallel": {
                "tensor": cfg.parallel.tensor,
                "pipeline": cfg.parallel.pipeline,
                "data": self.topo.dp,
                "expert": cfg.parallel.expert,
                "context": cfg.parallel.context,
                "sequence_parallel": cfg.parallel.sequence_parallel,
            },
            "zero_stage": cfg.parallel.zero_stage,
            "precision": cfg.train.precision,
            "fp8_demoted": list(state.fp8_demoted),
        }
        info = {
            "step": state.step,
            "consumed_samples": consumed,
            "layout": meta["parallel"],
            "lr": t.scheduler.get_last_lr(),
            "precision": cfg.train.precision,
        }
        access = OptimizerAccess(t.engine, self.topo)
        # fp16's loss scaler lives in DeepSpeed's files: that optimizer saves through them
        shard = cfg.train.precision != "fp16" and access.covered(t.params())
        if shard:  # taken now: an asynchronous save writes the index after training went on
            info["adam_step"] = access.adam_step()
            info["optimizer"] = access.name
        pieces: list = []
        t0 = time.perf_counter()
        path = save_checkpoint(
            t.engine,
            self.run_dir,
            state.step,
            rank=self.rank,
            world_size=self.world_size,
            client_state={
                "step": state.step,
                "consumed_samples": consumed,
                "skipped_steps": state.skipped_steps,
                "fp8_demoted": list(state.fp8_demoted),
            },
            snapshot=lambda tmp, memo: self._snapshot(
                tmp, memo, state, meta, access if shard else None, pieces
            ),
            keep_last=cfg.checkpoint.keep_last,
            barrier=self._barrier,
            group=self.group,
            extra_rng={"tensor_parallel": t.tp_rng.state_dict()} if t.tp_rng else None,
            background=self.writer,
            before_commit=(lambda: t.before_commit(state.step)) if t.before_commit else None,
            engine_files=not shard,
            before_seal=(lambda tmp: sharded.write_index(tmp, pieces, info)) if shard else None,
            thread_sync=self._threads_agree if self.thread_group is not None else None,
        )
        if path is not None and self.writer is None:
            log.info("saved checkpoint %s (%.2f s)", path, time.perf_counter() - t0)
        elif path is not None:
            log.info(
                "checkpoint %s: training stalled %.2f s for the host copy of each rank's "
                "shard; writing in the background",
                path.name,
                time.perf_counter() - t0,
            )
        return path

    def _snapshot(
        self,
        tmp: Path,
        memo: Optional[dict],
        state: TrainState,
        meta: dict,
        access: Optional[OptimizerAccess],
        pieces: list,
    ) -> dict[str, Any]:
        """This rank's share of a checkpoint's files, on the host (collective): its shard of the
        training state (``access``; None: DeepSpeed's files hold it), and on rank 0 the files
        that describe the checkpoint. Copies where ``memo`` is given (asynchronous save).
        ``pieces`` receives, on rank 0, every rank's description of its shard (for the index)."""
        cfg, t = self.cfg, self.trained
        files: dict[str, Any] = {}
        if access is not None:
            owned = access.owned(t.params(), cfg.model.vocab_size, for_save=True)
            tensors, where = sharded.snapshot(
                access, owned, copy=memo is not None, staging=self.staging
            )
            files[f"{sharded.STATE_DIR}/{sharded.rank_file(self.rank)}"] = sharded.rank_payload(
                tensors, where
            )
            pieces.extend(
                self._gather_to_main(
                    sharded.piece_description(
                        self.rank, tensors, where, owned, self.topo.tp, access.keys
                    )
                )
            )
        files.update(router_files(t.engine.module, self.topo))  # aux-loss-free biases
        weights = t.full_weights() if cfg.checkpoint.export_weights and t.full_weights else None
        if self.rank == 0:
            if weights is not None:  # full_weights() returns fresh tensors: already a snapshot
                files[WEIGHTS] = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
            files[CONFIG] = cfg.to_yaml()
            if t.tokenizer is not None:
                t.tokenizer.save(tmp / "tokenizer.json")
            full_meta = {
                "megaformer_version": __version__,
                "step": state.step,
                "world_size": self.world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "skipped_steps": state.skipped_steps,
                "state": "sharded" if access is not None else "deepspeed",
                **meta,
            }
            files[META] = json.dumps(full_meta, indent=2)  # last: marks it complete
        return files

    def _barrier(self) -> None:
        dist = torch.distributed
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier(group=self.group)

    def _threads_agree(self, ok: bool) -> bool:
        """The writer threads of all ranks meet once: True when every rank wrote its files."""
        flag = torch.tensor([1 if ok else 0])
        torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MIN, group=self.thread_group
        )
        return bool(flag.item())

    def _gather_to_main(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small, picklable) on rank 0, in rank order; [] elsewhere."""
        dist = torch.distributed
        if not dist.is_initialized():
            return [obj]
        out: Optional[list] = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out or []

    def check(self) -> None:
        """Raise a failed background save (CheckpointError); a no-op otherwise."""
        if self.writer is not None:
            self.writer.check()

    def wait(self) -> None:
        """Until the background save, if any, is written and sealed (raises if it failed)."""
        if self.writer is not None:
            self.writer.wait()


def _on_accelerator(engine: Any) -> bool:
    p = next(iter(engine.module.parameters()), None)
    return p is not None and p.device.type == "cuda"
