"""Checks on a sharded checkpoint's ``state/index.json`` made before any tensor is read.

The index places boxes of each saved tensor ``NAME/KEY`` (offsets ``o`` and sizes ``z``, one
per dimension) in the shard files. Reading fills a tensor of the index's shape ``S`` box by box,
so the boxes must tile it exactly:

- every box lies inside the tensor (``0 <= o_d`` and ``o_d + z_d <= S_d``) -- checked by the
  reader itself;
- the boxes are pairwise disjoint, and their volumes add up to the tensor's,
  ``sum_b prod_d z_{b,d} == prod_d S_d``.

Disjoint boxes inside the tensor whose volumes add up to the tensor's cover every element exactly
once. Counting elements found (what the reader did before) is not enough: two copies of half an
embedding add up to a whole one and leave the other half as uninitialised memory.

Disjointness is checked by a sweep along dimension 0: boxes sorted by first offset, each compared
only with the earlier boxes whose rows reach its first row (in a saved layout a handful: the
partial rows where one rank's range ends and the next begins). A crafted index whose boxes would
need more than :data:`MAX_COMPARISONS` comparisons is refused rather than checked for minutes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megaformer.errors import CheckpointError

MAX_COMPARISONS = 4_000_000  # a saved layout needs a few per box


def _overlap(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]) -> bool:
    return all(ao < bo + bz and bo < ao + az for ao, az, bo, bz in zip(a[0], a[1], b[0], b[1]))


def check_exact_cover(key: str, shape: tuple[int, ...], boxes: list[Any], where: Path) -> None:
    """The boxes ``[file, tensor_key, offsets, sizes]`` of ``key`` tile ``shape`` exactly
    (disjoint, volumes adding up); CheckpointError naming ``key`` otherwise. The boxes are already
    known to lie inside the tensor."""
    total = math.prod(shape)
    volume = sum(math.prod(b[3]) for b in boxes)
    if volume != total:
        raise CheckpointError(f"{where}: the boxes of {key} hold {volume} elements, the tensor "
                              f"{total} (part of it missing or saved twice)")
    active: list[tuple[list[int], list[int]]] = []
    budget = MAX_COMPARISONS
    for off, size in sorted(((b[2], b[3]) for b in boxes), key=lambda ob: ob[0]):
        if off:  # 0-d tensors hold one box of volume 1: nothing can overlap
            active = [a for a in active if a[0][0] + a[1][0] > off[0]]
        budget -= len(active)
        if budget < 0:
            raise CheckpointError(f"{where}: the boxes of {key} are too fragmented to check "
                                  f"(more than {MAX_COMPARISONS} overlapping candidates)")
        for other in active:
            if _overlap((off, size), other):
                raise CheckpointError(f"{where}: two boxes of {key} overlap (at offsets "
                                      f"{other[0]} and {off}); a saved state covers each "
                                      "element once")
        active.append((off, size))


def check_index_coverage(shapes: dict[str, tuple[int, ...]], boxes: dict[str, list],
                         where: Path) -> None:
    """Every parameter has master weights, and every saved tensor ``NAME/KEY`` is covered exactly
    by its boxes (:func:`check_exact_cover`)."""
    missing = [n for n in shapes if f"{n}/master" not in boxes]
    if missing:
        raise CheckpointError(f"{where}: no master weights for {', '.join(missing[:3])}")
    for pkey, entries in boxes.items():
        check_exact_cover(pkey, shapes[pkey.rsplit("/", 1)[0]], entries, where)
