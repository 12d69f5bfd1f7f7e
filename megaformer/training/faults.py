"""Fault injection, for tests only: ``MEGAFORMER_FAULT`` makes a run fail on purpose.

The variable holds faults separated by ``;``, each ``KIND@step=S[,rank=R][,attempt=A][,seconds=T]``:

    nan           the loss of rank R's first micro-batch of step S is multiplied by NaN (so its
                  gradients are NaN too) before the backward pass
    stall         rank R sleeps T seconds (default 3600) at the start of step S
    slow          rank R computes T CPU seconds longer (default 0.2; a busy loop) at the start of
                  every step S1..S2: a straggler the other ranks wait for in each step
    blowup        at the start of step S, rank R multiplies the matrices of block L (``layer=L``,
                  0-based) by F (``factor=F``, default 10): a weight blow-up for the replay
    scale         in step S, rank R's token embeddings of micro-batch J (``micro=J``, 0-based) are
                  multiplied by F (``factor=F``, default 10): one micro-batch far out of range,
                  for the replay's attribution to a micro-batch (not under pipeline parallelism)
    kill          rank R sends itself SIGKILL at the start of step S
    sigterm       rank R sends itself SIGTERM in the middle of step S (after the backward pass)
    sigusr1       the same with SIGUSR1 (Slurm's warning signal)
    kill-in-save  rank R sends itself SIGKILL inside the checkpoint save of step S, after the engine
                  state is written and before the checkpoint is committed

``step`` may be a range ``S1-S2``; without ``rank`` the fault hits every rank. ``attempt`` is the
torchrun restart it fires in (``TORCHELASTIC_RESTART_COUNT``, default 0), so a restarted run does not
fail again. Example: ``MEGAFORMER_FAULT='nan@step=3,rank=1;kill@step=5,rank=0'``.

Nothing here runs unless the variable is set; production code paths only call the no-op methods
of an empty :class:`FaultPlan`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megaformer.errors import LaunchError

ENV = "MEGAFORMER_FAULT"
KINDS = ("nan", "stall", "slow", "blowup", "scale", "kill", "sigterm", "sigusr1", "kill-in-save")


@dataclass(frozen=True)
class Fault:
    kind: str
    first: int
    last: int
    rank: Optional[int] = None
    attempt: int = 0
    seconds: float = 3600.0
    layer: int = 0
    factor: float = 10.0
    micro: int = 0

    def hits(self, kind: str, step: int, rank: int, attempt: int) -> bool:
        return (
            self.kind == kind
            and self.first <= step <= self.last
            and attempt == self.attempt
            and (self.rank is None or self.rank == rank)
        )


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, _, args = item.partition("@")
        fields = dict(a.split("=", 1) for a in args.split(",") if "=" in a)
        if kind not in KINDS or "step" not in fields:
            raise LaunchError(
                f"{ENV}={spec!r}: expected KIND@step=S[,rank=R][,attempt=A][,seconds=T] with KIND "
                f"one of {', '.join(KINDS)}"
            )
        first, _, last = fields["step"].partition("-")
        faults.append(
            Fault(
                kind,
                int(first),
                int(last or first),
                int(fields["rank"]) if "rank" in fields else None,
                int(fields.get("attempt", 0)),
                float(fields.get("seconds", 0.2 if kind == "slow" else 3600)),
                int(fields.get("layer", 0)),
                float(fields.get("factor", 10.0)),
                int(fields.get("micro", 0)),
            )
        )
    return faults


class FaultPlan:
    """The faults meant for this rank in this attempt; every method is a no-op when there are none."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int) -> None:
        self.faults, self.rank, self.attempt = faults, rank, attempt

    @classmethod
    def from_env(cls, rank: int) -> "FaultPlan":
        spec = os.environ.get(ENV, "")
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if spec and rank == 0:
            logging.getLogger("megaformer").warning(
                "WARNING: %s=%r is set: this run will fail ON PURPOSE (fault injection, for "
                "tests only); unset it for a real run",
                ENV,
                spec,
            )
        return cls(parse(spec) if spec else [], rank, attempt)

    def _hit(self, kind: str, step: int) -> Optional[Fault]:
        return next((f for f in self.faults if f.hits(kind, step, self.rank, self.attempt)), None)

    def step_start(self, step: int) -> None:
        if self._hit("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        stall = self._hit("stall", step)
        if stall:
            time.sleep(stall.seconds)
        slow = self._hit("slow", step)
        if slow:  # busy: the rank computes longer, as a slow device or host does
            end = time.process_time() + slow.seconds
            while time.process_time() < end:
                pass

    def weights(self, step: int, model: torch.nn.Module) -> None:
        """``blowup``: block L's matrices times F, in place, before step ``step`` trains."""
        fault = self._hit("blowup", step)
        if fault is None:
            return
        prefix = f"layers.{fault.layer}."
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith(prefix) and p.dim() >= 2:
                    p.mul_(fault.factor)

    @contextlib.contextmanager
    def micro_batch(self, step: int, micro: int, model: torch.nn.Module) -> Iterator[None]:
        """``scale``: inside, model's token embeddings come out times F when ``micro`` is J."""
        fault = self._hit("scale", step)
        if fault is None or fault.micro != micro:
            yield
            return
        embedding = next(m for n, m in model.named_modules() if n.endswith("tok_embeddings"))
        handle = embedding.register_forward_hook(lambda m, i, out: out * fault.factor)
        try:
            yield
        finally:
            handle.remove()

    def loss(self, step: int, micro: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if micro == 0 and self._hit("nan", step) else loss

    def mid_step(self, step: int) -> None:
        for kind, sig in (("sigterm", signal.SIGTERM), ("sigusr1", signal.SIGUSR1)):
            if self._hit(kind, step):
                os.kill(os.getpid(), sig)

    def in_save(self, step: int) -> None:
        if self._hit("kill-in-save", step):
            os.kill(os.getpid(), signal.SIGKILL)
