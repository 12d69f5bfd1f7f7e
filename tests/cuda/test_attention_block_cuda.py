"""The GPU tier for ring attention's block kernels (:mod:`megaformer.kernels.attention_block`):
aten's FlashAttention-2 (unmasked pairs, bf16) and memory-efficient kernel (explicit masks, fp32)
against the written-out fp32 formula, forward (output and log-sum-exp) and backward given the
final output and log-sum-exp, with grouped-query heads and a value head size of its own; the
selection tracker must show the kernel the rule names ran."""

from __future__ import annotations

import pytest
import torch

from megaformer.kernels.attention_block import block_backward, block_forward
from megaformer.kernels.selection import track

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _reference(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-2, -1) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return p @ v.repeat_interleave(g, 1), lse


@pytest.mark.parametrize(
    "dtype,masked,dv,impl",
    [
        (torch.bfloat16, False, 64, "flash"),
        (torch.bfloat16, True, 64, "efficient"),
        (torch.float32, False, 64, "efficient"),
        (torch.bfloat16, True, 32, "efficient"),
        (torch.float16, False, 96, "flash"),
    ],
)
def test_block_kernels_against_the_formula(dtype, masked, dv, impl):
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    q, k, v, do = (
        randn(2, 8, 200, 64),
        randn(2, 2, 200, 64),
        randn(2, 2, 200, dv),
        randn(2, 8, 200, dv),
    )
    mask = None
    if masked:  # a band and document boundaries, a row that sees nothing
        mask = (torch.rand(2, 1, 200, 200, device="cuda", generator=g) > 0.3).tril()
        mask[0, 0, 5] = False
    scale = 64**-0.5
    leaves = [t.to(dtype).float().requires_grad_() for t in (q, k, v)]
    ref, lse_ref = _reference(*leaves, mask, scale)
    ref.backward(do.to(dtype).float())
    low = [t.to(dtype) for t in (q, k, v)]
    with track() as ran:
        o, lse = block_forward(*low, causal=False, mask=mask, scale=scale)
        grads = block_backward(do.to(dtype), *low, o, lse, causal=False, mask=mask, scale=scale)
    assert ran["attention_block"] == {impl}, ran
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    assert float((o.float() - ref.detach()).norm() / ref.norm()) < tol
    finite = ~torch.isinf(lse_ref)
    assert torch.allclose(lse[finite], lse_ref[finite].detach(), atol=tol)
    for got, leaf in zip(grads, leaves):
        assert float((got.float() - leaf.grad).norm() / leaf.grad.norm()) < 2 * tol
