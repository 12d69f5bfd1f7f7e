"""The conjugate communication operators of Megatron-style tensor and sequence parallelism.

Each is an autograd function whose backward is the adjoint of its forward, over an explicit
process group (the tensor-parallel group):

=====================  ===========================  ===========================
operator               forward                      backward
=====================  ===========================  ===========================
``copy_to_tp``  (f)    identity                     all-reduce
``reduce_from_tp`` (g) all-reduce                   identity
``gather_seq``         all-gather along the seq.    reduce-scatter along the seq.
``reduce_scatter_seq`` reduce-scatter along seq.    all-gather along the seq.
``scatter_seq``        keep this rank's seq. chunk  all-gather along the seq.
``gather_seq_split``   all-gather along the seq.    keep this rank's chunk
``sum_over_group``     all-reduce                   all-reduce
=====================  ===========================  ===========================

``sum_over_group`` is for a sum every rank of the group puts into its own loss (statistics over
a sequence split by context parallelism): each rank's loss depends on every rank's terms, so each
term's gradient is the sum of the ranks' gradients of the sum.

The sequence dimension is dim 1 of [batch, seq, hidden] activations. Every collective is recorded
(:func:`megaformer.comm.counters.record_collective`), so a benchmark can count the bytes each rank
sends per step (:class:`~megaformer.comm.counters.CommCounter`), with the bandwidth-optimal (ring)
algorithms' volumes over p ranks for a full (unsharded) tensor of N bytes: all-reduce 2(p-1)/p N, all-gather and reduce-scatter (p-1)/p N
each. Megatron's analytical TP volume, "4 all-reduces of b·s·h per layer per step", is then
4 · 2(p-1)/p · b·s·h·bytes; sequence parallelism replaces each all-reduce by a reduce-scatter plus an
all-gather, the same volume.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaformer.comm.counters import record_collective
from megaformer.comm.groups import size as _world

ProcessGroup = Optional[dist.ProcessGroup]


def all_reduce(
    x: torch.Tensor, group: ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """In-place all-reduce of ``x`` over ``group`` (returned; a no-op for a group of one)."""
    if _world(group) == 1:
        return x
    x = x.contiguous()
    record_collective("all_reduce", x.numel() * x.element_size(), _world(group))
    dist.all_reduce(x, op=op, group=group)
    return x


def all_gather_cat(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """cat([x_0, ..., x_{p-1}], dim): every rank's ``x`` over ``group``, in group order (no
    autograd; ``x`` itself for a group of one)."""
    n = _world(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    record_collective("all_gather", x.numel() * x.element_size() * n, n)
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def all_gather_seq(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """All-gather along the sequence dimension (:func:`all_gather_cat`)."""
    return all_gather_cat(x, group, dim)


def reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"sequence of {x.shape[dim]} cannot be split over {n} ranks")
    chunks = [c.contiguous() for c in x.chunk(n, dim=dim)]
    out = torch.empty_like(chunks[0])
    record_collective("reduce_scatter", x.numel() * x.element_size(), n)
    dist.reduce_scatter(out, chunks, group=group)
    return out


def split_seq(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"sequence of {x.shape[dim]} cannot be split over {n} ranks")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _identity(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x


def _all_reduce_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return all_reduce(x.clone(), group)  # never reduce into a tensor autograd still holds


def _conjugate(forward: Callable, backward: Callable) -> type:
    """An autograd function y = forward(x, group) whose gradient is backward(dy, group)."""

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):  # type: ignore[override]
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return backward(grad, ctx.group), None

    return Op


_CopyToTP = _conjugate(_identity, _all_reduce_copy)
_ReduceFromTP = _conjugate(_all_reduce_copy, _identity)
_GatherSeq = _conjugate(all_gather_seq, reduce_scatter_seq)
_ReduceScatterSeq = _conjugate(reduce_scatter_seq, all_gather_seq)
_ScatterSeq = _conjugate(split_seq, all_gather_seq)
_GatherSeqSplit = _conjugate(all_gather_seq, split_seq)
_SumOverGroup = _conjugate(_all_reduce_copy, _all_reduce_copy)


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """f: identity forward, all-reduce backward (input of a column-parallel layer)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """g: all-reduce forward, identity backward (output of a row-parallel layer)."""
    return _ReduceFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sequence parallel input of a column-parallel layer: all-gather fwd, reduce-scatter bwd."""
    return _GatherSeq.apply(x, group)


def reduce_scatter_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sequence parallel output of a row-parallel layer: reduce-scatter fwd, all-gather bwd."""
    return _ReduceScatterSeq.apply(x, group)


def scatter_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Enter the sequence-parallel region from a replicated activation: split fwd, gather bwd."""
    return _ScatterSeq.apply(x, group)


def gather_seq_split_bwd(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Leave the sequence-parallel region into a replicated one: gather fwd, split bwd."""
    return _GatherSeqSplit.apply(x, group)


def sum_over_group(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """sum_r x_r on every rank: all-reduce forward, all-reduce backward (a sum that enters every
    rank's loss)."""
    return _SumOverGroup.apply(x, group)
