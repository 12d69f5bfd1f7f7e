"""The GEMMs of every linear layer: y = x W^T + b, with W stored [out, in] as in ``nn.Linear``.

    forward:   Y  = X W^T + b          X [M, K], W [N, K], Y [M, N]     2 M K N FLOPs
    backward:  dX = dY W               (2 M K N)
               dW = dY^T X             (2 M K N)        db = sum_rows dY

On CUDA (and under autocast, and in bf16/fp16) this is ``F.linear``: cuBLAS. On CPU in fp32 torch's
matmul calls MKL's sgemm, which on non-Intel x86 CPUs takes a slower code path; oneDNN (built into
torch's CPU wheels as mkldnn) dispatches on the instruction set instead. Which library is faster
depends on the product: oneDNN for Y = X W^T, for dX = dY W only while W is small (oneDNN repacks
the strided operand per call), MKL for dW = dY^T X (oneDNN needs both operands transposed in
memory); the timings behind this rule are in docs/benchmarks.md.

So, with ``model.kernels=auto`` on fp32 CPU tensors outside autocast: Y on oneDNN; dX on
oneDNN for weights of at most 2^20 elements (a strided operand oneDNN repacks per call: cheap for
small weights, not for large ones), else ``torch.mm``; dW on ``torch.mm``. ``model.kernels=torch``
keeps ``F.linear`` throughout. The choice is a rule on shapes, never a timing, so two runs on one
machine compute the same bits (a resumed run equals the uninterrupted one).

The oneDNN path is a ``torch.library`` custom op with its own autograd formula and a fake
(shape-only) implementation, so ``torch.compile`` keeps it as one opaque call inside the graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megaformer.kernels.selection import choose_for


@torch.library.custom_op("megaformer::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] (contiguous) @ w[N, K]^T (+ b) on oneDNN; w may be a strided view."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@_onednn_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


# dX = dY W on oneDNN only up to this many weight elements (see the module docstring).
DX_ONEDNN_MAX_WEIGHT = 1 << 20


def _onednn_linear_flops(x_shape, w_shape, b_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    """2 M K N: torch.utils.flop_counter.FlopCounterMode counts the custom op like aten.mm."""
    return 2 * x_shape[0] * x_shape[1] * w_shape[0]


try:
    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(torch.ops.megaformer.onednn_linear)(_onednn_linear_flops)
except (
    ImportError,
    AttributeError,
    RuntimeError,
    ValueError,
):  # another torch version: no flop count
    pass


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w, b = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias = b is not None


def _onednn_dgrad(dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dX = dY W for 2-D dY on the oneDNN path (oneDNN for small weights, else torch.mm)."""
    return _onednn_linear(dy, w.t(), None) if w.numel() <= DX_ONEDNN_MAX_WEIGHT else dy.mm(w)


def _backward(ctx, dy: torch.Tensor):  # type: ignore[no-untyped-def]
    x, w = ctx.saved_tensors
    dy = dy.contiguous()
    dx = _onednn_dgrad(dy, w) if ctx.needs_input_grad[0] else None  # dY W
    dw = dy.t().mm(x) if ctx.needs_input_grad[1] else None  # dY^T X
    db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, dw, db


_onednn_linear.register_autograd(_backward, setup_context=_setup)


def use_onednn(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The oneDNN path runs for x W^T (:func:`megaformer.kernels.selection.choose`: fp32 CPU tensors,
    no autocast, kernel mode auto, oneDNN present)."""
    return w.dtype == x.dtype and x.dim() >= 2 and choose_for("linear", x).impl == "onednn"


def mm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T without autograd (inside other autograd Functions): oneDNN when
    :func:`use_onednn` applies, else ``torch.mm``."""
    if use_onednn(a, b):
        return _onednn_linear(a.contiguous(), b, None)
    return a @ b.t()


class FusedLinear(torch.autograd.Function):
    """Y = X [W_1; ...; W_n]^T + [b_1 | ... | b_n] as one GEMM, saving X and the separate weights:
    the concatenated weight exists only inside forward and inside backward, never in between
    (holding it would cost the projections' parameter memory once more per layer).

    Not under autocast (where the caller concatenates and calls :func:`linear`, whose weight cast
    autocast keeps anyway)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        n: int,
        *params: torch.Tensor,  # type: ignore[override]
    ) -> torch.Tensor:
        ws, bs = params[:n], params[n:]
        w = torch.cat(ws)
        b = torch.cat(bs) if bs else None
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        onednn = use_onednn(x, w)
        y = _onednn_linear(x2, w, b) if onednn else F.linear(x2, w, b)
        ctx.save_for_backward(x2, *ws)
        ctx.onednn, ctx.n, ctx.has_bias, ctx.lead = onednn, n, bool(bs), x.shape
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x2, *ws = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            w = torch.cat(ws)
            dx = (_onednn_dgrad(dy2, w) if ctx.onednn else dy2.mm(w)).view(ctx.lead)
        sizes = [w_.shape[0] for w_ in ws]
        dws = (
            list(dy2.t().mm(x2).split(sizes))
            if any(ctx.needs_input_grad[3 : 3 + ctx.n])
            else [None] * ctx.n
        )
        dbs = list(dy2.sum(0).split(sizes)) if ctx.has_bias else []
        return (dx, None, *dws, *dbs)


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] W^T + b -> [..., N]: oneDNN on fp32 CPU tensors (see above), else F.linear."""
    if not use_onednn(x, w):
        return F.linear(x, w, b)
    lead = x.shape[:-1]
    y = _onednn_linear(x.reshape(-1, x.shape[-1]).contiguous(), w, b)
    return y.view(*lead, w.shape[0])
