"""Text generation from a trained model or a checkpoint (no DeepSpeed, no process group)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint.model_weights import load_model_weights
from megaformer.config import Config
from megaformer.data.tokenizer import Tokenizer, load_tokenizer
from megaformer.errors import CheckpointError, UserError
from megaformer.model.decoding import decode, kv_cached
from megaformer.safe_files import check_file

MAX_TOKENIZER_BYTES = 1 << 30


def generate_text(
    model: Any,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    seed: int = 0,
) -> str:
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
    with cpu_threads(decoding_threads() if device.type == "cpu" else None):
        out = model.generate(
            x,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            generator=gen,
            eos_id=tokenizer.eod_id,
        )
    return continuation_text(tokenizer, prompt, out[0, len(prefix) :].tolist())


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The prompt's tokens; an empty prompt starts a new document (the end-of-document token)."""
    ids = tokenizer.encode(prompt) if prompt else []
    return list(ids) if ids else [tokenizer.eod_id]


def continuation_text(tokenizer: Tokenizer, prompt: str, new: list[int]) -> str:
    """Prompt + the generated tokens ``new`` up to the first end-of-document, as text."""
    if tokenizer.eod_id in new:
        new = new[: new.index(tokenizer.eod_id)]
    return prompt + tokenizer.decode(new)


def decoding_threads(env: Mapping[str, str] = os.environ) -> int:
    """CPU threads for decoding: ``OMP_NUM_THREADS`` when set; else the idle physical cores of
    this process's CPUs, n = max(1, round(cores - load)) with ``load`` the 1-minute load average.

    One token at a time is a chain of small matmuls; each waits for its slowest thread, so a thread
    on a busy core (oversubscription) costs far more than it adds (on 2 loaded cores, 120 tokens
    took 93 s with torch's default of one thread per core and 3 s with one thread)."""
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    cores = physical_cores()
    return max(1, min(cores, round(cores - os.getloadavg()[0])))


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (logical CPUs / threads per core)."""
    if hasattr(os, "sched_getaffinity"):
        logical = len(os.sched_getaffinity(0))
    else:
        logical = os.cpu_count() or 1
    try:
        siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text()
        per_core = sum(
            b - a + 1
            for a, b in (
                (int(r.split("-")[0]), int(r.split("-")[-1])) for r in siblings.strip().split(",")
            )
        )
    except (OSError, ValueError):
        per_core = 1
    return max(1, logical // max(1, per_core))


@contextlib.contextmanager
def cpu_threads(n: Optional[int]) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block (None: unchanged), restored after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_checkpoint_model(
    path: str | Path, device: str = "cpu"
) -> tuple[Any, Tokenizer, Config, Path]:
    """Model (eval mode, fp32), tokenizer and config from a run directory or checkpoint."""
    ckpt = ckpt_layout.resolve_checkpoint(path)
    if not (ckpt / "tokenizer.json").exists() and not (ckpt / "tokenizer.json").is_symlink():
        raise CheckpointError(
            f"{ckpt}: no tokenizer.json (a model converted without its "
            "tokenizer: convert it again with --tokenizer PATH)"
        )
    check_file(ckpt / "tokenizer.json", MAX_TOKENIZER_BYTES)
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    model, cfg, ckpt = load_model_weights(ckpt, device)
    return model, tokenizer, cfg, ckpt


@torch.no_grad()
def greedy_tokens(
    model: Any,
    prefix: list[int],
    max_new_tokens: int,
    stop: Optional[Callable[[list[int]], bool]] = None,
    device: Optional[torch.device] = None,
) -> list[int]:
    """Greedy (argmax) continuation of ``prefix`` with the model's KV cache, one token per step,
    until ``stop(new_tokens)`` is true or ``max_new_tokens`` are made
    (:func:`megaformer.model.decoding.decode`, as ``Transformer.generate``: the model sees at most
    max_seq_len tokens)."""
    device = device or next(model.parameters()).device
    ids = torch.tensor([list(prefix)], dtype=torch.long, device=device)
    out = decode(kv_cached(model), ids, max_new_tokens, model.cfg.max_seq_len, stop=stop)
    return out[0, ids.shape[1] :].tolist()
