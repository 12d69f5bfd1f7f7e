"""FP8 casts and scaled GEMMs: the arithmetic of FP8 training, without the parallelism.

A dynamic cast of a tensor T over a set of dimensions (all of them: tensorwise; one: rowwise):

    amax = max |T|  (over those dimensions)
    s    = fp8_max / max(amax, 1e-12)        (rounded down to a power of two when asked)
    q(T) = saturate(T s) in e4m3 or e5m2,    deq(q) = q / s

and a scaled GEMM of two cast operands, deq(a) deq(b) = (q_a q_b) / (s_a s_b): on CUDA
``torch._scaled_mm`` (the GEMM reads one byte per element and applies the inverse scales in its
epilogue), emulated elsewhere by dequantising each operand to fp32 and multiplying there.

Speed by construction: eager, one cast is a chain of 5-7 aten ops (|T|, amax, the scale, multiply,
clamp, convert), each a pass over T. So each cast runs as one small compiled function (amax ->
scale -> cast: inductor makes it a reduction and one fused pointwise kernel that writes the FP8
bytes, in the layout the GEMM wants), whether or not the caller is compiled; inside a compiled
region the same Python is traced inline instead (no nested compilation, no graph break). Casts are
compiled on CUDA; on other devices (emulation: correctness, not speed) they run eagerly unless
:data:`COMPILE_CASTS` says otherwise. A tensor-parallel caller splits a cast in two
(:func:`amax`, reduce, :func:`cast_with_amax`); both halves are compiled alike.

Grouped (MoE experts): :func:`emulated_grouped_mm` is ``torch._grouped_mm`` on dequantised
operands, with :func:`group_amax` for scales per column and row group (the weight gradient).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12

#: None: compile the casts on CUDA only; True / False: on every device / on none (tests).
COMPILE_CASTS: Optional[bool] = None
#: the torch.compile backend of the casts (tests on CPU use "aot_eager": no C++ build)
CAST_BACKEND = "inductor"


def amax(t: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """max |t| in fp32: of the whole tensor (``dim`` None, a 0-d tensor) or over ``dim`` (kept)."""
    a = t.abs()
    return (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()


def scale_of(a: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """s = fp8_max / max(amax, eps) in fp32 (the quotient taken in fp64, so eager and compiled
    code agree), rounded down to a power of two when ``pow2``."""
    s = (torch.finfo(dtype).max / a.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s))) if pow2 else s


def cast_with_amax(
    t: torch.Tensor, a: torch.Tensor, dtype: torch.dtype, pow2: bool, column_major: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q(t), s) for the given amax (``a`` broadcasts against t); ``column_major``: q(t) of 2-D
    t stored column-major (the right operand of a GEMM, written in that layout at once)."""
    s = scale_of(a, dtype, pow2)
    fmax = torch.finfo(dtype).max
    q = (t.float() * s).clamp(-fmax, fmax).to(dtype)
    if column_major:
        q = q.t().contiguous().t()
    return q, s


def cast(
    t: torch.Tensor, dim: Optional[int], dtype: torch.dtype, pow2: bool, column_major: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q(t), s) with the amax of t over ``dim`` (None: the whole tensor): amax -> scale -> cast."""
    return cast_with_amax(t, amax(t, dim), dtype, pow2, column_major)


def _compiles(t: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():  # traced inline by the enclosing compilation
        return False
    return t.device.type == "cuda" if COMPILE_CASTS is None else COMPILE_CASTS


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable[..., Any], backend: str, constants: tuple) -> Callable[..., Any]:
    """``fn`` compiled (shapes dynamic, one graph) for one tuple of its constant arguments: a copy
    of its code per tuple, so each has its own compile cache and the variants never compete for
    dynamo's recompile limit."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_v{len(_VARIANTS)}")
    _VARIANTS.append(constants)
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return torch.compile(copy, backend=backend, dynamic=True, fullgraph=True)


_VARIANTS: list[tuple] = []


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*tensors, *constants)`` (the tensors first, then the Python constants): compiled
    (:data:`COMPILE_CASTS`) or eager; both compute the same bits."""
    n = sum(isinstance(a, torch.Tensor) for a in args)
    if _COUNT is not None and not torch.compiler.is_compiling():
        _COUNT.casts.append((fn.__name__, tuple(args[0].shape), args[0].data_ptr()))
        _COUNT.inside += 1
        try:
            return fn(*args)
        finally:
            _COUNT.inside -= 1
    if _compiles(args[0]):
        return _compiled(fn, CAST_BACKEND, tuple(args[n:]))(*args)
    return fn(*args)


@dataclass
class OpCount:
    """What FP8 code dispatched under :func:`counting`: the aten ops outside the casts (by name),
    the casts, each one compiled function ((name, shape, data pointer of the input)), and the
    FLOPs of the FP8 GEMMs (2 M K N each, grouped ones summed over their groups)."""

    ops: collections.Counter = field(default_factory=collections.Counter)
    gemm_flops: int = 0
    casts: list = field(default_factory=list)
    inside: int = 0
    every_op: collections.Counter = field(default_factory=collections.Counter)


_COUNT: Optional[OpCount] = None


@contextlib.contextmanager
def counting() -> Iterator[OpCount]:
    """Count what runs inside (eagerly, in this thread and in autograd's backward): ``ops`` the
    aten ops outside the casts, ``every_op`` all of them (each cast's chain, as eager runs it),
    ``casts`` the casts (what a compiled cast runs as one function)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    global _COUNT
    record = OpCount()

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.overloadpacket.__name__
            record.every_op[name] += 1
            if not record.inside:
                record.ops[name] += 1
            return func(*args, **(kwargs or {}))

    _COUNT = record
    try:
        with _Mode():
            yield record
    finally:
        _COUNT = None


# ----------------------------------------------------------------------------- the GEMMs


def _column_major(b: torch.Tensor) -> torch.Tensor:
    return b if b.stride(0) == 1 else b.t().contiguous().t()


def scaled_mm(
    a: torch.Tensor,
    s_a: torch.Tensor,
    b: torch.Tensor,
    s_b: torch.Tensor,
    out_dtype: torch.dtype,
    emulate: bool,
    fast_accum: bool = False,
) -> torch.Tensor:
    """deq(a) deq(b) for FP8 a [M, K] (scales s_a: 0-d, or [M, 1]) and b [K, N] (s_b: 0-d, or
    [1, N]), in ``out_dtype``. Real: ``torch._scaled_mm`` (a row-major, b column-major; rowwise
    scales write bf16, converted after); emulated: fp32 products of the dequantised operands."""
    if _COUNT is not None and not _COUNT.inside:  # one GEMM, however it is emulated
        _COUNT.ops["scaled_mm"] += 1
        _COUNT.gemm_flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        _COUNT.inside += 1
        try:
            return scaled_mm(a, s_a, b, s_b, out_dtype, emulate, fast_accum)
        finally:
            _COUNT.inside -= 1
    if emulate:
        return torch.mm(a.float() / s_a, b.float() / s_b).to(out_dtype)
    rowwise = s_a.dim() > 0
    inv_a, inv_b = s_a.reciprocal(), s_b.reciprocal()
    post = None
    if rowwise and not fast_accum:
        # the rowwise kernel is slow without fast accumulation: the tensorwise one, scaled after
        # (the rowwise scales are powers of two: the product by them is exact)
        post, inv_a, inv_b = inv_a * inv_b, inv_a.new_ones(()), inv_b.new_ones(())
    dtype = torch.bfloat16 if rowwise else out_dtype
    y = torch._scaled_mm(
        a.contiguous(),
        _column_major(b),
        scale_a=inv_a,
        scale_b=inv_b,
        out_dtype=dtype,
        use_fast_accum=fast_accum,
    )
    if post is not None:
        y = y * post
    return y.to(out_dtype)


def _aligned(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    pad = -t.shape[dim] % multiple
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim)


@torch.library.custom_op("megaformer::grouped_mm_fp32", mutates_args=())
def _grouped_mm_fp32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` on fp32 operands, as one opaque op under torch.compile (the shape
    rule torch registers for it accepts bf16 only, the CPU kernel fp32 too)."""
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_fp32.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


def emulated_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` on fp32 operands of any width: the CPU kernel wants
    16-byte row strides, so the dimensions are padded with zeros to multiples of 4 (which adds
    nothing to any product) and the result is cut back. a [M, K] x b [E, K, N] -> [M, N]; a [N, M]
    x b [M, K] (groups along M) -> [E, N, K]."""
    if _COUNT is not None and not _COUNT.inside:  # one grouped GEMM
        _COUNT.ops["scaled_grouped_mm"] += 1
        _COUNT.gemm_flops += 2 * a.shape[0] * a.shape[1] * b.shape[-1]
        _COUNT.inside += 1
        try:
            return emulated_grouped_mm(a, b, offs)
        finally:
            _COUNT.inside -= 1
    if b.dim() == 3:
        M, N = a.shape[0], b.shape[2]
        y = _grouped_mm_fp32(
            _aligned(a, 1, 4).contiguous(), _aligned(_aligned(b, 1, 4), 2, 4).contiguous(), offs
        )
        return y[:M, :N]
    N, K = a.shape[0], b.shape[1]
    y = _grouped_mm_fp32(
        _aligned(_aligned(a, 0, 4), 1, 4).contiguous(),
        _aligned(_aligned(b, 0, 4), 1, 4).contiguous(),
        offs,
    )
    return y[:, :N, :K]


def group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each of ``rows`` rows given the groups' end offsets (int64 [rows]; rows past
    the last offset get id E: a group of their own, never used)."""
    return torch.searchsorted(offs.long(), torch.arange(rows, device=offs.device), right=True)


def group_amax(t: torch.Tensor, ids: torch.Tensor, groups: int) -> torch.Tensor:
    """[groups, C]: max |t| over the rows of each group, per column of t [M, C] (fp32; a fixed
    shape, no host read)."""
    out = t.new_zeros(groups + 1, t.shape[1], dtype=torch.float32)
    idx = ids.unsqueeze(1).expand(-1, t.shape[1])
    return out.scatter_reduce(0, idx, t.abs().float(), "amax")[:groups]
