"""Every collective of megaformer, over explicit process groups.

=====================  ==========================================================================
module                 what
=====================  ==========================================================================
``groups``             :class:`ProcessGroups` (one real group per kind, a group of one at degree
                       1), :func:`size` / :func:`rank` of a group
``counters``           :class:`CommCounter` and the public :func:`record` /
                       :func:`record_collective` every exchange reports its bytes through
``tensor_parallel``    the conjugate TP / sequence-parallel operators (``copy_to_tp``,
                       ``reduce_from_tp``, ``gather_seq``, ...) and their plain collectives
``all_to_all``         the uneven all-to-all (expert dispatch, all-to-all context parallelism)
``p2p``                one ring pass (ring attention), send / receive with the shape first
``collectives``        barrier, mean over a group, gathering and broadcasting objects
=====================  ==========================================================================
"""

from megaformer.comm.all_to_all import AllToAll, AllToAllStart, all_to_all
from megaformer.comm.collectives import (
    all_gather_objects,
    all_reduce_mean,
    barrier,
    broadcast_from_main,
    broadcast_tensor,
    broadcast_with_shape,
    gather_to_main,
)
from megaformer.comm.counters import CommCounter, no_counting, record, record_collective
from megaformer.comm.groups import (
    KINDS,
    ProcessGroups,
    UnknownGroupError,
    check_kind,
    rank,
    ranks,
    size,
)
from megaformer.comm.p2p import RingPass, recv_with_shape, send_with_shape
from megaformer.comm.tensor_parallel import (
    ProcessGroup,
    all_gather_cat,
    all_gather_seq,
    all_reduce,
    copy_to_tp,
    gather_seq,
    gather_seq_split_bwd,
    reduce_from_tp,
    reduce_scatter_seq,
    reduce_scatter_to_seq,
    scatter_seq,
    split_seq,
    sum_over_group,
)

__all__ = [
    "AllToAll",
    "AllToAllStart",
    "CommCounter",
    "KINDS",
    "ProcessGroup",
    "ProcessGroups",
    "RingPass",
    "UnknownGroupError",
    "all_gather_cat",
    "all_gather_objects",
    "all_gather_seq",
    "all_reduce",
    "all_reduce_mean",
    "all_to_all",
    "barrier",
    "broadcast_from_main",
    "broadcast_tensor",
    "broadcast_with_shape",
    "check_kind",
    "copy_to_tp",
    "gather_seq",
    "gather_seq_split_bwd",
    "gather_to_main",
    "no_counting",
    "rank",
    "ranks",
    "record",
    "record_collective",
    "recv_with_shape",
    "reduce_from_tp",
    "reduce_scatter_seq",
    "reduce_scatter_to_seq",
    "scatter_seq",
    "send_with_shape",
    "size",
    "split_seq",
    "sum_over_group",
]
