"""Activation checkpointing (recomputation) as wrapper modules, applied to a built model like the
tensor-parallel plan.

Modes (``train.recompute``):

* ``none``      every activation a block's backward needs is kept;
* ``full``      only the input of every ``recompute_every``-th block is kept; the block is run again
                in backward (Chen et al. 2016; Megatron's "full" granularity, "uniform" method);
* ``selective`` only the attention core softmax(QK^T/sqrt(d_k))V is recomputed — the part whose
                activations grow with s² but cost few FLOPs (Korthikanti et al. 2022).

``full`` replaces ``layers[i]`` by a :class:`CheckpointedBlock` holding the block; ``selective``
replaces each attention core ``attn.core`` by a :class:`CheckpointedAttentionCore` around it.
``print(model)`` shows them. Parameter and state-dict names stay those of the plain model (``layers.0.attn.wq.weight``,
not ``layers.0.block.attn.wq.weight``): the wrapper shares the block's parameter, buffer, child
and hook registries instead of registering the block as a child, so checkpoints, conversion and
the tensor-parallel plan see the same names with and without recomputation. Hooks on the block
(sequence-parallel scatter/gather) run outside the recomputed region, as before wrapping.

A replay runs under :func:`megaformer.model.moe.recomputing` (MoE blocks count their load once).
Recomputation replays dropout exactly: torch restores the default RNG stream, and the
tensor-parallel stream is saved at the first forward and restored for the replay (as Megatron's
CheckpointFunction does), so a checkpointed run computes the same numbers as an uncheckpointed one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megaformer.model.moe import recomputing
from megaformer.parallel.random import TensorParallelRNG

RECOMPUTE_MODES = ("none", "full", "selective")

# What a wrapper shares with the module it wraps: its parameters, buffers and children (so names
# are unchanged) and its forward hooks (so they run around the recomputed region, not inside it).
_SHARED = (
    "_parameters",
    "_buffers",
    "_non_persistent_buffers_set",
    "_modules",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _rng_contexts(rng: Optional[TensorParallelRNG]) -> Callable[[], tuple]:
    def make() -> tuple:
        saved: dict = {}

        @contextlib.contextmanager
        def first_forward() -> Iterator[None]:
            if rng is not None:
                saved["state"] = rng.state_dict()
            yield

        @contextlib.contextmanager
        def replay() -> Iterator[None]:
            if rng is None:
                with recomputing():
                    yield
                return
            current = rng.state_dict()
            rng.load_state_dict(saved["state"])
            try:
                with recomputing():
                    yield
            finally:
                rng.load_state_dict(current)

        return first_forward(), replay()

    return make


def _recomputed(fn: Callable, rng: Optional[TensorParallelRNG], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=_rng_contexts(rng),
        **kwargs,
    )


class CheckpointedBlock(nn.Module):
    """``block(x, ...)`` whose activations are recomputed in backward; only the input is kept.

    The block is held (``self.block``) but not registered as a child: the wrapper's parameters,
    buffers, children and hooks are the block's own, so every name is the block's."""

    def __init__(self, block: nn.Module, rng: Optional[TensorParallelRNG] = None) -> None:
        super().__init__()
        for attr in _SHARED:
            if hasattr(block, attr):
                object.__setattr__(self, attr, getattr(block, attr))
        object.__setattr__(self, "block", block)
        object.__setattr__(self, "rng", rng)

    @property  # type: ignore[override]
    def training(self) -> bool:  # the block's own flag: one flag, whoever sets it
        return self.__dict__["block"].training if "block" in self.__dict__ else True

    @training.setter
    def training(self, mode: bool) -> None:
        if "block" in self.__dict__:
            self.__dict__["block"].training = mode

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, children (the block's)
        except AttributeError:
            if "block" not in self.__dict__:
                raise
            return getattr(self.__dict__["block"], name)  # the block's plain attributes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # block.forward, not block(...): the block's hooks are this wrapper's and ran already
        return _recomputed(self.block.forward, self.rng, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"recomputes {type(self.block).__name__} in backward"


class CheckpointedAttentionCore(nn.Module):
    """The attention core softmax(QK^T/sqrt(d_k))V (``attn.core``, held as ``inner``) recomputed
    in backward. No parameters: the attention module's parameter names are unchanged."""

    def __init__(self, inner: nn.Module, rng: Optional[TensorParallelRNG] = None) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "rng", rng)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _recomputed(self.inner, self.rng, *args, **kwargs)

    def extra_repr(self) -> str:
        return "recomputes inner in backward"


def apply_recompute(
    blocks: nn.ModuleList, mode: str, every: int = 1, rng: Optional[TensorParallelRNG] = None
) -> None:
    """Wrap every ``every``-th block (full) or every attention core (selective), in place."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {mode!r}")
    if mode == "none":
        return
    for i, block in enumerate(blocks):
        if mode == "full":
            if i % every == 0:
                blocks[i] = CheckpointedBlock(block, rng)
        else:
            block.attn.core = CheckpointedAttentionCore(block.attn.core, rng)
