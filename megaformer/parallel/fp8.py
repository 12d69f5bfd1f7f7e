"""FP8 training of the blocks' linear layers, with torchao's float8 casts and scaled GEMMs.

Each of the three GEMMs of a linear layer Y = X W^T (X [M, K], W [N, K], dY [M, N]) runs on FP8
operands, each cast with a dynamic scale s = fp8_max / amax:

    Y  = deq(q(X) q(W)^T)          dX = deq(q(dY) q(W))          dW = deq(q(dY)^T q(X))
    q(T) = saturate(T * s_T) in e4m3 (e5m2 for dY under tensorwise),   deq divides by s_a s_b

``tensorwise``: one scale per operand (amax over the whole tensor), cuBLAS's FP8 GEMM.
``rowwise``: one scale per row of the contraction, amax over the contracted dimension only
(X and W over K for Y, dY and W over N for dX, dY and X over M for dW), scales rounded down to a
power of two, all operands e4m3 (torchao's ``rowwise`` recipe).

Master weights, optimizer states, gradients and every other op stay in ``train.precision``: the
casts happen inside the GEMM's autograd function, so ZeRO 1/2/3 see ordinary parameters and
gradients. Converted: q, k, v, the attention output, the FFN (and MoE shared experts); not the
embedding, the output head, the MoE router or the routed experts' grouped GEMMs.

Tensor parallelism (plain tensors, :mod:`megaformer.parallel.layers`): a column-parallel shard
splits N, a row-parallel shard splits K. A scale whose amax runs over a split dimension is
all-reduced (MAX) over the TP group, so every shard is quantised with the scale one process would
use and TP=N computes what TP=1 computes:

    tensorwise   X (row: K split), W (always), dY (column: N split)
    rowwise      X and W for Y (row), dY and W for dX (column); dW's scales (over M) never

(the sequence-parallel gather happens before the column-parallel GEMM, so X is whole there).

torchao is imported lazily (only when ``train.fp8 != off``) with its load-time messages silenced.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from megaformer.comm import ProcessGroup
from megaformer.errors import ConfigError

RECIPES = ("tensorwise", "rowwise")
# The operand dimensions (GEMM letters) each amax runs over: tensorwise = the whole operand.
_WHOLE = {"input": "MK", "weight": "NK", "grad_output": "MN"}


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """Silence torchao's import-time messages (missing CUDA extensions on this machine, a pytree
    deprecation) without touching other loggers' settings for longer than the import."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def torchao_float8() -> Any:
    """The ``torchao.float8`` pieces this module uses, as a namespace (imported once, quietly)."""
    global _TORCHAO
    if _TORCHAO is None:
        try:
            with _quiet_import():
                import torchao.float8.config as config
                import torchao.float8.float8_training_tensor as tensor
                import torchao.float8.float8_utils as utils
        except ImportError as e:
            raise ConfigError(f"train.fp8 needs torchao ({e}); install megaformer[fp8]") from None
        _TORCHAO = _Namespace(config=config, tensor=tensor, utils=utils)
    return _TORCHAO


@dataclass(frozen=True)
class _Namespace:
    config: Any
    tensor: Any
    utils: Any


_TORCHAO: Optional[_Namespace] = None


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
    emulation is off, or for what :func:`check_fp8_device_type` refuses; nothing when fp8 is off."""
    if train.fp8 == "off" or train.fp8_emulate:
        return
    ok, why = fp8_gemm_support(device)
    if not ok:
        raise ConfigError(
            f"train.fp8={train.fp8}: {why}; use train.fp8=off, or "
            "train.fp8_emulate=true for the same arithmetic without FP8 hardware"
        )
    check_fp8_device_type(train, torch.device(device).type)


def check_fp8_device_type(train: Any, device_type: str) -> None:
    """The FP8 rules that depend on the device type alone (``megaformer train --dry-run`` checks
    them from ``train.device``, without the device): FP8 GEMMs on CUDA need ``train.compile``.

    Eager, each cast of an operand is 5-7 separate kernels (amax of |t|, the scale, multiply,
    clamp, convert, each a pass over the tensor: 86 aten ops per linear layer's forward and
    backward tensorwise, 104 rowwise, besides its 3 GEMMs), and each linear layer casts its input
    again; the memory traffic costs more than the FP8 GEMMs save. Compiled, inductor fuses the
    casts' chains into its generated kernels, leaving the GEMMs outside them."""
    if train.fp8 == "off" or train.fp8_emulate or device_type != "cuda" or train.compile:
        return
    raise ConfigError(
        f"train.fp8={train.fp8} on CUDA needs train.compile=true: eager FP8 casts "
        "take 5-7 kernels per operand and are slower than bf16; set "
        "train.compile=true, or train.fp8=off"
    )


# ----------------------------------------------------------------------------- the GEMM


@dataclass(frozen=True)
class Fp8Matmul:
    """y = x W^T + b with FP8 GEMMs in forward and backward (see the module docstring).

    ``split``: the GEMM dimension this rank holds a shard of, "N" (column parallel), "K" (row
    parallel) or None; ``group``: the TP group whose ranks hold the other shards."""

    recipe: str
    emulate: bool
    split: Optional[str] = None
    group: ProcessGroup = None

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe {self.recipe!r}: must be one of {RECIPES}")
        ao = torchao_float8()
        config = ao.config.Float8LinearConfig.from_recipe_name(self.recipe)
        mm = ao.tensor.ScaledMMConfig
        object.__setattr__(self, "config", config)
        object.__setattr__(
            self,
            "mm_config",
            ao.tensor.LinearMMConfig(
                mm(
                    self.emulate,
                    config.gemm_config_output.use_fast_accum,
                    False,
                    config.pad_inner_dim,
                ),
                mm(
                    self.emulate,
                    config.gemm_config_grad_input.use_fast_accum,
                    False,
                    config.pad_inner_dim,
                ),
                mm(
                    self.emulate,
                    config.gemm_config_grad_weight.use_fast_accum,
                    False,
                    config.pad_inner_dim,
                ),
            ),
        )

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = _Fp8Linear.apply(x, w, self)
        return y + b.to(y.dtype) if b is not None else y

    def cast(
        self, t: torch.Tensor, cast_config: Any, role: str, axis: Optional[str], dim: int
    ) -> torch.Tensor:
        """``t`` as a Float8TrainingTensor scaled per ``cast_config``; ``axis`` names the GEMM
        dimension a rowwise amax runs over (tensor dimension ``dim``), ``role`` the operand.
        Returned unchanged when the recipe keeps this operand in high precision."""
        ao = torchao_float8()
        cfg = ao.config
        if cast_config.scaling_type is cfg.ScalingType.DISABLED:
            return t
        rowwise = cast_config.scaling_granularity is cfg.ScalingGranularity.AXISWISE
        over = axis if rowwise else _WHOLE[role]
        with torch.no_grad():
            amax = (t.abs().amax(dim=dim, keepdim=True) if rowwise else t.abs().amax()).float()
            if self.split is not None and self.split in over and dist.is_initialized():
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            scale = ao.utils.amax_to_scale(
                amax, cast_config.target_dtype, self.config.round_scales_to_power_of_2
            )
        roles = ao.tensor.GemmInputRole
        gemm_role = {
            "input": roles.INPUT,
            "weight": roles.WEIGHT,
            "grad_output": roles.GRAD_OUTPUT,
        }[role]
        return ao.tensor.hp_tensor_and_scale_to_float8(
            t, scale, cast_config.target_dtype, self.mm_config, gemm_role, dim if rowwise else None
        )


class _Fp8Linear(torch.autograd.Function):
    """x [..., K] W^T -> [..., N] on FP8 operands (torchao's ``matmul_with_hp_or_float8_args``,
    with the tensor-parallel amax reductions). Saves x and W itself (not a view: under ZeRO-3
    the parameter's storage is swapped between forward and backward)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        w: torch.Tensor,
        mm: Fp8Matmul,  # type: ignore[override]
    ) -> torch.Tensor:
        c = mm.config
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, w)
        ctx.mm, ctx.lead = mm, x.shape[:-1]
        xq = mm.cast(x2, c.cast_config_input, "input", "K", -1)  # [M, K]
        wq = mm.cast(w.t(), c.cast_config_weight, "weight", "K", 0)  # [K, N]
        y = torch.mm(xq, wq)
        return y.reshape(*ctx.lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x2, w = ctx.saved_tensors
        mm, c = ctx.mm, ctx.mm.config
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq = mm.cast(dy2, c.cast_config_grad_output, "grad_output", "N", -1)  # [M, N]
            wq = mm.cast(w.t(), c.cast_config_weight_for_grad_input, "weight", "N", -1)  # [K, N]
            dx = torch.mm(dyq, wq.t()).reshape(*ctx.lead, x2.shape[-1])
        if ctx.needs_input_grad[1]:
            dyq = mm.cast(dy2, c.cast_config_grad_output_for_grad_weight, "grad_output", "M", 0)
            xq = mm.cast(x2, c.cast_config_input_for_grad_weight, "input", "M", 0)
            dw = torch.mm(dyq.t(), xq).to(w.dtype)  # [N, K]
        return dx, dw, None


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


def apply_fp8(model: nn.Module, recipe: str, emulate: bool, tp_group: ProcessGroup = None) -> int:
    """Make the blocks' linear layers of ``model`` (after the tensor-parallel plan) run their
    GEMMs in FP8; returns how many were converted. ``recipe == "off"`` converts none."""
    if recipe == "off":
        return 0
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
    return n
