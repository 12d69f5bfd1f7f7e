"""Small whole-group helpers: barrier, mean, and gathering picklable objects.

All are safe in a process without torch.distributed (a world of one): the barrier returns, the
mean is the value, the gathers return ``[obj]``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megaformer.comm.counters import record
from megaformer.comm.groups import size


def barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    """Wait for every rank of ``group`` (default: all ranks); nothing for a group of one."""
    if size(group) > 1:
        dist.barrier(group=group)


def all_reduce_mean(value: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """(1/n) sum_r value_r over the n ranks of ``group`` (default: all ranks); a new tensor when
    n > 1, ``value`` itself otherwise."""
    n = size(group)
    if n > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= n
    return value


def all_gather_objects(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``obj`` (small, picklable) on every rank of ``group``, in group order."""
    n = size(group)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_main(obj: Any, group: Optional[dist.ProcessGroup] = None) -> Any:
    """Rank 0's ``obj`` (small, picklable; ignored elsewhere) on every rank of ``group`` (default:
    all ranks; rank 0 of the world must be in it); ``obj`` itself for a group of one."""
    if size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def broadcast_with_shape(
    x: Optional[torch.Tensor], src: int, group: dist.ProcessGroup, dtype: torch.dtype
) -> torch.Tensor:
    """Global rank ``src``'s ``x`` (any shape up to 7 dimensions, ``dtype``; None elsewhere) on
    every rank of ``group``: a header of the shape, then the values (host tensors: a gloo group)."""
    if size(group) == 1:
        assert x is not None
        return x
    header = torch.zeros(8, dtype=torch.long)
    if x is not None:
        header[0] = x.dim()
        header[1 : 1 + x.dim()] = torch.tensor(x.shape)
    dist.broadcast(header, src=src, group=group)
    shape = tuple(int(d) for d in header[1 : 1 + int(header[0])])
    out = x.contiguous() if x is not None else torch.empty(shape, dtype=dtype)
    dist.broadcast(out, src=src, group=group)
    return out


def broadcast_tensor(x: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Group rank ``src``'s ``x`` into ``x`` on every rank of ``group`` (in place; a tensor of the
    same shape and dtype everywhere). Records the bytes ``src`` sends, once."""
    if size(group) == 1:
        return x
    if dist.get_rank(group) == src:
        record("broadcast", x.numel() * x.element_size())
    dist.broadcast(x, src=dist.get_global_rank(group, src), group=group)
    return x


def gather_to_main(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (small, picklable) on rank 0, in rank order; [] on the other ranks
    ([obj] without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: Optional[list] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []
