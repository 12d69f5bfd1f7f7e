"""``megaformer convert --verify``: both sides of a conversion run one fixed batch of token ids in
fp32 and their logits are compared,

    diff = max |logits_megaformer - logits_transformers|   over a [2, T] batch, T = min(64, max_seq_len),

the ids drawn from a fixed seed over the vocabulary. Above the tolerance the conversion fails (its
output, still under a temporary name, is removed). Both models are in memory at once, in fp32:
about 8 bytes per parameter.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megaformer.errors import ConversionError

log = logging.getLogger("megaformer")

DEFAULT_TOLERANCE = 1e-3
PROMPT_SEED = 1234


def prompt_batch(vocab_size: int, max_seq_len: int) -> torch.Tensor:
    """The fixed [2, T] batch of ids both models run."""
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, vocab_size, (2, min(64, max_seq_len)), generator=g)


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits of ``ids`` for the model in ``folder`` (local files only, no
    remote code)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ConversionError(
            "--verify runs the model in transformers: pip install 'megaformer[hf]'"
        ) from None
    model = AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, trust_remote_code=False, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = model(ids).logits
    del model
    return out


def megaformer_logits(run: Path, ids: torch.Tensor) -> torch.Tensor:
    """megaformer's fp32 logits of ``ids`` for the checkpoint (or run directory) ``run``."""
    from megaformer.checkpoint.model_weights import load_model_weights

    model, _, _ = load_model_weights(run)
    with torch.no_grad():
        out = model(ids)
    del model
    return out


def verify(run: Path, hf_folder: Path, tolerance: float = DEFAULT_TOLERANCE) -> float:
    """max |logit difference| of the two models on :func:`prompt_batch`; ConversionError above
    ``tolerance``. Prints the figure."""
    from megaformer.checkpoint.layout import read_config, resolve_checkpoint

    m = read_config(resolve_checkpoint(run)).model
    ids = prompt_batch(m.vocab_size, m.max_seq_len)
    ours = megaformer_logits(run, ids)
    theirs = hf_logits(hf_folder, ids)
    if ours.shape != theirs.shape:
        raise ConversionError(
            f"--verify: logits of shape {tuple(ours.shape)} (megaformer) and "
            f"{tuple(theirs.shape)} (transformers) differ"
        )
    diff = (ours - theirs).abs().max().item()
    print(
        f"verify: max |logit difference| = {diff:.3g} over {ids.shape[0]} x {ids.shape[1]} "
        f"tokens (fp32; tolerance {tolerance:g})"
    )
    if not diff <= tolerance:  # NaN fails too
        raise ConversionError(
            f"--verify: max |logit difference| {diff:.3g} exceeds the tolerance "
            f"{tolerance:g}; nothing was written"
        )
    return diff
