"""Downstream evaluation with EleutherAI's lm-evaluation-harness on megaformer's own model.

    forward.py     how a rank runs the model: token scores and greedy decoding, plain or pipeline
    harness.py     the lm-eval ``LM`` adapter (loglikelihood, rolling, generate_until; DP split)
    tasks.py       task lookup (registry + local YAMLs), running, tables, flat scores, JSON
    checkpoint.py  ``megaformer eval``: a checkpoint at any TP x PP x DP layout
    training.py    the same harness on the live model during training (eval.tasks)

lm-eval is an optional dependency (``pip install megaformer[eval]``), imported only when used.
"""
