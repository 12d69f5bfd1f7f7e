"""Which implementation of each op runs, and why: one rule per op, decided from the device, the
dtype, the kernel mode and what this process can run (:mod:`megaformer.kernels.capabilities`).

Every public op of :mod:`megaformer.kernels` asks :func:`choose` and runs what it answers; the
trainer's start-up summary, ``megaformer bench`` and the tests ask the same function (through
:func:`model_plan` and :func:`track`), so "what runs here" is never derived twice.

    op             implementations, in the order the rule tries them
    linear         onednn (fp32 CPU) | torch (cuBLAS on CUDA)
    projections    fused: q/k/v (and the SwiGLU gate/up) as one GEMM over the concatenated
                   weights (fp32 CPU) | separate GEMMs (CUDA: no weight concatenation per call)
    swiglu         native (fp32 CPU) | cpu (fewer-pass torch ops, fp32 CPU) | triton | torch
    bias_gelu      triton | torch
    rms_norm       apex | triton | torch-native | native (fp32 CPU) | cpu | torch
    layer_norm     apex | triton | torch-native | torch
    rope           native (fp32 CPU) | cpu | torch
    dropout        native (fp32 CPU) | int16 (CPU) | torch
    attention      flash | sdpa | native (fp32 CPU) | reference
    attention_block  (one key block with its log-sum-exp, forward and backward: ring attention)
                   cpu-flash (CPU) | flash (CUDA fp16/bf16, no explicit mask) | efficient (CUDA)
    cross_entropy  chunked (model.loss_chunk_tokens > 0) | native (fp32 CPU) | torch
    experts        grouped (torch._grouped_mm: bf16 or bf16 autocast; on CUDA sm90+)
                   | loop (one GEMM per expert; reads the expert counts on the host)

The rules are functions of shapes, dtypes and devices only -- never of a timing -- so two runs, a
resumed run and two tensor-parallel ranks always run the same kernels. Inside ``torch.compile``
the torch implementations run (inductor fuses them into its own kernels) and the decision is a
trace-time constant (no graph break).

The kernel mode is set once per process (:func:`set_mode`, from ``model.kernels``): ``auto``
takes the fastest implementation the rule allows, ``torch`` plain torch ops everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterator, NamedTuple, Optional

import torch

from megaformer.errors import ConfigError
from megaformer.kernels import capabilities as caps
from megaformer.kernels import native

logger = logging.getLogger("megaformer")

MODES = ("auto", "torch")
ATTENTION_BACKENDS = ("auto", "flash", "sdpa", "reference")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
_mode = "auto"


class Choice(NamedTuple):
    impl: str
    reason: str


# ----------------------------------------------------------------------------- mode


def set_mode(mode: str) -> None:
    """Set the kernel mode of this process: ``auto`` (fastest allowed) or ``torch`` (plain torch)."""
    global _mode
    if mode not in MODES:
        raise ConfigError(f"model.kernels={mode!r}: must be one of {', '.join(MODES)}")
    _mode = mode


def get_mode() -> str:
    return _mode


@contextlib.contextmanager
def kernel_mode(mode: str) -> Iterator[None]:
    """Run the block in ``mode``, then restore the previous mode."""
    saved = _mode
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(saved)


# ----------------------------------------------------------------------------- the rules


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _triton_runs(device: str) -> Optional[str]:
    """None when the Triton kernels can run on ``device``, else why not."""
    if not (device == "cuda" or (device == "cpu" and caps.interpreting())):
        return f"Triton kernels need CUDA (or TRITON_INTERPRET=1), got {device}"
    ok, why = caps.triton_status()
    return None if ok else why


def _cpu_fp32(device: str, dtype: torch.dtype, autocast: bool) -> bool:
    return device == "cpu" and dtype == torch.float32 and not autocast


def _linear(device: str, dtype: torch.dtype, autocast: bool) -> Choice:
    if _cpu_fp32(device, dtype, autocast) and caps.onednn_available():
        return Choice("onednn", "oneDNN for X W^T and dY W (small weights), torch.mm for dY^T X")
    return Choice("torch", "F.linear" + (" (cuBLAS)" if device == "cuda" else ""))


def _projections(device: str, dtype: torch.dtype, autocast: bool) -> Choice:
    if _cpu_fp32(device, dtype, autocast):
        return Choice("fused", "one GEMM over the concatenated q/k/v (gate/up) weights")
    return Choice("separate", "one GEMM per projection (no weight concatenation per call)")


def _interpreted(device: str) -> bool:
    """Triton's interpreter runs the Triton kernels on CPU tensors: the tests' way to check them,
    so there they take precedence over the CPU implementations."""
    return device == "cpu" and caps.interpreting() and caps.triton_status()[0]


def _swiglu(device: str, dtype: torch.dtype, autocast: bool) -> Choice:
    if _interpreted(device):
        return Choice("triton", "Triton interpreter (TRITON_INTERPRET=1)")
    if _cpu_fp32(device, dtype, autocast):
        if native.library() is not None:
            return Choice("native", "megaformer's native CPU kernel on [gate | up]")
        return Choice("cpu", "fewer-pass torch ops on [gate | up] (" + native.status() + ")")
    why = _triton_runs(device)
    if why is None:
        return Choice("triton", "fused Triton kernel")
    return Choice("torch", f"F.silu(g) * u ({why})")


def _bias_gelu(device: str) -> Choice:
    why = _triton_runs(device)
    if why is None:
        return Choice("triton", "fused Triton kernel (bias added in the kernel)")
    return Choice("torch", f"F.gelu(h + b) ({why})")


# torch's native RMSNorm is one fused CUDA kernel from 2.8 on (composed of elementwise ops before)
_TORCH_FUSED_RMS_NORM = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (
    2,
    8,
)


def _norm(
    op: str, device: str, dtype: torch.dtype, weight_dtype: torch.dtype, autocast: bool, bias: bool
) -> Choice:
    """Norms on CUDA: apex (same dtypes, not under autocast, not a bias-less LayerNorm), else
    torch's native op (LayerNorm; RMSNorm where it is one fused kernel) for same dtypes, else the
    Triton kernel (it reads bf16 activations with an fp32 gain)."""
    same = dtype == weight_dtype
    if device == "cuda":
        apex, why_apex = caps.apex_status()
        if apex is not None and same and not autocast and (op == "rms_norm" or bias):
            return Choice("apex", why_apex)
        triton_why = _triton_runs(device)
        native_fused = op == "layer_norm" or _TORCH_FUSED_RMS_NORM
        if same and native_fused:
            return Choice("torch-native", f"F.{op} (one fused kernel); {why_apex}")
        if triton_why is None:
            return Choice("triton", "fused Triton kernel (statistics in fp32, mixed dtypes)")
        return Choice("torch", f"torch reference ({triton_why})")
    if _interpreted(device):
        return Choice("triton", "Triton interpreter (TRITON_INTERPRET=1)")
    if op == "rms_norm" and _cpu_fp32(device, dtype, autocast) and weight_dtype == torch.float32:
        if native.library() is not None:
            return Choice("native", "megaformer's native CPU kernel")
        return Choice("cpu", "fewer-pass torch ops (" + native.status() + ")")
    return Choice("torch", "torch reference, statistics in fp32")


def _rope(device: str, dtype: torch.dtype, autocast: bool, full: bool) -> Choice:
    if full and _cpu_fp32(device, dtype, autocast):
        if native.library() is not None:
            return Choice("native", "megaformer's native CPU kernel")
        return Choice("cpu", "fewer-pass torch ops (" + native.status() + ")")
    return Choice("torch", "x cos + rotate_half(x) sin")


def _dropout(device: str, dtype: torch.dtype) -> Choice:
    if device == "cpu" and dtype == torch.float32 and native.library() is not None:
        return Choice("native", "megaformer's native CPU kernel (counter-based mask)")
    if device == "cpu":
        return Choice("int16", "int16 random draw, one-byte mask")
    return Choice("torch", "F.dropout")


def _flash_unusable(device: str, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    impl, why = caps.flash_status()
    if impl is None:
        return why
    if device != "cuda":
        return f"flash-attn needs CUDA tensors, got device {device}"
    if dtype not in FLASH_DTYPES:
        return f"flash-attn needs fp16/bf16 tensors, got {_dtype_name(dtype)}"
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8 != 0:
        return (
            f"flash-attn needs head_dim <= {FLASH_MAX_HEAD_DIM} and a multiple of 8, got {head_dim}"
        )
    return None


def native_attention_supported(head_dim: int) -> bool:
    """The native CPU attention kernel's 4x16 register tiles need head_dim % 16 == 0."""
    return native.flash_supported(head_dim)


def _attention(
    device: str,
    dtype: torch.dtype,
    requested: str,
    head_dim: int,
    dropout: bool,
    doc_mask: bool,
    compiling: bool,
    window: bool = False,
) -> Choice:
    if requested not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"model.attention_backend={requested!r}: must be one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if requested == "reference":
        return Choice("reference", "requested in config")
    why_not = _flash_unusable(device, dtype, head_dim)
    if requested == "flash":
        if why_not is not None:
            raise ConfigError(f"model.attention_backend=flash: {why_not}; use auto or sdpa")
        return Choice("flash", "requested in config")
    if requested == "auto" and why_not is None:
        return Choice("flash", f"{caps.flash_status()[0].name} on {device} {_dtype_name(dtype)}")
    if (
        requested == "auto"
        and device == "cpu"
        and dtype == torch.float32
        and not compiling
        and not dropout
        and not doc_mask
        and not window
        and native_attention_supported(head_dim)
        and native.library() is not None
    ):
        return Choice(
            "native",
            "megaformer's native CPU FlashAttention-2 kernel (fp32, no dropout, "
            "document mask or sliding window); attention_backend=sdpa for torch's",
        )
    reason = "requested in config" if requested == "sdpa" else why_not
    return Choice(
        "sdpa",
        f"{reason}; torch SDPA (torch picks its backend"
        f"{', or MEGAFORMER_SDPA_BACKENDS' if device == 'cuda' else ''})",
    )


def _attention_block(device: str, dtype: torch.dtype, head_dim: int, masked: bool) -> Choice:
    """One key block of ring attention with its log-sum-exp (:mod:`megaformer.kernels.attention_block`),
    in the training dtype: torch's fused attention ops that return the log-sum-exp and have a
    backward op taking it."""
    if device == "cpu":
        return Choice("cpu-flash", "aten's CPU FlashAttention kernel (the mask as a bias)")
    if device != "cuda":
        raise ConfigError(f"ring attention: no attention kernel with a log-sum-exp on {device}")
    if masked:
        return Choice("efficient", "aten's memory-efficient kernel (the block's mask as a bias)")
    if dtype not in FLASH_DTYPES or head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8:
        return Choice(
            "efficient",
            f"aten's memory-efficient kernel (FlashAttention-2 needs fp16/bf16 and head_dim <= "
            f"{FLASH_MAX_HEAD_DIM}, a multiple of 8; got {_dtype_name(dtype)}, {head_dim})",
        )
    return Choice("flash", "aten's FlashAttention-2 kernel")


def _experts(device: str, dtype: torch.dtype, d_model: int, d_ffn: int) -> Choice:
    """The MoE experts' GEMMs on rows sorted by expert; ``dtype`` the one they compute in (the
    autocast dtype under autocast). torch's grouped GEMM takes bf16 with 16-byte aligned rows."""
    if not hasattr(torch, "_grouped_mm"):
        return Choice("loop", "this torch has no _grouped_mm")
    if dtype != torch.bfloat16:
        return Choice(
            "loop", f"grouped GEMM needs bf16 (or bf16 autocast), got {_dtype_name(dtype)}"
        )
    if d_model % 8 or d_ffn % 8:
        return Choice(
            "loop",
            f"d_model={d_model}, d_ffn={d_ffn}: grouped GEMM rows must be "
            "multiples of 8 (16 bytes)",
        )
    # (planning for CUDA on a machine without one: the GPU planned for is taken to be sm90+)
    if (
        device == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability() < (9, 0)
    ):
        return Choice("loop", "grouped GEMM needs CUDA sm90+")
    if device not in ("cuda", "cpu"):
        return Choice("loop", f"no grouped GEMM on {device}")
    return Choice("grouped", "torch._grouped_mm, one per matrix (no host synchronisation)")


def _cross_entropy(device: str, dtype: torch.dtype, autocast: bool, chunked: bool) -> Choice:
    if chunked:
        return Choice(
            "chunked", "fused with the output projection, model.loss_chunk_tokens at a time"
        )
    if _cpu_fp32(device, dtype, autocast) and native.library() is not None:
        return Choice("native", "megaformer's native CPU kernel over the padded logits")
    return Choice("torch", "F.cross_entropy in fp32")


@functools.lru_cache(maxsize=None)
def _decide(
    op: str,
    device: str,
    dtype: torch.dtype,
    mode: str,
    compiling: bool,
    autocast: bool,
    interpreting: bool,
    native_loaded: bool,
    facts: tuple,
) -> tuple[str, str]:
    f = dict(facts)
    if op == "attention":  # a model choice (model.attention_backend), not a kernel-mode one
        return tuple(
            _attention(
                device,
                dtype,
                f["backend"],
                f["head_dim"],
                f["dropout"],
                f["doc_mask"],
                compiling,
                f.get("window", False),
            )
        )
    if op == "attention_block":  # fused kernels either way (ring attention is not traced)
        return tuple(_attention_block(device, dtype, f["head_dim"], f["masked"]))
    if op == "experts":  # torch ops either way: neither a kernel-mode nor a compile choice
        return tuple(_experts(device, f.get("compute_dtype", dtype), f["d_model"], f["d_ffn"]))
    if op == "cross_entropy" and f.get("chunked"):
        return tuple(_cross_entropy(device, dtype, autocast, True))
    if mode == "torch":
        return "torch", "model.kernels=torch"
    if compiling:
        if op == "linear":
            return tuple(_linear(device, dtype, autocast))
        return "torch", "torch ops inside torch.compile (inductor fuses them)"
    rules = {
        "linear": lambda: _linear(device, dtype, autocast),
        "projections": lambda: _projections(device, dtype, autocast),
        "swiglu": lambda: _swiglu(device, dtype, autocast),
        "bias_gelu": lambda: _bias_gelu(device),
        "rms_norm": lambda: _norm(op, device, dtype, f.get("weight_dtype", dtype), autocast, True),
        "layer_norm": lambda: _norm(
            op, device, dtype, f.get("weight_dtype", dtype), autocast, f.get("bias", True)
        ),
        "rope": lambda: _rope(device, dtype, autocast, f.get("full", True)),
        "dropout": lambda: _dropout(device, dtype),
        "cross_entropy": lambda: _cross_entropy(device, dtype, autocast, False),
    }
    if op not in rules:
        raise ValueError(f"unknown op {op!r}")
    return tuple(rules[op]())


def choose(
    op: str,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    autocast: bool = False,
    compiling: Optional[bool] = None,
    **facts: object,
) -> Choice:
    """The implementation of ``op`` for tensors on ``device`` with ``dtype`` (see the table above).

    ``facts`` are the op's own inputs to its rule: attention takes backend, head_dim, dropout and
    doc_mask (and window: a sliding window hides keys); attention_block head_dim and masked (an
    explicit mask); norms weight_dtype (and bias for LayerNorm); rope full; cross_entropy chunked;
    experts d_model and d_ffn (and compute_dtype, the autocast dtype, when not ``dtype``)."""
    device_type = device if isinstance(device, str) else device.type
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    native_loaded = not compiling and native.library() is not None  # never inside a graph
    impl, reason = _decide_constant(
        op,
        device_type,
        dtype,
        _mode,
        compiling,
        autocast,
        caps.interpreting(),
        native_loaded,
        tuple(sorted(facts.items())),
    )
    return Choice(impl, reason)


def _decide_constant(*args: object) -> tuple[str, str]:
    return _decide(*args)


def choose_for(op: str, x: torch.Tensor, **facts: object) -> Choice:
    """:func:`choose` for the tensor ``x`` (its device and dtype, autocast as it is now); records
    what was chosen while :func:`track` is active."""
    choice = choose(
        op, x.device, x.dtype, autocast=torch.is_autocast_enabled(x.device.type), **facts
    )
    if not torch.compiler.is_compiling():
        _note(op, choice)
    return choice


def mark_constant_for_compile() -> None:
    """Make the decision a trace-time constant under torch.compile (no graph break); done when a
    model is compiled, not at import (it imports torch._dynamo)."""
    torch.compiler.assume_constant_result(_decide_constant)  # marks the function in place


# ----------------------------------------------------------------------------- what ran

_TRACKERS: list[dict[str, set[str]]] = []
_announced: set = set()


def _note(op: str, choice: Choice) -> None:
    for ran in _TRACKERS:
        ran.setdefault(op, set()).add(choice.impl)
    if (op, choice) not in _announced:
        _announced.add((op, choice))
        logger.debug("%s: %s (%s)", op, choice.impl, choice.reason)


@contextlib.contextmanager
def track() -> Iterator[dict[str, set[str]]]:
    """``with track() as ran: ...`` -> ran[op] is the set of implementations that ran in the block."""
    ran: dict[str, set[str]] = {}
    _TRACKERS.append(ran)
    try:
        yield ran
    finally:
        _TRACKERS.remove(ran)


def announce(what: str, how: str) -> None:
    """Log once per process a choice made outside the op table (e.g. the host allocator)."""
    if torch.compiler.is_compiling() or (what, how) in _announced:
        return
    _announced.add((what, how))
    logger.info("%s: %s", what, how)


# ----------------------------------------------------------------------------- a model's plan


def model_plan(
    model_cfg: object,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    compiled: bool = False,
    autocast: bool = False,
    training: bool = True,
) -> list[tuple[str, Choice]]:
    """(op, choice) for every op a model of ``model_cfg`` (a ModelConfig) runs in a training step
    on ``device`` with activations of ``dtype`` -- the trainer's summary and the bench print this.
    Under ``compiled`` the blocks' ops are traced (torch ops), the loss outside them is not."""
    with kernel_mode(model_cfg.kernels):
        return _model_plan(model_cfg, device, dtype, compiled, autocast, training)


def _model_plan(
    m: object,
    device: torch.device | str,
    dtype: torch.dtype,
    compiled: bool,
    autocast: bool,
    training: bool,
) -> list[tuple[str, Choice]]:
    kw = dict(autocast=autocast)
    inner = dict(kw, compiling=compiled)
    plan: list[tuple[str, Choice]] = [
        ("linear", choose("linear", device, dtype, **inner)),
        ("projections", choose("projections", device, dtype, **inner)),
        (
            "attention",
            choose(
                "attention",
                device,
                dtype,
                compiling=compiled,
                backend=m.attention_backend,
                head_dim=m.qk_head_dim,
                dropout=training and m.attention_dropout > 0,
                doc_mask=m.document_mask,
                window=m.sliding_window is not None,
            ),
        ),
    ]
    norm = "rms_norm" if m.norm == "rmsnorm" else "layer_norm"
    norm_facts = {"weight_dtype": torch.float32 if autocast else dtype}
    if norm == "layer_norm":
        norm_facts["bias"] = m.bias
    plan.append((norm, choose(norm, device, dtype, **inner, **norm_facts)))
    if m.activation == "swiglu":
        plan.append(("swiglu", choose("swiglu", device, dtype, **inner)))
    elif m.bias:
        plan.append(("bias_gelu", choose("bias_gelu", device, dtype, **inner)))
    if m.position == "rope":
        plan.append(("rope", choose("rope", device, dtype, **inner, full=m.rotary_fraction == 1.0)))
    if training and (m.dropout > 0 or m.attention_dropout > 0):
        plan.append(("dropout", choose("dropout", device, dtype, **inner)))
    if m.moe.interval > 0:
        plan.append(
            ("experts", choose("experts", device, dtype, d_model=m.d_model, d_ffn=m.expert_dim))
        )
    plan.append(
        (
            "cross_entropy",
            choose(
                "cross_entropy",
                device,
                torch.float32 if not autocast else dtype,
                **kw,
                chunked=m.loss_chunk_tokens > 0,
            ),
        )
    )
    return plan


def format_plan(plan: list[tuple[str, Choice]]) -> str:
    """One line per op: ``op: impl (reason)``."""
    return "\n".join(f"  {op:14s} {c.impl} ({c.reason})" for op, c in plan)
