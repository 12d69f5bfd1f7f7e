"""Dropout RNG under tensor parallelism.

Two random streams per rank:

* the default torch stream, seeded identically on every TP rank: dropout on *replicated*
  activations (embedding output, the residual stream without sequence parallelism) draws the same
  mask on every TP rank, as if one process computed it;
* the tensor-parallel stream, seeded with ``seed + 2718 + tp_rank`` (Megatron's offset): dropout on
  *sharded* activations (attention probabilities of the local heads; the residual stream under
  sequence parallelism) draws independent masks on each rank, as one process would draw
  independent masks for different heads or positions.

``tracker.fork()`` swaps the tensor-parallel stream in for the default one (CPU and, when present,
the current CUDA device) for the duration of a block.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

TP_SEED_OFFSET = 2718


class TensorParallelRNG:
    def __init__(self, seed: int, tp_rank: int) -> None:
        self.seed = seed + TP_SEED_OFFSET + tp_rank
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        torch.manual_seed(self.seed)
        self.cpu_state = torch.get_rng_state()
        self.cuda_state = torch.cuda.get_rng_state() if saved_cuda is not None else None
        torch.set_rng_state(saved_cpu)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if self.cuda_state is not None else None
        torch.set_rng_state(self.cpu_state)
        if self.cuda_state is not None:
            torch.cuda.set_rng_state(self.cuda_state)
        try:
            yield
        finally:
            self.cpu_state = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                self.cuda_state = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)

    def state_dict(self) -> dict:
        out = {"cpu": self.cpu_state}
        if self.cuda_state is not None:
            out["cuda"] = self.cuda_state
        return out

    def load_state_dict(self, state: dict) -> None:
        self.cpu_state = state["cpu"]
        if "cuda" in state and self.cuda_state is not None:
            self.cuda_state = state["cuda"]
