"""The blend schedule: the compiled scheduler against the Python loop, and Tijdeman's per-prefix
bound |c_d(n) - w_d n| <= 1 - 1/(2D - 2) up to 10^8 samples, checked chunk by chunk."""

from __future__ import annotations

import numpy as np
import pytest

from megaformer.data.blend import blend_chunks, blend_index, normalise, scheduler


def max_prefix_error(weights, n: int, chunk: int = 1 << 22) -> float:
    """max over prefixes m <= n and datasets d of |c_d(m) - w_d m|, in bounded memory.

    Between two samples of d the error c_d(m) - w_d m only falls, so its extremes are right after a
    sample of d (global slot i, the k-th of d: (k + 1) - w_d (i + 1)) and right before one
    (k - w_d i), or at m = n. The per-dataset numbering k = ``offset`` is checked on the way (each
    dataset's offsets in a chunk continue its running count, in slot order)."""
    w = normalise(weights)
    D = len(w)
    base = np.zeros(D, dtype=np.int64)
    worst = 0.0
    for start, which, offset in blend_chunks(weights, n, chunk):
        cnt = np.bincount(which, minlength=D)
        by_dataset = offset[
            np.argsort(which.astype(np.int16), kind="stable")
        ]  # d's offsets, in slot order
        first = np.concatenate([[0], np.cumsum(cnt)[:-1]])
        assert np.array_equal(by_dataset, np.repeat(base - first, cnt) + np.arange(len(which)))
        base += cnt
        i = np.arange(start, start + len(which), dtype=np.float64)
        wi = w[which]
        after = (offset + 1) - wi * (i + 1)
        before = offset - wi * i
        worst = max(worst, float(np.abs(after).max()), float(np.abs(before).max()))
    return max(worst, float(np.abs(base - w * n).max()))


def tijdeman_bound(weights) -> float:
    active = int((np.asarray(weights) > 0).sum())
    return 1.0 - 1.0 / (2 * active - 2) if active > 1 else 0.0


def random_weights(rng, D):
    w = rng.random(D) ** 3 + 1e-3
    w[rng.random(D) < 0.15] = 0.0
    w[0] = max(w[0], 0.01)
    return w


def test_compiled_scheduler_is_the_python_loop():
    assert scheduler() is not None  # the test machines have a C compiler
    rng = np.random.default_rng(0)
    for D in (2, 3, 5, 8, 13, 40):
        w = random_weights(rng, D)
        loop = blend_index(w, 30_000, native=False)
        fast = blend_index(w, 30_000)
        assert np.array_equal(loop[0], fast[0]) and np.array_equal(loop[1], fast[1])
        # resumed from the counts chunk by chunk: the same schedule
        pieces = [wh for _, wh, _ in blend_chunks(w, 30_000, chunk=997)]
        assert np.array_equal(np.concatenate(pieces), fast[0])
        assert fast[0].dtype == np.int8 and fast[1].dtype == np.int16


def test_one_dataset_and_zero_weights():
    which, offset = blend_index([0, 3, 0], 1000)
    assert (which == 1).all() and np.array_equal(offset, np.arange(1000))
    which, offset = blend_index([1, 0, 1], 1000)
    assert set(which.tolist()) == {0, 2} and abs(int((which == 0).sum()) - 500) <= 1


@pytest.mark.parametrize("seed", range(4))
def test_every_prefix_within_tijdeman_bound_1e6(seed):
    rng = np.random.default_rng(seed)
    w = random_weights(rng, int(rng.integers(3, 12)))
    err = max_prefix_error(w, 10**6)
    assert err <= tijdeman_bound(w) + 1e-9
    assert err > 0.25  # the check sees real deviations, not an all-zero error


@pytest.mark.slow
def test_every_prefix_within_tijdeman_bound_1e8():
    w = [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01]
    assert max_prefix_error(w, 10**8) <= tijdeman_bound(w) + 1e-9
