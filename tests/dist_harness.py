"""The rank-spawning harness lives in :mod:`megaformer.runtime.spawn`; this name stays for tests
written against it."""

from megaformer.runtime.spawn import run_ranks  # noqa: F401
