"""What a process sets up around a model before it trains, shared by the trainer, ``bench`` and
the data tools: the optimizer (AdamW parameter groups and implementation), the host memory
allocator, and the lock that gives a run directory to one job at a time."""
