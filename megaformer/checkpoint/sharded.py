"""Sharded, layout-free training state: every rank writes what it owns; any layout reads it back.

The training state of a parameter with whole (unsharded, vocabulary-unpadded) shape ``S`` is fp32
tensors of shape ``S``: the master weight theta and the optimizer's state under its own names
(AdamW: first moment m and second moment v; Muon's matrices: momentum m; the index lists each
parameter's). No rank ever holds a whole one. Rank r owns, of each of its parameters, one flat range [s, e) of
its tensor-parallel shard (row-major order):

* ZeRO 1/2 and the bf16 optimizer: the fragment of DeepSpeed's flat fp32 partition that maps onto
  this parameter (``_hp_mapping.lp_fragment_address``);
* ZeRO-3: its partition, elements [r_dp * n_part, (r_dp + 1) * n_part) of the flattened shard;
* ZeRO-0 (torch's AdamW, replicated over data parallelism): the data-parallel ranks split each
  shard evenly, [r_dp * n / dp, (r_dp + 1) * n / dp), so that each byte is written once.
* Muon under ZeRO-1/2: the whole shard of each parameter whose state the rank owns, nothing of
  the others.

A parameter replicated over tensor parallelism (a norm's gain) is split the same way over the TP
ranks; a pipeline-tied weight is written by the first stage only. An expert parameter under
expert parallelism is this rank's slice of experts along dim 0 (its boxes placed at its first
expert), owned as above over the expert-data group (the ranks holding the same experts). A flat
range of a row-major array is a union of at most 2 ndim - 1 boxes (a partial row, whole rows, a
partial row; recursively), so a rank stores its range as boxes placed in whole-tensor
coordinates::

    CKPT/state/
      rank_00000.safetensors   "NAME/KEY/i": box i of KEY of NAME: master, and the optimizer's
                               state (AdamW: exp_avg, exp_avg_sq; Muon: momentum)
      ...                      one file per rank, written by that rank, in parallel
      index.json               rank 0: every box's file, offsets and sizes; whole shapes; file
                               sizes; each parameter's keys; the optimizer (train.optimizer) and
                               Adam's step count; the layout and precision it came from

Reading at any layout is the same decomposition run backwards: each rank splits the flat range it
owns now (whole shards for ZeRO-0) into boxes, and for each reads the intersection with every saved
box that overlaps it: safetensors slices, so only those bytes. Memory: one parameter's fragment at
a time (the staging buffer), nothing whole. Nothing here unpickles; files are checked against the
index's sizes and their own headers before a byte of data is used.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megaformer.checkpoint.files import write_payload
from megaformer.checkpoint.index_checks import check_exact_cover, check_index_coverage
from megaformer.checkpoint.safetensors_check import read_header
from megaformer.checkpoint.staging import HostStaging
from megaformer.errors import CheckpointError
from megaformer.safe_files import read_text_inside

STATE_DIR = "state"
INDEX = "index.json"
KEYS = ("master", "exp_avg", "exp_avg_sq")  # AdamW's (and every checkpoint's before Muon)
STATE_KEYS = {*KEYS, "momentum"}  # every name a parameter's saved state may have
BYTES_PER_ELEMENT = 4 * len(KEYS)  # fp32 master weight and Adam's two moments
VOCAB_TABLES = ("tok_embeddings.weight", "lm_head.weight")
FORMAT = 2  # 1: every box listed (still read)
MAX_INDEX_BYTES = 256 << 20

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def has_sharded_state(ckpt: Path) -> bool:
    return (ckpt / STATE_DIR / INDEX).is_file()


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


# ----------------------------------------------------------------------------- geometry


def flat_boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [start, stop) of a row-major array of ``shape`` as boxes
    ``(offsets, sizes, flat_start)``, in order; each box is a contiguous flat run."""
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])
    out: list = []
    row = start // inner
    if start % inner:  # partial first row
        end = min(stop, (row + 1) * inner)
        out += [
            ((row, *off), (1, *size), row * inner + flat)
            for off, size, flat in flat_boxes(shape[1:], start - row * inner, end - row * inner)
        ]
        start, row = end, row + 1
    full = stop // inner - row
    if full > 0:  # whole rows
        out.append(((row, *([0] * (len(shape) - 1))), (full, *shape[1:]), start))
        start, row = start + full * inner, row + full
    if start < stop:  # partial last row
        out += [
            ((row, *off), (1, *size), row * inner + flat)
            for off, size, flat in flat_boxes(shape[1:], 0, stop - start)
        ]
    return out


def intersect(a: Box, b: Box) -> Optional[Box]:
    lo = [max(x, y) for x, y in zip(a[0], b[0])]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1])]
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - low for low, h in zip(lo, hi))


def _slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - g, o - g + s) for o, s, g in zip(box[0], box[1], origin))


# ----------------------------------------------------------------------------- ownership


@dataclass
class Owned:
    """A parameter's shard on this rank and the flat range of it this rank owns."""

    name: str
    param: torch.nn.Parameter
    local_shape: tuple[int, ...]  # the tensor-parallel shard (vocabulary rows padded)
    start: int  # owned flat range of the shard
    stop: int
    dim: Optional[int]  # the tensor-parallel split dimension, or None
    tp_offset: int  # where the shard starts along ``dim`` in the whole tensor
    rows: Optional[int]  # vocabulary tables: the real rows (padding beyond is dropped)
    base: int = 0  # the flat index where the optimizer's local tensor starts
    ep_offset: int = 0  # expert parameters: this rank's first expert (dim 0)
    ep: int = 1  # expert parameters: the expert-parallel degree

    def boxes(self) -> list[tuple[Box, tuple[int, ...], int]]:
        """The owned range as (box in whole-tensor coordinates, the box's size in the shard,
        its flat start in the owned range). A box reaching into the vocabulary padding is cut
        to the real rows (its shard size stays uncut: that is its flat run); one wholly in the
        padding is dropped."""
        out = []
        for off, size, flat in flat_boxes(self.local_shape, self.start, self.stop):
            g = list(off)
            if self.dim is not None:
                g[self.dim] += self.tp_offset
            g[0] += self.ep_offset
            cut = list(size)
            if self.rows is not None:
                cut[0] = max(0, min(g[0] + size[0], self.rows) - g[0])
                if cut[0] == 0:
                    continue
            out.append(((tuple(g), tuple(cut)), size, flat - self.start))
        return out

    def whole_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.local_shape)
        if self.dim is not None:
            shape[self.dim] *= tp
        if self.rows is not None:
            shape[0] = self.rows
        shape[0] *= self.ep
        return tuple(shape)


# ----------------------------------------------------------------------------- save


def owned_elements(owned: list[Owned]) -> int:
    """The elements of one key (master, exp_avg, ...) this rank's boxes hold."""
    return sum(math.prod(box[1]) for o in owned for box, _, _ in o.boxes())


def snapshot(
    access: Any, owned: list[Owned], copy: bool, staging: Optional[HostStaging] = None
) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """This rank's boxes on the host: ({"NAME/KEY/i": tensor}, {"NAME/KEY/i": offsets}), read
    through ``access`` (:class:`megaformer.checkpoint.optimizer_state.OptimizerAccess`).
    ``copy``: own the memory (an asynchronous save: training goes on and changes the state).
    With ``staging`` (state on an accelerator) every box is copied into its pinned arena: views of
    one buffer of :func:`owned_elements` x :data:`BYTES_PER_ELEMENT` bytes, reused by every save."""
    access.link()  # DeepSpeed links parameters to their Adam-state fragments lazily
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, list] = {}
    arena = None
    for o in owned:
        boxes = o.boxes()
        if not boxes:
            continue
        for key in ("master", *access.keys(o.param)):
            flat = access.get_owned(o, key)
            for i, ((off, cut), uncut, pos) in enumerate(boxes):
                box = flat[pos : pos + math.prod(uncut)].view(uncut)[: cut[0]]
                if staging is not None:
                    if arena is None:
                        arena = staging.arena(owned_elements(owned) * BYTES_PER_ELEMENT)
                    tensors[f"{o.name}/{key}/{i}"] = arena.put(box)  # queued, not waited for
                elif copy:
                    tensors[f"{o.name}/{key}/{i}"] = box.clone(
                        memory_format=torch.contiguous_format
                    )
                else:
                    tensors[f"{o.name}/{key}/{i}"] = box.contiguous()
                where[f"{o.name}/{key}/{i}"] = list(off)
    if arena is not None:
        arena.synchronize()  # the device-to-host copies were queued without waiting
    return tensors, where


def rank_payload(tensors: dict[str, torch.Tensor], where: dict[str, list]) -> tuple[dict, dict]:
    """A rank's file as (tensors, safetensors metadata): each box's offsets travel with it, so a
    shard file describes itself even without the index."""
    return tensors, {"megaformer_boxes": json.dumps(where, sort_keys=True)}


def write_index(tmp: Path, pieces: list[dict], info: dict) -> None:
    """Rank 0, once every rank's file exists: ``index.json`` with each file's size."""
    for piece in pieces:
        piece["bytes"] = (tmp / STATE_DIR / piece["file"]).stat().st_size
    write_payload(tmp / STATE_DIR / INDEX, build_index(pieces, info))


def build_index(pieces: list[dict], info: dict) -> str:
    """``index.json`` from every rank's piece description ({"rank", "file", "bytes", "ranges":
    {name: [tp_offset, ep_offset, start, stop]}, "shards": {name: [local shape, dim, rows]},
    "shapes": {name: whole shape}, "keys": {name: [master, state names...]}}) and ``info`` (step,
    layout, the optimizer, Adam's step).

    Boxes are described by rule, not listed: a parameter's saved shard geometry once, and its
    owned flat ranges as runs (:func:`compress_ranges`): ZeRO-3's partition of a shard over any
    number of ranks is one run, so the index grows with parameters + ranks, not their product."""
    shapes: dict[str, list[int]] = {}
    shards: dict[str, list] = {}
    keys: dict[str, list[str]] = {}
    entries: dict[str, list] = {}
    for piece in pieces:
        shapes.update(piece["shapes"])
        shards.update(piece["shards"])
        keys.update(piece.get("keys", {}))
        for name, (tp_off, ep_off, start, stop) in piece["ranges"].items():
            entries.setdefault(name, []).append((piece["rank"], tp_off, ep_off, start, stop))
    files = {piece["file"]: piece["bytes"] for piece in pieces}
    for name, shape in shapes.items():  # every element of every tensor saved exactly once
        local, _, rows = shards.get(name, (shape, None, None))
        check_tiling(
            name, entries.get(name, []), math.prod(local), math.prod(shape), rows is not None
        )
    ranges = {name: compress_ranges(e) for name, e in entries.items()}
    return json.dumps(
        {
            "format": FORMAT,
            **info,
            "shapes": shapes,
            "files": files,
            "shards": shards,
            "ranges": ranges,
            "keys": keys,
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def check_tiling(
    name: str, entries: list[tuple[int, ...]], n_local: int, n_whole: int, padded: bool
) -> None:
    """Each saved shard of ``name`` (entries (rank, tp_offset, ep_offset, start, stop)) is tiled
    exactly by its ranges, and the shards hold the whole tensor (``padded``: a vocabulary table,
    whose shards' padding rows are not saved, may hold more)."""
    by_shard: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for _, tp_off, ep_off, start, stop in entries:
        by_shard.setdefault((tp_off, ep_off), []).append((start, stop))
    for ranges in by_shard.values():
        ranges.sort()
        if (
            ranges[0][0] != 0
            or ranges[-1][1] != n_local
            or any(a[1] != b[0] for a, b in itertools.pairwise(ranges))
        ):
            raise CheckpointError(
                f"sharded save: {name} is not saved exactly once (a rank's ownership is wrong)"
            )
    if len(by_shard) * n_local < n_whole or (not padded and len(by_shard) * n_local != n_whole):
        raise CheckpointError(
            f"sharded save: {name} has {len(by_shard)} shards of {n_local} of "
            f"{n_whole} elements (a rank's ownership is wrong)"
        )


def compress_ranges(entries: list[tuple[int, ...]]) -> list[list[int]]:
    """Entries (rank, tp_offset, ep_offset, start, stop) as runs ``[rank0, rank_step, count,
    tp_offset, ep_offset, lo, part, hi]``: entry j of a run is rank ``rank0 + j rank_step`` owning
    [lo + j part, min(lo + (j + 1) part, hi)) (``part`` > 0: equal parts, ZeRO-3 and ZeRO 1/2's
    whole-parameter fragments) or [lo + j (hi - lo) // count, lo + (j + 1) (hi - lo) // count)
    (``part`` = 0: an even split, ZeRO-0). Anything else is a run of one."""
    runs: list[list[int]] = []
    ordered = sorted(entries, key=lambda e: (e[1], e[2], e[3]))
    i = 0
    while i < len(ordered):
        r0, tp_off, ep_off, lo, _ = ordered[i]
        j = i + 1  # the longest contiguous stretch of one shard with a constant rank step
        step = ordered[i + 1][0] - r0 if i + 1 < len(ordered) else 1
        while (
            j < len(ordered)
            and ordered[j][1:3] == (tp_off, ep_off)
            and ordered[j][3] == ordered[j - 1][4]
            and ordered[j][0] - ordered[j - 1][0] == step
        ):
            j += 1
        run = [tuple(e) for e in ordered[i:j]]
        count, hi = len(run), run[-1][4]
        for part in (run[0][4] - lo, 0):
            if count > 1 and expand_run([r0, step, count, tp_off, ep_off, lo, part, hi]) == run:
                runs.append([r0, step, count, tp_off, ep_off, lo, part, hi])
                break
        else:
            runs.append([r0, 1, 1, tp_off, ep_off, lo, run[0][4] - lo, run[0][4]])
            j = i + 1
        i = j
    return runs


def expand_run(
    run: list[int], first: int = 0, last: Optional[int] = None
) -> list[tuple[int, int, int, int, int]]:
    """The entries (rank, tp_offset, ep_offset, start, stop) of a run of :func:`compress_ranges`
    (entries ``first`` to ``last`` of it)."""
    r0, step, count, tp_off, ep_off, lo, part, hi = run
    out = []
    for j in range(first, count if last is None else last + 1):
        if part > 0:
            a, b = lo + j * part, min(lo + (j + 1) * part, hi)
        else:
            a, b = lo + j * (hi - lo) // count, lo + (j + 1) * (hi - lo) // count
        out.append((r0 + j * step, tp_off, ep_off, a, b))
    return out


def piece_description(
    rank: int,
    tensors: dict[str, torch.Tensor],
    where: dict[str, list],
    owned: list[Owned],
    tp: int,
    keys: Callable[[Any], tuple[str, ...]] = lambda p: KEYS[1:],
) -> dict:
    """What rank 0 needs to know of this rank's file for the index (small: no tensor data, one
    flat range per parameter; ``tensors`` and ``where`` are the file's, described by rule;
    ``keys(p)``: the names of a parameter's optimizer state besides its master weight)."""
    return {
        "rank": rank,
        "file": rank_file(rank),
        "bytes": None,
        "ranges": {
            o.name: [o.tp_offset, o.ep_offset, o.start, o.stop] for o in owned if o.stop > o.start
        },
        "shards": {o.name: [list(o.local_shape), o.dim, o.rows] for o in owned},
        "shapes": {o.name: list(o.whole_shape(tp)) for o in owned},
        "keys": {o.name: ["master", *keys(o.param)] for o in owned},
    }


# ----------------------------------------------------------------------------- load


def origin_of(
    local: tuple[int, ...], dim: Optional[int], tp_offset: int, ep_offset: int
) -> list[int]:
    """Where a saved shard of shape ``local`` starts in the whole tensor."""
    origin = [0] * len(local)
    if dim is not None:
        origin[dim] += tp_offset
    origin[0] += ep_offset
    return origin


class ShardedState:
    """Reads a checkpoint's sharded state: index checked, each file's header checked (size
    against the index, tensors against the header) when first used."""

    def __init__(self, ckpt: Path) -> None:
        self.folder = ckpt / STATE_DIR
        path = self.folder / INDEX
        try:
            self.index = json.loads(read_text_inside(ckpt, Path(STATE_DIR, INDEX), MAX_INDEX_BYTES))
            self.shapes = {k: tuple(v) for k, v in self.index["shapes"].items()}
            self._keys: dict[str, list[str]] = self.index.get("keys", {})
            if not isinstance(self._keys, dict) or any(
                not isinstance(v, list)
                or v[:1] != ["master"]
                or len(set(v)) != len(v)
                or not set(v) <= STATE_KEYS
                for v in self._keys.values()
            ):
                raise ValueError("keys")
            self.files: dict[str, int] = self.index["files"]
            self.format = self.index.get("format")
            if self.format == 1:  # every box listed
                self.boxes: dict[str, list] = self.index["boxes"]
            else:  # boxes by rule, expanded for one parameter when it is first read
                self.boxes = {}
                self._shards: dict[str, list] = self.index["shards"]
                self._ranges: dict[str, list] = self.index["ranges"]
                missing = [n for n in self.shapes if n not in self._ranges or n not in self._shards]
        except (
            OSError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            CheckpointError,
            RecursionError,
        ):
            raise CheckpointError(f"{path}: missing or corrupt") from None
        if self.format not in (1, FORMAT):
            raise CheckpointError(
                f"{path}: format {self.format!r}; this megaformer reads formats 1 and {FORMAT}"
            )
        for name in self.files:
            if Path(name).name != name or not name.endswith(".safetensors"):
                raise CheckpointError(f"{path}: names file {name[:80]!r} outside {self.folder}")
        self._expect: dict[str, dict[str, list[int]]] = {f: {} for f in self.files}
        self._headers: dict[str, dict] = {}
        if self.format == 1:
            self._check_boxes(self.boxes)
            check_index_coverage(self.shapes, self.boxes, self.files, path)  # before allocating
        elif missing:
            raise CheckpointError(f"{path}: no master weights for {', '.join(missing[:3])}")
        else:
            self._check_runs()  # before any allocation
        self._open: dict[str, Any] = {}
        self.bytes_read = 0  # tensor bytes this process read from the shard files
        self.group: Any = None  # ranks holding identical shards: each byte read once among them
        self._pieces: dict[str, torch.Tensor] = {}  # this rank's read piece of each master shard

    def share(self, group: Any) -> None:
        """Read each shard once per ``group`` (ranks holding identical shards: the replica group,
        or the expert-data group under expert parallelism). Of a shard's n elements, group rank r
        of k reads [r n / k, (r + 1) n / k) and the group all-gathers the k pieces, so the group
        reads the shard once instead of k times (a fully parallel load). The master weights'
        pieces are kept (1 / world of the fp32 masters) until this reader is dropped: the
        resume's master weights then cost no second read (:meth:`fill_shared`)."""
        self.group = group

    def fill_shared(self, o: Owned, key: str) -> torch.Tensor:
        """:meth:`fill`, for a range ``o`` that ranks of the :meth:`share` group may also need
        (collective over the group: every rank calls it for the same parameters in the same
        order): the group's pieces of the whole shard, gathered, cut to ``o``'s range."""
        from megaformer.comm import all_gather_cat, rank, size
        from megaformer.runtime.collectives import collective_device

        k = size(self.group) if self.group is not None else 1
        if k == 1:
            return self.fill(o, key)
        r, n = rank(self.group), math.prod(o.local_shape)
        piece = self._pieces.get(o.name) if key == "master" else None
        if piece is None:
            piece = self.fill(replace(o, start=r * n // k, stop=(r + 1) * n // k), key)
            if key == "master":
                self._pieces[o.name] = piece
        width = -(-n // k)  # pieces padded to one width for the all-gather
        buf = torch.zeros(width, dtype=torch.float32, device=collective_device(self.group))
        buf[: piece.numel()] = piece.to(buf.device)
        parts = all_gather_cat(buf, self.group, 0).cpu()
        whole = torch.cat(
            [parts[i * width : i * width + (i + 1) * n // k - i * n // k] for i in range(k)]
        )
        return whole[o.start : o.stop].clone()

    def state_bytes(self) -> int:
        """The bytes of the whole saved state (every key of every parameter, fp32)."""
        return sum(4 * len(self.keys_of(n)) * math.prod(s) for n, s in self.shapes.items())

    def keys_of(self, name: str) -> tuple[str, ...]:
        """The saved keys of parameter ``name``: its master weight, then its optimizer state's
        names (AdamW's two moments in checkpoints that do not list them)."""
        return tuple(self._keys.get(name, KEYS))

    @property
    def optimizer(self) -> str:
        """``train.optimizer`` of the run that wrote this state."""
        return str(self.index.get("optimizer", "adamw"))

    def _check_boxes(self, boxes: dict[str, list]) -> None:
        """Every box inside its tensor, in a listed file (checked against the file's header when
        read)."""
        try:
            for pkey, entries in boxes.items():
                shape = self.shapes[pkey.rsplit("/", 1)[0]]
                for file, tkey, off, size in entries:
                    if (
                        len(off) != len(shape)
                        or len(size) != len(shape)
                        or any(o < 0 or z < 1 or o + z > d for o, z, d in zip(off, size, shape))
                    ):
                        raise ValueError(tkey)
                    self._expect[file][tkey] = list(size)
        except (KeyError, ValueError, TypeError, AttributeError):
            raise CheckpointError(
                f"{self.folder / INDEX}: corrupt (a box outside its tensor, or "
                "in a file it does not list)"
            ) from None

    def _check_runs(self) -> None:
        """Format 2, by arithmetic on the runs (none is expanded: O(runs), whatever the world):
        each run's ranges are non-empty and in listed files; each saved shard is tiled exactly by
        its runs; the shards (placed at their TP / EP offsets, vocabulary rows cut) tile the whole
        tensor exactly (:func:`check_exact_cover`); the shard files hold the bytes claimed. So no
        allocation is sized by the index, and every element is read from exactly one box."""
        where, claimed = self.folder / INDEX, 0
        self._runs: dict[str, list[tuple[Box, list[int]]]] = {}
        try:
            for name, shape in self.shapes.items():
                local, dim, rows = self._shards[name]
                local = tuple(int(d) for d in local)
                if (
                    len(local) != len(shape)
                    or dim not in (None, *range(len(shape)))
                    or (rows is not None and int(rows) != shape[0])
                ):
                    raise ValueError(name)
                n_local = math.prod(local)
                runs = [[int(v) for v in run] for run in self._ranges[name]]
                tiles: dict[tuple[int, int], list[tuple[int, int]]] = {}
                for r0, step, count, tp_off, ep_off, lo, part, hi in runs:
                    if (
                        count < 1
                        or not 0 <= lo < hi <= n_local
                        or part < 0
                        or (part > 0 and not (count - 1) * part < hi - lo <= count * part)
                        or (part == 0 and count > hi - lo)
                        or any(
                            rank_file(r) not in self.files for r in (r0, r0 + (count - 1) * step)
                        )
                        or (count > 1 and step == 0)
                    ):
                        raise ValueError(name)
                    tiles.setdefault((tp_off, ep_off), []).append((lo, hi))
                shard_boxes = []
                for (tp_off, ep_off), spans in tiles.items():
                    spans.sort()
                    if (
                        spans[0][0] != 0
                        or spans[-1][1] != n_local
                        or any(a[1] != b[0] for a, b in itertools.pairwise(spans))
                    ):
                        raise ValueError(name)
                    if dim is None and tp_off:
                        raise ValueError(name)
                    origin = origin_of(local, dim, tp_off, ep_off)
                    size = list(local)
                    if rows is not None:
                        size[0] = min(origin[0] + local[0], int(rows)) - origin[0]
                    if size[0] > 0:
                        shard_boxes.append(["", name, origin, size])
                check_exact_cover(name, shape, shard_boxes, where)
                self._runs[name] = [
                    ((tuple(origin_of(local, dim, r[3], r[4])), local), r) for r in runs
                ]
                claimed += 4 * len(self.keys_of(name)) * math.prod(shape)  # each saved once
        except (KeyError, ValueError, TypeError, AttributeError, OverflowError):
            raise CheckpointError(
                f"{where}: corrupt (the ranges or shards of a parameter)"
            ) from None
        have = sum(int(v) for v in self.files.values())
        if claimed > have:
            raise CheckpointError(
                f"{self.folder}: the index places {claimed} bytes of tensors in "
                f"{have} bytes of shard files"
            )

    def _boxes_in(self, name: str, key: str, target: Box) -> list:
        """The saved boxes of ``name``'s ``key`` that may meet ``target``: those of the run
        entries whose flat ranges meet the target's span in each saved shard (O(1) per run to find,
        whatever the number of ranks)."""
        if self.format == 1:
            return self.boxes.get(f"{name}/{key}", [])
        local, dim, rows = self._shards[name]
        local = tuple(int(d) for d in local)
        strides = [math.prod(local[k + 1 :]) for k in range(len(local))]
        out = []
        for (origin, _), (r0, step, count, tp_off, ep_off, lo, part, hi) in self._runs[name]:
            common = intersect(target, (origin, local))
            if common is None:
                continue
            rel = [o - g for o, g in zip(common[0], origin)]
            a = sum(x * st for x, st in zip(rel, strides))
            b = sum((x + z - 1) * st for x, z, st in zip(rel, common[1], strides)) + 1
            if b <= lo or a >= hi:
                continue
            if part > 0:
                first, last = max(0, (a - lo) // part), min(count - 1, (b - 1 - lo) // part)
            else:
                first = max(0, (a - lo) * count // (hi - lo) - 1)
                last = min(count - 1, (b - 1 - lo) * count // (hi - lo) + 1)
            run = [r0, step, count, tp_off, ep_off, lo, part, hi]
            for rank, _, _, start, stop in expand_run(run, first, last):
                o = Owned(
                    name,
                    None,
                    local,
                    start,
                    stop,
                    dim,
                    tp_off,
                    rows,  # type: ignore
                    ep_offset=ep_off,
                )
                for i, ((off, cut), _, _) in enumerate(o.boxes()):
                    out.append([rank_file(rank), f"{name}/{key}/{i}", list(off), list(cut)])
        return out

    def listed(self) -> dict[str, list]:
        """Every box, listed as format 1 lists them (``{"NAME/KEY": [[file, tensor key, offsets,
        sizes], ...]}``)."""
        return {f"{n}/{k}": self.boxes_of(n, k) for n in self.shapes for k in self.keys_of(n)}

    def boxes_of(self, name: str, key: str) -> list:
        """The saved boxes ``[file, tensor key, offsets, sizes]`` of ``name``'s ``key``: listed
        (format 1), or expanded from the parameter's runs and checked to tile it once (format 2)."""
        pkey = f"{name}/{key}"
        if self.format == 1 or pkey in self.boxes or name not in self.shapes:
            return self.boxes.get(pkey, [])
        where = self.folder / INDEX
        try:
            local, dim, rows = self._shards[name]
            local = tuple(int(d) for d in local)
            expanded = {k: [] for k in self.keys_of(name)}
            for run in self._ranges[name]:
                if len(run) != 8 or not 1 <= run[2] <= len(self.files):
                    raise ValueError(run)
                for rank, tp_off, ep_off, start, stop in expand_run([int(v) for v in run]):
                    if not 0 <= start < stop <= math.prod(local):
                        raise ValueError(run)
                    o = Owned(
                        name,
                        None,
                        local,
                        start,
                        stop,
                        dim,
                        tp_off,
                        rows,  # type: ignore
                        ep_offset=ep_off,
                    )
                    for i, ((off, cut), _, _) in enumerate(o.boxes()):
                        for k in expanded:
                            expanded[k].append(
                                [rank_file(rank), f"{name}/{k}/{i}", list(off), list(cut)]
                            )
        except (KeyError, ValueError, TypeError, AttributeError, IndexError):
            raise CheckpointError(f"{where}: corrupt (the ranges of {name[:80]})") from None
        boxes = {f"{name}/{k}": v for k, v in expanded.items()}
        self._check_boxes(boxes)
        check_exact_cover(f"{name}/master", self.shapes[name], boxes[f"{name}/master"], where)
        self.boxes.update(boxes)
        return self.boxes[pkey]

    @property
    def adam_step(self) -> float:
        return float(self.index.get("adam_step", 0.0))

    def names(self) -> list[str]:
        return list(self.shapes)

    def open_file(self, file: str) -> Any:
        """The shard ``file`` (a name from the index), opened once: a regular file whose size is
        the index's and whose header matches the boxes the index places in it."""
        from safetensors import safe_open

        if file not in self._open:
            path = self.folder / file
            if path.is_symlink() or not path.is_file():
                raise CheckpointError(f"{path}: missing shard of the checkpoint")
            size = path.stat().st_size
            if size != self.files[file]:
                raise CheckpointError(
                    f"{path}: {size} bytes, the checkpoint's index says "
                    f"{self.files[file]} (truncated or replaced)"
                )
            self._headers[file] = read_header(path)  # every tensor's byte range in the file
            for tkey, size in self._expect[file].items():
                self._check_header(file, tkey, size)
            self._open[file] = safe_open(str(path), framework="pt")
        return self._open[file]

    def _check_header(self, file: str, tkey: str, size: list[int]) -> None:
        """The shard ``file`` holds ``tkey`` as an fp32 tensor of ``size`` (opened first)."""
        if file not in self._headers:
            self.open_file(file)
        entry = self._headers[file].get(tkey)
        if (
            not isinstance(entry, dict)
            or entry.get("dtype") != "F32"
            or entry.get("shape") != list(size)
        ):
            raise CheckpointError(
                f"{self.folder / file}: {tkey} is missing or does not match {self.folder / INDEX}"
            )

    def read(self, name: str, key: str, target: Box, out: torch.Tensor) -> int:
        """Fill ``out`` (a tensor of ``target``'s size) with the saved values inside ``target``;
        returns how many elements were found."""
        found = 0
        for file, tkey, off, size in self._boxes_in(name, key, target):
            common = intersect(target, (tuple(off), tuple(size)))
            if common is None:
                continue
            self._check_header(file, tkey, size)
            try:
                part = self.open_file(file).get_slice(tkey)[_slices(common, tuple(off))]
            except CheckpointError:
                raise
            except Exception as e:  # safetensors' own errors
                raise CheckpointError(
                    f"{self.folder / file}: cannot read {tkey} ({str(e)[:200]})"
                ) from None
            out[_slices(common, target[0])] = part.to(out.dtype)
            found += math.prod(common[1])
            self.bytes_read += part.numel() * part.element_size()
        return found

    def whole(self, name: str, key: str = "master") -> torch.Tensor:
        """One whole tensor (generation, export: one process reads the whole model)."""
        if name not in self.shapes:
            raise CheckpointError(f"{self.folder}: no parameter {name}")
        shape = self.shapes[name]
        out = torch.empty(shape, dtype=torch.float32)
        box = (tuple([0] * len(shape)), shape)
        if self.read(name, key, box, out) != math.prod(shape):
            raise CheckpointError(f"{self.folder}: {name}/{key} is incomplete")
        return out

    def fill(self, o: Owned, key: str) -> torch.Tensor:
        """The flat range ``o`` owns of ``key``, fp32 (vocabulary padding rows: zeros)."""
        flat = torch.zeros(o.stop - o.start, dtype=torch.float32)
        for box, uncut, pos in o.boxes():
            target = flat[pos : pos + math.prod(uncut)].view(uncut)[: box[1][0]]
            if self.read(o.name, key, box, target) != math.prod(box[1]):
                raise CheckpointError(
                    f"{self.folder}: {o.name}/{key} does not cover this "
                    "layout's shard (saved for another model?)"
                )
        return flat

    def shard(
        self,
        name: str,
        shape: tuple[int, ...],
        dim: Optional[int],
        tp_offset: int,
        key: str = "master",
        ep_offset: int = 0,
    ) -> torch.Tensor:
        """A parameter's tensor-parallel shard of ``key`` (``shape``, starting at ``tp_offset``
        along ``dim`` and at ``ep_offset`` along dim 0 for an expert-parallel slice of experts;
        the weights a rank builds its model from), vocabulary padding rows zero; read once per
        :meth:`share` group (collective over it)."""
        if name not in self.shapes:
            raise CheckpointError(f"{self.folder}: no parameter {name}")
        rows = self.shapes[name][0] if name in VOCAB_TABLES else None
        o = Owned(
            name,
            None,
            shape,
            0,
            math.prod(shape),
            dim,
            tp_offset,
            rows,  # type: ignore
            ep_offset=ep_offset,
        )
        return self.fill_shared(o, key).view(shape)

    def check_model(self, expected: dict[str, tuple[int, ...]]) -> None:
        """The saved parameters are the model's (names and whole shapes)."""
        tied_extra = set(expected) - set(self.shapes) - {"lm_head.weight"}
        extra = set(self.shapes) - set(expected)
        if tied_extra or extra:
            raise CheckpointError(
                f"{self.folder}: parameters do not fit the configured model "
                f"(missing {sorted(tied_extra)[:3]}, unexpected {sorted(extra)[:3]})"
            )
        for name, shape in self.shapes.items():
            if tuple(expected[name]) != shape:
                raise CheckpointError(
                    f"{self.folder}: {name} has shape {list(shape)}, the "
                    f"configured model needs {list(expected[name])}"
                )


class ShardedWeights:
    """The master weights of a sharded checkpoint as a tensor source (``keys``/``meta``/``get``,
    like :class:`megaformer.checkpoint.hf.stream.TensorSource`), one whole tensor at a time, in
    the precision the model trained in."""

    def __init__(self, ckpt: Path, dtype: torch.dtype = torch.float32) -> None:
        self.state = ShardedState(ckpt)
        self.dtype = dtype

    def keys(self) -> list[str]:
        return self.state.names()

    def meta(self, name: str) -> torch.Tensor:
        return torch.empty(self.state.shapes[name], dtype=self.dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        return self.state.whole(name).to(self.dtype)
