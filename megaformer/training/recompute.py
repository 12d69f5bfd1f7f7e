"""Activation checkpointing (recomputation), applied to a built model like a parallel plan.

Modes (``train.recompute``):

* ``none``      every activation a block's backward needs is kept;
* ``full``      only the input of every ``recompute_every``-th block is kept; the block is run again
                in backward (Chen et al. 2016; Megatron's "full" granularity, "uniform" method);
* ``selective`` only the attention core softmax(QK^T/sqrt(d_k))V is recomputed — the part whose
                activations grow with s² but cost few FLOPs (Korthikanti et al. 2022).

Recomputation replays dropout exactly: torch restores the default RNG stream, and the
tensor-parallel stream is saved at the first forward and restored for the replay (as Megatron's
CheckpointFunction does), so a checkpointed run computes the same numbers as an uncheckpointed one.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megaformer.parallel.random import TensorParallelRNG


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
                yield
                return
            current = rng.state_dict()
            rng.load_state_dict(saved["state"])
            try:
                yield
            finally:
                rng.load_state_dict(current)

        return first_forward(), replay()
    return make


def checkpointed(fn: Callable, rng: Optional[TensorParallelRNG]) -> Callable:
    """``fn`` whose activations are recomputed in backward."""
    context_fn = _rng_contexts(rng)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=context_fn, **kwargs)
    return run


def apply_recompute(blocks: nn.ModuleList, mode: str, every: int = 1,
                    rng: Optional[TensorParallelRNG] = None) -> None:
    """Wrap the blocks (full) or their attention cores (selective) in place."""
    if mode == "none":
        return
    for i, block in enumerate(blocks):
        if mode == "full":
            if i % every == 0:
                block.forward = checkpointed(block.forward, rng)
        elif mode == "selective":
            block.attn.core_attention = checkpointed(block.attn.core_attention, rng)
        else:
            raise ValueError(f"unknown recompute mode {mode!r}")
