"""DeepSpeed engine setup, the training loop, schedules and logging."""
