"""Checkpoints: atomic (optionally asynchronous) save, safe load, exact and re-layout resume,
offline reshard, and the consolidated weights used by generate."""
