"""The training loop: DeepSpeed engine, periodic evaluation, logging, checkpoints, exact resume.

One optimizer step = ``grad_accum`` micro-batches per data-parallel rank::

    for each micro-batch (x, y):  loss = engine(x, y); engine.backward(loss); engine.step()

``engine.step()`` applies the update only at the accumulation boundary (DeepSpeed averages the
gradients over micro-batches and ranks, clips the global norm and steps the LR schedule). The logged
loss is the mean over the step's micro-batches and the data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import functools
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
from megaformer.checkpoint import portable, sharded
from megaformer.checkpoint.compat import check_resume_compatible, layout_changes, relayout_changes
from megaformer.config import Config, validate_for_training, validate_for_world
from megaformer.data.dataset import TrainLoader, validation_batches
from megaformer.data.setup import setup_data
from megaformer.evaluation.training import TaskEvaluator
from megaformer.errors import CheckpointError, ConfigError
from megaformer.kernels import native
from megaformer.training import distributed as dist
from megaformer.training import deepspeed_adapter as ds_adapter
from megaformer.training.bad_steps import BadStepCounter
from megaformer.training.faults import FaultPlan
from megaformer.runtime.host_allocator import configure_host_allocator
from megaformer.runtime.run_lock import acquire_on_rank0
from megaformer.training.preemption import REASONS, StopRequest, agree_max
from megaformer.training.watchdog import StepWatchdog
from megaformer.training.deepspeed_config import build_deepspeed_config
from megaformer.training.metrics import METRICS_FILE, MetricsWriter, truncate_metrics
from megaformer.training import wandb_log
from megaformer.runtime.optimizer import build_optimizer
from megaformer.training.intervals import LoopIntervals
from megaformer.training.schedule import lr_lambda
from megaformer.analysis.params import count_parameters
from megaformer.model.moe import checkpoint_files as moe_checkpoint_files
from megaformer.model.moe import end_of_step as moe_end_of_step
from megaformer.model.moe import load_router_state
from megaformer.parallel import experts
from megaformer.parallel.build import build_model
from megaformer.parallel.context import split_sequence
from megaformer.parallel.fp8 import check_fp8_device
from megaformer.parallel.grad_norm import GradNormClipper
from megaformer.parallel.pipeline import pipeline_state_dict
from megaformer.parallel.plan import full_state_dict
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


def _precision_checks(cfg: Config, device: torch.device) -> None:
    if cfg.train.precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16: needs a CUDA device; use bf16 or fp32 on CPU")
    check_fp8_device(cfg.train, device)
    validate_for_training(cfg)


def _resolve_vocab(cfg: Config, tokenizer_vocab: int) -> Config:
    v = cfg.model.vocab_size
    if v is None:
        v = tokenizer_vocab
    elif v < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={v}: smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab})")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=v))


class Trainer:
    """Builds everything for one run and runs the loop; see :func:`train`."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.proc = dist.detect_process(cfg.train.device)
        self.grad_accum = validate_for_world(cfg, self.proc.world_size)
        _precision_checks(cfg, self.proc.device)
        if run_dir.exists() and not run_dir.is_dir():
            raise CheckpointError(f"--run-dir {run_dir}: exists and is not a directory")
        self.run_dir = run_dir
        ckpt_io.check_run_dir(run_dir)  # no symlinked entries: nothing is written through a link
        self.resume_from = ckpt_io.latest_checkpoint(run_dir / ckpt_io.CHECKPOINTS)
        if self.resume_from is not None and not cfg.checkpoint.resume:
            raise CheckpointError(f"{run_dir} already holds checkpoints (latest "
                                  f"{self.resume_from.name}); resume with checkpoint.resume=true "
                                  "or choose another --run-dir")
        if self.resume_from is not None:
            check_resume_compatible(cfg, self.resume_from)
        # A weights-only checkpoint (``megaformer convert``) seeds the model; nothing else resumes.
        self.init_only = self.resume_from is not None and ckpt_io.is_weights_only(self.resume_from)
        # A sharded checkpoint resumes at any layout from its shards; one in the earlier format at
        # another layout from its layout-free state, not from DeepSpeed's per-rank files.
        resuming = self.resume_from is not None and not self.init_only
        self.sharded_resume = resuming and sharded.has_sharded_state(self.resume_from)
        if resuming and not self.sharded_resume and cfg.parallel.expert > 1:
            raise CheckpointError(f"{self.resume_from}: parallel.expert={cfg.parallel.expert} "
                                  "resumes from a sharded checkpoint only (this one holds "
                                  "DeepSpeed's per-rank files); resume with parallel.expert=1")
        self.relayout = ([] if not resuming else
                         layout_changes(cfg, self.resume_from, self.proc.world_size)
                         if self.sharded_resume else
                         relayout_changes(cfg, self.resume_from, self.proc.world_size))
        from megaformer.kernels.selection import model_plan

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        # which implementation runs for each op (also refuses a forced attention backend that
        # cannot run here, before anything is built)
        self.kernel_plan = model_plan(cfg.model, self.proc.device, dtype[cfg.train.precision],
                                      compiled=cfg.train.compile)
        self.attention_backend = dict(self.kernel_plan)["attention"]
        self.cfg = cfg
        self.rank = self.proc.rank
        self.is_main = self.proc.is_main
        # Data-parallel coordinates: which slice of each global batch this rank reads.
        self.layout = layout_groups(self.proc.world_size, cfg.parallel.tensor, cfg.parallel.pipeline,
                                    cfg.parallel.context, cfg.parallel.expert)
        self.layout.rank = self.proc.rank
        self.dp_rank, self.dp_size = self.layout.dp_rank, self.layout.dp
        # Context parallelism: this rank's part of every sequence it reads (None: the whole).
        self.part = (functools.partial(split_sequence, rank=self.layout.cp_rank,
                                       size=self.layout.cp, mode=cfg.parallel.context_mode)
                     if cfg.parallel.context > 1 else None)

    # ------------------------------------------------------------------------- setup

    def setup(self) -> None:
        cfg = self.cfg
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        dist.init_distributed(self.proc, cfg.parallel.collective_timeout_minutes)
        self.run_lock = acquire_on_rank0(self.run_dir, self.rank)  # one job per run directory
        self.topo = build_topology(self.proc.world_size, self.rank, cfg.parallel.tensor,
                                   cfg.parallel.pipeline, cfg.parallel.context, cfg.parallel.expert)
        dist.barrier()
        setup_logging(self.run_dir, self.rank, cfg.log.all_ranks)
        _quiet_known_warnings()
        self.task_eval = TaskEvaluator.from_config(cfg)  # eval.tasks: checked before any work
        wandb_log.check_available(cfg)
        configure_host_allocator(cfg.train.cpu_malloc, self.proc.device)  # before anything allocates
        if self.proc.device.type == "cpu" and cfg.model.fused_kernels == "auto":
            log.info("%s", native.status())  # built on first use (cached), before step 1
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
        elif self.sharded_resume:
            self.step, consumed, skipped = self._resume_sharded()
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
        if self.resume_from is not None and not self.init_only:
            load_router_state(self.engine.module, self.resume_from)  # MoE aux-loss-free biases
        self.loader = TrainLoader(self.train_set, cfg.train.micro_batch_size, self.grad_accum,
                                  self.dp_rank, self.dp_size, cfg.train.seed, consumed,
                                  prefetch=cfg.data.prefetch,
                                  stop_at=cfg.train.steps * cfg.train.global_batch_size,
                                  part=self.part)
        if self.is_main:
            ckpt_io.write_text_atomic(self.run_dir / "config.yaml", cfg.to_yaml())
            truncate_metrics(self.run_dir / METRICS_FILE, self.step)
        self.metrics = MetricsWriter(self.run_dir, self.is_main, cfg.log.tensorboard,
                                     wandb_log.open_run(cfg, self.run_dir) if self.is_main else None)
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
        """This rank's model (:func:`megaformer.parallel.build.build_model`): from the seed, or from
        the weights of a weights-only checkpoint or of the layout-free state (another layout)."""
        weights: Any = None
        source: Any = None
        if self.init_only:
            weights, source = ckpt_io.load_weights(self.resume_from), self.resume_from
        elif self.sharded_resume:  # each rank reads its own shards of the master weights
            self.shards = sharded.ShardedState(self.resume_from)
            self.shards.check_model(ckpt_io.expected_shapes(self.cfg.model))
            weights, source = self.shards, self.shards.folder
        elif self.relayout:
            self.portable = portable.PortableState(self.resume_from)
            weights, source = self.portable.masters(), self.resume_from / portable.STATE_DIR
        built = build_model(self.cfg, self.topo, device=self.proc.device, weights=weights,
                            weights_source=source, eod_id=self.tokenizer.eod_id)
        self.plain_model, self.tp_rng, self.param_names = built.plain, built.tp_rng, built.param_names
        self.weigh_loss = built.weigh_loss  # context parallelism: the loss the group averages
        return built.model

    def _local_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        names = self.param_names if self.cfg.parallel.pipeline > 1 else None
        return portable.local_parameters(self.engine.module, names)

    def _resume_sharded(self) -> tuple[int, int, int]:
        """Master weights (already in the model), Adam moments and step count from this rank's
        part of the sharded state, at whatever layout this run has; the LR schedule and data
        position from meta.json; every rank's RNG streams when the layout is the saved one."""
        ckpt, state = self.resume_from, self.shards
        meta = ckpt_io.read_meta(ckpt)
        access = sharded.StateAccess(self.engine, self.topo)
        params = self._local_params()
        if not access.covered(params):
            raise CheckpointError(f"{ckpt}: its sharded state cannot be loaded into this "
                                  f"optimizer ({type(self.engine.optimizer).__name__}); resume "
                                  "with train.precision bf16 or fp32")
        access.prepare(state.adam_step)
        for o in access.owned(params, self.cfg.model.vocab_size, for_save=False):
            for key in sharded.KEYS:
                access.set_owned(o, key, state.fill(o, key))
        step, consumed = int(meta["step"]), int(meta["consumed_samples"])
        portable.restore_schedule(self.engine, self.scheduler, step,
                                  self.cfg.train.global_batch_size)
        del self.shards
        if self.relayout:
            log.warning("resumed from %s at a new layout (%s; step %d, %s samples consumed); RNG "
                        "streams are per rank and do not carry over, so dropout masks differ from "
                        "the saved layout's continuation", ckpt, ", ".join(self.relayout), step,
                        f"{consumed:,}")
        else:
            rng = ckpt_io.load_rng_state(ckpt, self.rank)
            if self.tp_rng is not None and "tensor_parallel" in rng:
                self.tp_rng.load_state_dict(rng["tensor_parallel"])
            log.info("resumed from %s (step %d, %s samples consumed)", ckpt, step, f"{consumed:,}")
        return step, consumed, int(meta.get("skipped_steps", 0))

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

        ep = self.cfg.parallel.expert
        experts.deepspeed_groups(self.topo)  # expert parallelism: DeepSpeed's expert groups
        optimizer = build_optimizer(self.model, self.cfg.train)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg.train))
        ds_config = build_deepspeed_config(self.cfg, self.grad_accum)
        with experts.recognised_by_deepspeed(ep > 1):  # expert grads over expert-data groups
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=self.model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
                # a PipelineModule brings its own grid (same rank order as self.topo)
                mpu=self.topo if self.cfg.parallel.pipeline == 1 else None,
                dist_init_required=False)
        install_safe_checkpoint_engine(self.engine)
        self.clipper: Optional[GradNormClipper] = None
        if not ds_adapter.reports_grad_norm(self.engine):
            self._measure_grad_norm()

    def _measure_grad_norm(self) -> None:
        """Without a ZeRO/bf16 optimizer DeepSpeed reports no gradient norm, and its fp32 clipping
        counts a pipeline-tied weight once per stage that holds it. megaformer measures the norm
        itself (:class:`megaformer.parallel.grad_norm.GradNormClipper`) and clips with it."""
        engine = self.engine
        self.clipper = GradNormClipper(engine.module.parameters, self.topo.group("tp"),
                                       self.topo.group("pp"), self.cfg.train.grad_clip,
                                       self.topo.group("ep"))
        if self.cfg.train.grad_clip > 0:
            ds_adapter.replace_fp32_clipping(engine, self.clipper.measure_and_clip)
        # DeepSpeed steps this torch optimizer directly: megaformer skips a non-finite step itself
        ds_adapter.skip_nonfinite_steps(engine, self.clipper.norm_for_step)

    def _print_summary(self) -> None:
        cfg, p = self.cfg, self.proc
        counts = count_parameters(cfg.model)
        dp, tp, pp = self.dp_size, cfg.parallel.tensor, cfg.parallel.pipeline
        name, reason = self.attention_backend
        sp = " + sequence parallel" if cfg.parallel.sequence_parallel and cfg.parallel.tensor > 1 else ""
        if cfg.parallel.context > 1:
            sp += f" x CP {cfg.parallel.context} ({cfg.parallel.context_mode})"
        log.info("megaformer: %s parameters (%s non-embedding; vocabulary %d padded to %d) | "
                 "world %d = DP %d x TP %d%s x PP %d | ZeRO %d | %s %s | attention %s (%s)",
                 f"{counts['total']:,}", f"{counts['non_embedding']:,}", cfg.model.vocab_size,
                 self.plain_model.padded_vocab_size, p.world_size, dp, tp, sp, pp,
                 cfg.parallel.zero_stage, p.device.type,
                 cfg.train.precision, name, reason)
        from megaformer.kernels.selection import format_plan

        log.info("kernels:\n%s", format_plan(self.kernel_plan))
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
        if "active" in counts:  # MoE: FLOPs, TFLOP/s and MFU count the active parameters
            log.info("MoE: %s parameters held, %s active per token: FLOPs, TFLOP/s and MFU count "
                     "the active ones (router, top-%d routed and the shared experts)%s",
                     f"{counts['total']:,}", f"{counts['active']:,}", cfg.model.moe.top_k,
                     f"; experts split over EP {cfg.parallel.expert}" if cfg.parallel.expert > 1
                     else "")

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
                loss = self.weigh_loss(engine(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)), y)
                loss = self.faults.loss(step, i, loss)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach().float())
            # over DP x CP: the context ranks' weighted losses average to the sequences' mean
            loss = dist.all_reduce_mean(torch.stack(losses).mean(), self.topo.group("replica"))
        self.faults.mid_step(step)
        gn = (self.clipper.norm if self.clipper is not None and self.clipper.norm is not None
              else ds_adapter.grad_norm(engine))
        grad_norm = gn if gn is not None else float("nan")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        self.step = step
        # skipped by the optimizer (non-finite gradient norm), or a non-finite loss on this rank
        bad = not ds_adapter.step_applied(engine) or not math.isfinite(float(loss))
        # MoE blocks: the step's expert load over DP, the aux-loss-free bias update, the metrics
        moe = (moe_end_of_step(engine.module, self.topo.group("dp"), update_bias=not bad)
               if self.cfg.model.moe.interval > 0 else {})
        return {"loss": float(loss), "lr": lr, "grad_norm": grad_norm, "bad": bad,
                "step_time_s": time.perf_counter() - t0, "moe": moe}

    @torch.no_grad()
    def evaluate(self) -> float:
        if self.cfg.parallel.pipeline > 1:
            return self._evaluate_pipeline()
        self.engine.eval()
        losses = [self.weigh_loss(self.engine(x.to(self.proc.device), y.to(self.proc.device)), y).float()
                  for x, y in validation_batches(self.valid_set, self.cfg.train.micro_batch_size,
                                                 self.grad_accum, self.cfg.eval.iters, self.dp_rank,
                                                 self.dp_size, self.part)]
        self.engine.train()
        return float(dist.all_reduce_mean(torch.stack(losses).mean(), self.topo.group("replica")))

    def _evaluate_pipeline(self) -> float:
        batches = list(validation_batches(self.valid_set, self.cfg.train.micro_batch_size,
                                          self.grad_accum, self.cfg.eval.iters, self.dp_rank,
                                          self.dp_size, self.part))
        losses = []
        for it in range(self.cfg.eval.iters):
            chunk = batches[it * self.grad_accum:(it + 1) * self.grad_accum]
            losses.append(float(self.engine.eval_batch(iter(chunk))))  # mean over micro & DP
        return sum(losses) / len(losses)

    def _evaluate_tasks(self, bar: Any) -> dict:
        """eval.tasks on the live model (:mod:`megaformer.evaluation.training`): eval/TASK/METRIC."""
        scores, table = self.task_eval.run(self.engine, self.plain_model, self.topo,
                                           self.tokenizer, self.proc.device)
        self._console(f"step {self.step}: lm-eval tasks\n{table}", bar)
        return scores

    def save(self) -> Optional[Path]:
        """Collective. With ``checkpoint.async_save`` the files are written on a background
        thread after a synchronous snapshot (see :func:`megaformer.checkpoint.io.save_checkpoint`)."""
        if self.writer is not None:
            self.writer.wait()  # one save in flight at a time; raises if the last one failed
        consumed = self.loader.consumed_samples
        meta = {"consumed_samples": consumed, "consumed_tokens": consumed * self.cfg.seq_len,
                "parallel": {"tensor": self.cfg.parallel.tensor, "pipeline": self.cfg.parallel.pipeline,
                             "data": self.dp_size, "expert": self.cfg.parallel.expert,
                             "context": self.cfg.parallel.context,
                             "sequence_parallel": self.cfg.parallel.sequence_parallel},
                "zero_stage": self.cfg.parallel.zero_stage, "precision": self.cfg.train.precision}
        info = {"step": self.step, "consumed_samples": consumed, "layout": meta["parallel"],
                "lr": self.scheduler.get_last_lr(), "precision": self.cfg.train.precision}
        access = sharded.StateAccess(self.engine, self.topo)
        # fp16's loss scaler lives in DeepSpeed's files: that optimizer saves through them
        shard = self.cfg.train.precision != "fp16" and access.covered(self._local_params())
        if shard:  # taken now: an asynchronous save writes the index after training went on
            info["adam_step"] = access.adam_step()
        pieces: list = []
        t0 = time.perf_counter()
        path = ckpt_io.save_checkpoint(
            self.engine, self.run_dir, self.step, rank=self.rank, world_size=self.proc.world_size,
            client_state={"step": self.step, "consumed_samples": consumed,
                          "skipped_steps": self.bad_steps.total},
            snapshot=lambda tmp, memo: self._snapshot(tmp, memo, meta, access if shard else None,
                                                      pieces),
            keep_last=self.cfg.checkpoint.keep_last, barrier=dist.barrier,
            extra_rng={"tensor_parallel": self.tp_rng.state_dict()} if self.tp_rng else None,
            background=self.writer, before_commit=lambda: self.faults.in_save(self.step),
            engine_files=not shard,
            before_seal=(lambda tmp: sharded.write_index(tmp, pieces, info)) if shard else None)
        if path is not None and self.writer is None:
            log.info("saved checkpoint %s (%.2f s)", path, time.perf_counter() - t0)
        elif path is not None:
            log.info("checkpoint %s: training stalled %.2f s for the host copy of each rank's "
                     "shard; writing in the background", path.name, time.perf_counter() - t0)
        return path

    def _snapshot(self, tmp: Path, memo: Optional[dict], meta: dict,
                  access: Optional[sharded.StateAccess], pieces: list) -> dict[str, Any]:
        """This rank's share of a checkpoint's files, on the host (collective): its shard of the
        training state (``access``; None: DeepSpeed's files hold it), and on rank 0 the files
        that describe the checkpoint. Copies where ``memo`` is given (asynchronous save).
        ``pieces`` receives, on rank 0, every rank's description of its shard (for the index)."""
        files: dict[str, Any] = {}
        if access is not None:
            owned = access.owned(self._local_params(), self.cfg.model.vocab_size, for_save=True)
            tensors, where = sharded.snapshot(access, owned, copy=memo is not None)
            files[f"{sharded.STATE_DIR}/{sharded.rank_file(self.rank)}"] = \
                sharded.rank_payload(tensors, where)
            pieces.extend(dist.gather_to_main(
                sharded.piece_description(self.rank, tensors, where, owned, self.topo.tp)))
        files.update(moe_checkpoint_files(self.engine.module, self.topo))  # aux-loss-free biases
        weights = self.full_weights() if self.cfg.checkpoint.export_weights else None
        if self.is_main:
            if weights is not None:  # full_weights() returns fresh tensors: already a snapshot
                files[ckpt_io.WEIGHTS] = {k: v.detach().to("cpu").contiguous()
                                          for k, v in weights.items()}
            files[ckpt_io.CONFIG] = self.cfg.to_yaml()
            self.tokenizer.save(tmp / "tokenizer.json")
            full_meta = {"megaformer_version": __version__, "step": self.step,
                         "world_size": self.proc.world_size,
                         "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         "skipped_steps": self.bad_steps.total,
                         "state": "sharded" if access is not None else "deepspeed", **meta}
            files[ckpt_io.META] = json.dumps(full_meta, indent=2)  # last: marks it complete
        return files

    def full_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """Unsharded, unpadded weights (collective: every rank calls; rank 0 gets them)."""
        if self.cfg.parallel.zero_stage == 3:
            full = ds_adapter.zero3_full_state_dict(self.engine)
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
        due = LoopIntervals.from_config(cfg)
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
                if due.log_due(self.step, bool(bad)):
                    record = self._interval_record(window, tokens_per_step)
                    window = []
                self._count_bad_step(last, record, bar)
                if self.diagnostics is not None and self.diagnostics.due(self.step):
                    record = {**(record or {"step": self.step}), **self.diagnostics()}
                if due.eval_due(self.step, stopping=bool(stop_code)):
                    val_loss = self.evaluate()
                    record = record or {"step": self.step}
                    record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50.0)))
                    self._console(f"step {self.step}: val loss {val_loss:.4f} | val ppl "
                                  f"{record['val_ppl']:.2f} | unigram baseline {self.unigram:.4f}", bar)
                if self.task_eval is not None and self.task_eval.due(self.step, bool(stop_code)):
                    record = {**(record or {"step": self.step}), **self._evaluate_tasks(bar)}
                if record:
                    self.metrics.write(record)
                    if bar is None and "loss" in record:
                        self._console(self._format(record), bar)
                if due.save_due(self.step, stopping=bool(stop_code)):
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
        record.update(window[-1].get("moe", {}))  # the last step's MoE metrics
        return record

    @staticmethod
    def _format(r: dict) -> str:
        return (f"step {r['step']}: loss {r['loss']:.4f} | lr {r['lr']:.3e} | grad norm "
                f"{r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tokens/s | "
                f"{r['step_time_s'] * 1000:.0f} ms/step"
                + (f" | {r['tflops_per_gpu']:.3g} TFLOP/s/GPU" if "tflops_per_gpu" in r else "")
                + (f" | MFU{' vs bf16 peak' if 'fp8_tflops_per_gpu' in r else ''} "
                   f"{100 * r['mfu']:.1f}% HFU {100 * r['hfu']:.1f}%" if "mfu" in r else "")
                + (f" (FP8 {r['fp8_tflops_per_gpu']:.3g} TFLOP/s/GPU)" if "fp8_tflops_per_gpu" in r
                   else "")
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
        """A short text sample from the trained weights, generated on rank 0 when it holds them
        whole (TP = PP = EP = 1, ZeRO below 3); a sharded model is never gathered for it."""
        n = self.cfg.log.sample_tokens
        p = self.cfg.parallel
        if n == 0 or not self.is_main:
            return None
        if p.tensor > 1 or p.pipeline > 1 or p.zero_stage == 3 or p.expert > 1:
            log.info("text sample skipped: the model is sharded over ranks (megaformer generate "
                     "RUN_DIR reads the checkpoint)")
            return None
        from megaformer.generation import generate_text

        weights = full_state_dict(self.engine.module, self.topo)
        model = build_model(self.cfg, device=self.proc.device, weights=weights,
                            weights_source="the trained model", training=False).model
        return generate_text(model, self.tokenizer, self.cfg.log.sample_prompt, n,
                             temperature=0.8, top_k=40, seed=self.cfg.train.seed)


def train(cfg: Config, run_dir: Path) -> TrainResult:
    """Train ``cfg`` in ``run_dir`` (resuming from its latest checkpoint when there is one)."""
    trainer = Trainer(cfg, Path(run_dir))
    try:
        trainer.setup()
        result = trainer.run()
        dist.barrier()  # every rank leaves together: none closes its connections under another
    finally:
        if getattr(trainer, "run_lock", None) is not None:
            trainer.run_lock.release()
    return result
