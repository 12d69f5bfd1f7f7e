"""The TP x CP x DP x PP process grid and DeepSpeed's ``mpu`` interface.

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
    expert-data group is the DP ranks holding the same experts (they average those experts'
    gradients): ``dp_rank = ep_rank + EP * edp_rank``.

The object is also DeepSpeed's ``mpu``: it answers ``get_{tensor_model,pipeline_model,model,data}
_parallel_{rank,world_size,group}``; its data-parallel group is the replica group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist


@dataclass
class Topology:
    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    tp_groups: list[list[int]] = field(default_factory=list)
    dp_groups: list[list[int]] = field(default_factory=list)
    pp_groups: list[list[int]] = field(default_factory=list)
    mp_groups: list[list[int]] = field(default_factory=list)
    cp_groups: list[list[int]] = field(default_factory=list)
    replica_groups: list[list[int]] = field(default_factory=list)
    ep_groups: list[list[int]] = field(default_factory=list)
    edp_groups: list[list[int]] = field(default_factory=list)
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)

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

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

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

    def group(self, kind: str) -> Optional[dist.ProcessGroup]:
        """This rank's process group of ``kind``: tp, cp, dp, replica, pp, mp, ep or edp."""
        return self._handles.get(kind)

    # -------------------------------------------------------------- DeepSpeed mpu interface

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.group("tp")

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tp_group_ranks[0]

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp

    def get_pipeline_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.group("pp")

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank + self.tp * self.pp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp * self.pp

    def get_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.group("mp")

    # DeepSpeed's "data parallel" is the gradient-averaging group: DP x CP.
    def get_data_parallel_rank(self) -> int:
        return self.replica_rank

    def get_data_parallel_world_size(self) -> int:
        return self.replicas

    def get_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.group("replica")

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
        lines = [f"topology: world {self.world_size} = TP {self.tp}{cp} x PP {self.pp} x "
                 f"DP {self.dp}{ep} (TP ranks adjacent)",
                 f"  tensor-parallel groups:   {fmt(self.tp_groups)}"]
        if self.cp > 1:
            lines.append(f"  context-parallel groups:  {fmt(self.cp_groups)}")
        lines.append(f"  data-parallel groups:     {fmt(self.dp_groups)}")
        if self.ep > 1:
            lines.append(f"  expert-parallel groups:   {fmt(self.ep_groups)}")
            lines.append(f"  expert-data groups:       {fmt(self.edp_groups)}")
        lines.append(f"  pipeline groups:          {fmt(self.pp_groups)}")
        return "\n".join(lines)


def layout_groups(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> Topology:
    """The rank lists of every group (no process groups created; usable without torch.distributed)."""
    if world_size % (tp * pp * cp):
        what = "TP*PP" if cp == 1 else "TP*CP*PP"
        raise ValueError(f"world size {world_size} is not divisible by {what} = {tp * pp * cp}")
    dp = world_size // (tp * pp * cp)
    if dp % ep:
        raise ValueError(f"data-parallel size {dp} is not divisible by the expert-parallel size {ep}")
    topo = Topology(world_size, 0, tp, pp, dp, cp, ep)
    r = topo.rank_of
    T, C, D, P = range(tp), range(cp), range(dp), range(pp)
    topo.tp_groups = [[r(t, d, p, c) for t in T] for p in P for d in D for c in C]
    topo.cp_groups = [[r(t, d, p, c) for c in C] for p in P for d in D for t in T]
    topo.dp_groups = [[r(t, d, p, c) for d in D] for p in P for c in C for t in T]
    topo.replica_groups = [[r(t, d, p, c) for d in D for c in C] for p in P for t in T]
    topo.pp_groups = [[r(t, d, p, c) for p in P] for d in D for c in C for t in T]
    topo.mp_groups = [[r(t, d, p, c) for p in P for t in T] for d in D for c in C]
    E, G = range(ep), range(dp // ep)
    topo.ep_groups = [[r(t, e + ep * g, p, c) for e in E] for p in P for g in G for c in C for t in T]
    topo.edp_groups = [[r(t, e + ep * g, p, c) for g in G] for p in P for e in E for c in C for t in T]
    return topo


def build_topology(world_size: int, rank: int, tp: int, pp: int, cp: int = 1,
                   ep: int = 1) -> Topology:
    """Create every group (collectively: all ranks call this, in the same order)."""
    topo = layout_groups(world_size, tp, pp, cp, ep)
    topo.rank = rank
    kinds = [("tp", topo.tp_groups), ("dp", topo.dp_groups), ("pp", topo.pp_groups),
             ("mp", topo.mp_groups)]
    if cp > 1:
        kinds += [("cp", topo.cp_groups), ("replica", topo.replica_groups)]
    if ep > 1:
        kinds += [("ep", topo.ep_groups), ("edp", topo.edp_groups)]
    for kind, groups in kinds:
        for ranks in groups:
            handle = dist.new_group(ranks) if dist.is_initialized() else None
            if rank in ranks:
                topo._handles[kind] = handle
    if cp == 1:  # the replica group is the DP group: one communicator, not two
        topo._handles["replica"] = topo._handles.get("dp")
    return topo
