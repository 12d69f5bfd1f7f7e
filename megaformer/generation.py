"""Text generation from a trained model or a checkpoint (no DeepSpeed, no process group)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint.model_weights import load_model_weights
from megaformer.config import Config
from megaformer.data.tokenizer import Tokenizer, load_tokenizer
from megaformer.errors import CheckpointError, UserError
from megaformer.model.decoding import decode, kv_cached
from megaformer.safe_files import check_file

MAX_TOKENIZER_BYTES = 1 << 30


def generate_text(model: Any, tokenizer: Tokenizer, prompt: str, max_new_tokens: int,
                  temperature: float = 0.0, top_k: Optional[int] = None,
                  seed: int = 0) -> str:
    """Prompt + continuation as text. Temperature 0 is greedy (argmax) decoding."""
    if temperature < 0:
        raise UserError(f"--temperature {temperature}: must be >= 0")
    if max_new_tokens < 0:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be >= 0")
    prefix = prompt_ids(tokenizer, prompt)
    device = next(model.parameters()).device
    x = torch.tensor([prefix], dtype=torch.long, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen,
                         eos_id=tokenizer.eod_id)
    return continuation_text(tokenizer, prompt, out[0, len(prefix):].tolist())


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The prompt's tokens; an empty prompt starts a new document (the end-of-document token)."""
    ids = tokenizer.encode(prompt) if prompt else []
    return list(ids) if ids else [tokenizer.eod_id]


def continuation_text(tokenizer: Tokenizer, prompt: str, new: list[int]) -> str:
    """Prompt + the generated tokens ``new`` up to the first end-of-document, as text."""
    if tokenizer.eod_id in new:
        new = new[:new.index(tokenizer.eod_id)]
    return prompt + tokenizer.decode(new)


def load_checkpoint_model(path: str | Path, device: str = "cpu") -> tuple[Any, Tokenizer, Config, Path]:
    """Model (eval mode, fp32), tokenizer and config from a run directory or checkpoint."""
    ckpt = ckpt_layout.resolve_checkpoint(path)
    if not (ckpt / "tokenizer.json").exists() and not (ckpt / "tokenizer.json").is_symlink():
        raise CheckpointError(f"{ckpt}: no tokenizer.json (a model converted without its "
                              "tokenizer: convert it again with --tokenizer PATH)")
    check_file(ckpt / "tokenizer.json", MAX_TOKENIZER_BYTES)
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    model, cfg, ckpt = load_model_weights(ckpt, device)
    return model, tokenizer, cfg, ckpt


@torch.no_grad()
def greedy_tokens(model: Any, prefix: list[int], max_new_tokens: int,
                  stop: Optional[Callable[[list[int]], bool]] = None,
                  device: Optional[torch.device] = None) -> list[int]:
    """Greedy (argmax) continuation of ``prefix`` with the model's KV cache, one token per step,
    until ``stop(new_tokens)`` is true or ``max_new_tokens`` are made
    (:func:`megaformer.model.decoding.decode`, as ``Transformer.generate``: the model sees at most
    max_seq_len tokens)."""
    device = device or next(model.parameters()).device
    ids = torch.tensor([list(prefix)], dtype=torch.long, device=device)
    out = decode(kv_cached(model), ids, max_new_tokens, model.cfg.max_seq_len, stop=stop)
    return out[0, ids.shape[1]:].tolist()
