"""Blending several datasets with weights, each within one sample of its share at every point.

With weights w_1..w_D (sum 1) and c_d(n) the samples taken from dataset d among the first n, we
want |c_d(n) - w_d n| < 1 for every d and every n. This is the chairman-assignment problem;
Tijdeman (1980) showed the bound 1 - 1/(2D - 2) is reached by earliest-deadline-first scheduling of
dataset d's k-th sample in the window

    release (k + delta) / w_d  <=  n  <=  deadline (k + 1 - delta) / w_d,    delta = 1 / (2D - 2),

which is what :func:`blend_index` does (a heap over D datasets, O(n log D); a greedy "largest
deficit" rule, as in Megatron-LM, can overshoot 1). The sequence is online, so the first n entries
never depend on how many are built. Global sample g is sample ``k = offset[g]`` of dataset
``which[g]``, and that dataset's own (shuffled) order supplies the tokens.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

log = logging.getLogger("megaformer")


def normalise(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def blend_index(weights: Sequence[float], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(which dataset, its sample number) for global samples 0..n-1 (Tijdeman's schedule)."""
    w = normalise(weights)
    D = len(w)
    which = np.zeros(n, dtype=np.int16 if D < 2**15 else np.int32)
    offset = np.zeros(n, dtype=np.int64)
    active = [d for d in range(D) if w[d] > 0]
    if len(active) <= 1:
        which[:] = active[0] if active else 0
        offset[:] = np.arange(n)
        return which, offset
    delta = 1.0 / (2 * (len(active) - 1))
    count = [0] * D
    future = [(delta / w[d], d) for d in active]  # (release, d)
    heapq.heapify(future)
    ready: list[tuple[float, int]] = []  # (deadline, d)
    for i in range(n):
        t = i + 1 + 1e-9
        while future and future[0][0] <= t:
            _, d = heapq.heappop(future)
            heapq.heappush(ready, ((count[d] + 1 - delta) / w[d], d))
        _, d = heapq.heappop(ready)
        which[i] = d
        offset[i] = count[d]
        count[d] += 1
        heapq.heappush(future, ((count[d] + delta) / w[d], d))
    return which, offset


class BlendedDataset:
    """Global sample g = sample ``offset[g]`` of dataset ``which[g]``; built for ``n`` samples,
    extended (exactly, the schedule being online) when asked for more. ``len()`` = samples built."""

    shuffled = True

    def __init__(self, datasets: Sequence, weights: Sequence[float], n: int,
                 cache_dir: Optional[Path] = None, build: bool = True) -> None:
        self.datasets = list(datasets)
        self.weights = normalise(weights)
        self.cache_dir = cache_dir
        self._build(n, build)

    def _key(self) -> str:
        parts = [[str(getattr(getattr(d, "data", None), "prefix", "")), getattr(d, "split", ""),
                  getattr(d, "start", 0), getattr(d, "end", 0), getattr(d, "seq_len", 0),
                  getattr(d, "seed", 0)] for d in self.datasets]
        text = json.dumps({"v": 1, "datasets": parts, "weights": self.weights.tolist()})
        return "blend-" + hashlib.sha256(text.encode()).hexdigest()[:20]

    def _build(self, n: int, save: bool) -> None:
        path = self.cache_dir / f"{self._key()}.npz" if self.cache_dir is not None else None
        if path is not None and path.is_file():
            with np.load(path) as z:
                if len(z["which"]) >= n:
                    self.which, self.offset = z["which"], z["offset"]
                    self._ensure_parts()
                    return
        t0 = time.perf_counter()
        self.which, self.offset = blend_index(self.weights, n)
        if path is not None and save:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}.npz"
            np.savez(tmp, which=self.which, offset=self.offset)
            os.replace(tmp, path)
        log.info("data: blend of %d datasets (weights %s): %s samples in %.2fs", len(self.datasets),
                 ", ".join(f"{w:.3f}" for w in self.weights), f"{n:,}", time.perf_counter() - t0)
        self._ensure_parts()

    def _ensure_parts(self) -> None:
        for d, ds in enumerate(self.datasets):
            mine = self.offset[self.which == d]
            if len(mine) and hasattr(ds, "ensure"):
                ds.ensure(int(mine.max()) + 1, build=False)

    def __len__(self) -> int:
        return len(self.which)

    def counts(self, n: int) -> np.ndarray:
        """Samples per dataset among the first n."""
        return np.bincount(self.which[:n], minlength=len(self.datasets))

    def sample(self, g: int) -> np.ndarray:
        if g >= len(self.which):
            self._build(max(g + 1, 2 * len(self.which)), save=False)
        return self.datasets[int(self.which[g])].sample(int(self.offset[g]))

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.sample(int(g)) for g in indices]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
