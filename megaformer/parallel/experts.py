"""Expert parallelism: the routed experts of each MoE block split over the expert-parallel group.

With ``parallel.expert = P`` the EP group is P consecutive data-parallel ranks (same tensor,
context and pipeline coordinates; :mod:`megaformer.parallel.topology`); rank ``r`` of it holds the
L = E / P experts ``r L ... (r + 1) L - 1`` of every MoE block (w1, w3 [L, f, d], w2 [L, d, f]).
Each rank routes its own tokens; the (token, expert) assignments, sorted by expert, travel to the
ranks owning their experts and back (GShard; DeepSpeed-MoE; Megatron's all-to-all dispatcher)::

    counts   c[s -> r, j]   assignments rank s sends to local expert j of rank r   (all-to-all of E ints)
    dispatch x rows, sorted by global expert = by destination rank   (all-to-all: uneven, or fixed
             blocks of C rows; the shared experts run while it is in flight)
    permute  received rows from (source, expert) order to (expert, source) order
    experts  L FFNs on their contiguous row blocks (grouped GEMM on CUDA, a loop elsewhere)
    return   inverse permutation, all-to-all back with the splits swapped

Dropless: every assignment travels, whatever the balance. Each all-to-all is an autograd function
whose backward is the all-to-all with the splits swapped (its adjoint), so the expert weights'
gradients collect the contributions of every rank's tokens. :class:`ExpertDispatch` says which
exchange runs and how tensor parallelism splits the tokens.

Gradient averaging: a non-expert parameter's gradient is averaged over the data- (x context-)
parallel group (D ranks). An expert's gradient already sums the contributions of the P ranks of
its EP group; DeepSpeed then all-reduces it over the expert-data group (the D / P ranks holding
the same experts) and divides by D (``engine._reduce_expert_gradients``; ZeRO 1/2 partition those
parameters over the expert-data group), which is the one-process mean over all D micro-batches. The parameters
say so the way DeepSpeed's own MoE layers do: ``allreduce = False`` and ``group_name``
(``ep_size_P``), with DeepSpeed's expert groups set to this topology's (:func:`deepspeed_groups`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaformer import comm
from megaformer.model.moe import expert_counts


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


def expert_major(
    recv: torch.Tensor, block_start: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of ``rows`` received rows goes in expert-major order, and the rows per expert.

    The buffer holds Q source blocks starting at ``block_start`` [Q] (ascending); block q holds
    ``recv[q, j]`` rows for local expert j = 0..L-1 in that order, then padding (zero rows) up to
    the next block. Returns ``dest`` [rows], a permutation: real row of (q, j) -> its place among
    expert j's rows (experts in order, sources in order within one), padding after all real
    rows; and ``counts`` [L], the rows per expert with the padding counted to the last expert
    (zero rows give zero outputs and zero weight gradients, so that is exact). Fixed shapes, no
    host read."""
    Q, L = recv.shape
    i = torch.arange(rows, device=recv.device)
    q = torch.searchsorted(block_start, i, right=True) - 1
    o = i - block_start[q]  # offset in the block
    ends = torch.cumsum(recv, 1)  # [Q, L] segment ends within a block
    j = (o.unsqueeze(1) >= ends[q]).sum(1)  # local expert; L: padding
    jc = j.clamp(max=L - 1)
    lengths = recv.t().reshape(-1)  # expert-major segments (j, q)
    em_start = (torch.cumsum(lengths, 0) - lengths).view(L, Q)
    real_dest = em_start[jc, q] + o - (ends - recv)[q, jc]
    real_upto = torch.cumsum(ends[:, -1], 0)  # real rows in blocks 0..q
    pad_dest = ends[:, -1].sum() + i - real_upto[q]
    dest = torch.where(j < L, real_dest, pad_dest)
    counts = recv.sum(0)
    counts = torch.cat([counts[:-1], counts[-1:] + (rows - ends[:, -1].sum())])
    return dest, counts


def _rows_per_destination(n: int, k: int, L: int, cap: Optional[int]) -> int:
    """The most rows ``n`` tokens can send one rank holding L experts: each token picks k distinct
    experts, so at most min(k, L) of that rank's; with a capacity at most ``cap`` per expert."""
    bound = n * min(k, L)
    return bound if cap is None else min(bound, L * cap)


class ExpertDispatch:
    """Sends the rows of each MoE block to the ranks of ``group`` (the expert-parallel group)
    holding their experts and brings the outputs back.

    Two exchanges, both exact:

    ``splits``  the uneven all-to-all: exactly the routed rows travel; all_to_all_single takes
                its split sizes as Python ints, so the counts are read on the host once per
                block's forward (a stream synchronisation on CUDA); the backward reuses them.
    ``padded``  a fixed-size exchange: every rank sends each rank C rows, its routed rows first,
                zero rows after, C the most it could route there (n min(k, L) dropless; with a
                capacity at most L * capacity). The counts are exchanged on the device and the
                received rows placed by a device-computed permutation, so nothing is read on the
                host, forward or backward; zero rows add nothing (no bias in the experts). The
                price is the padding: dropless, P min(k, L) / k times the rows of ``splits``.
    ``auto``    ``padded`` on CUDA when the experts run as grouped GEMMs and the padding costs at
                most 2x the rows (a capacity, or P min(k, L) <= 2k), else ``splits``.

    Under tensor parallelism (``tp_group``) every TP rank routes the whole micro-batch but sends
    only its share of the tokens (Megatron's dispatcher with sequence parallelism): the TP ranks
    of one EP rank all-gather the rows they received (each holds a slice of every expert's
    columns), compute their partial outputs, and reduce-scatter them back, so the all-to-all
    carries 1 / TP of the rows each TP rank used to send.

    ``overlap`` (the shared experts) runs while the dispatch exchange is in flight."""

    def __init__(self, group: Any, mode: str = "auto") -> None:
        self.group, self.mode = group, mode  # mode: parallel.expert_dispatch
        self.size = comm.size(group)

    def padded(self, x: torch.Tensor, experts: nn.Module, k: int, dropless: bool) -> bool:
        """Whether this call takes the fixed-size exchange (decided from shapes, dtypes and the
        device: no host read, no graph break)."""
        if self.mode != "auto":
            return self.mode == "padded"
        from megaformer.model.moe import _grouped_mm_ok

        L = experts.w1.shape[0]
        cheap = not dropless or self.size * min(k, L) <= 2 * k
        return x.device.type == "cuda" and cheap and _grouped_mm_ok(x, experts.w1)

    def block(
        self,
        moe: nn.Module,
        x: torch.Tensor,
        idx: torch.Tensor,
        gates: torch.Tensor,
        keep: Optional[torch.Tensor],
        cap: Optional[int],
        overlap: Optional[Callable[[], torch.Tensor]],
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The routed output of MoE block ``moe`` for x [B, T, d] whose tokens chose experts
        ``idx`` [B T, k] with weights ``gates``, ``keep`` [B T k] (None: all) the assignments
        within the capacity ``cap``: (routed output, ``overlap()``). The routed output is in the
        layout of the block's output: under tensor parallelism whole and replicated, or this
        rank's sequence chunk with sequence parallelism. A sequence the TP ranks cannot split
        evenly (a one-token generation step) is dispatched whole by every TP rank, the partial
        routed outputs reduced over TP after the combine."""
        B, T, d = x.shape
        k = idx.shape[1]
        tp = moe.tp_group if moe.tp_size > 1 else None
        tp_group = tp if T % moe.tp_size == 0 else None  # the token split
        if tp_group is not None:  # this TP rank's tokens: its sequence chunk
            lo = comm.rank(tp_group) * (T // moe.tp_size)
            span = slice(lo, lo + T // moe.tp_size)
            x = x[:, span]
            idx, gates = (t.view(B, T, k)[:, span].reshape(-1, k) for t in (idx, gates))
            keep = None if keep is None else keep.view(B, T, k)[:, span].reshape(-1)
        x2 = x.reshape(-1, d)
        n, E = x2.shape[0], moe.num_experts
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # sorted by expert, then token
        counts = expert_counts(flat, E)
        kept = counts
        if keep is not None:
            kept = expert_counts(flat, E, keep)
        experts = moe.experts
        if self.padded(x2, experts, k, cap is None):
            token = order // k
            bound = _rows_per_destination(n, k, experts.w1.shape[0], cap)
            y, shared = self._padded(x2[token], counts, kept, bound, experts, tp_group, overlap)
        else:
            if keep is not None:
                order = order[keep[order]]
            token = order // k
            y, shared = self._splits(x2[token], kept, experts, tp_group, overlap)
        out = combine(n, token, y, gates.reshape(-1)[order]).view(x.shape)
        if tp_group is not None and not moe.sequence_parallel:
            out = comm.gather_seq_split_bwd(out, tp_group)  # whole again, replicated
        elif tp is not None and tp_group is None:  # every TP rank's partial sums, reduced
            out = comm.reduce_from_tp(out, tp)
        return out, shared

    # ------------------------------------------------------------------ the two exchanges

    def _splits(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor,
        experts: nn.Module,
        tp_group: Any,
        overlap: Optional[Callable[[], torch.Tensor]],
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The uneven exchange: rank s sends rank r the counts[r L : (r + 1) L].sum() rows of r's
        experts and receives sum_s recv[s] rows; the split sizes are read on the host once."""
        P = self.size
        recv = exchange_counts(counts, self.group)  # [P, L]
        sizes = recv if tp_group is None else comm.all_gather_cat(recv, tp_group, 0)  # [tp P, L]
        # all_to_all_single takes its split sizes as Python ints: the one host read of a block
        host = torch.cat([counts.view(P, -1).sum(1), sizes.sum(1)]).tolist()
        send = host[:P]
        t = 0 if tp_group is None else comm.rank(tp_group)
        back = host[P + t * P : P + (t + 1) * P]
        pending: list[Any] = []
        received = comm.AllToAllStart.apply(rows, back, send, self.group, pending)
        shared = overlap() if overlap is not None else None
        pending.pop().wait()
        width = sum(back)
        if tp_group is not None:  # every TP rank's rows, each block padded to the longest
            tp = comm.size(tp_group)
            per_rank = [sum(host[P + u * P : P + (u + 1) * P]) for u in range(tp)]
            width = max(per_rank)
            received = F.pad(received, (0, 0, 0, width - sum(back)))
        y = self._compute(received, sizes, width, experts, tp_group, None)
        return AllToAll.apply(y[: sum(back)], send, back, self.group), shared

    def _padded(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor,
        kept: torch.Tensor,
        bound: int,
        experts: nn.Module,
        tp_group: Any,
        overlap: Optional[Callable[[], torch.Tensor]],
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The fixed-size exchange: row a (expert e, position p among e's rows) goes to slot
        (e // L) C + sum_{e' < e in its rank's block} kept[e'] + p when p < kept[e], else
        nowhere (its output is zero); every rank sends and receives P blocks of C rows."""
        P, C = self.size, bound
        M, E = rows.shape[0], counts.numel()
        L = E // P
        expert = torch.repeat_interleave(torch.arange(E, device=rows.device), counts, output_size=M)
        pos = torch.arange(M, device=rows.device) - (torch.cumsum(counts, 0) - counts)[expert]
        per_rank = kept.view(P, L)
        offset = (torch.cumsum(per_rank, 1) - per_rank).reshape(-1)  # expert's start in its block
        slot = torch.where(
            pos < kept[expert],
            (expert // L) * C + offset[expert] + pos,
            torch.full_like(pos, P * C),
        )
        send = rows.new_zeros(P * C + 1, rows.shape[1]).index_copy(0, slot, rows)[: P * C]
        recv = exchange_counts(kept, self.group)
        sizes = recv if tp_group is None else comm.all_gather_cat(recv, tp_group, 0)
        pending: list[Any] = []
        received = comm.AllToAllStart.apply(send, [C] * P, [C] * P, self.group, pending)
        shared = overlap() if overlap is not None else None
        pending.pop().wait()
        y = self._compute(received, sizes, P * C, experts, tp_group, C)
        back = AllToAll.apply(y, [C] * P, [C] * P, self.group)
        return torch.cat([back, back.new_zeros(1, back.shape[1])])[slot], shared

    def _compute(
        self,
        received: torch.Tensor,
        sizes: torch.Tensor,
        width: int,
        experts: nn.Module,
        tp_group: Any,
        block: Optional[int],
    ) -> torch.Tensor:
        """The experts on the received rows (``width`` per TP rank, ``sizes`` [tp P, L] the real
        ones): gathered over the TP ranks, put in expert-major order, computed, put back, their
        partial sums reduce-scattered."""
        tp = 1 if tp_group is None else comm.size(tp_group)
        if tp > 1:
            received = comm.gather_seq(received.unsqueeze(0), tp_group).squeeze(0)
        if block is not None:  # padded: every source's block holds ``block`` rows
            starts = torch.arange(sizes.shape[0], device=sizes.device) * block
        else:  # uneven: sources back to back, every TP rank's rows from ``u width`` on
            per = sizes.sum(1).view(tp, -1)
            starts = (torch.cumsum(per, 1) - per) + width * torch.arange(
                tp, device=per.device
            ).unsqueeze(1)
            starts = starts.reshape(-1)
        dest, per_expert = expert_major(sizes, starts, received.shape[0])
        ordered = torch.zeros_like(received).index_copy(0, dest, received)
        if block is not None:
            from megaformer.model.moe import _compute_dtype

            out = experts.grouped(ordered, per_expert, _compute_dtype(ordered))
        else:
            out = experts(ordered, per_expert)
        out = out[dest]
        if tp > 1:
            out = comm.reduce_scatter_to_seq(out.unsqueeze(0), tp_group).squeeze(0)
        return out


def combine(n: int, token: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out_n = sum_a [token_a = n] w_a y_a over ``n`` tokens: the k terms of a token accumulate
    in fp32, one cast at the end."""
    return (
        y.new_zeros((n, y.shape[1]), dtype=torch.float32)
        .index_add(0, token, y.float() * w.unsqueeze(1).float())
        .to(y.dtype)
    )


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
        moe.expert_dispatch = ExpertDispatch(group)


def configure_routing(model: nn.Module, topo: Any, dispatch: str) -> None:
    """After the experts are distributed: the exchange every MoE block's dispatch takes
    (``parallel.expert_dispatch``), and under context parallelism the group the router's
    statistics are summed over (each rank routes its part of every sequence)."""
    from megaformer.model.moe import moe_layers

    for moe in moe_layers(model):
        if moe.expert_dispatch is not None:
            moe.expert_dispatch.mode = dispatch
        if topo.cp > 1:
            moe.cp_group, moe.cp_size = topo.groups.cp, topo.cp


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
