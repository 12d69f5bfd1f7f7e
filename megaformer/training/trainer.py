"""A training run: builds the DeepSpeed engine and its train step, resumes, then runs the loop.

One optimizer step = ``grad_accum`` micro-batches per data-parallel rank::

    for each micro-batch (x, y):  loss = engine(x, y); engine.backward(loss); engine.step()

``engine.step()`` applies the update only at the accumulation boundary (DeepSpeed averages the
gradients over micro-batches and ranks, clips the global norm and steps the LR schedule). The logged
loss is the mean over the step's micro-batches and the data-parallel ranks. The step itself is the
schedule's :class:`~megaformer.training.train_step.TrainStep`; the loop
(:class:`~megaformer.training.loop.TrainLoop`) runs it with one hook per side job
(:mod:`megaformer.training.hooks`: metrics, validation, task evaluation, checkpoints, stop
requests, the watchdog), and :meth:`Trainer.add_hook` adds more without touching the loop.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megaformer.checkpoint.checkpointer import Checkpointer, Trained, TrainState
from megaformer.checkpoint.files import write_text_atomic
from megaformer.comm import broadcast_from_main, flight
from megaformer.config import Config
from megaformer.config.preflight import preflight
from megaformer.data.dataset import TrainLoader, validation_batches
from megaformer.data.setup import setup_data
from megaformer.errors import CheckpointError, ConfigError
from megaformer.evaluation.training import TaskEvaluator
from megaformer.kernels import native
from megaformer.parallel import experts, interleaved_engine
from megaformer.parallel.build import build_model
from megaformer.parallel.context import context_disabled, split_sequence
from megaformer.parallel.grad_norm import GradNormClipper
from megaformer.parallel.stage_walk import StageWalk
from megaformer.parallel.topology import build_topology, layout_groups
from megaformer.runtime.collectives import host_group
from megaformer.runtime.host_allocator import configure_host_allocator
from megaformer.runtime.muon import MuonGroups
from megaformer.runtime.optimizer import build_optimizer
from megaformer.runtime.run_lock import acquire_on_rank0
from megaformer.safe_files import check_run_dir
from megaformer.training import deepspeed_adapter as ds_adapter
from megaformer.training import distributed as dist
from megaformer.training import hooks, profiling, wandb_log
from megaformer.training.bad_steps import BadStepCounter
from megaformer.training.console import Console, log_summary
from megaformer.training.deepspeed_config import build_deepspeed_config, zero3_partitioner
from megaformer.training.faults import FaultPlan
from megaformer.training.hang import HangReport, nccl_flight_recorder_env
from megaformer.training.intervals import LoopIntervals
from megaformer.training.loop import TrainLoop
from megaformer.training.metrics import METRICS_FILE, MetricsWriter, truncate_metrics
from megaformer.training.preemption import StopRequest
from megaformer.training.schedule import lr_lambda
from megaformer.training.stragglers import StragglerDetector
from megaformer.training.train_step import train_step_class
from megaformer.training.watchdog import StepWatchdog

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
    # gradients equal one process: tests/distributed/test_pipeline.py).
    warnings.filterwarnings(
        "ignore", message="c10d::broadcast_: an autograd kernel was not registered"
    )


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


def _resolve_vocab(cfg: Config, tokenizer_vocab: int) -> Config:
    v = cfg.model.vocab_size
    if v is None:
        v = tokenizer_vocab
    elif v < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={v}: smaller than the tokenizer's vocabulary ({tokenizer_vocab})"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=v))


class Trainer:
    """Builds everything for one run and runs the loop; see :func:`train`."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        if cfg.model.init_from is not None:  # the folder's model
            from megaformer.checkpoint.hf.init_from import with_hf_model

            cfg = with_hf_model(cfg)
        self.proc = dist.detect_process(cfg.train.device)
        # every world- and device-dependent check, once; the op implementations it settled on
        checked = preflight(cfg, self.proc.world_size, self.proc.device)
        self.grad_accum = checked.grad_accum
        if run_dir.exists() and not run_dir.is_dir():
            raise CheckpointError(f"--run-dir {run_dir}: exists and is not a directory")
        self.run_dir = run_dir
        check_run_dir(run_dir)  # no symlinked entries: nothing is written through a link
        # which checkpoint the run resumes from, and how (checked before anything is built)
        self.checkpointer = Checkpointer(cfg, run_dir, self.proc.world_size, self.proc.rank)
        self.kernel_plan = checked.kernel_plan
        self.attention_backend = dict(self.kernel_plan)["attention"]
        self.cfg = cfg
        self.rank = self.proc.rank
        self.is_main = self.proc.is_main
        # Data-parallel coordinates: which slice of each global batch this rank reads.
        self.layout = layout_groups(
            self.proc.world_size,
            tp=cfg.parallel.tensor,
            cp=cfg.parallel.context,
            pp=cfg.parallel.pipeline,
            ep=cfg.parallel.expert,
        )
        self.layout.rank = self.proc.rank
        self.dp_rank, self.dp_size = self.layout.dp_rank, self.layout.dp
        # Context parallelism: this rank's part of every sequence it reads (None: the whole).
        self.part = (
            functools.partial(
                split_sequence,
                rank=self.layout.cp_rank,
                size=self.layout.cp,
                mode=cfg.parallel.context_mode,
            )
            if cfg.parallel.context > 1
            else None
        )
        self.extra_hooks: list[tuple[Any, Optional[int]]] = []  # see add_hook
        # end the loop after this step, the schedule still that of train.steps (a replay)
        self.stop_after: Optional[int] = None

    # ------------------------------------------------------------------------- setup

    def setup(self) -> None:
        cfg = self.cfg
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        # every collective counted per group (hang attribution, straggler timing): installed
        # before DeepSpeed's comm layer looks its functions up
        self.flight = flight.recorder()
        if self.proc.device.type == "cuda":
            nccl_flight_recorder_env(self.run_dir / "logs")
        dist.init_distributed(self.proc, cfg.parallel.collective_timeout_minutes)
        self.run_lock = acquire_on_rank0(self.run_dir, self.rank)  # one job per run directory
        self.topo = build_topology(
            self.proc.world_size,
            self.rank,
            tp=cfg.parallel.tensor,
            cp=cfg.parallel.context,
            pp=cfg.parallel.pipeline,
            ep=cfg.parallel.expert,
        )
        dist.barrier()
        setup_logging(self.run_dir, self.rank, cfg.log.all_ranks)
        _quiet_known_warnings()
        self.task_eval = TaskEvaluator.from_config(cfg)  # eval.tasks: checked before any work
        configure_host_allocator(
            cfg.train.cpu_malloc, self.proc.device
        )  # before anything allocates
        if self.proc.device.type == "cpu" and cfg.model.kernels == "auto":
            log.info("%s", native.status())  # built on first use (cached), before step 1
        if self.is_main:
            for tmp in self.checkpointer.half_written():
                log.warning("ignoring %s: a checkpoint save that did not complete", tmp)
        self.faults = FaultPlan.from_env(self.rank)
        self.profiled = self.rank in profiling.profiled_ranks(cfg.log.profile_ranks)
        if cfg.log.memory_snapshot_step is not None and self.profiled:
            profiling.start_memory_history(self.proc.device)  # before the model is built
        self.tokenizer, data = setup_data(
            cfg,
            self.run_dir,
            self.rank,
            dist.barrier,
            self.checkpointer.source,
            share=lambda obj: broadcast_from_main(obj, host_group()),
        )
        self.cfg = cfg = _resolve_vocab(cfg, self.tokenizer.vocab_size)
        self.train_set, self.valid_set = data.train, data.valid
        self.unigram = data.unigram(cfg.model.vocab_size)
        self.model = self._build_model()
        self._build_engine()
        self.checkpointer.attach(
            cfg,
            self.topo,
            Trained(
                self.engine,
                self.scheduler,
                self._local_params,
                self.plain_model.padded_vocab_size,
                tokenizer=self.tokenizer,
                tp_rng=self.tp_rng,
                full_weights=self.full_weights,
                before_commit=self.faults.in_save,
            ),
        )
        resumed = self.checkpointer.resume() or TrainState(0, 0)
        self.step, consumed = resumed.step, resumed.consumed_samples
        self.loader = TrainLoader(
            self.train_set,
            cfg.train.micro_batch_size,
            self.grad_accum,
            self.dp_rank,
            self.dp_size,
            cfg.train.seed,
            consumed,
            prefetch=cfg.data.prefetch,
            stop_at=cfg.train.steps * cfg.train.global_batch_size,
            part=self.part,
            device=self.proc.device,
            readers=_batch_readers(self.topo),
        )
        if self.is_main:
            write_text_atomic(self.run_dir / "config.yaml", cfg.to_yaml())
            truncate_metrics(self.run_dir / METRICS_FILE, self.step)
        self.metrics = MetricsWriter(
            self.run_dir,
            self.is_main,
            cfg.log.tensorboard,
            wandb_log.open_run(cfg, self.run_dir) if self.is_main else None,
        )
        self.diagnostics = self._build_diagnostics() if cfg.log.diagnostics else None
        if resumed.fp8_demoted:  # per-layer FP8 demotion: the blocks demoted before the save
            self._restore_demoted(resumed.fp8_demoted)
        self.bad_steps = BadStepCounter(cfg.train.max_bad_steps, resumed.skipped_steps)
        self._print_summary()

    def _restore_demoted(self, layers: tuple[int, ...]) -> None:
        from megaformer.parallel.fp8 import demote

        demotion = self.diagnostics.demotion if self.diagnostics is not None else None
        if demotion is not None:
            demotion.restore(self.plain_model, layers)
        else:
            for i in layers:
                demote(self.plain_model.layers[i])
        log.info("FP8: blocks %s run in high precision (demoted before the checkpoint)", layers)

    def _build_diagnostics(self) -> Any:
        """Residual-stream diagnostics on the first validation micro-batch (same on every rank),
        with per-layer FP8 demotion when ``train.fp8_demote_threshold`` is set."""
        from megaformer.diagnostics.fp8_demotion import Fp8Demotion
        from megaformer.diagnostics.training import DiagnosticsHook

        batch = next(
            iter(validation_batches(self.valid_set, self.cfg.train.micro_batch_size, 1, 1, 0, 1))
        )
        t = self.cfg.train
        demotion = (
            Fp8Demotion(t.fp8_demote_threshold, t.fp8_demote_intervals, self.cfg.model.n_layers)
            if t.fp8 != "off" and t.fp8_demote_threshold > 0
            else None
        )
        pipe = self.stepper.pipeline_module
        return DiagnosticsHook(
            self.plain_model,
            batch,
            self.cfg.log.diagnostics_interval,
            self.topo,
            pipe,
            demotion,
            StageWalk.of_layout(self.cfg.parallel, self.topo) if pipe is not None else None,
        )

    def _build_model(self) -> torch.nn.Module:
        """This rank's model (:func:`megaformer.parallel.build.build_model`): from the seed, or from
        the weights of the checkpoint the run resumes from (:meth:`Checkpointer.model_weights`)."""
        weights, source = self.checkpointer.model_weights(self.cfg.model, self.topo)
        # ZeRO-3: each module keeps its partition as soon as it has its values
        partition = zero3_partitioner(
            self.cfg,
            build_deepspeed_config(self.cfg, self.grad_accum),
            train_step_class(self.cfg).engine_mpu(self.topo),
        )
        built = build_model(
            self.cfg,
            self.topo,
            device=self.proc.device,
            weights=weights,
            weights_source=source,
            eod_id=self.tokenizer.eod_id,
            partition=partition,
        )
        self.plain_model, self.tp_rng, self.param_names = (
            built.plain,
            built.tp_rng,
            built.param_names,
        )
        self.weigh_loss = built.weigh_loss  # context parallelism: the loss the group averages
        return built.model

    def _local_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self.stepper.local_parameters()

    def _build_engine(self) -> None:
        import deepspeed

        from megaformer.checkpoint.safe_load import install_safe_checkpoint_engine

        ep = self.cfg.parallel.expert
        experts.deepspeed_groups(self.topo)  # expert parallelism: DeepSpeed's expert groups
        groups = self.topo.groups
        optimizer = build_optimizer(
            self.model,
            self.cfg.train,
            self.param_names,
            MuonGroups(groups.tp, groups.replica, groups.edp, self.cfg.parallel.zero_stage > 0),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg.train))
        ds_config = build_deepspeed_config(self.cfg, self.grad_accum)
        step_class = train_step_class(self.cfg)
        # expert grads over expert-data groups; the interleaved schedule's engine
        with experts.recognised_by_deepspeed(ep > 1), interleaved_engine.engine_for(self.model):
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=self.model,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=ds_config,
                mpu=step_class.engine_mpu(self.topo),
                dist_init_required=False,
            )
        install_safe_checkpoint_engine(self.engine)
        self.clipper: Optional[GradNormClipper] = None
        if not ds_adapter.reports_grad_norm(self.engine):
            self._measure_grad_norm()
        # the schedule's step, validation pass and view of the weights
        self.stepper = step_class(
            self.cfg,
            self.engine,
            self.scheduler,
            self.topo,
            self.proc.device,
            grad_accum=self.grad_accum,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            valid_set=self.valid_set,
            part=self.part,
            param_names=self.param_names,
            clipper=self.clipper,
            faults=self.faults,
            weigh_loss=self.weigh_loss,
        )

    def _measure_grad_norm(self) -> None:
        """Without a ZeRO/bf16 optimizer DeepSpeed reports no gradient norm, and its fp32 clipping
        counts a pipeline-tied weight once per stage that holds it. megaformer measures the norm
        itself (:class:`megaformer.parallel.grad_norm.GradNormClipper`) and clips with it."""
        engine = self.engine
        self.clipper = GradNormClipper(
            engine.module.parameters,
            self.topo.groups.tp,
            self.topo.groups.pp,
            self.cfg.train.grad_clip,
            self.topo.groups.ep,
        )
        if self.cfg.train.grad_clip > 0:
            ds_adapter.replace_fp32_clipping(engine, self.clipper.measure_and_clip)
        # DeepSpeed steps this torch optimizer directly: megaformer skips a non-finite step itself
        ds_adapter.skip_nonfinite_steps(engine, self.clipper.norm_for_step)

    def _print_summary(self) -> None:
        from megaformer.analysis.throughput import TrainingMeter

        self.meter = TrainingMeter.for_run(self.cfg, self.proc.device, self.proc.world_size)
        log_summary(
            self.cfg,
            self.proc,
            self.topo,
            dp_size=self.dp_size,
            grad_accum=self.grad_accum,
            padded_vocab=self.plain_model.padded_vocab_size,
            attention_backend=self.attention_backend,
            kernel_plan=self.kernel_plan,
            meter=self.meter,
            run_dir=self.run_dir,
        )

    # ------------------------------------------------------------------------- steps

    def train_step(self) -> dict[str, Any]:
        """One optimizer step (:class:`~megaformer.training.train_step.TrainStep`)."""
        self.faults.weights(self.step + 1, self.plain_model)
        result = self.stepper(self.step + 1, self.loader)
        self.step += 1
        return result

    def save(self) -> Optional[Path]:
        """Collective: checkpoint the current step (:meth:`Checkpointer.save`); None when a
        checkpoint of this step already exists."""
        from megaformer.parallel.fp8 import demoted_blocks

        demoted = tuple(demoted_blocks(self.plain_model))
        return self.checkpointer.save(
            TrainState(self.step, self.loader.consumed_samples, self.bad_steps.total, demoted)
        )

    def full_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """Unsharded, unpadded weights (collective: every rank calls; rank 0 gets them)."""
        return self.stepper.full_weights()

    # ------------------------------------------------------------------------- loop

    def add_hook(self, hook: Any, every: Optional[int] = None) -> Any:
        """Run ``hook`` (a :class:`~megaformer.training.loop.StepHook`) after every ``every`` steps
        of :meth:`run`, after the built-in hooks that fill the step's record and before it is
        written and the checkpoint saved."""
        self.extra_hooks.append((hook, every))
        return hook

    def run(self) -> TrainResult:
        """Train to ``train.steps``; on a stop request (signal, time limit) agreed by all ranks at
        a step boundary, save a checkpoint and return early with ``stopped`` set."""
        t_start = time.perf_counter()
        loop, metrics, validation, checkpoints = self._build_loop()
        state = loop.run(self.step)
        stopped = state.stop_reason
        sample = self.sample() if stopped is None else None
        return TrainResult(
            self.run_dir,
            self.step,
            state.result.get("loss", float("nan")),
            validation.val_loss,
            self.unigram,
            metrics.tokens_per_s,
            time.perf_counter() - t_start,
            checkpoints.last,
            sample,
            stopped,
        )

    def _build_loop(
        self,
    ) -> tuple[TrainLoop, hooks.IntervalMetrics, hooks.Validation, hooks.Checkpoints]:
        """The loop over :meth:`train_step` with every side job as a hook (in the order of
        :mod:`megaformer.training.hooks`)."""
        cfg, t = self.cfg, self.cfg.train
        console = Console(self.is_main, cfg.log.progress_bar, t.steps, self.step)
        due = LoopIntervals.from_config(cfg)
        loop = TrainLoop(lambda n: self.train_step(), min(t.steps, self.stop_after or t.steps))
        if cfg.checkpoint.async_save:  # a failed background save stops the run at a step boundary
            loop.add_hook(hooks.BackgroundWriteCheck(self.checkpointer))
        loop.add_hook(hooks.StopAgreement(StopRequest(t.exit_after_minutes)))
        if t.watchdog_factor > 0:
            loop.add_hook(
                hooks.Watchdog(
                    StepWatchdog(
                        t.watchdog_factor,
                        t.watchdog_min_seconds,
                        self.run_dir / "logs" / f"rank_{self.rank}.log",
                        self.rank,
                        hang=HangReport(self.run_dir / "logs", self.rank),
                    )
                )
            )
        if cfg.log.straggler_interval > 0:
            loop.add_hook(
                StragglerDetector(
                    cfg.log.straggler_interval,
                    cfg.log.straggler_threshold,
                    self.flight,
                    self.rank,
                    self.proc.device,
                    self.run_dir,
                    host_group(),
                )
            )
        metrics = loop.add_hook(
            hooks.IntervalMetrics(
                console,
                due,
                t.global_batch_size * cfg.seq_len,
                lambda: self.loader.consumed_samples * cfg.seq_len,
                self.meter,
            )
        )
        loop.add_hook(
            hooks.BadSteps(
                self.bad_steps, console, self.metrics, self.checkpointer.latest, self.run_dir
            )
        )
        loop.add_hook(hooks.LossSpikes(console, self.run_dir))
        if self.diagnostics is not None:
            loop.add_hook(hooks.Diagnostics(self.diagnostics))
        validation = loop.add_hook(
            hooks.Validation(self.stepper.evaluate, due, console, self.unigram)
        )
        if self.task_eval is not None:
            loop.add_hook(hooks.TaskEvaluation(self.task_eval, self._evaluate_tasks, console))
        for hook in self._profiling_hooks():
            loop.add_hook(hook)
        for hook, every in self.extra_hooks:
            loop.add_hook(hook, every)
        checkpoints = hooks.Checkpoints(self.save, due, console, self.checkpointer)
        loop.tail += [hooks.WriteRecord(self.metrics, console), checkpoints]
        return loop, metrics, validation, checkpoints

    def _profiling_hooks(self) -> list[Any]:
        """``log.profile_steps`` and ``log.memory_snapshot_step`` on the ranks of
        ``log.profile_ranks`` (:mod:`megaformer.training.profiling`)."""
        lg, out, device = self.cfg.log, self.run_dir / profiling.PROFILE_DIR, self.proc.device
        if not self.profiled:
            return []
        found: list[Any] = []
        if lg.profile_steps is not None:
            first, last = lg.profile_steps
            found.append(
                profiling.ProfileSteps(first, last, out / f"rank_{self.rank}", self.rank, device)
            )
        if lg.memory_snapshot_step is not None:
            path = out / f"memory_rank_{self.rank}.pickle"
            found.append(profiling.MemorySnapshot(lg.memory_snapshot_step, path, device))
        return found

    def _evaluate_tasks(self) -> tuple[dict, str]:
        """eval.tasks on the live model (:mod:`megaformer.evaluation.training`)."""
        return self.task_eval.run(
            self.engine, self.plain_model, self.topo, self.tokenizer, self.proc.device
        )

    def sample(self) -> Optional[str]:
        """A short text sample from the training model itself (no second copy: eval mode and no
        gradients while it runs, train mode after, context parallelism switched off so rank 0
        decodes alone), on rank 0 when it holds the model whole (TP = PP = EP = 1, ZeRO below 3);
        a sharded model is never gathered for it."""
        n = self.cfg.log.sample_tokens
        p = self.cfg.parallel
        if n == 0 or not self.is_main:
            return None
        if p.tensor > 1 or p.pipeline > 1 or p.zero_stage == 3 or p.expert > 1:
            log.info(
                "text sample skipped: the model is sharded over ranks (megaformer generate "
                "RUN_DIR reads the checkpoint)"
            )
            return None
        from megaformer.generation import generate_text

        model = self.engine.module
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), context_disabled(model):
                return generate_text(
                    model,
                    self.tokenizer,
                    self.cfg.log.sample_prompt,
                    n,
                    temperature=0.8,
                    top_k=40,
                    seed=self.cfg.train.seed,
                )
        finally:
            model.train(was_training)


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


def _batch_readers(topo: Any) -> Any:
    """A gloo group of this rank's model-parallel ranks (TP x PP of one data-parallel and context
    rank: they train on the same batches), made collectively for every such group: its first rank
    reads each step's batches and broadcasts them (:class:`TrainLoader`). None at TP = PP = 1."""
    if topo.tp * topo.pp == 1 or not torch.distributed.is_initialized():
        return None
    mine = None
    for ranks in topo.mp_groups:
        group = torch.distributed.new_group(ranks, backend="gloo")
        if topo.rank in ranks:
            mine = group
    return mine
