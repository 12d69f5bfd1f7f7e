"""Process identity and the process group.

megaformer reads the rank, world size and local rank the launcher put in the environment (torchrun
sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT); a plain ``python`` or
``megaformer train`` without a launcher is a world of one. The process group is gloo on CPU and nccl
on GPU, created through ``deepspeed.init_distributed`` so DeepSpeed's comm layer shares it.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megaformer.errors import LaunchError


@dataclass
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"environment variable {name}={raw!r}: expected an integer") from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_process(device: str = "auto") -> ProcessInfo:
    """Rank, world size, local rank and device from the launcher's environment (no group yet)."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} / WORLD_SIZE={world}: rank must be in [0, world size)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise LaunchError("train.device=cuda: no CUDA device is visible to this process")
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise LaunchError(f"LOCAL_RANK={local_rank}: only {n} CUDA devices on this node")
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    return ProcessInfo(rank, world, local_rank, dev)


def _disable_cpu_shm_comm_op() -> None:
    """Skip DeepSpeed's JIT-built shared-memory all-reduce on CPU.

    The op serves only ``inference_all_reduce`` (never called in training), its first build costs
    ~45 s of compilation, and several ranks building it at once has been seen to abort. Set
    MEGAFORMER_DS_SHM=1 to keep DeepSpeed's default.
    """
    if os.environ.get("MEGAFORMER_DS_SHM") == "1":
        return
    import importlib

    # importlib, not `import deepspeed.comm.torch as m`: the package also has an attribute `torch`
    # (the real torch module), which the `as` form would resolve to.
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None


def init_distributed(proc: ProcessInfo, timeout_minutes: float = 30.0) -> None:
    """Create the default process group (gloo on CPU, nccl on CUDA) through DeepSpeed."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if proc.device.type == "cuda" else "cpu")
    if proc.world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    elif "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise LaunchError("WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun")
    if proc.device.type == "cuda":
        torch.cuda.set_device(proc.device)
    else:
        _disable_cpu_shm_comm_op()
    import deepspeed

    if torch.distributed.is_initialized():
        return
    deepspeed.init_distributed(dist_backend="nccl" if proc.device.type == "cuda" else "gloo",
                               auto_mpi_discovery=False, verbose=False,
                               timeout=datetime.timedelta(minutes=timeout_minutes))


def barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def all_reduce_mean(value: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """Mean of a tensor over the ranks of ``group`` (default: all ranks)."""
    if torch.distributed.is_initialized():
        n = torch.distributed.get_world_size(group)
        if n > 1:
            value = value.clone()
            torch.distributed.all_reduce(value, group=group)
            value /= n
    return value
