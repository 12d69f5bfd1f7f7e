"""FP8 training of the blocks' linear layers and of the MoE routed experts: dynamic casts and
scaled GEMMs (:mod:`megaformer.kernels.fp8`), with the tensor-parallel scale reductions.

Each of the three GEMMs of a linear layer Y = X W^T (X [M, K], W [N, K], dY [M, N]) runs on FP8
operands, each cast with a dynamic scale s = fp8_max / amax:

    Y  = deq(q(X) q(W)^T)          dX = deq(q(dY) q(W))          dW = deq(q(dY)^T q(X))
    q(T) = saturate(T * s_T) in e4m3 (e5m2 for dY under tensorwise),   deq divides by s_a s_b

``tensorwise``: one scale per operand (amax over the whole tensor), cuBLAS's FP8 GEMM.
``rowwise``: one scale per row of the contraction, amax over the contracted dimension only
(X and W over K for Y, dY and W over N for dX, dY and X over M for dW), scales rounded down to a
power of two, all operands e4m3 (torchao's ``rowwise`` recipe, the same arithmetic).

Projections that share an input (q, k, v; the SwiGLU gate and up) cast it once: Y_i =
deq(q(X) q(W_i)^T) for every i from one q(X); backward dX = sum_i deq(q(dY_i) q(W_i)) and every
dW_i from one q(X) over M (tensorwise: the forward's q(X) itself). Each product equals the one a
projection computes alone, bit for bit (one scale per weight, as alone).

The routed experts (an MoE block's grouped GEMMs, Y_e = X_e W_e^T for the rows X_e routed to
expert e) run rowwise whatever ``train.fp8`` says (one scale per row of X and per output row of
each W_e; for dW_e = dY_e^T X_e one per column of each expert's rows): on CUDA torchao's scaled
grouped GEMM, the token groups padded to multiples of 16 on the device; emulated elsewhere.

Master weights, optimizer states, gradients and every other op stay in ``train.precision``: the
casts happen inside the GEMMs' autograd functions, so ZeRO 1/2/3 see ordinary parameters and
gradients. Converted: q, k, v, the attention output, the FFN, the MoE shared and routed experts;
not the embedding, the output head or the MoE router.

Tensor parallelism (plain tensors, :mod:`megaformer.parallel.layers`): a column-parallel shard
splits N, a row-parallel shard splits K. A scale whose amax runs over a split dimension is
all-reduced (MAX) over the TP group, so every shard is quantised with the scale one process would
use and TP=N computes what TP=1 computes:

    tensorwise   X (row: K split), W (always), dY (column: N split)
    rowwise      X and W for Y (row), dY and W for dX (column); dW's scales (over M) never

(the sequence-parallel gather happens before the column-parallel GEMM, so X is whole there).
Expert parallelism splits no GEMM dimension (an expert and all its rows live on one rank).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from megaformer.comm import ProcessGroup
from megaformer.errors import ConfigError
from megaformer.kernels import fp8 as kernels
from megaformer.kernels.fp8 import E4M3, E5M2

RECIPES = ("tensorwise", "rowwise")
# The GEMM letters of each operand's last dimensions.
_WHOLE = {"input": "MK", "weight": "NK", "grad_output": "MN"}


@dataclass(frozen=True)
class Recipe:
    """How a recipe casts: rowwise or tensorwise scales, dY's FP8 type, power-of-two scales, and
    fast accumulation in the three GEMMs (Y, dX, dW)."""

    rowwise: bool
    grad_dtype: torch.dtype
    pow2: bool
    fast_accum: tuple[bool, bool, bool]


RECIPE = {
    "tensorwise": Recipe(False, E5M2, False, (True, False, False)),
    "rowwise": Recipe(True, E4M3, True, (True, False, False)),
}


# ----------------------------------------------------------------------------- the device


def fp8_gemm_support(device: Union[str, torch.device]) -> tuple[bool, str]:
    """(whether ``device`` has FP8 GEMMs, why not): CUDA capability >= 8.9 (Ada, Hopper,
    Blackwell) or an AMD MI300-class GPU; never a CPU."""
    device = torch.device(device)
    if device.type == "meta":
        return True, ""
    if device.type != "cuda":
        return False, f"the {device.type.upper()} has no FP8 GEMMs"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    name = torch.cuda.get_device_name(device)
    if torch.version.hip is not None:
        arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
        ok = any(a in arch for a in ("gfx942", "gfx950"))
        return ok, "" if ok else f"{name} ({arch}) has no FP8 GEMMs (MI300 or newer needed)"
    cap = torch.cuda.get_device_capability(device)
    if cap >= (8, 9):
        return True, ""
    return False, f"{name} (compute capability {cap[0]}.{cap[1]}) has no FP8 GEMMs (8.9+ needed)"


def check_fp8_device(train: Any, device: Union[str, torch.device]) -> None:
    """ConfigError (one line) when ``train.fp8`` asks for FP8 GEMMs ``device`` does not have and
    emulation is off; nothing when fp8 is off. Eager FP8 is allowed everywhere: each cast is a
    compiled function of its own (:mod:`megaformer.kernels.fp8`)."""
    if train.fp8 == "off" or train.fp8_emulate:
        return
    ok, why = fp8_gemm_support(device)
    if not ok:
        raise ConfigError(
            f"train.fp8={train.fp8}: {why}; use train.fp8=off, or "
            "train.fp8_emulate=true for the same arithmetic without FP8 hardware"
        )


# ----------------------------------------------------------------------------- the GEMM


@dataclass(frozen=True)
class Fp8Matmul:
    """y = x W^T + b with FP8 GEMMs in forward and backward (see the module docstring);
    :meth:`many` computes several projections of one input from one cast of it.

    ``split``: the GEMM dimension this rank holds a shard of, "N" (column parallel), "K" (row
    parallel) or None; ``group``: the TP group whose ranks hold the other shards."""

    recipe: str
    emulate: bool
    split: Optional[str] = None
    group: ProcessGroup = None

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe {self.recipe!r}: must be one of {RECIPES}")

    @property
    def r(self) -> Recipe:
        return RECIPE[self.recipe]

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.many(x, [w], [b])[0]

    def many(
        self,
        x: torch.Tensor,
        weights: Sequence[torch.Tensor],
        biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
    ) -> list[torch.Tensor]:
        """[x W_i^T + b_i for each i], x [..., K] cast to FP8 once for all of them."""
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        ys = _Fp8Linears.apply(x, self, *weights)
        return [
            y + b.to(y.dtype) if b is not None else y
            for y, b in zip(ys, biases or [None] * len(ys))
        ]

    def quantise(
        self, t: torch.Tensor, role: str, over: str, column_major: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q(t), s): ``t`` the operand ``role`` (its last dimensions are the GEMM letters of
        ``_WHOLE[role]``) cast with the recipe's scale; rowwise, the amax runs over the GEMM
        dimension ``over``. One compiled cast; under tensor parallelism, an amax over a split
        dimension is all-reduced (MAX) between the amax and the cast."""
        r = self.r
        dtype = r.grad_dtype if role == "grad_output" else E4M3
        letters = _WHOLE[role]
        dim = letters.index(over) - len(letters) if r.rowwise else None
        if self.split is not None and self.split in (over if r.rowwise else letters):
            if dist.is_initialized():
                a = kernels.run(kernels.amax, t, dim)
                dist.all_reduce(a, op=dist.ReduceOp.MAX, group=self.group)
                return kernels.run(kernels.cast_with_amax, t, a, dtype, r.pow2, column_major)
        return kernels.run(kernels.cast, t, dim, dtype, r.pow2, column_major)

    def mm(self, a, s_a, b, s_b, out_dtype: torch.dtype, gemm: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """deq(a) deq(b) for GEMM ``gemm`` (0: Y, 1: dX, 2: dW) of the recipe."""
        return kernels.scaled_mm(a, s_a, b, s_b, out_dtype, self.emulate, self.r.fast_accum[gemm])


class _Fp8Linears(torch.autograd.Function):
    """x [..., K] -> [x W_i^T for each W_i [N_i, K]] on FP8 operands, x cast once. Saves x (or,
    tensorwise, its FP8 cast: what dW reads) and the weights themselves (not views: under ZeRO-3
    a parameter's storage is swapped between forward and backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mm: Fp8Matmul, *weights: torch.Tensor):  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = mm.quantise(x2, "input", "K")  # [M, K], scales [M, 1] or 0-d
        ys = []
        for w in weights:
            wq, ws = mm.quantise(w, "weight", "K")  # [N, K], [N, 1] or 0-d
            y = mm.mm(xq, xs, wq.t(), ws.t(), x.dtype, 0)
            ys.append(y.reshape(*x.shape[:-1], y.shape[-1]))
        if mm.r.rowwise:  # dW's X is scaled over M: cast again in backward
            ctx.save_for_backward(x2, *weights)
        else:  # tensorwise: dW reads the forward's cast
            ctx.save_for_backward(xq, xs, *weights)
        ctx.mm, ctx.lead, ctx.n = mm, x.shape, len(weights)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor):  # type: ignore[override]
        mm, n = ctx.mm, ctx.n
        saved = ctx.saved_tensors
        weights = saved[-n:]
        dx = None
        dws: list[Optional[torch.Tensor]] = [None] * n
        x_over_m = None
        # dX sums the terms last projection first: the order autograd adds them in when each
        # projection runs alone (ZeRO-3), so both compute the same bits
        for i in reversed(range(n)):
            dy, w = dys[i], weights[i]
            dy2 = dy.reshape(-1, dy.shape[-1])
            dyq, dys_ = mm.quantise(dy2, "grad_output", "N")  # [M, N], [M, 1] or 0-d
            if ctx.needs_input_grad[0]:
                wq, ws = mm.quantise(w, "weight", "N", column_major=True)  # [N, K], [1, K]
                term = mm.mm(dyq, dys_, wq, ws, dy.dtype, 1)
                dx = term if dx is None else dx + term
            if ctx.needs_input_grad[2 + i]:
                if mm.r.rowwise:
                    if x_over_m is None:  # one cast of X for every projection's dW
                        x_over_m = mm.quantise(saved[0], "input", "M", column_major=True)
                    xq, xs = x_over_m  # [M, K] column-major, [1, K]
                    dyq, dys_ = mm.quantise(dy2, "grad_output", "M", column_major=True)
                else:
                    xq, xs = saved[0], saved[1]
                dws[i] = mm.mm(dyq.t(), dys_.t(), xq, xs, dy.dtype, 2).to(w.dtype)  # [N, K]
        if dx is not None:
            dx = dx.reshape(ctx.lead)
        return (dx, None, *dws)


# ----------------------------------------------------------------------------- routed experts


def pad_groups(
    x: torch.Tensor, counts: torch.Tensor, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x with each group of rows padded with zero rows to a multiple of ``align``, the padded
    groups' end offsets int32, where each row of x went): a fixed shape (M + E (align - 1) rows),
    no host read. ``x[i] == padded[dest[i]]``; the gradient flows back through the index."""
    M, E = x.shape[0], counts.numel()
    padded = (counts + align - 1) // align * align
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
    ids = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=M)
    dest = torch.arange(M, device=x.device) + shift[ids]
    out = x.new_zeros(M + E * (align - 1), x.shape[1]).index_copy(0, dest, x)
    return out, torch.cumsum(padded, 0).to(torch.int32), dest


@dataclass(frozen=True)
class Fp8Experts:
    """The routed experts' grouped GEMMs in FP8 with rowwise scales: ``first`` for w1/w3 (under
    TP column parallel, N split), ``second`` for w2 (row parallel, K split). On CUDA
    (``emulate`` False) torchao's scaled grouped GEMM, which takes no scale reduction: used only
    where no GEMM dimension is split (the experts stay in high precision otherwise; see
    :func:`apply_fp8`)."""

    first: Fp8Matmul
    second: Fp8Matmul

    def grouped(
        self,
        x: torch.Tensor,
        weights: Sequence[torch.Tensor],
        counts: torch.Tensor,
        second: bool = False,
    ) -> list[torch.Tensor]:
        """[Y_e = X_e W_e^T for each W [E, N, K] of ``weights``] for rows x [M, K] sorted by
        expert, ``counts[e]`` rows for expert e; x cast once for all of ``weights``."""
        mm = self.second if second else self.first
        if mm.emulate:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            return list(_Fp8Grouped.apply(x, offs, mm, *weights))
        from megaformer.kernels.capabilities import fp8_grouped_status

        fn, why = fp8_grouped_status()
        if fn is None:
            raise ConfigError(f"train.fp8 with model.moe on CUDA: {why}; install megaformer[fp8]")
        xp, offs, dest = pad_groups(x, counts, 16)
        out = torch.bfloat16
        return [
            fn(xp, w.transpose(-2, -1), offs, out, E4M3, False)[dest].to(x.dtype) for w in weights
        ]


class _Fp8Grouped(torch.autograd.Function):
    """Emulated FP8 grouped GEMMs, rowwise: x [M, K] (rows grouped by ``offs``, end offsets) ->
    [Y_i]: Y_i[rows of e] = deq(q(X_e)) deq(q(W_i[e]))^T; the products in fp32 on the dequantised
    operands (``torch._grouped_mm``). Backward: dX = sum_i deq(q(dY_i)) deq(q(W_i)) (dY over N,
    W over N), dW_i[e] = deq(q(dY_i,e))^T deq(q(X_e)) with one scale per column of each
    expert's rows (over the M_e rows of group e)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, mm: Fp8Matmul, *weights: torch.Tensor):  # type: ignore[override]
        xq, xs = mm.quantise(x, "input", "K")  # [M, K], [M, 1]
        xd = xq.float() / xs
        ys = []
        for w in weights:
            wq, ws = mm.quantise(w, "weight", "K")  # [E, N, K], [E, N, 1]
            wd = (wq.float() / ws).transpose(1, 2)
            ys.append(kernels.emulated_grouped_mm(xd, wd, offs).to(x.dtype))
        ctx.save_for_backward(x, offs, *weights)
        ctx.mm = mm
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor):  # type: ignore[override]
        x, offs, *weights = ctx.saved_tensors
        mm = ctx.mm
        E = weights[0].shape[0]
        ids = kernels.group_ids(offs, x.shape[0])
        xd = None
        dx = None
        dws: list[Optional[torch.Tensor]] = []
        for i, (dy, w) in enumerate(zip(dys, weights)):
            if ctx.needs_input_grad[0]:
                dyq, dys_ = mm.quantise(dy, "grad_output", "N")  # [M, N], [M, 1]
                wq, ws = mm.quantise(w, "weight", "N")  # [E, N, K], [E, 1, K]
                term = kernels.emulated_grouped_mm(dyq.float() / dys_, wq.float() / ws, offs)
                dx = term if dx is None else dx + term
            if not ctx.needs_input_grad[3 + i]:
                dws.append(None)
                continue
            if xd is None:  # X over the rows of each expert, once for every weight
                xd = _group_dequantised(x, ids, E, mm.r.pow2)
            dyd = _group_dequantised(dy, ids, E, mm.r.pow2)
            dws.append(kernels.emulated_grouped_mm(dyd.t(), xd, offs).to(w.dtype))  # [E, N, K]
        return (dx.to(x.dtype) if dx is not None else None, None, None, *dws)


def _group_dequantised(t: torch.Tensor, ids: torch.Tensor, groups: int, pow2: bool) -> torch.Tensor:
    """deq(q(t)) in fp32 with one e4m3 scale per column of each group's rows (``ids``: the group
    of each row of t [M, C])."""
    a = kernels.group_amax(t, ids, groups)  # [E, C]
    a = torch.cat([a, a.new_ones(1, a.shape[1])])[ids]  # each row's group's amax [M, C]
    q, s = kernels.run(kernels.cast_with_amax, t, a, E4M3, pow2, False)
    return q.float() / s


# ----------------------------------------------------------------------------- the model


def fp8_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every linear layer FP8 converts: the blocks' projections of the
    tensor-parallel plan (q, k, v, attention output, FFN, shared experts) and multi-head latent
    attention's projections to its latents."""
    from megaformer.parallel.plan import BLOCK_PLAN, MLA_DOWN_PROJECTIONS, MOE_PLAN, submodule

    for i, block in enumerate(model.layers):
        for name in (*BLOCK_PLAN, *MOE_PLAN, *MLA_DOWN_PROJECTIONS):
            parent, leaf = submodule(block, name)
            if parent is not None:
                yield f"layers.{i}.{name}", getattr(parent, leaf)


def routed_experts_in_fp8(emulate: bool, expert_tp: int) -> bool:
    """Whether ``train.fp8`` runs the routed experts' grouped GEMMs in FP8: emulated, always; on
    FP8 hardware (torchao's grouped GEMM, which reduces no scale over a tensor-parallel group)
    where tensor parallelism does not split the experts."""
    return emulate or expert_tp == 1


def apply_fp8(model: nn.Module, recipe: str, emulate: bool, tp_group: ProcessGroup = None) -> int:
    """Make the blocks' linear layers and routed experts of ``model`` (after the tensor-parallel
    plan) run their GEMMs in FP8; returns how many modules were converted (a block's routed
    experts count as one). ``recipe == "off"`` converts none."""
    if recipe == "off":
        return 0
    from megaformer.model.moe import moe_layers
    from megaformer.parallel.layers import ColumnParallelLinear, RowParallelLinear

    specs: dict[Optional[str], Fp8Matmul] = {}
    n = 0
    for _, module in fp8_layers(model):
        split = (
            "N"
            if isinstance(module, ColumnParallelLinear)
            else "K"
            if isinstance(module, RowParallelLinear)
            else None
        )
        if split not in specs:
            specs[split] = Fp8Matmul(recipe, emulate, split, tp_group if split else None)
        module.fp8 = specs[split]
        n += 1
    for moe in moe_layers(model):
        if not routed_experts_in_fp8(emulate, moe.tp_size):
            continue
        if not emulate:
            from megaformer.kernels.capabilities import fp8_grouped_status

            fn, why = fp8_grouped_status()
            if fn is None:
                raise ConfigError(
                    f"train.fp8={recipe} with model.moe: the routed experts' FP8 grouped GEMM "
                    f"needs torchao ({why}); install megaformer[fp8]"
                )
        tp = moe.tp_size > 1
        group = moe.tp_group if tp else None
        moe.experts.fp8 = Fp8Experts(
            Fp8Matmul("rowwise", emulate, "N" if tp else None, group),
            Fp8Matmul("rowwise", emulate, "K" if tp else None, group),
        )
        n += 1
    return n


# ----------------------------------------------------------------------------- demotion


def _fp8_modules(module: nn.Module) -> list[nn.Module]:
    """The modules inside ``module`` whose GEMMs run in FP8 (linear layers, routed experts)."""
    return [m for m in module.modules() if getattr(m, "fp8", None) is not None]


@contextlib.contextmanager
def high_precision(module: nn.Module) -> Iterator[None]:
    """While active: every FP8 GEMM inside ``module`` runs in high precision (same weights)."""
    saved = [(m, m.fp8) for m in _fp8_modules(module)]
    for m, _ in saved:
        m.fp8 = None
    try:
        yield
    finally:
        for m, spec in saved:
            m.fp8 = spec


def demote(block: nn.Module) -> None:
    """Run ``block``'s FP8 GEMMs in high precision from now on (per-layer FP8 demotion)."""
    for m in _fp8_modules(block):
        m.fp8 = None
    block.fp8_demoted = True


def demoted_blocks(model: nn.Module) -> list[int]:
    """The blocks of ``model`` :func:`demote` switched to high precision."""
    return [i for i, block in enumerate(model.layers) if getattr(block, "fp8_demoted", False)]
