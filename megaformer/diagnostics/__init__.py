"""Residual-stream diagnostics: what every layer writes, per-head attention statistics and the
logit lens, from a separate no-grad pass (``residual``), named for the logs (``metrics``), run by
the trainer (``training``) and shown by ``megaformer inspect`` (``inspect``)."""
