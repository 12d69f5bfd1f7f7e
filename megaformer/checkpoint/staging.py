"""Host staging of a rank's checkpoint shard: one pinned arena per rank, reused by every save.

Copying device tensors to the host without waiting needs page-locked (pinned) host memory. A
pinned tensor per box would go through torch's caching host allocator, which rounds every
request up to a power of two and keeps the blocks for the life of the process: the first save
pays page-locking for the whole shard and up to twice the shard stays pinned for good. Instead
each rank allocates one ordinary host buffer of exactly its staging bytes and page-locks it in
place (``cudaHostRegister``, as ``torch.distributed.checkpoint``'s staging does), outside the
caching allocator,

    arena bytes = 12 x (elements of the boxes this rank owns)    (fp32 master, exp_avg, exp_avg_sq)

at the first save, and every save fills it box by box as views (``megaformer plan`` prints the
same figure per rank). The next save reuses it once the previous save's files are written (the
save protocol waits for the background writer before it snapshots).
"""

from __future__ import annotations

from typing import Optional

import torch

PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def pin_host(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory: one host allocation, registered with CUDA."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes and torch.cuda.is_available():
        err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, PORTABLE))
        if err:
            raise RuntimeError(
                f"page-locking {nbytes} bytes of host memory for checkpoint "
                f"staging failed (cudaError {err})"
            )
    return buffer


def unpin_host(buffer: torch.Tensor) -> None:
    """Undo :func:`pin_host` (the memory is freed with the tensor)."""
    if buffer.numel() and torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class PinnedArena:
    """One pinned byte buffer handed out front to back as typed views."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = pin_host(nbytes)
        self.nbytes = nbytes
        self.used = 0

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """A view of the arena holding ``t``'s values (the copy is queued, not waited for)."""
        size = t.element_size()
        start = -(-self.used // size) * size  # aligned to the element size
        stop = start + t.numel() * size
        if stop > self.nbytes:
            raise RuntimeError(f"checkpoint staging arena of {self.nbytes} bytes is full")
        view = self.buffer[start:stop].view(t.dtype).view(t.shape)
        view.copy_(t, non_blocking=True)
        self.used = stop
        return view

    def release(self) -> None:
        unpin_host(self.buffer)

    def synchronize(self) -> None:
        """Wait for the queued device-to-host copies."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()


class HostStaging:
    """A rank's staging: its arena, allocated at the first save and refilled by each later one
    (replaced only when a save needs more bytes than it has)."""

    def __init__(self) -> None:
        self._arena: Optional[PinnedArena] = None

    def arena(self, nbytes: int) -> PinnedArena:
        if self._arena is None or self._arena.nbytes < nbytes:
            if self._arena is not None:  # free the smaller one first
                self._arena.release()
                self._arena = None
            self._arena = PinnedArena(nbytes)
        self._arena.used = 0
        return self._arena

    @property
    def pinned_bytes(self) -> int:
        """The bytes this rank holds pinned for checkpoint staging."""
        return self._arena.nbytes if self._arena is not None else 0
