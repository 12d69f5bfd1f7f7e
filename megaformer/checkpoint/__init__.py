"""Checkpoints: atomic save, safe load, resume, and the consolidated weights used by generate."""
