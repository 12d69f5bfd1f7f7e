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
import os
import stat
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
        raise CheckpointError(
            f"{where}: the boxes of {key} hold {volume} elements, the tensor "
            f"{total} (part of it missing or saved twice)"
        )
    active: list[tuple[list[int], list[int]]] = []
    budget = MAX_COMPARISONS
    for off, size in sorted(((b[2], b[3]) for b in boxes), key=lambda ob: ob[0]):
        if off:  # 0-d tensors hold one box of volume 1: nothing can overlap
            active = [a for a in active if a[0][0] + a[1][0] > off[0]]
        budget -= len(active)
        if budget < 0:
            raise CheckpointError(
                f"{where}: the boxes of {key} are too fragmented to check "
                f"(more than {MAX_COMPARISONS} overlapping candidates)"
            )
        for other in active:
            if _overlap((off, size), other):
                raise CheckpointError(
                    f"{where}: two boxes of {key} overlap (at offsets "
                    f"{other[0]} and {off}); a saved state covers each "
                    "element once"
                )
        active.append((off, size))


def check_shard_bytes(folder: Path, files: dict[str, int], boxes: dict[str, list]) -> None:
    """Each shard file the index lists is a regular file of the size the index gives, and holds at
    least the bytes its boxes need (4 per fp32 element): a small index claiming a huge tensor is
    refused before that tensor is allocated."""
    need = dict.fromkeys(files, 0)
    for entries in boxes.values():
        for file, _, _, size in entries:
            need[file] += 4 * math.prod(size)
    for file, size in files.items():
        path = folder / file
        try:
            st = os.lstat(path)
        except OSError:
            raise CheckpointError(f"{path}: missing shard of the checkpoint") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{path}: not a regular file (links, devices and folders are refused)"
            )
        if st.st_size != size:
            raise CheckpointError(
                f"{path}: {st.st_size} bytes, the checkpoint's index says "
                f"{size} (truncated or replaced)"
            )
        if need[file] > size:
            raise CheckpointError(
                f"{path}: the index places {need[file]} bytes of tensors in this {size}-byte file"
            )


def check_index_coverage(
    shapes: dict[str, tuple[int, ...]], boxes: dict[str, list], files: dict[str, int], where: Path
) -> None:
    """Every parameter has master weights, every saved tensor ``NAME/KEY`` is covered exactly by
    its boxes (:func:`check_exact_cover`), and the shard files hold the bytes the boxes need
    (:func:`check_shard_bytes`)."""
    missing = [n for n in shapes if f"{n}/master" not in boxes]
    if missing:
        raise CheckpointError(f"{where}: no master weights for {', '.join(missing[:3])}")
    for pkey, entries in boxes.items():
        check_exact_cover(pkey, shapes[pkey.rsplit("/", 1)[0]], entries, where)
    check_shard_bytes(where.parent, files, boxes)


def check_data_position(step: int, consumed: Any, global_batch_size: int, ckpt: Path) -> int:
    """The number of samples checkpoint ``ckpt`` says were consumed, checked against its step: a
    non-negative integer of at most ``step * G``, G the larger of this run's global batch and the
    one in the checkpoint's config.yaml. A crafted ``meta.json`` cannot move the data position,
    and with it the sample indexes built for it, beyond what the saved steps read."""
    from megaformer.checkpoint.layout import read_config_yaml

    saved = read_config_yaml(ckpt)
    train = saved.get("train") if isinstance(saved, dict) else None
    saved_g = train.get("global_batch_size") if isinstance(train, dict) else None
    global_batch_sizes = (global_batch_size,) + ((saved_g,) if isinstance(saved_g, int) else ())
    where = ckpt / "meta.json"
    bound = max(0, int(step)) * max(global_batch_sizes)
    if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= bound:
        raise CheckpointError(
            f"{where}: consumed_samples {str(consumed)[:40]} is not a count "
            f"that {step} steps of at most {max(global_batch_sizes)} samples "
            "could have read"
        )
    return consumed
