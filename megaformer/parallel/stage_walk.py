"""One forward pass through the pipeline stages in order, under any schedule.

The blocks are cut into stages 0..S-1; pipeline rank r holds the stages ``rank_stages`` gives it
(its "chunks" c = 0, 1, ...): S = p under 1F1B (rank r holds stage r), S = v p under the
interleaved schedule (stages r, r+p, ..., r+(v-1)p), S = 2p under DualPipeV (stages r and 2p-1-r).
A walk visits the stages in order:

    for s = 0..S-1:   x = stage_s(x)         on holder(s), chunk c(s)
                      holder(s) -> holder(s+1)  x, unless both are the same rank

so a rank runs each of its chunks once, receives each chunk's input from the holder of the stage
before and sends the output on. Where one rank holds two consecutive stages (DualPipeV's
turn-around: rank p-1 holds p-1 and p) the activation stays on the rank. Every rank of the pipeline
steps through the same stages in the same order, so each send meets its receive: there is one
transfer per stage boundary and none is waited for out of order. The last stage's holder ends
with the output.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch.nn as nn

from megaformer.parallel.pipeline import rank_stages

#: run(stage, chunk, x) -> the stage's output
RunStage = Callable[[int, int, Any], Any]


@dataclass(frozen=True)
class StageWalk:
    """The stages of a pipeline in order, seen from pipeline rank ``rank``: ``holders[s]`` is the
    pipeline rank that holds stage s and ``chunks[s]`` its chunk (phase) on that rank."""

    holders: tuple[int, ...]
    chunks: tuple[int, ...]
    rank: int

    @classmethod
    def of(cls, schedule: str, pp: int, pp_rank: int, virtual_stages: int = 1) -> "StageWalk":
        """The walk of ``schedule`` over ``pp`` pipeline ranks, for pipeline rank ``pp_rank``."""
        placed = {
            s: (r, c)
            for r in range(pp)
            for c, s in enumerate(rank_stages(schedule, pp, r, virtual_stages))
        }
        order = [placed[s] for s in range(len(placed))]
        return cls(tuple(r for r, _ in order), tuple(c for _, c in order), pp_rank)

    @classmethod
    def of_layout(cls, parallel: Any, topo: Any) -> "StageWalk":
        """The walk of the schedule in ``parallel`` (the config's ``parallel`` section) for this
        rank of ``topo``."""
        return cls.of(
            parallel.pipeline_schedule, topo.pp, topo.pp_rank, parallel.pipeline_virtual_stages
        )

    @property
    def stages(self) -> int:
        return len(self.holders)

    @property
    def last(self) -> int:
        """The pipeline rank of the last stage (the output head)."""
        return self.holders[-1]

    def mine(self) -> list[int]:
        """This rank's stages, in order."""
        return [s for s, r in enumerate(self.holders) if r == self.rank]

    def check_module(self, pipe: nn.Module) -> None:
        """``pipe`` (this rank's ``PipelineModule``, with the layer boundaries ``parts`` of every
        stage) holds the stages this walk runs on this rank, chunk by chunk; ValueError if not."""
        parts = pipe.parts
        bounds = getattr(pipe, "phase_bounds", None)
        if bounds is None:  # one stage per rank: its own
            bounds = [(parts[pipe.stage_id], parts[pipe.stage_id + 1])]
        want = [(parts[s], parts[s + 1]) for s in self.mine()]
        if len(parts) - 1 != self.stages or [tuple(b) for b in bounds] != want:
            raise ValueError(
                f"pipeline rank {self.rank} holds layers {bounds} of {len(parts) - 1} stages; "
                f"this walk expects {want} of {self.stages}"
            )

    def walk(
        self,
        run: RunStage,
        x: Any,
        send: Callable[[Any, int], None],
        recv: Callable[[int], Any],
        between: Optional[Callable[[int, int], None]] = None,
    ) -> Any:
        """Run every stage in order from ``x`` (the first stage's input, used on its holder):
        ``run(s, chunk, x)`` on stage s's holder, ``send(x, pipeline rank)`` and ``recv(pipeline
        rank)`` between holders. ``between(s, holder)``, where given, runs on every other rank
        right after stage s ran (before stage s's output travels on), for exchanges of its own with
        the holder. Returns the last stage's output on its holder, None on the other ranks."""
        for s, holder in enumerate(self.holders):
            if holder == self.rank:
                x = run(s, self.chunks[s], x)
            elif between is not None:
                between(s, holder)
            following = self.holders[s + 1] if s + 1 < self.stages else holder
            if following == holder:
                continue
            if holder == self.rank:
                send(x, following)
                x = None
            elif following == self.rank:
                x = recv(holder)
        return x if self.last == self.rank else None


def activate(pipe: nn.Module, chunk: int) -> None:
    """Expose chunk ``chunk`` of ``pipe`` as its forward (a module of one chunk has just chunk 0)."""
    if hasattr(pipe, "activate_phase"):
        pipe.activate_phase(chunk)
    elif chunk != 0:
        raise ValueError(f"chunk {chunk} of a pipeline module that holds one stage")


@contextlib.contextmanager
def chunks_of(pipe: nn.Module) -> Iterator[Callable[[int], None]]:
    """``activate(chunk)`` for a walk over ``pipe``'s chunks; the chunk exposed before (the one
    the training engine left active) is exposed again after."""
    before = getattr(pipe, "active_phase", 0)
    try:
        yield lambda chunk: activate(pipe, chunk)
    finally:
        if hasattr(pipe, "activate_phase"):
            pipe.activate_phase(before)
