"""The TP x CP x DP x PP process grid (experts carved out of DP) and DeepSpeed's ``mpu`` interface.

Ranks are laid out with tensor-parallel ranks adjacent (fastest-varying), then context-parallel,
then data-parallel, then pipeline stages, as in Megatron-LM, so a TP group stays inside a node::

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

Groups (each a list of global ranks):
  * TP group: the TP ranks of one (cp, dp, pp) position — they split each layer's matrices;
  * CP group: the context ranks of one (tp, dp, pp) position — they split each sequence;
  * DP group: the DP ranks of one (tp, cp, pp) position — they read different samples;
  * replica group (DP x CP): the ranks of one (tp, pp) position — they hold identical shards and
    average gradients; ZeRO partitions over this group. Without context parallelism it is the DP
    group;
  * PP group: the stages of one (tp, cp, dp) position;
  * model-parallel group: the TP x PP ranks of one (cp, dp) position;
  * expert groups, when experts are split over ``EP`` ranks carved out of data parallelism: the EP
    group is ``EP`` consecutive DP ranks (they hold different experts and exchange tokens), the
    expert-data group is the DP x CP ranks holding the same experts (they average those experts'
    gradients): ``dp_rank = ep_rank + EP * edp_rank``.

Degrees are always named, and listed, in one order: TP, CP, DP, PP, EP (:data:`DEGREES`; the
fields of :class:`Degrees`, :class:`Topology` and the analytic model's ``Layout``).

:func:`build_topology` creates every group: ``topo.groups`` (:class:`megaformer.comm.ProcessGroups`)
holds one real group per kind, a group of one at degree 1; ``topo.group(kind)`` is the same by name
and raises on a kind that does not exist.

The object is also DeepSpeed's ``mpu``: it answers ``get_{tensor_model,pipeline_model,model,data}
_parallel_{rank,world_size,group}``; its data-parallel group is the replica group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from megaformer.comm import KINDS, ProcessGroups, check_kind

#: the parallel degrees, in the one order every signature and table uses
DEGREES = ("tp", "cp", "dp", "pp", "ep")


@dataclass(frozen=True)
class Degrees:
    """The parallel degrees of a layout: world = TP x CP x DP x PP, EP divides DP."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp


@dataclass
class Topology:
    world_size: int
    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int = 1
    tp_groups: list[list[int]] = field(default_factory=list)
    dp_groups: list[list[int]] = field(default_factory=list)
    pp_groups: list[list[int]] = field(default_factory=list)
    mp_groups: list[list[int]] = field(default_factory=list)
    cp_groups: list[list[int]] = field(default_factory=list)
    replica_groups: list[list[int]] = field(default_factory=list)
    ep_groups: list[list[int]] = field(default_factory=list)
    edp_groups: list[list[int]] = field(default_factory=list)
    _groups: Optional[ProcessGroups] = field(default=None, repr=False)

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.tp, self.cp, self.dp, self.pp, self.ep)

    # -------------------------------------------------------------- coordinates

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def replica_rank(self) -> int:
        """Rank in the replica (DP x CP) group."""
        return self.cp_rank + self.cp * self.dp_rank

    @property
    def replicas(self) -> int:
        """Size of the replica (DP x CP) group."""
        return self.dp * self.cp

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def expert_replicas(self) -> int:
        """Size of the expert-data group: the DP / EP x CP ranks holding the same experts."""
        return self.dp // self.ep * self.cp

    @property
    def expert_replica_rank(self) -> int:
        """Rank in the expert-data group (its ranks ordered by edp rank, then context rank)."""
        return self.edp_rank * self.cp + self.cp_rank

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at grid coordinates (tp, cp, dp, pp)."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    # -------------------------------------------------------------- groups

    def _mine(self, groups: list[list[int]]) -> list[int]:
        return next(g for g in groups if self.rank in g)

    @property
    def tp_group_ranks(self) -> list[int]:
        return self._mine(self.tp_groups)

    @property
    def dp_group_ranks(self) -> list[int]:
        return self._mine(self.dp_groups)

    @property
    def replica_group_ranks(self) -> list[int]:
        return self._mine(self.replica_groups)

    @property
    def groups(self) -> ProcessGroups:
        """This rank's process group of every kind (a group of one at degree 1)."""
        if self._groups is None:
            raise RuntimeError(
                "this topology holds rank lists only (layout_groups): "
                "build_topology creates its process groups"
            )
        return self._groups

    def group(self, kind: str) -> dist.ProcessGroup:
        """This rank's process group of ``kind`` (tp, cp, dp, pp, ep, edp, replica, mp); an
        unknown kind raises :class:`megaformer.comm.UnknownGroupError`."""
        kind = check_kind(kind)
        return getattr(self.groups, kind)

    # -------------------------------------------------------------- DeepSpeed mpu interface

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.tp

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tp_group_ranks[0]

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.pp

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank + self.tp * self.pp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp * self.pp

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.mp

    # DeepSpeed's "data parallel" is the gradient-averaging group: DP x CP.
    def get_data_parallel_rank(self) -> int:
        return self.replica_rank

    def get_data_parallel_world_size(self) -> int:
        return self.replicas

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.replica

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.replica_group_ranks

    # -------------------------------------------------------------- summary

    def summary(self) -> str:
        """One screen: the layout and which ranks share which group."""

        def fmt(groups: list[list[int]]) -> str:
            shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:8])
            return shown + (f" ... ({len(groups)} groups)" if len(groups) > 8 else "")

        cp = f" x CP {self.cp}" if self.cp > 1 else ""
        ep = f" (EP {self.ep} inside DP)" if self.ep > 1 else ""
        lines = [
            f"topology: world {self.world_size} = TP {self.tp}{cp} x PP {self.pp} x "
            f"DP {self.dp}{ep} (TP ranks adjacent)",
            f"  tensor-parallel groups:   {fmt(self.tp_groups)}",
        ]
        if self.cp > 1:
            lines.append(f"  context-parallel groups:  {fmt(self.cp_groups)}")
        lines.append(f"  data-parallel groups:     {fmt(self.dp_groups)}")
        if self.ep > 1:
            lines.append(f"  expert-parallel groups:   {fmt(self.ep_groups)}")
            lines.append(f"  expert-data groups:       {fmt(self.edp_groups)}")
        lines.append(f"  pipeline groups:          {fmt(self.pp_groups)}")
        return "\n".join(lines)


def layout_groups(
    world_size: int, *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1
) -> Topology:
    """The rank lists of every group (no process groups created; usable without torch.distributed).
    DP = world_size / (TP x CP x PP)."""
    if world_size % (tp * pp * cp):
        what = "TP*PP" if cp == 1 else "TP*CP*PP"
        raise ValueError(f"world size {world_size} is not divisible by {what} = {tp * pp * cp}")
    dp = world_size // (tp * pp * cp)
    if dp % ep:
        raise ValueError(
            f"data-parallel size {dp} is not divisible by the expert-parallel size {ep}"
        )
    topo = Topology(world_size, 0, tp, cp, dp, pp, ep)
    T, C, D, P = range(tp), range(cp), range(dp), range(pp)

    def r(t: int, d: int, p: int, c: int) -> int:
        return topo.rank_of(tp=t, cp=c, dp=d, pp=p)

    topo.tp_groups = [[r(t, d, p, c) for t in T] for p in P for d in D for c in C]
    topo.cp_groups = [[r(t, d, p, c) for c in C] for p in P for d in D for t in T]
    topo.dp_groups = [[r(t, d, p, c) for d in D] for p in P for c in C for t in T]
    topo.replica_groups = [[r(t, d, p, c) for d in D for c in C] for p in P for t in T]
    topo.pp_groups = [[r(t, d, p, c) for p in P] for d in D for c in C for t in T]
    topo.mp_groups = [[r(t, d, p, c) for p in P for t in T] for d in D for c in C]
    E, G = range(ep), range(dp // ep)
    topo.ep_groups = [
        [r(t, e + ep * g, p, c) for e in E] for p in P for g in G for c in C for t in T
    ]
    # the ranks holding the same experts: every other EP group's, and every context rank's (each
    # routes its part of the same sequences into them)
    topo.edp_groups = [
        [r(t, e + ep * g, p, c) for g in G for c in C] for p in P for e in E for t in T
    ]
    return topo


def build_topology(
    world_size: int, rank: int, *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1
) -> Topology:
    """Create every group (collectively: all ranks call this, in the same order).

    Each distinct set of ranks becomes one communicator, shared by the kinds that have it (the
    replica group is the DP group without context parallelism; every degree-1 kind is this rank's
    group of one)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "build_topology creates process groups: initialise torch.distributed "
            "first (layout_groups gives the rank lists alone)"
        )
    topo = layout_groups(world_size, tp=tp, cp=cp, pp=pp, ep=ep)
    topo.rank = rank
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def mine(groups: list[list[int]]) -> dist.ProcessGroup:
        for ranks in groups:  # every rank creates every group, in the same order
            key = tuple(sorted(ranks))
            if key not in made:
                made[key] = dist.new_group(list(key))
        return made[tuple(sorted(topo._mine(groups)))]

    topo._groups = ProcessGroups(**{kind: mine(getattr(topo, f"{kind}_groups")) for kind in KINDS})
    return topo
