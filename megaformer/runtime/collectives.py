"""Which device a collective's tensors must be on, and a process group that takes host tensors.

A backend serves some device types only: gloo the host (and CUDA when built with it), NCCL CUDA
alone. On a CUDA run the default group is NCCL's (DeepSpeed creates it with ``"nccl"``), so a host
tensor passed to ``broadcast``/``all_reduce``/``barrier`` on it raises "No backend type associated
with device type cpu". Small control-plane collectives (a flag, a handful of integers, pickled
descriptions) therefore either put their tensor on :func:`collective_device` of their group, or run
on :func:`host_group`: the default group when it takes host tensors, else a gloo group of all ranks.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

# the device type of a backend named alone (``init_process_group("nccl")``)
_BACKEND_DEVICE = {"gloo": "cpu", "mpi": "cpu", "ucc": "cpu", "nccl": "cuda", "xccl": "xpu"}

_host_groups: dict[int, Any] = {}  # id(default group) -> its host group


def device_types(group: Optional[Any] = None) -> list[str]:
    """The device types ``group``'s backends serve, from its backend configuration: ``"nccl"``,
    ``"cuda:gloo"`` (one backend for CUDA only) or ``"cpu:gloo,cuda:nccl"``."""
    config = str(dist.get_backend_config(group))
    if ":" not in config:
        return [_BACKEND_DEVICE.get(config, "cuda")]
    return [part.split(":", 1)[0] for part in config.split(",")]


def collective_device(group: Optional[Any] = None) -> torch.device:
    """The device for a tensor of a collective on ``group`` (default: the default group): the host
    when a backend of the group takes host tensors, else the current accelerator. The host without
    a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    types = device_types(group)
    if "cpu" in types:
        return torch.device("cpu")
    if types[0] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(types[0])


def host_group(timeout: Optional[datetime.timedelta] = None) -> Optional[Any]:
    """A group of all ranks whose collectives take host tensors: None (the default group) when the
    default group does, else a gloo group made on the first call (a collective: every rank calls
    at the same point) and reused while the default group lives."""
    if not (dist.is_available() and dist.is_initialized()) or "cpu" in device_types(None):
        return None
    return gloo_group_of_all(_host_groups, timeout)


def gloo_group_of_all(cache: dict[int, Any], timeout: Optional[datetime.timedelta]) -> Any:
    """A gloo group of all ranks, made on the first call (a collective) and kept in ``cache``
    while the default group it was made beside lives."""
    world = id(dist.group.WORLD)
    if world not in cache:
        cache.clear()
        cache[world] = dist.new_group(backend="gloo", timeout=timeout)
    return cache[world]
