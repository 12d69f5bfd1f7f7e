"""The layout-independent optimizer state of first-release checkpoints (read, to resume them at
another layout; new checkpoints are sharded, :mod:`megaformer.checkpoint.sharded`), and the
optimizer accessors both formats use.

DeepSpeed's own files hold each rank's shard (per TP/PP rank, and per DP rank under ZeRO), so they
only load back into the layout that wrote them. Next to them every checkpoint carries::

    CKPT/optimizer/
      stage_00.safetensors   for every parameter of pipeline stage 0, under its plain-model name N:
                             "N/master"      fp32 master weight  theta
                             "N/exp_avg"     Adam's first moment  m
                             "N/exp_avg_sq"  Adam's second moment v
      stage_01.safetensors   ... one file per pipeline stage (a tied embedding appears in two)
      state.json             Adam's step count t, the LR schedule position, the layout it came from

Each tensor is whole: tensor-parallel shards concatenated along their split dimension, ZeRO
partitions reassembled (DeepSpeed's ``safe_get_full_*``), vocabulary padding dropped. Resuming at
a new layout cuts them again: pad the vocabulary rows to the new multiple, take this TP rank's
slice, and hand it to DeepSpeed's ``safe_set_full_*`` (ZeRO 1-3, bf16) or, for a plain torch
optimizer (ZeRO-0 in fp32), to ``optimizer.state[p]`` directly.

Memory: saving gathers one parameter at a time; the writer of a stage (TP rank 0, DP rank 0) holds
that stage's three fp32 tensors per parameter in host memory until the file is written. Loading
reads one tensor at a time from the memory-mapped files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from megaformer.checkpoint.safe_load import host_copy
from megaformer.checkpoint.safetensors_check import read_header
from megaformer.deepspeed_attrs import has_hp_mapping, zero3_partitioned
from megaformer.errors import CheckpointError

log = logging.getLogger("megaformer")

STATE_DIR = "optimizer"
STATE_JSON = "state.json"
KEYS = ("master", "exp_avg", "exp_avg_sq")
VOCAB_TABLES = ("tok_embeddings.weight", "lm_head.weight")


def has_portable_state(ckpt: Path) -> bool:
    return (ckpt / STATE_DIR / STATE_JSON).is_file()


def local_parameters(module: torch.nn.Module,
                     names: Optional[dict[int, str]] = None) -> list[tuple[str, torch.nn.Parameter]]:
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
    """The fp32 master weight and Adam moments of one parameter (this TP rank's shard, whole over
    the DP group), whatever optimizer DeepSpeed wrapped around torch's AdamW."""

    def __init__(self, engine: Any) -> None:
        opt = engine.optimizer
        self.plain = isinstance(opt, torch.optim.Optimizer)  # ZeRO-0 in fp32: torch's AdamW as is
        self.wrapper = opt
        self.inner: torch.optim.Optimizer = opt if self.plain else getattr(opt, "optimizer", None)

    def covered(self, params: list[tuple[str, torch.nn.Parameter]]) -> bool:
        """Whether these accessors reach the state of every one of ``params``."""
        return self.inner is not None and all(self.supports(p) for _, p in params)

    def supports(self, p: torch.nn.Parameter) -> bool:
        return self.plain or has_hp_mapping(p) or zero3_partitioned(p)

    def get(self, p: torch.nn.Parameter, key: str) -> torch.Tensor:
        """Collective over the DP group for DeepSpeed's optimizers."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if self.plain:
            if key == "master":
                return p.detach().float()
            state = self.inner.state.get(p, {})
            return state[key].detach().float() if key in state else torch.zeros_like(p, dtype=torch.float32)
        t = safe_get_full_fp32_param(p) if key == "master" else safe_get_full_optimizer_state(p, key)
        if t is None:
            raise CheckpointError(f"DeepSpeed has no {key} for a parameter of shape {tuple(p.shape)}")
        return t.float()

    def adam_step(self) -> float:
        for state in self.inner.state.values():
            if "step" in state:
                return float(state["step"])
        return 0.0

    def prepare(self, adam_step: float) -> None:
        """Give every parameter of the wrapped optimizer its Adam state (zeros; torch creates it
        lazily at the first step) with step count ``adam_step``, so the setters have a target."""
        targets = [q for group in self.inner.param_groups for q in group["params"]]
        # ZeRO-3 hands its flat fp32 partitions to the optimizer one sub-group at a time
        targets += list(getattr(self.wrapper, "fp32_partitioned_groups_flat", []))
        for q in dict.fromkeys(targets):
            state = self.inner.state[q]
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = torch.zeros_like(q, memory_format=torch.preserve_format)
            state["step"] = torch.tensor(float(adam_step), dtype=torch.float32)
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

    def set(self, p: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if self.plain:
            if key == "master":
                p.data.copy_(value.to(p.dtype))
            else:
                v = value.to(p.device, torch.float32)
                # a TP slice is a view of the whole tensor: own its memory
                self.inner.state[p][key] = v.clone() if v._base is not None else v
            return
        value = value.to(p.device, torch.float32)
        if key == "master":
            safe_set_full_fp32_param(p, value)
        else:
            safe_set_full_optimizer_state(p, value, key)


def _gather_tp(t: torch.Tensor, p: torch.nn.Parameter, topo: Any) -> torch.Tensor:
    import torch.distributed as dist

    if not (getattr(p, "tensor_model_parallel", False) and topo.tp > 1):
        return t
    parts = [torch.empty_like(t) for _ in range(topo.tp)]
    dist.all_gather(parts, t.contiguous(), group=topo.group("tp"))
    return torch.cat(parts, dim=p.partition_dim)


def covered(engine: Any, params: list[tuple[str, torch.nn.Parameter]]) -> bool:
    """Whether the accessors reach this optimizer's state (not fp16's FP16_Optimizer)."""
    return OptimizerAccess(engine).covered(params)


def stage_file(pp_rank: int) -> str:
    return f"{STATE_DIR}/stage_{pp_rank:02d}.safetensors"


def snapshot_portable_state(engine: Any, params: list[tuple[str, torch.nn.Parameter]],
                            topo: Any, vocab_size: int,
                            memo: Optional[dict] = None) -> Optional[dict[str, torch.Tensor]]:
    """Collective (every rank): this pipeline stage's whole tensors, on the host, for the
    stage's writer (TP rank 0, DP rank 0); an empty dict on the other ranks. None when the
    optimizer is one the accessors do not cover (fp16's), so there is nothing layout-free.

    With ``memo`` (an asynchronous save) the tensors are host copies, shared through ``memo``
    with the copies already taken of the same tensors (DeepSpeed's state, see
    :func:`megaformer.checkpoint.safe_load.host_copy`); without it (a synchronous save, written
    before training goes on) they may be views of live host tensors."""
    if not covered(engine, params):
        return None
    access = OptimizerAccess(engine)
    access.link()
    writer = topo.tp_rank == 0 and topo.dp_rank == 0
    out: dict[str, torch.Tensor] = {}
    for name, p in params:
        for key in KEYS:
            local = access.get(p, key)
            t = _gather_tp(local, p, topo)
            live = access.plain and t is local  # a view of the optimizer's own tensor
            if name in VOCAB_TABLES:
                t = t[:vocab_size]
            if writer:
                t = t.detach().float()
                out[f"{name}/{key}"] = (host_copy(t, memo) if memo is not None and live
                                        else t.to("cpu").contiguous())  # fresh: already a copy
    return out


def portable_info(engine: Any, info: dict) -> str:
    """``state.json``: ``info`` (step, consumed samples, layout, LR) and Adam's step count."""
    return json.dumps({**info, "adam_step": OptimizerAccess(engine).adam_step()}, indent=2)


class PortableState:
    """Reads a checkpoint's layout-free optimizer state, one tensor at a time."""

    def __init__(self, ckpt: Path) -> None:
        from safetensors import safe_open

        folder = ckpt / STATE_DIR
        try:
            self.info = json.loads((folder / STATE_JSON).read_text())
        except (OSError, ValueError, RecursionError):
            raise CheckpointError(f"{folder / STATE_JSON}: missing or corrupt") from None
        self.files = sorted(folder.glob("stage_*.safetensors"))
        if not self.files:
            raise CheckpointError(f"{folder}: no stage_*.safetensors files")
        self._where: dict[str, Any] = {}
        self._handles = []
        for f in self.files:
            header = read_header(f)
            handle = safe_open(str(f), framework="pt")
            self._handles.append(handle)
            for key in header:
                if key != "__metadata__":
                    self._where.setdefault(key, (handle, f))

    def names(self) -> list[str]:
        return list(dict.fromkeys(k.rsplit("/", 1)[0] for k in self._where))

    def tensor(self, name: str, key: str) -> torch.Tensor:
        found = self._where.get(f"{name}/{key}")
        if found is None:
            raise CheckpointError(f"{self.files[0].parent}: no {key} for parameter {name}")
        handle, f = found
        try:
            return handle.get_tensor(f"{name}/{key}")
        except Exception as e:  # safetensors' own errors
            raise CheckpointError(f"{f}: cannot read {name}/{key} ({str(e)[:200]})") from None

    def masters(self) -> dict[str, torch.Tensor]:
        return {n: self.tensor(n, "master") for n in self.names()}


def _shard(full: torch.Tensor, name: str, p: torch.nn.Parameter, topo: Any,
           padded_vocab: int, source: Path) -> torch.Tensor:
    """Whole tensor -> this rank's piece: vocabulary padded with zero rows, then TP-sliced."""
    if name in VOCAB_TABLES and full.shape[0] < padded_vocab:
        full = torch.cat([full, full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])])
    if getattr(p, "tensor_model_parallel", False) and topo.tp > 1:
        full = full.chunk(topo.tp, dim=p.partition_dim)[topo.tp_rank]
    if tuple(full.shape) != tuple(p.shape) and not zero3_partitioned(p):
        raise CheckpointError(f"{source}: {name} does not fit this layout (shard {tuple(full.shape)}, "
                              f"parameter {tuple(p.shape)})")
    return full


def restore_portable_state(engine: Any, params: list[tuple[str, torch.nn.Parameter]], topo: Any,
                           padded_vocab: int, state: PortableState, source: Path) -> None:
    """Set every local parameter's master weight and Adam moments from ``state`` (collective-free
    except for what DeepSpeed's setters do)."""
    access = OptimizerAccess(engine)
    if not covered(engine, params):
        raise CheckpointError(f"{source}: resuming at another layout is not supported with this "
                              f"optimizer ({type(engine.optimizer).__name__}); resume at the saved "
                              "layout")
    access.prepare(float(state.info.get("adam_step", 0.0)))
    for name, p in params:
        for key in KEYS:
            access.set(p, key, _shard(state.tensor(name, key), name, p, topo, padded_vocab, source))


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


def copy_files(files: Iterable[Path], dst: Path) -> None:
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, dst / f.name)
