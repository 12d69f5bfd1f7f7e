"""The layout-independent optimizer state of first-release checkpoints: read, to resume them at
another layout (new checkpoints are sharded, :mod:`megaformer.checkpoint.sharded`). Its writer
stays only for ``tools/bench_checkpoint.py``, which measures the single-writer design against the
sharded one.

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

from megaformer.checkpoint.compat import layout_changes
from megaformer.checkpoint.optimizer_state import OptimizerAccess
from megaformer.checkpoint.safe_load import host_copy
from megaformer.checkpoint.safetensors_check import read_header
from megaformer.deepspeed_attrs import zero3_partitioned
from megaformer.errors import CheckpointError

log = logging.getLogger("megaformer")

STATE_DIR = "optimizer"
STATE_JSON = "state.json"
KEYS = ("master", "exp_avg", "exp_avg_sq")
VOCAB_TABLES = ("tok_embeddings.weight", "lm_head.weight")


def has_portable_state(ckpt: Path) -> bool:
    return (ckpt / STATE_DIR / STATE_JSON).is_file()


def relayout_changes(cfg: Any, ckpt: Path, world_size: int) -> list[str]:
    """The layout changes that need the layout-free resume (empty: DeepSpeed's own resume);
    CheckpointError when there are some and the checkpoint has no layout-free state."""
    changes = layout_changes(cfg, ckpt, world_size)
    if changes and not has_portable_state(ckpt):
        raise CheckpointError(
            f"{ckpt}: resuming with a different layout ({', '.join(changes)}) needs the "
            f"checkpoint's layout-free optimizer state ({STATE_DIR}/{STATE_JSON}), "
            "which it lacks; resume at the saved layout"
        )
    return changes


def get_full(access: OptimizerAccess, p: torch.nn.Parameter, key: str) -> torch.Tensor:
    """Collective over the DP group for DeepSpeed's optimizers."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if access.plain:
        if key == "master":
            return p.detach().float()
        state = access.inner.state.get(p, {})
        return (
            state[key].detach().float()
            if key in state
            else torch.zeros_like(p, dtype=torch.float32)
        )
    t = safe_get_full_fp32_param(p) if key == "master" else safe_get_full_optimizer_state(p, key)
    if t is None:
        raise CheckpointError(f"DeepSpeed has no {key} for a parameter of shape {tuple(p.shape)}")
    return t.float()


def set_full(access: OptimizerAccess, p: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if access.plain:
        if key == "master":
            p.data.copy_(value.to(p.dtype))
        else:
            v = value.to(p.device, torch.float32)
            # a TP slice is a view of the whole tensor: own its memory
            access.inner.state[p][key] = v.clone() if v._base is not None else v
        return
    value = value.to(p.device, torch.float32)
    if key == "master":
        safe_set_full_fp32_param(p, value)
    else:
        safe_set_full_optimizer_state(p, value, key)


def _gather_tp(t: torch.Tensor, p: torch.nn.Parameter, topo: Any) -> torch.Tensor:
    from megaformer.parallel.plan import gather_tensor_parallel

    return gather_tensor_parallel(p, t, topo)


def covered(engine: Any, params: list[tuple[str, torch.nn.Parameter]]) -> bool:
    """Whether the accessors reach this optimizer's state (not fp16's FP16_Optimizer)."""
    return OptimizerAccess(engine).covered(params)


def stage_file(pp_rank: int) -> str:
    return f"{STATE_DIR}/stage_{pp_rank:02d}.safetensors"


def snapshot_portable_state(
    engine: Any,
    params: list[tuple[str, torch.nn.Parameter]],
    topo: Any,
    vocab_size: int,
    memo: Optional[dict] = None,
) -> Optional[dict[str, torch.Tensor]]:
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
            local = get_full(access, p, key)
            t = _gather_tp(local, p, topo)
            live = access.plain and t is local  # a view of the optimizer's own tensor
            if name in VOCAB_TABLES:
                t = t[:vocab_size]
            if writer:
                t = t.detach().float()
                out[f"{name}/{key}"] = (
                    host_copy(t, memo) if memo is not None and live else t.to("cpu").contiguous()
                )  # fresh: already a copy
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


def _shard(
    full: torch.Tensor, name: str, p: torch.nn.Parameter, topo: Any, padded_vocab: int, source: Path
) -> torch.Tensor:
    """Whole tensor -> this rank's piece: vocabulary padded with zero rows, then TP-sliced."""
    if name in VOCAB_TABLES and full.shape[0] < padded_vocab:
        full = torch.cat([full, full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])])
    if getattr(p, "tensor_model_parallel", False) and topo.tp > 1:
        full = full.chunk(topo.tp, dim=p.partition_dim)[topo.tp_rank]
    if tuple(full.shape) != tuple(p.shape) and not zero3_partitioned(p):
        raise CheckpointError(
            f"{source}: {name} does not fit this layout (shard {tuple(full.shape)}, "
            f"parameter {tuple(p.shape)})"
        )
    return full


def restore_portable_state(
    engine: Any,
    params: list[tuple[str, torch.nn.Parameter]],
    topo: Any,
    padded_vocab: int,
    state: PortableState,
    source: Path,
) -> None:
    """Set every local parameter's master weight and Adam moments from ``state`` (collective-free
    except for what DeepSpeed's setters do)."""
    access = OptimizerAccess(engine)
    if not covered(engine, params):
        raise CheckpointError(
            f"{source}: resuming at another layout is not supported with this "
            f"optimizer ({type(engine.optimizer).__name__}); resume at the saved "
            "layout"
        )
    access.prepare(float(state.info.get("adam_step", 0.0)))
    for name, p in params:
        for key in KEYS:
            set_full(
                access, p, key, _shard(state.tensor(name, key), name, p, topo, padded_vocab, source)
            )


def copy_files(files: Iterable[Path], dst: Path) -> None:
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, dst / f.name)
