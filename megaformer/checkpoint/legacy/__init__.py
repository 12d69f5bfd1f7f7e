"""Read-only older checkpoint formats: still loaded, never written by training (fp16 runs excepted,
whose state lives in DeepSpeed's engine files)."""
