"""Time of the attention core per training step on one rank, priced by what each context mode runs.

The attention core (scores and values: 4 s_q s_k d FLOPs per head forward under the mask, twice
that backward, once more when recomputed) runs a fused kernel at the rate

    R(n) = peak * efficiency * n / (n + N_HALF),     N_HALF = 256 tokens,

where n is the length of the blocks one kernel call sees: a kernel is taken to reach half its
long-sequence rate on blocks of 256 tokens (per-call launch and tile-tail costs; FlashAttention-2
works in 128-row tiles) -- an assumption of this model, not a measurement. One process and all-to-all (DeepSpeed-Ulysses) run one call over the whole
sequence (n = s, on h/CP heads); the all-to-all exchange of q, k, v and the output is not
overlapped (it is priced as communication by the planner).

The ring (:mod:`megaformer.parallel.context`) runs CP steps per layer. Each rank holds chunks r and
2CP-1-r of C = s / 2CP tokens; step i runs the chunk pairs it sees against the block it holds then,
w_i C x C score blocks of work (:func:`megaformer.parallel.context.ring_step_work`: a pair below
the diagonal 1, a diagonal one 1/2 under the kernel's causal mask, one with an explicit mask --
cut by the sliding window, or with document masks -- 1), taken on the busiest rank of the step.
Without a window every step of every rank is w_i = 2: the causal load is balanced. The K/V block
for the next step travels while a step computes; the fp32 dK/dV accumulators travel after each
backward step, waited at once:

    forward  = sum_i t_i + sum_{i < CP-1} max(0, t_kv - t_i)
    backward = sum_i 2 t_i + sum_{i < CP-1} max(0, t_kv - 2 t_i) + CP t_dkv
    t_i = w_i 4 C^2 h d b / R(C),  t_kv = b (s / CP) 2 h_kv d e / BW,  t_dkv = the same with 4 bytes

The first terms are the kernel time (``compute``), the rest the exposed point-to-point time
(``exposed``). The merge of the partial outputs (elementwise, fp32) is not priced.
"""

from __future__ import annotations

import functools
from typing import Optional

from megaformer.analysis.flops import attention_pairs, checkpointed_blocks
from megaformer.analysis.memory import DTYPE_BYTES, Layout
from megaformer.config import ModelConfig
from megaformer.parallel.context import ring_step_work

N_HALF = 256
GB = 1e9


def kernel_efficiency(tokens: float) -> float:
    """The fraction of its long-sequence rate a fused attention kernel reaches on blocks of
    ``tokens`` queries and keys: tokens / (tokens + 256)."""
    return tokens / (tokens + N_HALF)


def recomputed_share(cfg: ModelConfig, layout: Layout) -> float:
    """The share of layers whose attention core runs its forward again in backward."""
    if layout.recompute == "selective":
        return 1.0
    if layout.recompute == "full":
        return checkpointed_blocks(cfg.n_layers, layout.recompute_every) / cfg.n_layers
    return 0.0


def attention_seconds(
    cfg: ModelConfig, seq_len: int, layout: Layout, rate: float, gbps: float
) -> dict:
    """{'compute', 'exposed'} seconds per layer and micro-batch of one rank's attention core
    (module docstring); ``rate`` the FLOP/s of a kernel on long sequences (peak x efficiency),
    ``gbps`` the bandwidth between context ranks."""
    heads = cfg.n_heads / layout.tp
    fwd = 4 * attention_pairs(seq_len, True, cfg.sliding_window) * heads * cfg.head_dim
    fwd *= layout.micro_batch / layout.cp  # this rank's share (balanced under the ring)
    redo = recomputed_share(cfg, layout)
    cp = layout.cp
    if cp == 1 or layout.cp_mode != "ring":
        return {"compute": fwd * (3 + redo) / (rate * kernel_efficiency(seq_len)), "exposed": 0.0}
    c = seq_len / (2 * cp)
    block = 4 * c * c * heads * cfg.head_dim * layout.micro_batch  # one C x C pair, forward
    rate_c = rate * kernel_efficiency(c)
    t_f = [w * block / rate_c for w in _slowest_steps(cfg, seq_len, cp)]
    kv = layout.micro_batch * seq_len / cp * 2 * cfg.kv_heads * cfg.head_dim / layout.tp
    t_kv = kv * DTYPE_BYTES[layout.precision] / (gbps * GB)
    t_dkv = kv * 4 / (gbps * GB)
    exposed_f = sum(max(0.0, t_kv - t) for t in t_f[:-1])
    exposed_b = sum(max(0.0, t_kv - 2 * t) for t in t_f[:-1]) + cp * t_dkv
    return {
        "compute": sum(t_f) * (3 + redo),
        "exposed": exposed_f * (1 + redo) + exposed_b,
    }


@functools.lru_cache(maxsize=None)
def _steps(cp: int, seq_len: int, window: Optional[int], documents: bool) -> tuple:
    work = [ring_step_work(r, cp, seq_len // cp, window, documents) for r in range(cp)]
    return tuple(max(w[i] for w in work) for i in range(cp))


def _slowest_steps(cfg: ModelConfig, seq_len: int, cp: int) -> tuple:
    """Each ring step's kernel work on its busiest rank, in C x C score blocks (a step ends when
    its slowest rank has the next block): 2 per step without a sliding window."""
    window = cfg.sliding_window if cfg.sliding_window and cfg.sliding_window < seq_len else None
    return _steps(cp, seq_len, window, bool(cfg.document_mask))
