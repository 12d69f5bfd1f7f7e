"""Expert parallelism: the routed experts of each MoE block split over the expert-parallel group.

With ``parallel.expert = P`` the EP group is P consecutive data-parallel ranks (same tensor,
context and pipeline coordinates; :mod:`megaformer.parallel.topology`); rank ``r`` of it holds the
L = E / P experts ``r L ... (r + 1) L - 1`` of every MoE block (w1, w3 [L, f, d], w2 [L, d, f]).
Each rank routes its own tokens; the (token, expert) assignments, sorted by expert, travel to the
ranks owning their experts and back (GShard; DeepSpeed-MoE; Megatron's all-to-all dispatcher)::

    counts   c[s -> r, j]   assignments rank s sends to local expert j of rank r   (all-to-all of E ints)
    dispatch x rows, sorted by global expert = by destination rank             (all-to-all, uneven)
    permute  received rows from (source, expert) order to (expert, source) order
    experts  L FFNs on their contiguous row blocks (grouped GEMM on CUDA, a loop elsewhere)
    return   inverse permutation, all-to-all back with the splits swapped

Dropless: every assignment travels, whatever the balance (uneven splits). Each all-to-all is an
autograd function whose backward is the all-to-all with the splits swapped (its adjoint), so the
expert weights' gradients collect the contributions of every rank's tokens.

Gradient averaging: a non-expert parameter's gradient is averaged over the data-parallel group
(D ranks). An expert's gradient already sums the contributions of the P ranks of its EP group;
DeepSpeed then all-reduces it over the expert-data group (D / P ranks holding the same experts)
and divides by D (``engine._reduce_expert_gradients``; ZeRO 1/2 partition those parameters over
the expert-data group), which is the one-process mean over all D micro-batches. The parameters
say so the way DeepSpeed's own MoE layers do: ``allreduce = False`` and ``group_name``
(``ep_size_P``), with DeepSpeed's expert groups set to this topology's (:func:`deepspeed_groups`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megaformer import comm


def group_name(ep: int) -> str:
    """DeepSpeed's name for the expert groups of degree ``ep`` (``deepspeed.moe.layer.MoE``'s)."""
    return f"ep_size_{ep}"


def is_expert_param(p: torch.nn.Parameter) -> bool:
    """A parameter split over the expert-parallel group (DeepSpeed's ``is_moe_param``)."""
    return getattr(p, "allreduce", True) is False


#: differentiable uneven all-to-all (backward: the same exchange with the splits swapped)
AllToAll = comm.AllToAll


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """counts [E] (this rank's assignments per global expert) -> [P, L]: row s holds what rank s
    sends to each of this rank's L local experts."""
    recv = comm.all_to_all(counts, None, None, group, kind=None)  # E / P ints to each rank
    return recv.view(comm.size(group), -1)


def expert_major(recv: torch.Tensor, total: int) -> torch.Tensor:
    """The permutation taking rows received in (source rank, local expert) order to (local
    expert, source rank) order: ``rows[perm]`` is expert-major. ``recv`` [P, L] counts,
    ``total`` their sum (the rows received, known on the host from the split sizes)."""
    flat = recv.reshape(-1)
    start = torch.cumsum(flat, 0) - flat  # segment starts, source-major
    lengths = recv.t().reshape(-1)  # segments in expert-major order
    starts = start.view(recv.shape).t().reshape(-1)
    new_start = torch.cumsum(lengths, 0) - lengths
    shift = torch.repeat_interleave(starts - new_start, lengths, output_size=total)
    return torch.arange(total, device=recv.device) + shift


def dispatch_to_experts(
    x: torch.Tensor, counts: torch.Tensor, experts: nn.Module, group: Any
) -> torch.Tensor:
    """Rows ``x`` sorted by global expert (``counts[e]`` for expert e, all E) -> the expert
    outputs in the same order, computed on the ranks of ``group`` holding each expert."""
    P = dist.get_world_size(group)
    recv = exchange_counts(counts, group)  # [P, L]
    send_splits = counts.view(P, -1).sum(1)
    # the one host read of a layer: all_to_all_single takes its split sizes as Python ints
    splits = torch.stack([send_splits, recv.sum(1)]).tolist()
    send, back = splits
    received = AllToAll.apply(x, back, send, group)
    perm = expert_major(recv, sum(back))
    y = experts(received[perm], recv.sum(0))
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return AllToAll.apply(y[inverse], send, back, group)


@torch.no_grad()
def distribute_experts(model: nn.Module, topo: Any) -> None:
    """Keep this rank's E / P experts of every MoE block in ``model`` (a model or one block) and
    mark their parameters for DeepSpeed's expert-data-parallel reduction. A block is given its
    values whole (from the seed or a checkpoint) and split at once, before the next is built
    (:class:`megaformer.parallel.build.Materializer`), so EP = P starts from EP = 1's weights while
    a rank holds its experts and one block's. Blocks already split are left as they are; a no-op
    for EP = 1."""
    from megaformer.model.moe import moe_layers

    P = topo.ep
    if P == 1:
        return
    name = group_name(P)
    for moe in moe_layers(model):
        ex = moe.experts
        if moe.ep_size == P:
            continue  # split already
        L = ex.w1.shape[0] // P
        first = topo.ep_rank * L
        for attr in ("w1", "w3", "w2"):
            full = getattr(ex, attr)
            if full is None:
                continue
            p = nn.Parameter(full.data[first : first + L].clone())
            for key in ("tensor_model_parallel", "partition_dim"):  # TP marks, if sharded
                if hasattr(full, key):
                    setattr(p, key, getattr(full, key))
            p.allreduce, p.group_name = False, name  # DeepSpeed's MoE parameter marks
            p.expert_parallel = P
            setattr(ex, attr, p)
        ex.first_expert = first
        group = topo.groups.ep
        moe.ep_group, moe.ep_size = group, P
        moe.expert_dispatch = functools.partial(dispatch_to_experts, group=group)


def expert_offset(p: torch.nn.Parameter, topo: Optional[Any]) -> int:
    """Where this rank's experts start along dim 0 of the whole [E, ...] tensor (0: not split)."""
    if topo is None or not is_expert_param(p):
        return 0
    return topo.ep_rank * p.shape[0]


# ----------------------------------------------------------------------------- DeepSpeed


def deepspeed_groups(topo: Any) -> None:
    """Register this topology's EP and expert-data groups as DeepSpeed's expert groups
    (``deepspeed.utils.groups``, name ``ep_size_P``), after checking they are the ones DeepSpeed
    would build for this layout (``_get_expert_parallel_ranks``: EP groups are consecutive DP
    ranks, expert-data groups the strided rest). Collective-free; call on every rank."""
    from deepspeed.utils import groups

    P = topo.ep
    if P == 1:
        return
    name = group_name(P)
    if topo.cp == 1:  # DeepSpeed's rank formula knows no context parallelism
        ep_ranks, edp_ranks = groups._get_expert_parallel_ranks(
            topo.world_size, topo.tp, P, topo.pp
        )
        mine = topo._mine
        if sorted(map(sorted, ep_ranks)) != sorted(map(sorted, topo.ep_groups)) or sorted(
            map(sorted, edp_ranks)
        ) != sorted(map(sorted, topo.edp_groups)):
            raise AssertionError(
                f"expert groups differ from DeepSpeed's: {mine(topo.ep_groups)} vs {ep_ranks}"
            )
    groups._EXPERT_PARALLEL_GROUP[name] = topo.groups.ep
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = topo._mine(topo.ep_groups)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = topo.groups.edp
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = topo._mine(topo.edp_groups)


@contextlib.contextmanager
def recognised_by_deepspeed(enabled: bool) -> Iterator[None]:
    """While DeepSpeed builds its engine: treat megaformer's MoE blocks as MoE layers.

    DeepSpeed switches its expert-gradient path on (``engine.has_moe_layers``: expert gradients
    reduced over their expert-data group; ZeRO 1/2 and the bf16 optimizer partition expert
    parameter groups over it and average the expert norm) when the model holds a
    ``deepspeed.moe.layer.MoE``; the engine checks ``isinstance(module, MoE)`` with the name
    bound in ``deepspeed.runtime.engine``, which this widens to megaformer's block too."""
    if not enabled:
        yield
        return
    import deepspeed.runtime.engine as ds_engine

    from megaformer.model.moe import MoE

    saved = ds_engine.MoE
    ds_engine.MoE = (saved, MoE)
    try:
        yield
    finally:
        ds_engine.MoE = saved
