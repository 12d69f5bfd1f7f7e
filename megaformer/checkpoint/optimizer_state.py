"""This rank's fp32 master weights and optimizer state (Adam's moments; Muon's momentum) inside
whatever optimizer DeepSpeed built, and
the LR schedule's position: every reach into DeepSpeed's (and torch's) private state that saving
and resuming need, in this one module (listed for an upgrade audit in
:mod:`megaformer.training.deepspeed_adapter`).

Per optimizer, the owned flat range [s, e) of a parameter's tensor-parallel shard
(:class:`megaformer.checkpoint.sharded.Owned`) is read and written:

* ZeRO-0 in fp32 (torch's AdamW as is, replicated over data parallelism): the parameter itself and
  ``optimizer.state[p]``;
* Muon (:class:`megaformer.runtime.muon.Muon`, fp32, DeepSpeed without ZeRO): the parameter and
  ``optimizer.state[p]`` on the rank that owns ``p``'s state (every rank below ZeRO-1), which
  saves the whole shard;
* ZeRO 1/2 and the bf16 optimizer: the fragment of the flat fp32 partition mapped onto ``p`` by
  ``p._hp_mapping`` (``lp_fragment_address``, ``get_hp_fragment``), linked lazily by
  ``optimizer._lazy_init_hp_params_optimizer_state`` (re-armed through
  ``optimizer._hp_optimizer_states_linked``);
* ZeRO-3: ``p.ds_tensor`` (``ds_numel``), ``p.ds_shape`` and the partition rank
  ``p._z3_optimizer._get_param_partition_rank(p)``, read and written with DeepSpeed's
  ``safe_{get,set}_local_*`` and the flat groups ``optimizer.fp32_partitioned_groups_flat``;
* the schedule: ``scheduler._step_count`` / ``_last_lr`` (torch) and ``engine.global_steps`` /
  ``global_samples`` (DeepSpeed).

fp16's optimizer (FP16_Optimizer, with its loss scaler) is not covered (:meth:`covered`): fp16
checkpoints go through DeepSpeed's own files.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from megaformer.checkpoint.sharded import VOCAB_TABLES, Owned
from megaformer.deepspeed_attrs import has_hp_mapping, pipe_replicated, zero3_partitioned
from megaformer.runtime.muon import Muon

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def local_parameters(
    module: torch.nn.Module, names: Optional[dict[int, str]] = None
) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters once each, under their plain-model names (``names`` maps the
    pipeline's parameters back: :func:`megaformer.parallel.pipeline.original_names`)."""
    seen: set[int] = set()
    out = []
    for n, p in module.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((names[id(p)] if names is not None else n, p))
    return out


class OptimizerAccess:
    """This rank's own range of each parameter's fp32 master weight and optimizer state, whatever
    optimizer DeepSpeed wrapped around torch's AdamW (:meth:`covered`: not fp16's), or Muon (which
    it does not wrap). ``topo``: the rank's place in the layout (:meth:`owned` needs it)."""

    def __init__(self, engine: Any, topo: Any = None) -> None:
        self.topo = topo
        opt = engine.optimizer
        self.plain = isinstance(opt, torch.optim.Optimizer)  # ZeRO-0 in fp32: torch's AdamW as is
        self.wrapper = opt
        self.inner: torch.optim.Optimizer = opt if self.plain else getattr(opt, "optimizer", None)
        self.muon = isinstance(self.inner, Muon)
        # Muon under ZeRO-1/2: each parameter's state on one data-parallel rank, its owner
        self.distributed = self.muon and self.inner.comm.distribute

    @property
    def name(self) -> str:
        """``train.optimizer`` of the optimizer inside (what ``index.json`` records)."""
        return "muon" if self.muon else "adamw"

    def keys(self, p: torch.nn.Parameter) -> tuple[str, ...]:
        """The names of ``p``'s optimizer state, besides its master weight: Adam's two moments,
        or Muon's momentum for the matrices it updates."""
        return self.inner.state_keys(p) if self.muon else ADAM_KEYS

    def holds(self, p: torch.nn.Parameter) -> bool:
        """This rank keeps ``p``'s optimizer state (Muon under ZeRO-1/2: its owner only)."""
        return not self.distributed or self.inner.owns(p)

    def covered(self, params: list[tuple[str, torch.nn.Parameter]]) -> bool:
        """Whether these accessors reach the state of every one of ``params``."""
        return self.inner is not None and all(self.supports(p) for _, p in params)

    def supports(self, p: torch.nn.Parameter) -> bool:
        return self.plain or has_hp_mapping(p) or zero3_partitioned(p)

    def adam_step(self) -> float:
        if self.muon:  # a rank may own no AdamW parameter: Muon counts its steps itself
            return float(self.inner.steps)
        for state in self.inner.state.values():
            if "step" in state:
                return float(state["step"])
        return 0.0

    def prepare(self, adam_step: float) -> None:
        """Give every parameter of the wrapped optimizer its state (zeros; torch creates it lazily
        at the first step; Muon under ZeRO-1/2: the parameters this rank owns) with step count
        ``adam_step``, so the setters have a target."""
        targets = [q for group in self.inner.param_groups for q in group["params"]]
        # ZeRO-3 hands its flat fp32 partitions to the optimizer one sub-group at a time
        targets += list(getattr(self.wrapper, "fp32_partitioned_groups_flat", []))
        for q in dict.fromkeys(targets):
            if not self.holds(q):
                continue
            state = self.inner.state[q]
            keys = self.keys(q)
            for key in keys:
                if key not in state:
                    state[key] = torch.zeros_like(
                        q, dtype=torch.float32, memory_format=torch.preserve_format
                    )
            if keys == ADAM_KEYS:
                state["step"] = torch.tensor(float(adam_step), dtype=torch.float32)
        if self.muon:
            self.inner.steps = float(adam_step)
        self._relink()

    def link(self) -> None:
        """ZeRO 1/2 and bf16: point every parameter at its Adam-state fragment (DeepSpeed does it
        lazily, and not on every code path)."""
        if self.plain:
            return
        if not self.inner.state:  # before the first step: zeros, step 0 (what Adam starts from)
            self.prepare(0.0)
        else:
            self._relink()

    def _relink(self) -> None:
        link = getattr(self.wrapper, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            if hasattr(self.wrapper, "_hp_optimizer_states_linked"):
                self.wrapper._hp_optimizer_states_linked = False  # re-link to the current tensors
            link()

    def owned(
        self, params: list[tuple[str, torch.nn.Parameter]], vocab_size: int, for_save: bool
    ) -> list[Owned]:
        """The flat range of each parameter's shard this rank owns: for saving (every byte once)
        or for loading (what this rank's optimizer holds: whole shards for ZeRO-0)."""
        topo, out = self.topo, []
        for name, p in params:
            if for_save and topo.pp > 1 and pipe_replicated(p):
                continue  # a tied weight's second copy: the first stage writes it
            shape = tuple(p.ds_shape) if zero3_partitioned(p) else tuple(p.shape)
            n = math.prod(shape)
            expert = getattr(p, "allreduce", True) is False  # split over expert parallelism
            if self.distributed:  # whole parameters, each saved by the rank that owns its state
                start, stop = (0, n) if self.holds(p) or not for_save else (0, 0)
                base = 0
            elif self.plain:
                if for_save and expert:  # the expert-data ranks hold one copy of these experts
                    r, k = topo.expert_replica_rank, topo.expert_replicas
                    start, stop = r * n // k, (r + 1) * n // k
                elif for_save:
                    r, k = topo.replica_rank, topo.replicas  # DP x CP ranks hold one copy
                    start, stop = r * n // k, (r + 1) * n // k
                else:
                    start, stop = 0, n
                base = 0  # the whole shard
            elif zero3_partitioned(p):
                part = p.ds_tensor.ds_numel
                rank = p._z3_optimizer._get_param_partition_rank(p)
                start, stop = min(rank * part, n), min((rank + 1) * part, n)
                base = start
            else:
                mapping = p._hp_mapping
                if mapping is None:
                    start = stop = 0
                else:
                    start = mapping.lp_fragment_address.start
                    stop = start + mapping.lp_fragment_address.numel
                base = start
            split = getattr(p, "tensor_model_parallel", False) and topo.tp > 1
            dim = p.partition_dim if split else None
            if for_save and not split and topo.tp > 1:  # replicated over TP: each writes 1/tp
                lo, hi = topo.tp_rank * n // topo.tp, (topo.tp_rank + 1) * n // topo.tp
                start, stop = max(start, lo), max(min(stop, hi), max(start, lo))
            out.append(
                Owned(
                    name,
                    p,
                    shape,
                    start,
                    stop,
                    dim,
                    topo.tp_rank * shape[dim] if split else 0,
                    vocab_size if name in VOCAB_TABLES else None,
                    base,
                    topo.ep_rank * shape[0] if expert else 0,
                    topo.ep if expert else 1,
                )
            )
        return out

    def get_owned(self, o: Owned, key: str) -> torch.Tensor:
        """The owned range of ``key``, flat fp32 (a view of the optimizer's tensor where it can)."""
        p, n = o.param, o.stop - o.start
        if n == 0:
            return torch.empty(0)
        if self.plain:
            if key == "master":
                src = p.detach()
            else:
                state = self.inner.state.get(p, {})
                if key not in state:
                    return torch.zeros(n)
                src = state[key].detach()
            return src.reshape(-1)[o.start : o.stop].float()
        if zero3_partitioned(p):
            from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

            t = (
                safe_get_local_fp32_param(p)
                if key == "master"
                else safe_get_local_optimizer_state(p, key)
            )
            return t.reshape(-1)[o.start - o.base : o.stop - o.base].float()
        frag = p._hp_mapping.get_hp_fragment(None if key == "master" else key)
        return frag.reshape(-1)[o.start - o.base : o.stop - o.base].float()

    def set_owned(self, o: Owned, key: str, value: torch.Tensor) -> None:
        p = o.param
        if o.stop == o.start:
            return
        if self.plain:
            value = value.reshape(o.local_shape).to(p.device)
            if key == "master":
                p.data.copy_(value.to(p.dtype))
            elif self.holds(p):
                self.inner.state[p][key] = value.clone()
            return
        if zero3_partitioned(p):
            from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

            full = torch.zeros(p.ds_tensor.numel(), dtype=torch.float32, device=value.device)
            full[: value.numel()] = value
            if key == "master":
                safe_set_local_fp32_param(p, full)
            else:
                safe_set_local_optimizer_state(p, full, key)
            return
        frag = p._hp_mapping.get_hp_fragment(None if key == "master" else key)
        frag.data.reshape(-1)[o.start - o.base : o.stop - o.base].copy_(value.reshape(-1))


def restore_schedule(engine: Any, scheduler: Any, step: int, global_batch_size: int) -> None:
    """Put the LR schedule and DeepSpeed's counters where ``step`` optimizer steps leave them:
    lr_g = base_lr_g * lambda(step) in every parameter group."""
    scheduler.last_epoch = step
    scheduler._step_count = step + 1
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
    engine.global_steps = step
    engine.global_samples = step * global_batch_size
