"""The TP x PP x DP process grid and DeepSpeed's ``mpu`` interface.

Ranks are laid out with tensor-parallel ranks adjacent (fastest-varying), then data-parallel, then
pipeline stages, as in Megatron-LM, so a TP group stays inside a node::

    rank = tp_rank + TP * (dp_rank + DP * pp_rank)

Groups (each a list of global ranks):
  * TP group: the TP ranks of one (dp, pp) position — they split each layer's matrices;
  * DP group: the DP ranks of one (tp, pp) position — they hold identical shards and average
    gradients (ZeRO partitions over this group only);
  * PP group: the stages of one (tp, dp) position;
  * model-parallel group: the TP x PP ranks of one data-parallel replica.

The object is also DeepSpeed's ``mpu``: it answers ``get_{tensor_model,pipeline_model,model,data}
_parallel_{rank,world_size,group}``.
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
    tp_groups: list[list[int]] = field(default_factory=list)
    dp_groups: list[list[int]] = field(default_factory=list)
    pp_groups: list[list[int]] = field(default_factory=list)
    mp_groups: list[list[int]] = field(default_factory=list)
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)

    # -------------------------------------------------------------- coordinates

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    # -------------------------------------------------------------- groups

    def _mine(self, groups: list[list[int]]) -> list[int]:
        return next(g for g in groups if self.rank in g)

    @property
    def tp_group_ranks(self) -> list[int]:
        return self._mine(self.tp_groups)

    @property
    def dp_group_ranks(self) -> list[int]:
        return self._mine(self.dp_groups)

    def group(self, kind: str) -> Optional[dist.ProcessGroup]:
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

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.group("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group_ranks

    # -------------------------------------------------------------- summary

    def summary(self) -> str:
        """One screen: the layout and which ranks share which group."""
        def fmt(groups: list[list[int]]) -> str:
            shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:8])
            return shown + (f" ... ({len(groups)} groups)" if len(groups) > 8 else "")

        lines = [f"topology: world {self.world_size} = TP {self.tp} x PP {self.pp} x DP {self.dp} "
                 "(TP ranks adjacent)",
                 f"  tensor-parallel groups:   {fmt(self.tp_groups)}",
                 f"  data-parallel groups:     {fmt(self.dp_groups)}",
                 f"  pipeline groups:          {fmt(self.pp_groups)}"]
        return "\n".join(lines)


def layout_groups(world_size: int, tp: int, pp: int) -> Topology:
    """The rank lists of every group (no process groups created; usable without torch.distributed)."""
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by TP*PP = {tp * pp}")
    dp = world_size // (tp * pp)
    topo = Topology(world_size, 0, tp, pp, dp)
    r = topo.rank_of
    topo.tp_groups = [[r(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)]
    topo.dp_groups = [[r(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)]
    topo.pp_groups = [[r(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]
    topo.mp_groups = [[r(t, d, p) for p in range(pp) for t in range(tp)] for d in range(dp)]
    return topo


def build_topology(world_size: int, rank: int, tp: int, pp: int) -> Topology:
    """Create every group (collectively: all ranks call this, in the same order)."""
    topo = layout_groups(world_size, tp, pp)
    topo.rank = rank
    for kind, groups in (("tp", topo.tp_groups), ("dp", topo.dp_groups), ("pp", topo.pp_groups),
                         ("mp", topo.mp_groups)):
        for ranks in groups:
            handle = dist.new_group(ranks) if dist.is_initialized() else None
            if rank in ranks:
                topo._handles[kind] = handle
    return topo
