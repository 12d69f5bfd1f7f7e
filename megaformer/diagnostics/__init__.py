"""Residual-stream diagnostics: what every layer writes, per-head attention statistics and the
logit lens, from a separate no-grad pass (``residual``), named for the logs (``metrics``), run by
the trainer under any TP/PP layout (``training``), plotted by ``megaformer report`` (``plots``) and
shown for one prompt by ``megaformer inspect`` (``inspect``)."""
