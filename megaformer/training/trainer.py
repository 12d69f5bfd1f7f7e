"""The training loop: DeepSpeed engine, periodic evaluation, logging, checkpoints, exact resume.

One optimizer step = ``grad_accum`` micro-batches per data-parallel rank::

    for each micro-batch (x, y):  loss = engine(x, y); engine.backward(loss); engine.step()

``engine.step()`` applies the update only at the accumulation boundary (DeepSpeed averages the
gradients over micro-batches and ranks, clips the global norm and steps the LR schedule). The logged
loss is the mean over the step's micro-batches and the data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megaformer import __version__
from megaformer.checkpoint import io as ckpt_io
from megaformer.checkpoint import portable
from megaformer.config import Config, config_from_dict, validate_for_world
from megaformer.data.dataset import TrainLoader, validation_batches
from megaformer.errors import CheckpointError, ConfigError
from megaformer.kernels import native
from megaformer.training import distributed as dist
from megaformer.training.bad_steps import BadStepCounter, guard_optimizer_step
from megaformer.training.faults import FaultPlan
from megaformer.training.host_allocator import configure_host_allocator
from megaformer.training.preemption import REASONS, StopRequest, agree_max
from megaformer.training.watchdog import StepWatchdog
from megaformer.training.data_setup import setup_data
from megaformer.training.deepspeed_config import build_deepspeed_config
from megaformer.training.metrics import METRICS_FILE, MetricsWriter, truncate_metrics
from megaformer.training.optimizer import build_optimizer
from megaformer.training.schedule import lr_lambda
from megaformer.analysis.params import count_parameters
from megaformer.parallel.pipeline import build_pipeline, original_names, pipeline_state_dict
from megaformer.parallel.plan import (full_state_dict, load_full_weights, padded_vocab_size,
                                      parallelize)
from megaformer.model.block import compile_blocks
from megaformer.training.recompute import apply_recompute
from megaformer.parallel.random import TensorParallelRNG
from megaformer.parallel.topology import build_topology, layout_groups

log = logging.getLogger("megaformer")


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    train_loss: float
    val_loss: Optional[float]
    unigram_loss: float
    tokens_per_s: float
    wall_s: float
    checkpoint: Optional[Path]
    sample: Optional[str]
    stopped: Optional[str] = None  # why the run stopped before train.steps (preemption, time)


def _quiet_known_warnings() -> None:
    # DeepSpeed's pipeline p2p moves activations with c10d broadcast inside autograd; torch warns
    # that broadcast_ has no autograd kernel. DeepSpeed routes the gradients itself (losses and
    # gradients equal one process: tests/test_pipeline.py).
    warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")


def setup_logging(run_dir: Path, rank: int, all_ranks: bool) -> None:
    logger = logging.getLogger("megaformer")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
    if rank == 0:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(h)
    if all_ranks:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(run_dir / "logs" / f"rank_{rank}.log")
        fh.setFormatter(logging.Formatter("%(asctime)s rank" + str(rank) + " %(message)s"))
        logger.addHandler(fh)
    try:
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
    except ImportError:
        pass


# Model keys that do not change the weights, so a resumed run may set them differently.
RESUME_MAY_CHANGE = {"dropout", "attention_dropout", "attention_backend", "init_std", "fused_kernels",
                     "loss_chunk_tokens", "document_mask"}
# Data keys that define the sample stream the saved position (consumed samples) indexes.
RESUME_DATA_KEYS = ("seq_len", "tokenizer", "source", "text_field", "max_bytes", "valid_fraction",
                    "paths", "weights", "split")


def _check_resume_compatible(cfg: Config, ckpt: Path) -> None:
    """The model a checkpoint holds must be the model the config describes."""
    import yaml

    try:
        saved = yaml.safe_load((ckpt / ckpt_io.CONFIG).read_text())
        saved_cfg = config_from_dict(saved)
    except (OSError, yaml.YAMLError, ConfigError) as e:
        raise CheckpointError(f"{ckpt}: its {ckpt_io.CONFIG} is missing or invalid ({e})") from None
    for f in dataclasses.fields(saved_cfg.model):
        new, old = getattr(cfg.model, f.name), getattr(saved_cfg.model, f.name)
        if f.name in RESUME_MAY_CHANGE or (f.name == "vocab_size" and new is None):
            continue
        if new != old:
            raise CheckpointError(f"model.{f.name}={new!r} differs from the checkpoint {ckpt} "
                                  f"({old!r}); use another --run-dir or the checkpoint's model")
    if ckpt_io.is_weights_only(ckpt):  # a fresh run from these weights: any data, any layout
        return
    for key in RESUME_DATA_KEYS:
        new, old = getattr(cfg.data, key), getattr(saved_cfg.data, key)
        if new != old:
            raise CheckpointError(
                f"data.{key}={new!r} differs from the checkpoint {ckpt} ({old!r}): the saved data "
                "position would point into another sample stream; resume with the checkpoint's "
                "data settings, or start a new run from its weights")


def _layout_changes(cfg: Config, ckpt: Path, world_size: int) -> list[str]:
    """What about the layout differs from the checkpoint's in a way DeepSpeed's per-rank files
    cannot load (empty: DeepSpeed's exact resume applies). A resharded checkpoint has no engine
    files at all."""
    meta = ckpt_io.read_meta(ckpt)
    if not meta.get("engine_state", True):
        return ["resharded offline (no engine state)"]
    saved = dict(meta.get("parallel", {}), zero_stage=meta.get("zero_stage"),
                 precision=meta.get("precision"))
    dp = world_size // (cfg.parallel.tensor * cfg.parallel.pipeline)
    now = {"tensor": cfg.parallel.tensor, "pipeline": cfg.parallel.pipeline, "data": dp,
           "zero_stage": cfg.parallel.zero_stage, "precision": cfg.train.precision}
    keys = ["tensor", "pipeline", "zero_stage", "precision"]
    if cfg.parallel.zero_stage > 0 or saved.get("zero_stage", 0) > 0:  # ZeRO files are per DP rank
        keys.append("data")
    return [f"{k} {saved[k]} -> {now[k]}" for k in keys
            if saved.get(k) is not None and saved[k] != now[k]]


def _relayout_changes(cfg: Config, ckpt: Path, world_size: int) -> list[str]:
    """The layout changes that need the layout-free resume (empty: DeepSpeed's own resume)."""
    changes = _layout_changes(cfg, ckpt, world_size)
    if changes and not portable.has_portable_state(ckpt):
        raise CheckpointError(
            f"{ckpt}: resuming with a different layout ({', '.join(changes)}) needs the "
            f"checkpoint's layout-free optimizer state ({portable.STATE_DIR}/{portable.STATE_JSON}), "
            "which it lacks; resume at the saved layout")
    return changes


def _precision_checks(cfg: Config, device: torch.device) -> None:
    if cfg.train.precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16: needs a CUDA device; use bf16 or fp32 on CPU")


def _resolve_vocab(cfg: Config, tokenizer_vocab: int) -> Config:
    v = cfg.model.vocab_size
    if v is None:
        v = tokenizer_vocab
    elif v < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={v}: smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab})")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=v))


def global_grad_norm(params: Any, tp_group: Any, pp_group: Any = None) -> float:
    """||g||_2 over the whole model: shards of tensor-parallel parameters summed over the TP
    group, replicated parameters counted once, pipeline stages summed over the PP group (the copy
    of a tied weight on the last stage skipped). Used when DeepSpeed does not report it."""
    from megaformer.parallel.comm import all_reduce, no_counting

    parts: dict[bool, list[torch.Tensor]] = {True: [], False: []}  # sharded? -> squared norms
    device = torch.device("cpu")
    for p in params:
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        device = p.grad.device
        parts[bool(getattr(p, "tensor_model_parallel", False))].append(
            p.grad.detach().double().pow(2).sum())
    # summed where the gradients live: no host sync per parameter on the training step
    sharded, replicated = (torch.stack(v).sum() if v else torch.zeros((), dtype=torch.float64,
                                                                        device=device)
                           for v in (parts[True], parts[False]))
    with no_counting():
        total = all_reduce(sharded, tp_group) + replicated
        if pp_group is not None:
            total = all_reduce(total, pp_group)
    return float(total.sqrt())


class Trainer:
    """Builds everything for one run and runs the loop; see :func:`train`."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.proc = dist.detect_process(cfg.train.device)
        self.grad_accum = validate_for_world(cfg, self.proc.world_size)
        _precision_checks(cfg, self.proc.device)
        if run_dir.exists() and not run_dir.is_dir():
            raise CheckpointError(f"--run-dir {run_dir}: exists and is not a directory")
        self.run_dir = run_dir
        self.resume_from = ckpt_io.latest_checkpoint(run_dir / ckpt_io.CHECKPOINTS)
        if self.resume_from is not None and not cfg.checkpoint.resume:
            raise CheckpointError(f"{run_dir} already holds checkpoints (latest "
                                  f"{self.resume_from.name}); resume with checkpoint.resume=true "
                                  "or choose another --run-dir")
        if self.resume_from is not None:
            _check_resume_compatible(cfg, self.resume_from)
        # A weights-only checkpoint (``megaformer convert``) seeds the model; nothing else resumes.
        self.init_only = self.resume_from is not None and ckpt_io.is_weights_only(self.resume_from)
        # Another layout: model and optimizer from the layout-free state, not DeepSpeed's files.
        self.relayout = (_relayout_changes(cfg, self.resume_from, self.proc.world_size)
                         if self.resume_from is not None and not self.init_only else [])
        from megaformer.kernels.attention import resolve_backend, trains_on_native_kernel

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        m = cfg.model
        self.attention_backend = resolve_backend(m.attention_backend, self.proc.device,
                                                 dtype[cfg.train.precision])
        if trains_on_native_kernel(m.attention_backend, self.proc.device, dtype[cfg.train.precision],
                                   m.head_dim, m.attention_dropout, m.document_mask,
                                   cfg.train.compile):
            self.attention_backend = ("native", "megaformer's native CPU FlashAttention-2 kernel; "
                                                "attention_backend=sdpa for torch's")
        self.cfg = cfg
        self.rank = self.proc.rank
        self.is_main = self.proc.is_main
        # Data-parallel coordinates: which slice of each global batch this rank reads.
        self.layout = layout_groups(self.proc.world_size, cfg.parallel.tensor, cfg.parallel.pipeline)
        self.layout.rank = self.proc.rank
        self.dp_rank, self.dp_size = self.layout.dp_rank, self.layout.dp

    # ------------------------------------------------------------------------- setup

    def setup(self) -> None:
        cfg = self.cfg
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        dist.init_distributed(self.proc, cfg.parallel.collective_timeout_minutes)
        self.topo = build_topology(self.proc.world_size, self.rank, cfg.parallel.tensor,
                                   cfg.parallel.pipeline)
        dist.barrier()
        setup_logging(self.run_dir, self.rank, cfg.log.all_ranks)
        _quiet_known_warnings()
        configure_host_allocator(cfg.train.cpu_malloc, self.proc.device)  # before anything allocates
        if self.proc.device.type == "cpu" and cfg.model.fused_kernels == "auto":
            log.info("%s", native.status())  # builds them on first use (cached), before step 1
        if self.is_main:
            for tmp in ckpt_io.half_written(self.run_dir / ckpt_io.CHECKPOINTS):
                log.warning("ignoring %s: a checkpoint save that did not complete", tmp)
        self.faults = FaultPlan.from_env(self.rank)
        self.tokenizer, data = setup_data(cfg, self.run_dir, self.rank, dist.barrier,
                                          self.resume_from)
        self.cfg = cfg = _resolve_vocab(cfg, self.tokenizer.vocab_size)
        self.train_set, self.valid_set = data.train, data.valid
        self.unigram = data.unigram(cfg.model.vocab_size)
        self.model = self._build_model()
        self._build_engine()
        self.step, consumed, skipped = 0, 0, 0
        if self.resume_from is not None and self.init_only:
            log.info("starting from the weights of %s (fresh optimizer, step 0)", self.resume_from)
        elif self.relayout:
            self.step, consumed = self._resume_relayout()
        elif self.resume_from is not None:
            client, rng = ckpt_io.load_engine_state(self.engine, self.resume_from, self.rank)
            if self.tp_rng is not None and "tensor_parallel" in rng:
                self.tp_rng.load_state_dict(rng["tensor_parallel"])
            self.step, consumed = int(client["step"]), int(client["consumed_samples"])
            skipped = int(client.get("skipped_steps", 0))
            log.info("resumed from %s (step %d, %s samples consumed)", self.resume_from,
                     self.step, f"{consumed:,}")
        self.loader = TrainLoader(self.train_set, cfg.train.micro_batch_size, self.grad_accum,
                                  self.dp_rank, self.dp_size, cfg.train.seed, consumed,
                                  prefetch=cfg.data.prefetch,
                                  stop_at=cfg.train.steps * cfg.train.global_batch_size)
        if self.is_main:
            ckpt_io.write_text_atomic(self.run_dir / "config.yaml", cfg.to_yaml())
            truncate_metrics(self.run_dir / METRICS_FILE, self.step)
        self.metrics = MetricsWriter(self.run_dir, self.is_main, cfg.log.tensorboard)
        self.diagnostics = self._build_diagnostics() if cfg.log.diagnostics else None
        self.writer = ckpt_io.BackgroundWriter() if cfg.checkpoint.async_save else None
        self.bad_steps = BadStepCounter(cfg.train.max_bad_steps, skipped)
        self._print_summary()

    def _build_diagnostics(self) -> Any:
        """Residual-stream diagnostics on the first validation micro-batch (same on every rank)."""
        from megaformer.diagnostics.training import DiagnosticsHook

        batch = next(iter(validation_batches(self.valid_set, self.cfg.train.micro_batch_size,
                                             1, 1, 0, 1)))
        return DiagnosticsHook(self.plain_model, batch, self.cfg.log.diagnostics_interval,
                               self.topo, self.engine.module if self.cfg.parallel.pipeline > 1 else None)

    def _build_model(self) -> torch.nn.Module:
        """The whole model from the seed on every rank (so TP=N starts from TP=1's weights), then
        the tensor-parallel plan keeps this rank's shards."""
        from megaformer.model.transformer import Transformer

        p = self.cfg.parallel
        padded = padded_vocab_size(self.cfg.model.vocab_size, p.tensor, p.vocab_multiple)
        torch.manual_seed(self.cfg.train.seed)
        model = Transformer(self.cfg.model, padded_vocab_size=padded)
        model.eod_id = self.tokenizer.eod_id  # document boundaries for model.document_mask
        if self.init_only:
            load_full_weights(model, ckpt_io.load_weights(self.resume_from), self.resume_from)
        elif self.relayout:
            self.portable = portable.PortableState(self.resume_from)
            load_full_weights(model, self.portable.masters(), self.resume_from / portable.STATE_DIR)
        torch.manual_seed(self.cfg.train.seed + 1)  # dropout stream, independent of init
        self.tp_rng = (TensorParallelRNG(self.cfg.train.seed, self.topo.tp_rank)
                       if p.tensor > 1 else None)
        parallelize(model, self.topo, p.sequence_parallel, self.tp_rng)
        apply_recompute(model.layers, self.cfg.train.recompute, self.cfg.train.recompute_every,
                        self.tp_rng)
        if self.cfg.train.compile:
            compile_blocks(model.layers)
        self.plain_model = model.to(self.proc.device)
        if p.pipeline == 1:
            return model
        self.param_names = original_names(model)
        return build_pipeline(model, self.topo, p.pipeline_partition, loss_fn=model.loss_fn)

    def _local_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        names = self.param_names if self.cfg.parallel.pipeline > 1 else None
        return portable.local_parameters(self.engine.module, names)

    def _resume_relayout(self) -> tuple[int, int]:
        """Master weights, Adam moments, LR schedule and data position from the layout-free state."""
        ckpt = self.resume_from
        meta = ckpt_io.read_meta(ckpt)
        step, consumed = int(meta["step"]), int(meta["consumed_samples"])
        portable.restore_portable_state(self.engine, self._local_params(), self.topo,
                                        self.plain_model.padded_vocab_size, self.portable, ckpt)
        portable.restore_schedule(self.engine, self.scheduler, step,
                                  self.cfg.train.global_batch_size)
        del self.portable
        log.warning("resumed from %s at a new layout (%s; step %d, %s samples consumed) from its "
                    "layout-free state; RNG streams are per rank and do not carry over, so dropout "
                    "masks differ from the saved layout's continuation", ckpt,
                    ", ".join(self.relayout), step, f"{consumed:,}")
        return step, consumed

    def _build_engine(self) -> None:
        import deepspeed

        from megaformer.checkpoint.safe_load import install_safe_checkpoint_engine

        optimizer = build_optimizer(self.model, self.cfg.train)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg.train))
        ds_config = build_deepspeed_config(self.cfg, self.grad_accum)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
            # a PipelineModule brings its own grid (same rank order as self.topo)
            mpu=self.topo if self.cfg.parallel.pipeline == 1 else None, dist_init_required=False)
        install_safe_checkpoint_engine(self.engine)
        self._grad_norm: Optional[float] = None
        if not hasattr(self.engine.optimizer, "_global_grad_norm"):
            self._record_grad_norm()

    def _record_grad_norm(self) -> None:
        """Without a ZeRO/bf16 optimizer DeepSpeed reports no gradient norm, and its fp32 clipping
        counts a pipeline-tied weight once per stage that holds it. megaformer measures the norm
        itself (:func:`global_grad_norm`) and clips with it: g <- g * min(1, c / (||g|| + 1e-6))."""
        engine = self.engine
        groups = (self.topo.group("tp"), self.topo.group("pp"))
        max_norm = self.cfg.train.grad_clip

        def measure() -> None:
            self._grad_norm = global_grad_norm(engine.module.parameters(), *groups)

        def measure_and_clip() -> None:
            measure()
            coef = max_norm / (self._grad_norm + 1e-6)
            if coef < 1:
                for p in engine.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)

        def norm_for_step() -> float:
            if max_norm == 0:  # otherwise clip_fp32_gradients measured it just before the step
                measure()
            assert self._grad_norm is not None
            return self._grad_norm

        if max_norm > 0:
            engine.clip_fp32_gradients = measure_and_clip
        # DeepSpeed steps this torch optimizer directly: megaformer skips a non-finite step itself
        guard_optimizer_step(engine.optimizer, norm_for_step)

    def _print_summary(self) -> None:
        cfg, p = self.cfg, self.proc
        counts = count_parameters(cfg.model)
        dp, tp, pp = self.dp_size, cfg.parallel.tensor, cfg.parallel.pipeline
        name, reason = self.attention_backend
        sp = " + sequence parallel" if cfg.parallel.sequence_parallel and cfg.parallel.tensor > 1 else ""
        log.info("megaformer: %s parameters (%s non-embedding; vocabulary %d padded to %d) | "
                 "world %d = DP %d x TP %d%s x PP %d | ZeRO %d | %s %s | attention %s (%s)",
                 f"{counts['total']:,}", f"{counts['non_embedding']:,}", cfg.model.vocab_size,
                 self.plain_model.padded_vocab_size, p.world_size, dp, tp, sp, pp,
                 cfg.parallel.zero_stage, p.device.type,
                 cfg.train.precision, name, reason)
        log.info("launch: %s, rank %d of %d, local rank %d, collective timeout %g min",
                 p.launcher, p.rank, p.world_size, p.local_rank,
                 cfg.parallel.collective_timeout_minutes)
        if p.world_size > 1:
            log.info(self.topo.summary())
        log.info("batch: %d sequences x %d tokens per step (micro %d x accumulation %d x DP %d) | "
                 "%d steps | run dir %s", cfg.train.global_batch_size, cfg.seq_len,
                 cfg.train.micro_batch_size, self.grad_accum, self.dp_size, cfg.train.steps,
                 self.run_dir)
        from megaformer.analysis.throughput import TrainingMeter

        self.meter = TrainingMeter.for_run(cfg, p.device, p.world_size)
        log.info(self.meter.summary())

    # ------------------------------------------------------------------------- steps

    def train_step(self) -> dict[str, Any]:
        engine, dev = self.engine, self.proc.device
        lr = self.scheduler.get_last_lr()[0]
        t0 = time.perf_counter()
        step = self.step + 1
        self.faults.step_start(step)
        micro_batches = self.loader.next_step()
        if self.cfg.parallel.pipeline > 1:
            # 1F1B over the micro-batches; the loss comes back averaged over them and over DP
            loss = engine.train_batch(iter(micro_batches)).detach().float()
        else:
            losses = []
            for i, (x, y) in enumerate(micro_batches):
                loss = engine(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))
                loss = self.faults.loss(step, i, loss)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach().float())
            loss = dist.all_reduce_mean(torch.stack(losses).mean(), self.topo.group("dp"))
        self.faults.mid_step(step)
        gn = self._grad_norm if self._grad_norm is not None else engine.get_global_grad_norm()
        grad_norm = float(gn) if gn is not None else float("nan")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        self.step = step
        # skipped by the optimizer (non-finite gradient norm), or a non-finite loss on this rank
        bad = not engine.was_step_applied() or not math.isfinite(float(loss))
        return {"loss": float(loss), "lr": lr, "grad_norm": grad_norm, "bad": bad,
                "step_time_s": time.perf_counter() - t0}

    @torch.no_grad()
    def evaluate(self) -> float:
        if self.cfg.parallel.pipeline > 1:
            return self._evaluate_pipeline()
        self.engine.eval()
        losses = [self.engine(x.to(self.proc.device), y.to(self.proc.device)).float()
                  for x, y in validation_batches(self.valid_set, self.cfg.train.micro_batch_size,
                                                 self.grad_accum, self.cfg.eval.iters, self.dp_rank,
                                                 self.dp_size)]
        self.engine.train()
        return float(dist.all_reduce_mean(torch.stack(losses).mean(), self.topo.group("dp")))

    def _evaluate_pipeline(self) -> float:
        batches = list(validation_batches(self.valid_set, self.cfg.train.micro_batch_size,
                                          self.grad_accum, self.cfg.eval.iters, self.dp_rank,
                                          self.dp_size))
        losses = []
        for it in range(self.cfg.eval.iters):
            chunk = batches[it * self.grad_accum:(it + 1) * self.grad_accum]
            losses.append(float(self.engine.eval_batch(iter(chunk))))  # mean over micro & DP
        return sum(losses) / len(losses)

    def save(self) -> Optional[Path]:
        """Collective. With ``checkpoint.async_save`` the files are written on a background
        thread after a synchronous snapshot (see :func:`megaformer.checkpoint.io.save_checkpoint`)."""
        if self.writer is not None:
            self.writer.wait()  # one save in flight at a time; raises if the last one failed
        consumed = self.loader.consumed_samples
        meta = {"consumed_samples": consumed, "consumed_tokens": consumed * self.cfg.seq_len,
                "parallel": {"tensor": self.cfg.parallel.tensor, "pipeline": self.cfg.parallel.pipeline,
                             "data": self.dp_size,
                             "sequence_parallel": self.cfg.parallel.sequence_parallel},
                "zero_stage": self.cfg.parallel.zero_stage, "precision": self.cfg.train.precision}
        info = {"step": self.step, "consumed_samples": consumed, "layout": meta["parallel"],
                "lr": self.scheduler.get_last_lr()}
        path = ckpt_io.save_checkpoint(
            self.engine, self.run_dir, self.step, rank=self.rank, world_size=self.proc.world_size,
            client_state={"step": self.step, "consumed_samples": consumed,
                          "skipped_steps": self.bad_steps.total},
            snapshot=lambda tmp, memo: self._snapshot(tmp, memo, meta, info),
            keep_last=self.cfg.checkpoint.keep_last, barrier=dist.barrier,
            extra_rng={"tensor_parallel": self.tp_rng.state_dict()} if self.tp_rng else None,
            background=self.writer, before_commit=lambda: self.faults.in_save(self.step))
        if path is not None and self.writer is None:
            log.info("saved checkpoint %s", path)
        return path

    def _snapshot(self, tmp: Path, memo: Optional[dict], meta: dict, info: dict) -> dict[str, Any]:
        """This rank's share of a checkpoint's files, on the host (collective); copies when
        ``memo`` is given (asynchronous save)."""
        weights = self.full_weights()
        state = portable.snapshot_portable_state(self.engine, self._local_params(), self.topo,
                                                 self.cfg.model.vocab_size, memo)
        files: dict[str, Any] = {}
        if state:  # this stage's writer
            files[portable.stage_file(self.topo.pp_rank)] = state
        if self.is_main:
            assert weights is not None
            # full_weights() returns fresh tensors: moving them to the host is the snapshot
            files[ckpt_io.WEIGHTS] = {k: v.detach().to("cpu").contiguous()
                                      for k, v in weights.items()}
            files[ckpt_io.CONFIG] = self.cfg.to_yaml()
            self.tokenizer.save(tmp / "tokenizer.json")
            full_meta = {"megaformer_version": __version__, "step": self.step,
                         "world_size": self.proc.world_size,
                         "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         "layout_free_state": state is not None, **meta}
            if state is not None:
                files[f"{portable.STATE_DIR}/{portable.STATE_JSON}"] = \
                    portable.portable_info(self.engine, info)
            files[ckpt_io.META] = json.dumps(full_meta, indent=2)  # last: marks it complete
        return files

    def full_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """Unsharded, unpadded weights (collective: every rank calls; rank 0 gets them)."""
        if self.cfg.parallel.zero_stage == 3:
            full = self.engine._zero3_consolidated_16bit_state_dict()
            if full is None:
                return None
            V = self.cfg.model.vocab_size
            return {k: (v[:V] if k in ("tok_embeddings.weight", "lm_head.weight") else v)
                    for k, v in full.items()
                    if not (k == "lm_head.weight" and self.cfg.model.tie_embeddings)}
        if self.cfg.parallel.pipeline > 1:
            return pipeline_state_dict(self.engine.module, self.param_names, self.topo,
                                       self.cfg.model.vocab_size)
        return full_state_dict(self.engine.module, self.topo)

    # ------------------------------------------------------------------------- loop

    def run(self) -> TrainResult:
        """Train to ``train.steps``; on a stop request (signal, time limit) agreed by all ranks at
        a step boundary, save a checkpoint and return early with ``stopped`` set."""
        cfg = self.cfg
        t_start = time.perf_counter()
        tokens_per_step = cfg.train.global_batch_size * cfg.seq_len
        bar = self._progress_bar()
        window: list[dict] = []
        val_loss: Optional[float] = None
        last_ckpt: Optional[Path] = None
        last: dict = {}
        stopped: Optional[str] = None
        train_time, train_tokens = 0.0, 0
        stop_request = StopRequest(cfg.train.exit_after_minutes)
        stop_request.install()
        watchdog = self._start_watchdog()
        try:
            while self.step < cfg.train.steps:
                if watchdog is not None:
                    watchdog.step_started(self.step + 1)
                last = self.train_step()
                if self.writer is not None:
                    self.writer.check()  # a failed background save stops the run at a step boundary
                # one all-reduce per step: any rank asked to stop? any rank's step non-finite?
                stop_code, bad = agree_max([stop_request.local_code(), int(last["bad"])])
                if watchdog is not None:
                    watchdog.step_finished()
                last["bad"] = bool(bad)
                window.append(last)
                train_time += last["step_time_s"]
                train_tokens += tokens_per_step
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{last['loss']:.3f}",
                                    tok_s=f"{tokens_per_step / last['step_time_s']:,.0f}")
                record: dict[str, Any] = {}
                if self.step % cfg.log.interval == 0 or self.step == cfg.train.steps or bad:
                    record = self._interval_record(window, tokens_per_step)
                    window = []
                self._count_bad_step(last, record, bar)
                if self.diagnostics is not None and self.diagnostics.due(self.step):
                    record = {**(record or {"step": self.step}), **self.diagnostics()}
                final = self.step == cfg.train.steps
                if not stop_code and ((cfg.eval.interval and self.step % cfg.eval.interval == 0)
                                      or (final and cfg.eval.at_end)):
                    val_loss = self.evaluate()
                    record = record or {"step": self.step}
                    record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50.0)))
                    self._console(f"step {self.step}: val loss {val_loss:.4f} | val ppl "
                                  f"{record['val_ppl']:.2f} | unigram baseline {self.unigram:.4f}", bar)
                if record:
                    self.metrics.write(record)
                    if bar is None and "loss" in record:
                        self._console(self._format(record), bar)
                if stop_code or (cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0) \
                        or (final and cfg.checkpoint.save_at_end):
                    last_ckpt = self.save() or last_ckpt
                if stop_code:
                    stopped = REASONS[stop_code]
                    self._console(f"step {self.step}: {stopped}: checkpoint saved, stopping "
                                  "(run the same command to resume)", bar)
                    break
            if self.writer is not None:
                self.writer.wait()
        finally:
            stop_request.uninstall()
            if watchdog is not None:
                watchdog.close()
            if bar is not None:
                bar.close()
            self.metrics.close()
        sample = self.sample() if stopped is None else None
        return TrainResult(self.run_dir, self.step, last.get("loss", float("nan")), val_loss,
                           self.unigram, train_tokens / train_time if train_time else 0.0,
                           time.perf_counter() - t_start, last_ckpt, sample, stopped)

    def _start_watchdog(self) -> Optional[StepWatchdog]:
        t = self.cfg.train
        if t.watchdog_factor == 0:
            return None
        return StepWatchdog(t.watchdog_factor, t.watchdog_min_seconds,
                            self.run_dir / "logs" / f"rank_{self.rank}.log", self.rank)

    def _count_bad_step(self, last: dict, record: dict, bar: Any) -> None:
        """Report a skipped step; too many in a row end the run (TrainingError, this step's metrics
        written first)."""
        if last["bad"]:
            self._console(f"step {self.step}: non-finite loss or gradient norm on some rank (loss "
                          f"{last['loss']:.4g}, grad norm {last['grad_norm']:.4g}): update skipped "
                          f"({self.bad_steps.consecutive + 1} in a row, {self.bad_steps.total + 1} in "
                          "total)", bar)
        latest = ckpt_io.latest_checkpoint(self.run_dir / ckpt_io.CHECKPOINTS) if last["bad"] else None
        try:
            self.bad_steps.record(self.step, last["bad"], str(latest) if latest else None)
        finally:
            if record:
                record["skipped_steps"] = self.bad_steps.total
                if self.bad_steps.consecutive >= self.bad_steps.max_consecutive:
                    self.metrics.write(record)  # the run ends with the error just raised

    def _interval_record(self, window: list[dict], tokens_per_step: int) -> dict:
        t = sum(w["step_time_s"] for w in window)
        good = [w["loss"] for w in window if not w["bad"]]
        record = {"step": self.step, "loss": sum(good) / len(good) if good else float("nan"),
                  "lr": window[-1]["lr"], "grad_norm": window[-1]["grad_norm"],
                  "tokens_per_s": tokens_per_step * len(window) / t, "step_time_s": t / len(window),
                  "consumed_tokens": self.loader.consumed_samples * self.cfg.seq_len}
        if getattr(self, "meter", None) is not None:  # tflops_per_gpu, [mfu, hfu], peak_mem_gb
            record.update(self.meter.record(t / len(window)))
        return record

    @staticmethod
    def _format(r: dict) -> str:
        return (f"step {r['step']}: loss {r['loss']:.4f} | lr {r['lr']:.3e} | grad norm "
                f"{r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tokens/s | "
                f"{r['step_time_s'] * 1000:.0f} ms/step"
                + (f" | {r['tflops_per_gpu']:.3g} TFLOP/s/GPU" if "tflops_per_gpu" in r else "")
                + (f" | MFU {100 * r['mfu']:.1f}% HFU {100 * r['hfu']:.1f}%" if "mfu" in r else "")
                + (f" | mem {r['peak_mem_gb']:.2f} GB" if "peak_mem_gb" in r else ""))

    def _progress_bar(self) -> Any:
        if not (self.is_main and self.cfg.log.progress_bar):
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.train.steps, initial=self.step, desc="train", unit="step",
                    dynamic_ncols=True, mininterval=0.5, file=sys.stderr)

    def _console(self, text: str, bar: Any) -> None:
        if not self.is_main:
            return
        if bar is not None:
            bar.write(text, file=sys.stdout)
        else:
            log.info(text)

    def sample(self) -> Optional[str]:
        """A short text sample from the trained weights (gathered on every rank, generated on 0)."""
        n = self.cfg.log.sample_tokens
        if n == 0:
            return None
        from megaformer.generation import generate_text
        from megaformer.model.transformer import Transformer

        weights = self.full_weights()
        if not self.is_main or weights is None:
            return None
        model = Transformer(self.cfg.model)
        if self.cfg.model.tie_embeddings:
            weights = {**weights, "lm_head.weight": weights["tok_embeddings.weight"]}
        model.load_state_dict({k: v.float() for k, v in weights.items()})
        model.to(self.proc.device).eval()
        return generate_text(model, self.tokenizer, self.cfg.log.sample_prompt, n,
                             temperature=0.8, top_k=40, seed=self.cfg.train.seed)


def train(cfg: Config, run_dir: Path) -> TrainResult:
    """Train ``cfg`` in ``run_dir`` (resuming from its latest checkpoint when there is one)."""
    trainer = Trainer(cfg, Path(run_dir))
    trainer.setup()
    result = trainer.run()
    dist.barrier()  # every rank leaves together: none closes its connections under another
    return result
