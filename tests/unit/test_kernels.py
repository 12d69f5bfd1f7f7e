"""The Triton kernels (SwiGLU two-input and packed, bias-GELU, RMSNorm, LayerNorm) against their
torch references, forward and backward, under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU.

The interpreter must be switched on before triton is imported, so the comparisons run in one child
process (:func:`_interpreter_checks`) that prints the maximum errors and what ran as JSON; each
test asserts its own entries. Without triton the tests skip, printing why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _errors(fn, ref, *inputs, dtype=torch.float32) -> list[float]:
    """[forward error, grad error per input] of fn against ref, both run on copies of ``inputs``.

    fn runs in ``dtype``; ref runs in fp32 on the same (rounded) values; errors are max |a - b|
    relative to max |b|."""
    gen = torch.Generator().manual_seed(1)
    a = [t.detach().to(dtype).clone().requires_grad_() for t in inputs]
    b = [t.detach().to(dtype).float().clone().requires_grad_() for t in inputs]
    ya, yb = fn(*a), ref(*b)
    dy = torch.randn(yb.shape, generator=gen)
    ya.backward(dy.to(ya.dtype))
    yb.backward(dy)

    def rel(x, y):
        x, y = x.detach().float(), y.detach()
        return float((x - y).abs().max() / y.abs().max().clamp(min=1e-12))

    return [rel(ya, yb)] + [rel(x.grad, y.grad) for x, y in zip(a, b)]


def _model_check() -> dict:
    """A tiny model in kernel mode auto (Triton, interpreted) vs torch: loss and every gradient,
    GELU+bias+LayerNorm and SwiGLU+RMSNorm variants, and which implementations ran."""
    from megaformer.config import ModelConfig
    from megaformer.kernels.selection import kernel_mode, track
    from megaformer.model.transformer import Transformer

    out = {}
    for name, variant in (
        ("swiglu", dict(activation="swiglu", norm="rmsnorm")),
        ("gelu", dict(activation="gelu", norm="layernorm", bias=True, position="learned")),
    ):
        losses, grads, ran = [], [], {}
        for mode in ("auto", "torch"):
            cfg = ModelConfig(
                vocab_size=50, d_model=32, n_layers=1, n_heads=2, max_seq_len=8, **variant
            )
            torch.manual_seed(0)
            m = Transformer(cfg)
            ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
            with kernel_mode(mode), track() as ran[mode]:
                loss = m(ids, ids)
                loss.backward()
            losses.append(float(loss.detach()))
            grads.append([p.grad.clone() for p in m.parameters()])
        # relative to each gradient's size, floored at 1e-4 (the key biases' gradient is 0 up to
        # round-off: softmax does not change when a constant is added to every score)
        out[name] = {
            "loss": abs(losses[0] - losses[1]) / losses[1],
            "grad": max(
                float((a - b).abs().max() / (b.abs().max() + 1e-4)) for a, b in zip(*grads)
            ),
            "ran": {
                mode: {op: sorted(impls) for op, impls in r.items()} for mode, r in ran.items()
            },
        }
    return out


def _interpreter_checks() -> dict:
    """Run in a child with TRITON_INTERPRET=1: every kernel vs its reference."""
    from megaformer.kernels import activations as A
    from megaformer.kernels import norm as N
    from megaformer.kernels.selection import choose, kernel_mode, track

    torch.manual_seed(0)
    results = {"dispatch_cpu": choose("swiglu", "cpu", torch.float32).impl}
    with kernel_mode("torch"):
        results["dispatch_torch_mode"] = choose("swiglu", "cpu", torch.float32).impl
    g, u = torch.randn(3, 5, 77), torch.randn(3, 5, 77)  # odd sizes: masked tails
    b = torch.randn(77)
    x, w, bias = torch.randn(3, 5, 77) * 3 + 1, torch.randn(77), torch.randn(77)
    with track() as ran:
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            results[f"swiglu_{name}"] = _errors(A.swiglu, A.swiglu_reference, g, u, dtype=dtype)
            # the packed [g | u] form: halves read in place, [dg | du] written into one buffer
            results[f"swiglu_packed_{name}"] = _errors(
                A.swiglu_packed,
                lambda y: A.swiglu_reference(*y.chunk(2, dim=-1)),
                torch.cat((g, u), dim=-1),
                dtype=dtype,
            )
            for approx in ("none", "tanh"):
                results[f"bias_gelu_{approx}_{name}"] = _errors(
                    lambda h, b_: A.bias_gelu(h, b_, approx),
                    lambda h, b_: A.bias_gelu_reference(h, b_, approx),
                    g,
                    b,
                    dtype=dtype,
                )
            results[f"gelu_nobias_{name}"] = _errors(
                lambda h: A.bias_gelu(h, None),
                lambda h: A.bias_gelu_reference(h, None),
                g,
                dtype=dtype,
            )
            results[f"rmsnorm_{name}"] = _errors(
                lambda x_, w_: N.rms_norm(x_, w_, 1e-5),
                lambda x_, w_: N.rms_norm_reference(x_, w_, 1e-5),
                x,
                w,
                dtype=dtype,
            )
            results[f"layernorm_{name}"] = _errors(
                lambda x_, w_, b_: N.layer_norm(x_, w_, b_, 1e-5),
                lambda x_, w_, b_: N.layer_norm_reference(x_, w_, b_, 1e-5),
                x,
                w,
                bias,
                dtype=dtype,
            )
            results[f"layernorm_nobias_{name}"] = _errors(
                lambda x_, w_: N.layer_norm(x_, w_, None, 1e-5),
                lambda x_, w_: N.layer_norm_reference(x_, w_, None, 1e-5),
                x,
                w,
                dtype=dtype,
            )
        # fp32 gain on bf16 activations (autocast): the kernel returns the promoted dtype like the reference
        fused, ref = N.rms_norm(x.bfloat16(), w, 1e-5), N.rms_norm_reference(x.bfloat16(), w, 1e-5)
        results["rmsnorm_mixed_dtype"] = [
            float((fused - ref).abs().max() / ref.abs().max()),
            str(fused.dtype),
        ]
        # fp32 bias on bf16 pre-activations (autocast): read in its own dtype, output in h's
        h = g.bfloat16()
        fused, ref = A.bias_gelu(h, b), A.bias_gelu_reference(h.float(), b)
        results["bias_gelu_mixed_dtype"] = [
            float((fused.float() - ref).abs().max() / ref.abs().max()),
            str(fused.dtype),
        ]
    results["ran"] = {op: sorted(impls) for op, impls in ran.items()}
    results["model"] = _model_check()
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    try:
        import triton  # noqa: F401
    except Exception as e:
        reason = f"triton cannot be imported here ({type(e).__name__}: {e}); kernel tests skipped"
        print(reason)
        pytest.skip(reason)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    code = "import json, tests.unit.test_kernels as t; print('RESULT' + json.dumps(t._interpreter_checks()))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT") :])


def test_interpreter_dispatch(interpreted):
    """Under the interpreter the kernels run on CPU tensors; kernel mode torch never runs them;
    every kernel compared below really ran as Triton."""
    assert interpreted["dispatch_cpu"] == "triton"
    assert interpreted["dispatch_torch_mode"] == "torch"
    assert interpreted["ran"] == {
        "swiglu": ["triton"],
        "bias_gelu": ["triton"],
        "rms_norm": ["triton"],
        "layer_norm": ["triton"],
    }


@pytest.mark.parametrize(
    "kernel",
    [
        "swiglu",
        "swiglu_packed",
        "bias_gelu_none",
        "bias_gelu_tanh",
        "gelu_nobias",
        "rmsnorm",
        "layernorm",
        "layernorm_nobias",
    ],
)
def test_kernel_forward_backward_match_torch(interpreted, kernel):
    fp32 = interpreted[f"{kernel}_fp32"]
    bf16 = interpreted[f"{kernel}_bf16"]
    assert len(fp32) >= 2  # forward and at least one gradient were compared
    assert max(fp32) < 2e-6, fp32
    # bf16 inputs and outputs: one rounding of the output (2^-8 relative), reductions in fp32
    assert max(bf16) < 2e-2, bf16


def test_mixed_dtypes_match_reference(interpreted):
    err, dtype = interpreted["rmsnorm_mixed_dtype"]
    assert dtype == "torch.float32" and err < 1e-2
    err, dtype = interpreted["bias_gelu_mixed_dtype"]
    assert dtype == "torch.bfloat16" and err < 1e-2


def test_model_with_fused_kernels_equals_torch_ops(interpreted):
    """Whole model, both FFN/norm variants: loss and every gradient within fp32 round-off, with
    the Triton kernels demonstrably running (and not running in torch mode)."""
    swiglu, gelu = interpreted["model"]["swiglu"], interpreted["model"]["gelu"]
    assert swiglu["loss"] < 1e-6 and gelu["loss"] < 1e-6
    assert swiglu["grad"] < 1e-5 and gelu["grad"] < 1e-5
    assert swiglu["ran"]["auto"]["swiglu"] == ["triton"]
    assert swiglu["ran"]["auto"]["rms_norm"] == ["triton"]
    assert gelu["ran"]["auto"]["bias_gelu"] == ["triton"]
    assert gelu["ran"]["auto"]["layer_norm"] == ["triton"]
    for variant in (swiglu, gelu):
        assert all(
            impls == ["torch"]
            for op, impls in variant["ran"]["torch"].items()
            if op not in ("attention",)
        ), variant["ran"]["torch"]


def test_cpu_without_interpreter_never_runs_triton(monkeypatch):
    """Outside the interpreter a CPU tensor never reaches a Triton kernel (even with triton installed)."""
    from megaformer.kernels.selection import choose, kernel_mode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for op in ("swiglu", "bias_gelu", "rms_norm", "layer_norm"):
        for dtype in (torch.float32, torch.bfloat16):
            assert choose(op, "cpu", dtype).impl != "triton"
            with kernel_mode("torch"):
                assert choose(op, "cpu", dtype).impl == "torch"


def test_norm_warps_grow_with_the_row():
    """Wide rows get more warps per program, so a row's registers do not spill."""
    from megaformer.kernels.norm import _block, _num_warps

    assert [_num_warps(_block(n)) for n in (256, 1024, 2048, 4096, 8192, 16384)] == [
        4,
        4,
        8,
        16,
        16,
        16,
    ]
