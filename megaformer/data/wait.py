"""Rank 0 builds, the other ranks wait: collectives on a gloo group of their own with a long timeout.

Rank 0 prepares sources, trains a tokenizer and builds the dataset indices before training starts;
at scale that takes minutes, more than a collective timeout sized for training steps
(``parallel.collective_timeout_minutes``) allows. The waits around that work therefore run on a
separate gloo group of all ranks whose timeout is :data:`WAIT`: a slow build does not trip the
training timeout, and a rank 0 that dies still ends the wait at once (its connections close). Rank 0
logs what it is building.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import torch.distributed as tdist

from megaformer.runtime.collectives import gloo_group_of_all

WAIT = datetime.timedelta(hours=24)

_groups: dict[int, Any] = {}  # id(default group) -> the wait group


def wait_group() -> Optional[Any]:
    """The wait group (None without a process group of more than one rank). Its first call is a
    collective: every rank makes it at the same point."""
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() <= 1:
        return None
    return gloo_group_of_all(_groups, WAIT)


def wait_barrier(fallback: Callable[[], None]) -> Callable[[], None]:
    """A barrier on the wait group; ``fallback`` (the caller's barrier) without one."""
    group = wait_group()
    if group is None:
        return fallback
    return lambda: tdist.barrier(group=group)
