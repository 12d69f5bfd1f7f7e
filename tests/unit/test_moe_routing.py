"""The router against hand computation, where the gates are not all one.

selection  T_n  = top-k_e (s_ne + b_e)       the aux-loss-free bias b chooses experts ...
gates      g_ne = s_ne                        ... and never weights them (no renormalisation)
output     y_n  = sum_{e in T_n} g_ne FFN_e(x_n)
sigmoid load-balancing loss  E sum_e f_e mean_n p_ne,  p_ne = s_ne / sum_e' s_ne',
                              f_e = (assignments to e) / (n k)
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megaformer.config import ModelConfig, MoEConfig
from megaformer.model.moe import MoE, end_of_step


def _moe(**moe) -> MoE:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=37,
        d_model=16,
        n_layers=2,
        n_heads=2,
        max_seq_len=16,
        moe=MoEConfig(**{"interval": 1, "num_experts": 4, "top_k": 2, **moe}),
    )
    block = MoE(cfg, layer=0)
    with torch.no_grad():
        block.router.weight.normal_(0, 0.5)
        for p in block.experts.parameters():
            p.normal_(0, 0.2)
        block.reset_state()
    return block


def _ffn(block: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's FFN of rows x, from its weights."""
    ex = block.experts
    h = x @ ex.w1[e].t()
    h = F.silu(h) * (x @ ex.w3[e].t()) if ex.w3 is not None else F.gelu(h)
    return h @ ex.w2[e].t()


def test_aux_free_bias_selects_experts_and_never_weights_them():
    block = _moe(top_k=2, renormalize=False, aux_loss_coef=0.0, bias_update_rate=0.01)
    bias = torch.tensor([0.3, -0.2, 0.1, -0.4])
    block.expert_bias.copy_(bias)
    block.eval()
    x = torch.randn(24, 16)
    scores = torch.softmax(x @ block.router.weight.detach().t(), -1)
    chosen = [
        sorted(range(4), key=lambda e: -(float(scores[n, e]) + float(bias[e])))[:2]
        for n in range(24)
    ]
    plain = [sorted(range(4), key=lambda e: -float(scores[n, e]))[:2] for n in range(24)]
    assert sum(set(a) != set(b) for a, b in zip(chosen, plain)) >= 4  # the bias changes choices

    _, idx, gates = block.route(x)
    assert [sorted(r) for r in idx.tolist()] == [sorted(c) for c in chosen]
    want = torch.stack([scores[n, idx[n]] for n in range(24)])
    assert torch.allclose(gates, want, rtol=1e-6, atol=0)  # the plain scores: no bias, no sum to 1
    assert (gates.sum(-1) < 0.99).any()

    with torch.no_grad():
        y = block(x)
        ref = torch.stack(
            [
                sum(scores[n, e] * _ffn(block, e, x[n : n + 1])[0] for e in chosen[n])
                for n in range(24)
            ]
        )
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_sigmoid_load_balancing_loss_equals_hand_computed_value():
    E, k = 5, 2
    block = _moe(
        num_experts=E,
        top_k=k,
        score="sigmoid",
        renormalize=False,
        aux_loss_coef=0.1,
        z_loss_coef=0.0,
    )
    x = torch.randn(3, 7, 16)
    block.train()
    block(x)
    rows, W = x.reshape(-1, 16).tolist(), block.router.weight.detach().tolist()
    n = len(rows)
    counts, mean_p = [0] * E, [0.0] * E
    for row in rows:
        s = [1 / (1 + math.exp(-sum(a * b for a, b in zip(row, W[e])))) for e in range(E)]
        for e in sorted(range(E), key=lambda e: -s[e])[:k]:
            counts[e] += 1
        for e in range(E):
            mean_p[e] += s[e] / sum(s) / n
    aux = E * sum(counts[e] / (n * k) * mean_p[e] for e in range(E))
    assert block.step_load.tolist() == counts
    assert block.aux_loss.item() == pytest.approx(0.1 * aux, rel=1e-5)
    assert end_of_step(block)["moe/aux_loss"] == pytest.approx(aux, rel=1e-5)
    # not the softmax formula: the two differ by far more than the tolerance here
    soft = [
        [math.exp(v) for v in (sum(a * b for a, b in zip(row, W[e])) for e in range(E))]
        for row in rows
    ]
    soft_mean = [sum(r[e] / sum(r) for r in soft) / n for e in range(E)]
    assert abs(E * sum(counts[e] / (n * k) * soft_mean[e] for e in range(E)) - aux) > 1e-3 * aux


def test_group_limited_routing_and_the_routed_scale_equal_hand_computation():
    """DeepSeek-V3: 8 experts in 4 groups of 2, each token keeps its 2 best groups (ranked by
    the sum of their two scores plus biases), picks its top 3 experts there; the weights are the
    sigmoid scores renormalised, times 2.5."""
    block = _moe(
        num_experts=8,
        top_k=3,
        score="sigmoid",
        renormalize=True,
        num_groups=4,
        top_groups=2,
        routed_scaling_factor=2.5,
        aux_loss_coef=0.0,
    )
    bias = torch.tensor([0.05, -0.1, 0.2, 0.0, -0.05, 0.1, 0.0, -0.2])
    block.expert_bias.copy_(bias)
    block.eval()
    x = torch.randn(40, 16)
    scores = torch.sigmoid(x @ block.router.weight.detach().t())
    chooser = scores + bias
    chosen = []
    for n in range(40):
        rank = [float(chooser[n, 2 * g] + chooser[n, 2 * g + 1]) for g in range(4)]
        groups = sorted(range(4), key=lambda g: -rank[g])[:2]
        allowed = [e for e in range(8) if e // 2 in groups]
        chosen.append(sorted(allowed, key=lambda e: -float(chooser[n, e]))[:3])
    free = [sorted(range(8), key=lambda e: -float(chooser[n, e]))[:3] for n in range(40)]
    assert sum(set(a) != set(b) for a, b in zip(chosen, free)) >= 4  # the groups change choices

    _, idx, gates = block.route(x)
    assert [sorted(r) for r in idx.tolist()] == [sorted(c) for c in chosen]
    s = torch.stack([scores[n, idx[n]] for n in range(40)])
    torch.testing.assert_close(gates, 2.5 * s / s.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    with torch.no_grad():
        y = block(x)
    ref = torch.stack(
        [
            sum(
                2.5 * scores[n, e] / sum(scores[n, c] for c in chosen[n]) * _ffn(block, e, x[n])
                for e in chosen[n]
            )
            for n in range(40)
        ]
    )
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_the_first_blocks_stay_dense():
    cfg = ModelConfig(
        vocab_size=37,
        d_model=16,
        n_layers=5,
        n_heads=2,
        moe=MoEConfig(interval=1, first_dense=3),
    )
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert cfg.moe_layers == 2
