"""Time of the attention core per training step on one rank, priced by what each context mode runs.

The attention core (scores and values: 4 s_q s_k d FLOPs per head forward under the mask, twice
that backward, once more when recomputed) runs a fused kernel at the rate

    R(n) = peak * efficiency * n / (n + N_HALF),     N_HALF = 256 tokens,

where n is the length of the blocks one kernel call sees: a kernel reaches half its long-sequence
rate on blocks of 256 tokens (per-call launch and tile-tail costs; FlashAttention-2 works in
128-row tiles). One process and all-to-all (DeepSpeed-Ulysses) run one call over the whole
sequence (n = s, on h/CP heads); the all-to-all exchange of q, k, v and the output is not
overlapped (it is priced as communication by the planner).

The ring (:mod:`megaformer.parallel.context`) runs CP steps per layer. Each rank holds chunks r and
2CP-1-r of C = s / 2CP tokens, so every step is two C x C chunk pairs of work (step 0: two diagonal
pairs and one full) -- the causal load is balanced, each step F / CP of the rank's attention
FLOPs F = (causal FLOPs of the layer) / CP at the rate R(C). The K/V block for the next step travels
while a step computes; the fp32 dK/dV accumulators travel after each backward step, waited at once:

    forward  = CP t_f + (CP - 1) max(0, t_kv - t_f)
    backward = CP t_b + (CP - 1) max(0, t_kv - t_b) + CP t_dkv
    t_f = F / CP / R(C),  t_b = 2 t_f,  t_kv = b (s / CP) 2 h_kv e / BW,  t_dkv = the same with 4 bytes

The first terms are the kernel time (``compute``), the rest the exposed point-to-point time
(``exposed``). The merge of the partial outputs (elementwise, fp32) is not priced.
"""

from __future__ import annotations

from megaformer.analysis.flops import attention_pairs, checkpointed_blocks
from megaformer.analysis.memory import DTYPE_BYTES, Layout
from megaformer.config import ModelConfig

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
    t_f = fwd / cp / (rate * kernel_efficiency(seq_len / (2 * cp)))
    t_b = 2 * t_f
    kv = layout.micro_batch * seq_len / cp * 2 * cfg.kv_heads * cfg.head_dim / layout.tp
    t_kv = kv * DTYPE_BYTES[layout.precision] / (gbps * GB)
    t_dkv = kv * 4 / (gbps * GB)
    exposed_f = (cp - 1) * max(0.0, t_kv - t_f)
    exposed = exposed_f * (1 + redo) + (cp - 1) * max(0.0, t_kv - t_b) + cp * t_dkv
    return {"compute": cp * (t_f * (1 + redo) + t_b), "exposed": exposed}
