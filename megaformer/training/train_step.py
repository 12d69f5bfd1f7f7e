"""One optimizer step, one validation pass, and this rank's view of the weights, per schedule.

A train step owns what differs between schedules; the loop (:mod:`megaformer.training.loop`) and
its hooks only see ``step(n, loader) -> result``. For ``grad_accum`` micro-batches (x_i, y_i) per
data-parallel rank:

* :class:`TrainStep` (one stage): ``loss_i = engine(x_i, y_i); engine.backward(loss_i);
  engine.step()`` for each i (DeepSpeed applies the update at the accumulation boundary), and the
  logged loss is mean_i loss_i averaged over the data- and context-parallel ranks ("replica");
* :class:`PipelineTrainStep` (``parallel.pipeline > 1``): DeepSpeed's pipeline engine over the
  same micro-batches (``engine.train_batch``) on the schedule ``parallel.pipeline_schedule`` (1F1B;
  interleaved 1F1B, megaformer's engine on DeepSpeed's; or DualPipeV, DeepSpeed's engine for the
  DualPipeV module the build made), whose loss is
  already averaged over micro-batches and DP; MoE router losses are added from every stage.

A new pipeline schedule is a new subclass; :func:`train_step_class` picks one from the config.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from megaformer.checkpoint.optimizer_state import local_parameters
from megaformer.config import Config
from megaformer.data.dataset import validation_batches
from megaformer.model.moe import end_of_step as moe_end_of_step
from megaformer.parallel.pipeline import pipeline_state_dict
from megaformer.parallel.plan import full_state_dict
from megaformer.training import deepspeed_adapter as ds_adapter
from megaformer.training import distributed as dist


class TrainStep:
    """The step of a model whose every stage is on this rank (any TP, CP, DP, EP, ZeRO stage).

    ``part``: this rank's context-parallel part of each sequence (None: the whole);
    ``clipper``: megaformer's own gradient-norm measurement where DeepSpeed reports none;
    ``weigh_loss(loss, labels)``: the loss this rank contributes (context parallelism weighs each
    part by its share of the sequence's counted labels; the identity otherwise)."""

    def __init__(
        self,
        cfg: Config,
        engine: Any,
        scheduler: Any,
        topo: Any,
        device: torch.device,
        *,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        valid_set: Any,
        part: Optional[Callable] = None,
        param_names: Optional[list[str]] = None,
        clipper: Any = None,
        faults: Any = None,
        weigh_loss: Optional[Callable] = None,
    ) -> None:
        self.cfg, self.engine, self.scheduler, self.topo, self.device = (
            cfg,
            engine,
            scheduler,
            topo,
            device,
        )
        self.grad_accum, self.dp_rank, self.dp_size = grad_accum, dp_rank, dp_size
        self.valid_set, self.part, self.param_names = valid_set, part, param_names
        self.clipper, self.faults = clipper, faults
        self.weigh_loss = weigh_loss if weigh_loss is not None else (lambda loss, labels: loss)

    # DeepSpeed's model-parallel unit for ``deepspeed.initialize`` (a PipelineModule brings its own)
    @staticmethod
    def engine_mpu(topo: Any) -> Any:
        return topo

    @property
    def pipeline_module(self) -> Any:
        """The stage module diagnostics must run through (None: the plain model suffices)."""
        return None

    def __call__(self, step: int, loader: Any) -> dict[str, Any]:
        """Optimizer step number ``step`` on the next batches of ``loader``: {loss, lr, grad_norm,
        bad (this rank's step was skipped or its loss is not finite), step_time_s, moe, mtp}."""
        engine = self.engine
        lr = self.scheduler.get_last_lr()[0]
        t0 = time.perf_counter()
        if self.faults is not None:
            self.faults.step_start(step)
        loss = self._forward_backward(step, loader.next_step())
        if self.faults is not None:
            self.faults.mid_step(step)
        gn = (
            self.clipper.norm
            if self.clipper is not None and self.clipper.norm is not None
            else ds_adapter.grad_norm(engine)
        )
        grad_norm = gn if gn is not None else float("nan")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        # skipped by the optimizer (non-finite gradient norm), or a non-finite loss on this rank
        bad = not ds_adapter.step_applied(engine) or not math.isfinite(float(loss))
        # MoE blocks: the step's expert load over DP x CP, the aux-loss-free bias update, the metrics
        moe = (
            moe_end_of_step(engine.module, self.topo.groups.replica, update_bias=not bad)
            if self.cfg.model.moe.interval > 0
            else {}
        )
        # multi-token prediction: the step's mean of its losses over the data-parallel ranks
        mtp = (
            engine.module.mtp_metrics.take(
                self.topo.groups.replica, self.topo.groups.pp, self.device
            )
            if self.cfg.model.mtp_depth > 0
            else {}
        )
        return {
            "loss": float(loss),
            "lr": lr,
            "grad_norm": grad_norm,
            "bad": bad,
            "step_time_s": time.perf_counter() - t0,
            "moe": moe,
            "mtp": mtp,
        }

    def _forward_backward(self, step: int, micro_batches: list) -> torch.Tensor:
        engine, dev = self.engine, self.device
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            y = y.to(dev, non_blocking=True)
            faults = (
                self.faults.micro_batch(step, i, engine.module)
                if self.faults is not None
                else nullcontext()
            )
            with faults:
                loss = self.weigh_loss(engine(x.to(dev, non_blocking=True), y), y)
            if self.faults is not None:
                loss = self.faults.loss(step, i, loss)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        # over DP x CP: the context ranks' weighted losses average to the sequences' mean
        return dist.all_reduce_mean(torch.stack(losses).mean(), self.topo.groups.replica)

    def _validation_batches(self) -> Any:
        return validation_batches(
            self.valid_set,
            self.cfg.train.micro_batch_size,
            self.grad_accum,
            self.cfg.eval.iters,
            self.dp_rank,
            self.dp_size,
            self.part,
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss: mean over ``eval.iters`` x ``grad_accum`` micro-batches and the replicas."""
        self.engine.eval()
        losses = [
            self.weigh_loss(
                self.engine(x.to(self.device), y.to(self.device)), y.to(self.device)
            ).float()
            for x, y in self._validation_batches()
        ]
        self.engine.train()
        return float(dist.all_reduce_mean(torch.stack(losses).mean(), self.topo.groups.replica))

    def local_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(full-model name, parameter) of every parameter this rank holds."""
        return local_parameters(self.engine.module, None)

    def full_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """Unsharded, unpadded weights (collective: every rank calls; rank 0 gets them)."""
        if self.cfg.parallel.zero_stage == 3:
            full = ds_adapter.zero3_full_state_dict(self.engine)
            if full is None:
                return None
            V = self.cfg.model.vocab_size
            return {
                k: (v[:V] if k in ("tok_embeddings.weight", "lm_head.weight") else v)
                for k, v in full.items()
                if not (k == "lm_head.weight" and self.cfg.model.tie_embeddings)
            }
        return self._unsharded()

    def _unsharded(self) -> Optional[dict[str, torch.Tensor]]:
        return full_state_dict(self.engine.module, self.topo)


class PipelineTrainStep(TrainStep):
    """The step of this rank's pipeline stages (``deepspeed.pipe.PipelineModule``: 1F1B;
    :class:`~megaformer.parallel.interleaved_engine.InterleavedModule`: interleaved 1F1B;
    ``DualPipeVModule``: DualPipeV)."""

    @staticmethod
    def engine_mpu(topo: Any) -> Any:
        return None  # the PipelineModule's own grid (same rank order as the topology)

    @property
    def pipeline_module(self) -> Any:
        return self.engine.module

    def _forward_backward(self, step: int, micro_batches: list) -> torch.Tensor:
        # the schedule over the micro-batches; the loss comes back averaged over them and over DP
        router = self.engine.module.router_losses
        if router is not None:  # the router losses' gradient, scaled as the loss's
            router.scale = 1.0 / self.grad_accum
        loss = self.engine.train_batch(iter(micro_batches)).detach().float()
        if router is None:
            return loss
        # + every stage's router losses, mean over micro-batches, summed over stages, mean over DP
        groups = self.topo.groups
        mine = router.take(loss.device) / self.grad_accum
        total = dist.all_reduce_mean(mine, groups.pp) * self.topo.pp
        return loss + dist.all_reduce_mean(total, groups.replica)

    @torch.no_grad()
    def evaluate(self) -> float:
        batches = list(self._validation_batches())
        losses = []
        for it in range(self.cfg.eval.iters):
            chunk = batches[it * self.grad_accum : (it + 1) * self.grad_accum]
            losses.append(float(self.engine.eval_batch(iter(chunk))))  # mean over micro & DP
        return sum(losses) / len(losses)

    def local_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return local_parameters(self.engine.module, self.param_names)

    def _unsharded(self) -> Optional[dict[str, torch.Tensor]]:
        return pipeline_state_dict(
            self.engine.module, self.param_names, self.topo, self.cfg.model.vocab_size
        )


def train_step_class(cfg: Config) -> type[TrainStep]:
    """The train step of ``cfg``'s schedule."""
    return PipelineTrainStep if cfg.parallel.pipeline > 1 else TrainStep
