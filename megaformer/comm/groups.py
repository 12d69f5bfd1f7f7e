"""Typed process-group handles: one frozen object per rank, one real group per kind.

``torch.distributed`` reads ``group=None`` as the whole world, so a missing group is never a safe
stand-in for "degree 1". Every field of :class:`ProcessGroups` is a real group; at degree 1 it is
a group of one (this rank alone), on which every collective of :mod:`megaformer.comm` is a no-op.
Code that skips work at degree 1 asks :func:`size`, not ``is None``.

Kinds (the grid TP x CP x DP x PP, experts carved out of DP; :mod:`megaformer.parallel.topology`):

=========  =================================================================================
``tp``     tensor-parallel ranks of one (cp, dp, pp) position
``cp``     context-parallel ranks of one (tp, dp, pp) position
``dp``     data-parallel ranks of one (tp, cp, pp) position
``pp``     pipeline stages of one (tp, cp, dp) position
``ep``     expert-parallel ranks: EP consecutive DP ranks
``edp``    expert-data ranks: the DP ranks holding the same experts
``replica`` DP x CP ranks of one (tp, pp) position (gradient averaging, ZeRO partitioning)
``mp``     model-parallel ranks: TP x PP of one (cp, dp) position
=========  =================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch.distributed as dist

#: every kind of group, in the order of the fields of :class:`ProcessGroups`
KINDS = ("tp", "cp", "dp", "pp", "ep", "edp", "replica", "mp")


class UnknownGroupError(KeyError):
    """A group kind that does not exist (a misspelling)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process group of every kind (module docstring); frozen after creation."""

    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    pp: dist.ProcessGroup
    ep: dist.ProcessGroup
    edp: dist.ProcessGroup
    replica: dist.ProcessGroup
    mp: dist.ProcessGroup

    def __post_init__(self) -> None:
        missing = [f.name for f in fields(self) if getattr(self, f.name) is None]
        if missing:
            raise ValueError(
                f"process groups {missing} are None: every kind needs a real group "
                "(a group of one at degree 1)"
            )

    def get(self, kind: str) -> dist.ProcessGroup:
        """The group of ``kind``; a misspelled kind raises :class:`UnknownGroupError`."""
        return getattr(self, check_kind(kind))


def check_kind(kind: str) -> str:
    """``kind`` if it names a group (:data:`KINDS`), else :class:`UnknownGroupError`."""
    if kind not in KINDS:
        raise UnknownGroupError(
            f"unknown process group kind {kind!r}: choose from {', '.join(KINDS)}"
        )
    return kind


def size(group: Optional[dist.ProcessGroup]) -> int:
    """Number of ranks in ``group`` (1 without torch.distributed; None is the whole world)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank in ``group`` (0 without torch.distributed)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks of ``group``, in group order."""
    return dist.get_process_group_ranks(group)
