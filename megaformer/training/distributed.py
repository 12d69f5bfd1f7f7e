"""Process identity and the process group.

megaformer recognises how it was started and reads rank, world size and local rank from there:

    torchrun / torch.distributed.run   RANK, WORLD_SIZE, LOCAL_RANK (+ TORCHELASTIC_RUN_ID)
    deepspeed launcher                 RANK, WORLD_SIZE, LOCAL_RANK (+ CROSS_RANK, LOCAL_SIZE)
    srun, one task per process         SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (in a job step)
    mpirun (Open MPI)                  OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK
    mpirun (MPICH, Intel MPI, PMIx)    PMI_RANK / PMI_SIZE / MPI_LOCALRANKID, PMIX_RANK
    plain ``python`` / ``megaformer``  a world of one

The result is written back as RANK / WORLD_SIZE / LOCAL_RANK (and, under srun, MASTER_ADDR = the
step's first node, MASTER_PORT = 29500 + job id mod 1000 unless set) so torch's env:// rendezvous
and DeepSpeed see one convention. The process group is gloo on CPU and nccl on GPU, created through
``deepspeed.init_distributed`` so DeepSpeed's comm layer shares it. The collectives the loop uses
(``barrier``, ``all_reduce_mean``, ``gather_to_main``) are :mod:`megaformer.comm`'s, named here too.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from megaformer.comm import all_reduce_mean, barrier, gather_to_main
from megaformer.errors import LaunchError
from megaformer.runtime.spawn import free_port

__all__ = [
    "ProcessInfo",
    "LaunchInfo",
    "detect_launch",
    "detect_process",
    "first_host",
    "init_distributed",
    "barrier",
    "all_reduce_mean",
    "gather_to_main",
]


@dataclass
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    launcher: str = "python"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class LaunchInfo:
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: Optional[str] = None
    master_port: Optional[int] = None


def _env_int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"environment variable {name}={raw!r}: expected an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    head = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise LaunchError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = head.group(1), head.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


# (launcher, rank, world size, local rank) variable names, tried in order.
_MPI_FLAVOURS = (
    (
        "mpi (Open MPI)",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ),
    ("mpi (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("mpi (PMIx)", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
)


def detect_launch(env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """Which launcher started this process, and this process's place in the world."""
    if _env_int(env, "WORLD_SIZE") is not None or _env_int(env, "RANK") is not None:
        launcher = (
            "torchrun"
            if "TORCHELASTIC_RUN_ID" in env
            else "deepspeed"
            if "CROSS_RANK" in env
            else "environment"
        )
        return LaunchInfo(
            launcher,
            _env_int(env, "RANK", 0),
            _env_int(env, "WORLD_SIZE", 1),
            _env_int(env, "LOCAL_RANK", 0),
        )
    if "SLURM_STEP_ID" in env and _env_int(env, "SLURM_PROCID") is not None:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        job = _env_int(env, "SLURM_JOB_ID", 0)
        return LaunchInfo(
            "srun",
            _env_int(env, "SLURM_PROCID"),
            _env_int(env, "SLURM_STEP_NUM_TASKS", _env_int(env, "SLURM_NTASKS", 1)),
            _env_int(env, "SLURM_LOCALID", 0),
            first_host(nodes) if nodes else None,
            29500 + job % 1000,
        )
    for launcher, rank, size, local in _MPI_FLAVOURS:
        if _env_int(env, rank) is not None:
            if _env_int(env, size) is None:
                raise LaunchError(f"{rank} is set but {size} is not: cannot tell the world size")
            return LaunchInfo(
                launcher, _env_int(env, rank), _env_int(env, size), _env_int(env, local, 0)
            )
    return LaunchInfo("python", 0, 1, 0)


def detect_process(device: str = "auto") -> ProcessInfo:
    """Rank, world size, local rank and device from the launcher's environment (no group yet).

    Writes RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT under srun, when unset)
    into the environment for the env:// rendezvous."""
    info = detect_launch()
    world, rank, local_rank = info.world_size, info.rank, info.local_rank
    if world < 1 or not 0 <= rank < world:
        raise LaunchError(
            f"{info.launcher}: rank {rank} / world size {world}: rank must be in [0, world size)"
        )
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    if info.master_addr is not None:
        os.environ.setdefault("MASTER_ADDR", info.master_addr)
    if info.master_port is not None:
        os.environ.setdefault("MASTER_PORT", str(info.master_port))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise LaunchError("train.device=cuda: no CUDA device is visible to this process")
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise LaunchError(
                f"local rank {local_rank} ({info.launcher}): only {n} CUDA devices on this node"
            )
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    return ProcessInfo(rank, world, local_rank, dev, info.launcher)


def disable_cpu_shm_comm_op() -> None:
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
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    elif "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise LaunchError(
            f"{proc.launcher}: world size {proc.world_size} but MASTER_ADDR/MASTER_PORT "
            "are not set: export them (the rank-0 host and a free port) or launch "
            "with torchrun"
        )
    if proc.device.type == "cuda":
        torch.cuda.set_device(proc.device)
    else:
        disable_cpu_shm_comm_op()
    import deepspeed

    backend = "nccl" if proc.device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = _elastic_attempt_store(timeout)
    if store is not None and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend, store=store, rank=proc.rank, world_size=proc.world_size, timeout=timeout
        )
    # DeepSpeed's comm layer adopts an existing group, or creates it (env://)
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, verbose=False, timeout=timeout
    )


def _elastic_attempt_store(timeout: datetime.timedelta) -> Optional[Any]:
    """A key space of its own for each torchrun restart.

    Under torchrun the workers share the agent's TCPStore, which survives a restart (``--max-restarts``)
    with the keys the failed attempt wrote: the restarted workers' ``new_group`` calls then read the
    dead processes' addresses and fail to connect (seen with torch 2.13 and gloo). Prefixing the keys
    with the attempt number (TORCHELASTIC_RESTART_COUNT) keeps attempts apart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return torch.distributed.PrefixStore(f"megaformer/attempt_{attempt}", agent_store)
