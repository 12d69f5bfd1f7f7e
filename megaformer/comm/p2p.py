"""Point-to-point exchanges: one pass around a ring, and send/receive of a tensor of any shape.

Ring: the ranks ``r_0 ... r_{n-1}`` of a group pass a block one step: rank i sends to
``r_{(i+1) mod n}`` and receives from ``r_{(i-1) mod n}``, both asynchronous (ring attention
overlaps the pass with the work on the block it holds). Bytes recorded: the block sent.

Shaped send/receive: a header of 8 int64 (number of dimensions, then the sizes, zero-padded: at most
7 dimensions) goes first, so the receiver allocates the tensor without knowing its shape.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megaformer.comm.counters import record

_HEADER = 8


class RingPass:
    """One asynchronous pass: send ``t`` to the next rank of ``ranks`` (this rank is ``ranks[me]``),
    receive the previous one's; :meth:`wait` returns the received block."""

    def __init__(
        self,
        t: torch.Tensor,
        group: dist.ProcessGroup,
        ranks: list[int],
        me: int,
        kind: Optional[str] = None,
    ) -> None:
        self.recv = torch.empty_like(t)
        n = len(ranks)
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        ops = [dist.P2POp(dist.isend, t, nxt, group), dist.P2POp(dist.irecv, self.recv, prv, group)]
        self.reqs = dist.batch_isend_irecv(ops)
        if kind is not None:
            record(kind, t.numel() * t.element_size())

    def wait(self) -> torch.Tensor:
        for r in self.reqs:
            r.wait()
        return self.recv


def send_with_shape(x: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    """Send ``x`` (any shape up to 7 dimensions) to global rank ``dst``: header, then the values."""
    x = x.contiguous()
    if x.dim() >= _HEADER:
        raise ValueError(f"send_with_shape: {x.dim()} dimensions, at most {_HEADER - 1}")
    meta = torch.tensor(
        [x.dim(), *x.shape] + [0] * (_HEADER - 1 - x.dim()), dtype=torch.long, device=x.device
    )
    dist.send(meta, dst, group=group)
    dist.send(x, dst, group=group)


def recv_with_shape(
    src: int, group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The tensor :func:`send_with_shape` sent from global rank ``src``."""
    meta = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.recv(meta, src, group=group)
    shape = meta[1 : 1 + int(meta[0])].tolist()
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src, group=group)
    return x
