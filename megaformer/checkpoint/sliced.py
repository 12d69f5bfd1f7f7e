"""Whole-tensor weight files read shard by shard: each rank reads only the bytes it keeps.

A weights-only checkpoint's ``model.safetensors`` (what ``megaformer convert --to megaformer``
writes) and a Hugging Face folder hold every tensor whole. :class:`SlicedWeights` is the tensor-
parallel reader :func:`megaformer.parallel.build.build_model` takes (``shard(name, shape, dim,
tp_offset, ep_offset=)``, as :class:`~megaformer.checkpoint.sharded.ShardedState`): a parameter's
shard of local shape ``s`` starting at ``tp_offset`` along ``dim`` (and ``ep_offset`` along dim 0
for a slice of experts) is the box

    [o_0, o_0 + s_0) x ... x [o_k, o_k + s_k),   o_d = tp_offset [d = dim] + ep_offset [d = 0]

of the whole tensor, read through ``safetensors.safe_open(...).get_slice`` (only that box's bytes
leave the file). Vocabulary rows past the real ones (TP padding) are zeros. A rank of a TP x PP
layout so reads about 1 / (TP * PP) of the file, and its build never holds a whole tensor.

Names map through a plan (:class:`~megaformer.checkpoint.hf.stream.Entry`): a megaformer file maps
each name to itself; a Hugging Face folder maps through its architecture's import plan
(:func:`hf_weights`), so ``train`` starts from it with no converted copy on disk. A renamed tensor
is sliced, so is each of this rank's experts of a stacked expert tensor; another entry computed from
several tensors (a fused projection) is computed from its whole inputs, then sliced: only the
layers of this rank's stage are read.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch

from megaformer.checkpoint.hf.stream import Entry, TensorSource, is_rename, is_stack
from megaformer.checkpoint.layout import WEIGHTS
from megaformer.checkpoint.sharded import VOCAB_TABLES
from megaformer.checkpoint.weights import check_shapes, expected_shapes
from megaformer.errors import CheckpointError, ConversionError


class SlicedWeights:
    """Tensor-parallel shards of whole tensors in safetensors file(s) (see the module docstring).

    ``source``: the files' headers (:class:`TensorSource`); ``plan``: how each model tensor is made
    of source tensors; ``where``: how errors name the weights. ``bytes_read`` counts the tensor
    bytes read so far."""

    def __init__(self, source: TensorSource, plan: list[Entry], where: Any) -> None:
        self.source, self.where = source, where
        self.entries = {e.out: e for e in plan}
        self.bytes_read = 0

    @classmethod
    def checkpoint(cls, ckpt: Path, model_cfg: Any) -> "SlicedWeights":
        """A weights-only checkpoint's ``model.safetensors``, its tensors' shapes checked against
        ``model_cfg`` (headers only). A tied output layer is the embedding."""
        from megaformer.checkpoint.hf.stream import rename

        try:
            source = TensorSource(ckpt)
        except ConversionError as e:
            raise CheckpointError(str(e)) from None
        expected = expected_shapes(model_cfg)
        names = set(source.keys())
        want = set(expected)
        if model_cfg.tie_embeddings:  # the output layer is the embedding, saved or not
            want.discard("lm_head.weight")
            names.discard("lm_head.weight")
        missing, extra = sorted(want - names), sorted(names - want)
        if missing or extra:
            raise CheckpointError(
                f"{ckpt / WEIGHTS}: weights do not fit the configured model "
                f"(missing {missing[:3]}, unexpected {extra[:3]})"
            )
        check_shapes(((n, source.meta(n).shape) for n in names), expected, str(ckpt / WEIGHTS))
        plan = [rename(n, n) for n in sorted(names)]
        if model_cfg.tie_embeddings:
            plan.append(rename("lm_head.weight", "tok_embeddings.weight"))
        return cls(source, plan, ckpt)

    def whole_shape(self, name: str) -> tuple[int, ...]:
        e = self._entry(name)
        with torch.device("meta"):
            return tuple(e.fn(*(self.source.meta(n) for n in e.inputs)).shape)

    def _entry(self, name: str) -> Entry:
        if name not in self.entries:
            raise CheckpointError(f"{self.where}: no tensor for parameter {name}")
        return self.entries[name]

    def _slice(self, src: str, box: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        path = self.source.file_of(src).path
        try:  # opened per tensor: its mapped pages are released once the box is copied out
            with safe_open(str(path), framework="pt") as f:
                part = f.get_slice(src)[box]
        except Exception as e:  # safetensors' own errors
            raise CheckpointError(f"{path}: cannot read {src} ({str(e)[:200]})") from None
        self.bytes_read += part.numel() * part.element_size()
        return part

    def shard(
        self,
        name: str,
        shape: tuple[int, ...],
        dim: Optional[int],
        tp_offset: int,
        key: str = "master",
        ep_offset: int = 0,
    ) -> torch.Tensor:
        """The box of ``name`` of local ``shape`` at ``tp_offset`` along ``dim`` and ``ep_offset``
        along dim 0 (``key``: only ``master``, the weights), vocabulary padding rows zero."""
        e = self._entry(name)
        whole = self.whole_shape(name)
        start = [0] * len(shape)
        if dim is not None:
            start[dim] += tp_offset
        if shape:
            start[0] += ep_offset
        stop = [o + s for o, s in zip(start, shape)]
        if name in VOCAB_TABLES:  # rows past the real vocabulary: padding, zeros
            stop[0] = min(stop[0], whole[0])
        if len(whole) != len(shape) or any(b > w for b, w in zip(stop, whole)):
            raise CheckpointError(
                f"{self.where}: {name} has shape {list(whole)}, too small for "
                f"this layout's shard {list(shape)} at {start}"
            )
        box = tuple(slice(a, max(a, b)) for a, b in zip(start, stop))
        if is_rename(e):
            part = self._slice(e.inputs[0], box)
        elif is_stack(e):  # experts stacked along dim 0: only this rank's, each sliced
            part = torch.stack(
                [self._slice(e.inputs[k], box[1:]) for k in range(box[0].start, box[0].stop)]
            )
        else:  # computed from whole inputs (this stage's layers only), then sliced
            inputs = [
                self._slice(n, (slice(None),) * len(self.source.meta(n).shape)) for n in e.inputs
            ]
            part = e.fn(*inputs)[box]
        if tuple(part.shape) == tuple(shape):
            return part
        out = torch.zeros(shape, dtype=part.dtype)
        out[tuple(slice(0, n) for n in part.shape)] = part
        return out

    def total_bytes(self) -> int:
        """The bytes of every source tensor (what a whole read costs)."""
        return sum(
            math.prod(t.shape) * t.element_size()
            for t in (self.source.meta(n) for n in self.source.keys())
        )
