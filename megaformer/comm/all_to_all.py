"""Uneven all-to-all: the one exchange behind expert dispatch and all-to-all context parallelism.

Over a group of p ranks, rank s sends rows ``in_splits[r]`` of its input (consecutive, in rank
order) to rank r and receives ``out_splits[q]`` rows from each rank q, concatenated in rank order:

    out_r = cat_q ( x_q[ rows sent by q to r ] ),     sum_q out_splits[q] rows in all

Equal splits (``None``) cut dim 0 into p equal blocks each way (DeepSpeed-Ulysses' exchange). The
adjoint of an all-to-all is the all-to-all with the splits swapped, so :class:`AllToAll`'s backward
is one more call of :func:`all_to_all`. :class:`AllToAllStart` returns while the exchange is in
flight (its work handle appended to a list the caller waits on), so independent work can run
meanwhile. Bytes recorded: exactly what this rank sends to the others
(its own block excluded).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megaformer.comm.counters import record
from megaformer.comm.groups import rank, size


def _equal(rows: int, n: int) -> list[int]:
    if rows % n:
        raise ValueError(f"all-to-all: {rows} rows cannot be split into {n} equal blocks")
    return [rows // n] * n


def all_to_all(
    x: torch.Tensor,
    out_splits: Optional[list[int]],
    in_splits: Optional[list[int]],
    group: dist.ProcessGroup,
    kind: Optional[str] = "all_to_all",
    pending: Optional[list[Any]] = None,
) -> torch.Tensor:
    """Rows ``in_splits[q]`` of ``x`` (in order) to rank q of ``group``; rows ``out_splits[q]``
    from rank q, concatenated in rank order (``None``: equal blocks of dim 0). The bytes sent to
    other ranks are recorded under ``kind`` (``None``: not recorded). With ``pending`` the
    exchange is started only: its work handle is appended there, and the result is valid once
    the caller has waited on it."""
    n = size(group)
    in_splits = _equal(x.shape[0], n) if in_splits is None else in_splits
    out_splits = _equal(x.shape[0], n) if out_splits is None else out_splits
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    if kind is not None:
        row = x[0].numel() * x.element_size() if x.dim() > 0 and x.shape[0] else 0
        record(kind, row * (sum(in_splits) - in_splits[rank(group)]))
    work = dist.all_to_all_single(
        out, x.contiguous(), out_splits, in_splits, group=group, async_op=pending is not None
    )
    if pending is not None:
        pending.append(work)
    return out


class AllToAll(torch.autograd.Function):
    """Differentiable uneven all-to-all: forward sends ``in_splits`` rows, receives
    ``out_splits``; backward sends the gradient back with the splits swapped."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class AllToAllStart(torch.autograd.Function):
    """:class:`AllToAll` started only: forward appends the exchange's work handle to
    ``pending`` (wait on it before reading the result); backward is the blocking exchange with
    the splits swapped."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: Any,
        pending: list[Any],
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all(x, out_splits, in_splits, group, pending=pending)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None, None
