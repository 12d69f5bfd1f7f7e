"""Autoregressive decoding: one loop for every caller (sampling, greedy evaluation, pipelines).

Given a prompt x_1..x_T and a function returning the next-token logits of a window of at most L
(max_seq_len) tokens, step k appends

    y_k = argmax_v logits_v                                    (temperature 0: greedy)
    y_k ~ softmax(top_k(logits) / temperature)                 (otherwise)

until ``max_new_tokens`` are made, every row has produced ``eos_id`` (finished rows are padded
with it), or ``stop(new tokens of row 0)`` is true. The model sees at most L tokens: a longer
prompt is cropped from the left. With a KV cache each step feeds only the new token while the
context has room; once it is full (and always without a cache) a step recomputes the last L
tokens, exactly what a cache-free sliding window computes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# (ids [B, t] at positions start.., start) -> logits [B, V] of the last of them
NextLogits = Callable[[torch.Tensor, int], torch.Tensor]


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: Optional[int],
    generator: Optional[torch.Generator],
) -> torch.Tensor:
    """Next token [B, 1] from logits [B, V]: argmax at temperature 0, else top-k softmax sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def kv_cached(model: Any) -> NextLogits:
    """Next-token logits of ``model`` (a Transformer) through a fresh KV cache of its own."""
    cache = model.new_cache()

    def next_logits(ids: torch.Tensor, start: int) -> torch.Tensor:
        logits, _ = model.forward_cached(ids, cache, start, last_only=True)
        return logits[:, -1]

    return next_logits


@torch.no_grad()
def decode(
    next_logits: NextLogits,
    ids: torch.Tensor,
    max_new_tokens: int,
    max_len: int,
    *,
    cached: bool = True,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    eos_id: Optional[int] = None,
    stop: Optional[Callable[[list[int]], bool]] = None,
) -> torch.Tensor:
    """``ids`` [B, T] followed by up to ``max_new_tokens`` decoded tokens -> [B, T + n].

    ``cached``: ``next_logits`` keeps a KV cache, so a step may feed only the new token (at
    position ``start``); without one every call gets the whole window from position 0."""
    out = ids
    if max_new_tokens <= 0:
        return out
    T = ids.shape[1]
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    window = out[:, -max_len:]
    logits = next_logits(window, 0)
    pos = window.shape[1]
    for step in range(max_new_tokens):
        nxt = next_token(logits, temperature, top_k, generator)
        if eos_id is not None:
            nxt = nxt.masked_fill(done.unsqueeze(1), eos_id)
            done |= nxt.squeeze(1) == eos_id
        out = torch.cat((out, nxt), dim=1)
        if (
            step == max_new_tokens - 1
            or bool(done.all())
            or (stop is not None and stop(out[0, T:].tolist()))
        ):
            break
        if cached and pos < max_len:  # room left: feed only the new token
            logits = next_logits(nxt, pos)
            pos += 1
        else:  # context full (or no cache): positions shift, so recompute over the last L tokens
            logits = next_logits(out[:, -max_len:], 0)
    return out
