"""The GPU tier: what only a CUDA device can show. ``pytest -m cuda`` on one GPU (a few minutes);
on a machine without one every test here is collected and skips with the reason.

* every kernel against its torch reference in bf16 and fp16, forward and backward, naming what ran;
* the attention implementations (flash-attn if installed, each SDPA backend) against the fp32
  reference: MHA/GQA/MQA, KV-cache queries (T < S), packed-document masks;
* a whole model with megaformer's kernels against plain torch ops;
* the MoE experts' grouped GEMM, real FP8 GEMMs and one-rank context-parallel attention against
  their references;
* bf16 training through DeepSpeed against fp32 (:data:`TRAINING_CASES`: each ZeRO stage and
  recompute mode, MoE, compiled FP8, context parallelism, asynchronous checkpoints through pinned
  staging and a resume); every one of those commands passes ``--dry-run`` on CPU
  (tests/unit/test_cuda_commands.py), so a refused config shows without a GPU;
* one training step audited for host synchronisations; the compiled blocks without graph breaks.

A test passes only when it tested what it names: the kernel selection tracker
(:func:`megaformer.kernels.selection.track`) must show the fast implementation ran (a silent
fallback to the torch reference fails), and a backend that took none of the cases fails.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from megaformer.config import ModelConfig
from megaformer.kernels import activations as A
from megaformer.kernels import capabilities
from megaformer.kernels import norm as N
from megaformer.kernels.attention import attention, document_ids
from megaformer.kernels.cross_entropy import chunked_cross_entropy, cross_entropy
from megaformer.kernels.gemm import linear
from megaformer.kernels.rope import rope, rope_reference
from megaformer.kernels.selection import kernel_mode, track

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = {"bf16": (torch.bfloat16, 2e-2), "fp16": (torch.float16, 5e-3)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _compare(fn, ref, *inputs: torch.Tensor, dtype: torch.dtype) -> tuple[list[float], dict]:
    """Relative errors [output, grad of each input] of fn (inputs in ``dtype``) against ref in
    fp32 on the same rounded values, and what ran."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = [t.to(dtype).detach().requires_grad_() for t in inputs]
    b = [t.to(dtype).float().detach().requires_grad_() for t in inputs]
    with track() as ran:
        ya = fn(*a)
        dy = torch.randn(ya.shape, device="cuda", generator=gen)
        ya.backward(dy.to(ya.dtype))
    yb = ref(*b)
    yb.backward(dy)
    return [_rel(ya, yb)] + [_rel(x.grad, y.grad) for x, y in zip(a, b)], ran


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    return torch.randn(*shape, device="cuda", generator=g) * scale


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize(
    "kernel", ["swiglu", "swiglu_packed", "bias_gelu", "rms_norm", "layer_norm", "rope", "linear"]
)
def test_kernel_against_reference(kernel, dtype_name):
    dtype, tol = DTYPES[dtype_name]
    M, D, F_ = 257, 1024, 2816  # odd row count: masked tails
    cases = {
        "swiglu": (A.swiglu, A.swiglu_reference, (_randn(M, F_), _randn(M, F_))),
        "swiglu_packed": (
            A.swiglu_packed,
            lambda y: A.swiglu_reference(*y.chunk(2, -1)),
            (_randn(M, 2 * F_),),
        ),
        "bias_gelu": (A.bias_gelu, A.bias_gelu_reference, (_randn(M, F_), _randn(F_))),
        "rms_norm": (
            lambda x, w: N.rms_norm(x, w, 1e-5),
            lambda x, w: N.rms_norm_reference(x, w, 1e-5),
            (_randn(M, D) * 3 + 1, _randn(D)),
        ),
        "layer_norm": (
            lambda x, w, b: N.layer_norm(x, w, b, 1e-5),
            lambda x, w, b: N.layer_norm_reference(x, w, b, 1e-5),
            (_randn(M, D) * 3 + 1, _randn(D), _randn(D)),
        ),
        "rope": (
            lambda x: rope(x, *_tables(x)),
            lambda x: rope_reference(x, *_tables(x)),
            (_randn(2, 8, 64, 128),),
        ),
        "linear": (linear, F.linear, (_randn(M, D), _randn(F_, D, scale=0.03), _randn(F_))),
    }
    fn, ref, inputs = cases[kernel]
    errors, ran = _compare(fn, ref, *inputs, dtype=dtype)
    assert max(errors) < tol, (errors, ran)
    op = {"swiglu_packed": "swiglu"}.get(kernel, kernel)
    assert ran.get(op) and ran[op] <= CUDA_IMPLEMENTATIONS[op], (kernel, ran, _why(op, dtype))


#: What each op may run on CUDA with same-dtype operands (kernels/selection.py's rules); "torch"
#: appears only where the torch op is the CUDA implementation, never as a fallback.
CUDA_IMPLEMENTATIONS = {
    "swiglu": {"triton"},
    "bias_gelu": {"triton"},
    "rms_norm": {"apex", "torch-native"},
    "layer_norm": {"apex", "torch-native"},
    "rope": {"torch"},
    "linear": {"torch"},
}


def _why(op: str, dtype: torch.dtype) -> str:
    """The selection rule's reason for ``op`` on CUDA (shown when a test finds the wrong one)."""
    from megaformer.kernels.selection import choose

    return choose(op, "cuda", dtype).reason


def _tables(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from megaformer.model.positions import RotaryEmbedding

    return RotaryEmbedding(x.shape[-1]).tables(0, x.shape[2], x.device)


def test_triton_norms_at_large_widths_and_mixed_dtypes():
    """bf16 activations with an fp32 gain (autocast) go to the Triton kernel, at widths up to 8192."""
    for width in (4096, 8192):
        x, w = _randn(64, width) * 2, _randn(width)
        errors, ran = _compare(
            lambda x_, w_: N.rms_norm(x_.bfloat16(), w_, 1e-5),
            lambda x_, w_: N.rms_norm_reference(x_, w_, 1e-5),
            x,
            w,
            dtype=torch.float32,
        )
        assert ran["rms_norm"] == {"triton"} and max(errors) < 2e-2, (width, errors)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_cross_entropy_plain_and_chunked(dtype_name):
    dtype, tol = DTYPES[dtype_name]
    h, w = _randn(512, 256), _randn(1000, 256, scale=0.05)
    y = torch.randint(0, 900, (512,), device="cuda")
    y[:7] = -100
    errs, _ = _compare(
        lambda h_, w_: cross_entropy(h_ @ w_.t(), y, 900),
        lambda h_, w_: F.cross_entropy((h_ @ w_.t())[:, :900], y),
        h,
        w,
        dtype=dtype,
    )
    assert max(errs) < tol, errs
    errs, _ = _compare(
        lambda h_, w_: chunked_cross_entropy(h_, w_, y, 128, vocab_size=900),
        lambda h_, w_: F.cross_entropy((h_ @ w_.t())[:, :900], y),
        h,
        w,
        dtype=dtype,
    )
    assert max(errs) < tol, errs


def _attention_cases():
    for H, Hkv in ((8, 8), (8, 2), (8, 1)):
        for T, S in ((256, 256), (64, 256), (1, 256)):
            yield H, Hkv, T, S


def _sdpa_backends() -> list[str]:
    return ["flash", "efficient", "cudnn", "math"]


@pytest.mark.parametrize("backend", ["auto", "flash"] + [f"sdpa:{b}" for b in _sdpa_backends()])
def test_attention_implementations_against_reference(backend, monkeypatch):
    if backend == "flash" and capabilities.flash_status()[0] is None:
        pytest.skip(f"flash-attn: {capabilities.flash_status()[1]}")
    name = backend
    if backend.startswith("sdpa:"):
        monkeypatch.setenv("MEGAFORMER_SDPA_BACKENDS", backend.split(":")[1])
        name = "sdpa"
    compared, refused = [], []
    for H, Hkv, T, S in _attention_cases():
        q, k, v = _randn(2, H, T, 128), _randn(2, Hkv, S, 128), _randn(2, Hkv, S, 128)
        ref = attention(q, k, v, causal=True, backend="reference")
        try:
            with track() as ran:
                out = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, backend=name)
        except RuntimeError as e:  # an SDPA backend that does not take this case says so
            if backend.startswith("sdpa:") and "No available kernel" in str(e):
                refused.append((H, Hkv, T, S))
                continue
            raise
        assert _rel(out, ref) < 2e-2, (backend, H, Hkv, T, S)
        want = (
            {"flash"}
            if name == "flash" or (name == "auto" and capabilities.flash_status()[0])
            else {"sdpa"}
        )
        assert ran.get("attention") == want, (backend, ran, (H, Hkv, T, S))
        compared.append((H, Hkv, T, S))
    assert compared, f"{backend} took none of the cases (refused: {refused})"


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_document_mask_on_cuda(backend):
    """Packed documents (flash-attn's varlen kernel where installed, else the dense mask) equal
    each document run alone."""
    ids = torch.randint(1, 50, (2, 256), device="cuda")
    ids[0, [40, 41, 200]] = 0
    ids[1, [128]] = 0
    docs = document_ids(ids, 0)
    q, k, v = _randn(2, 8, 256, 64), _randn(2, 2, 256, 64), _randn(2, 2, 256, 64)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    with track() as ran:
        out = attention(q, k, v, causal=True, backend=backend, doc_ids=docs)
    want = {"reference": "reference", "sdpa": "sdpa"}.get(
        backend, "flash" if capabilities.flash_status()[0] else "sdpa"
    )
    assert ran.get("attention") == {want}, (backend, ran)
    for row in range(2):
        bounds = [0] + [int(i) + 1 for i in (ids[row] == 0).nonzero().flatten()] + [256]
        for s, e in zip(bounds[:-1], bounds[1:]):
            if s == e:
                continue
            alone = attention(
                q[row : row + 1, :, s:e],
                k[row : row + 1, :, s:e],
                v[row : row + 1, :, s:e],
                causal=True,
                backend="reference",
            )
            assert _rel(out[row : row + 1, :, s:e], alone) < 2e-2, (backend, row, s, e)


@pytest.mark.parametrize(
    "variant",
    [
        dict(activation="swiglu", norm="rmsnorm"),
        dict(activation="gelu", norm="layernorm", bias=True, position="learned"),
    ],
)
def test_model_with_kernels_equals_torch_ops(variant):
    from megaformer.model.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=1000,
        d_model=256,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=256,
        **variant,
    )
    x = torch.randint(0, 1000, (4, 256), device="cuda")
    out = []
    for mode in ("auto", "torch"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            m = Transformer(cfg)
        with kernel_mode(mode), track() as ran, torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x, x)
        loss.backward()
        out.append((loss.item(), torch.cat([p.grad.flatten() for p in m.parameters()]), ran))
    assert abs(out[0][0] - out[1][0]) < 1e-2 * out[1][0]
    assert _rel(out[0][1], out[1][1]) < 5e-2
    assert all(v == {"torch"} for op, v in out[1][2].items() if op != "attention")
    fused = out[0][2]  # under autocast: fp32 gains with bf16 activations (the Triton norms)
    act = "swiglu" if variant["activation"] == "swiglu" else "bias_gelu"
    assert fused.get(act) == {"triton"}, fused
    norm = "rms_norm" if variant["norm"] == "rmsnorm" else "layer_norm"
    assert fused.get(norm) and "torch" not in fused[norm], fused


def test_one_training_step_never_waits_for_the_host():
    """Forward, backward, clipping and the AdamW step of a model with megaformer's kernels under
    bf16 autocast: torch's sync debug mode raises on any host synchronisation."""
    from megaformer.model.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=1000, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256
    )
    with torch.device("cuda"):
        m = Transformer(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 1000, (4, 256), device="cuda")
    for step in range(2):  # the first step warms caches (RoPE tables, kernel builds)
        mode = "error" if step == 1 else "default"
        torch.cuda.set_sync_debug_mode(mode)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(x, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_compiled_blocks_have_no_graph_breaks():
    from torch._dynamo.utils import counters

    from megaformer.model.block import compile_blocks
    from megaformer.model.transformer import Transformer

    counters.clear()
    cfg = ModelConfig(
        vocab_size=1000, d_model=256, n_layers=2, n_heads=4, max_seq_len=256, document_mask=True
    )
    with torch.device("cuda"):
        m = Transformer(cfg)
    m.eod_id = 0
    compile_blocks(m.layers, backend="aot_eager")
    x = torch.randint(0, 1000, (2, 256), device="cuda")
    x[:, 100] = 0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        m(x, x).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])


class TrainingCase(NamedTuple):
    """One training run of the tier: ``shared`` overrides (beyond the tiny run) for the bf16 run
    and its fp32 reference, ``measured`` for the bf16 run only; ``processes`` ranks (one GPU each);
    ``tolerance`` on each step's loss relative to fp32's."""

    shared: dict[str, Any]
    measured: dict[str, Any] = {}
    processes: int = 1
    tolerance: float = 0.03
    config: str = "configs/quickstart.yaml"


#: The tier's training runs (ids "ZERO-RECOMPUTE" for the DeepSpeed stages). bf16 needs ZeRO 1+.
TRAINING_CASES: dict[str, TrainingCase] = {
    "1-none": TrainingCase({"parallel.zero_stage": 1}),
    "2-none": TrainingCase({"parallel.zero_stage": 2}),
    "3-none": TrainingCase({"parallel.zero_stage": 3}),
    "1-full": TrainingCase({"parallel.zero_stage": 1, "train.recompute": "full"}),
    "1-selective": TrainingCase({"parallel.zero_stage": 1, "train.recompute": "selective"}),
    # routed experts through torch._grouped_mm (bf16 weights, sm90+), a shared expert
    "moe-grouped": TrainingCase(
        {
            "parallel.zero_stage": 1,
            "model.moe.interval": 1,
            "model.moe.num_experts": 4,
            "model.moe.top_k": 2,
            "model.moe.d_expert": 64,
            "model.moe.num_shared_experts": 1,
        },
        tolerance=0.05,
    ),
    # real FP8 GEMMs (torch._scaled_mm), casts compiled by inductor; fp32 reference without FP8
    "fp8-compiled": TrainingCase(
        {"parallel.zero_stage": 1},
        {"train.fp8": "tensorwise", "train.compile": "true"},
        tolerance=0.05,
    ),
    "context-ring-2": TrainingCase(
        {"parallel.zero_stage": 1, "parallel.context": 2, "parallel.context_mode": "ring"},
        processes=2,
    ),
    # asynchronous sharded checkpoint (pinned host staging, background writer), then a resume
    "pinned-async-save": TrainingCase(
        {
            "parallel.zero_stage": 1,
            "checkpoint.async_save": "true",
            "checkpoint.save_at_end": "true",
        }
    ),
}


def training_args(case: TrainingCase, precision: str, run_dir: Path, steps: int = 4) -> list[str]:
    """``megaformer train`` arguments of ``case`` in ``precision`` (the measured keys with bf16)."""
    from tests.helpers import tiny_overrides

    keys = {
        "train.steps": steps,
        "eval.interval": 0,
        "model.d_model": 64,
        "train.device": "cuda",
        "train.precision": precision,
        **case.shared,
        **(case.measured if precision == "bf16" else {}),
    }
    return ["train", case.config, *tiny_overrides(**keys), "--run-dir", str(run_dir)]


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("case", list(TRAINING_CASES))
def test_bf16_training_with_deepspeed_tracks_fp32(tmp_path: Path, case: str):
    """megaformer train on the GPU in bf16 (each ZeRO stage, recomputation, MoE, FP8, context
    parallelism, asynchronous checkpoints) against the fp32 run: losses of the first steps within
    the case's tolerance, all finite."""
    from tests.helpers import run_cli, run_process, subprocess_env, torchrun_cmd

    spec = TRAINING_CASES[case]
    if torch.cuda.device_count() < spec.processes:
        pytest.skip(
            f"{case}: needs {spec.processes} CUDA devices, found "
            f"{torch.cuda.device_count()} (the one-rank ring and all-to-all attention run "
            "in test_context_parallel_attention_on_one_rank)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(spec.processes))))
    env = subprocess_env(CUDA_VISIBLE_DEVICES=visible, DS_ACCELERATOR="cuda")

    def train(args: list[str]):
        if spec.processes == 1:
            return run_cli(*args, env=env)
        return run_process(torchrun_cmd(spec.processes, *args), env=env)

    losses = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path / precision
        proc = train(training_args(spec, precision, run))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        losses[precision] = _losses(run)
    assert len(losses["bf16"]) == 4 and all(math.isfinite(v) for v in losses["bf16"]), losses
    for a, b in zip(losses["bf16"], losses["fp32"]):
        assert abs(a - b) < spec.tolerance * b, losses
    if spec.shared.get("checkpoint.save_at_end") == "true":
        run = tmp_path / "bf16"
        proc = train(training_args(spec, "bf16", run, steps=6))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "resumed from" in proc.stdout + proc.stderr and len(_losses(run)) == 6


@pytest.fixture
def one_rank_group():
    """A one-rank NCCL default group (the collectives of context parallelism on one GPU)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group(
        "nccl",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", torch.cuda.current_device()),
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_context_parallel_attention_on_one_rank(one_rank_group, mode, monkeypatch):
    """Context-parallel attention on a one-rank CUDA group (bf16, GQA) against the fp32 reference,
    forward and backward; the all-to-all core runs the fast attention kernel."""
    from megaformer.parallel import context as C

    if mode == "ring":  # one rank: the K/V pass goes to the rank itself

        class _SelfPass:
            def __init__(self, t, cp, kind):
                self.t = t

            def wait(self):
                return self.t

        monkeypatch.setattr(C, "_RingPass", _SelfPass)
    cp = C.ContextParallel(one_rank_group, 1, 0, mode)
    q, k, v = _randn(2, 8, 256, 64), _randn(2, 2, 256, 64), _randn(2, 2, 256, 64)

    def cp_attention(q_, k_, v_):
        if mode == "ring":
            return C.ring_attention(q_, k_, v_, cp, causal=True)
        return C.ulysses_attention(
            attention,
            q_,
            k_,
            v_,
            cp,
            causal=True,
            dropout_p=0.0,
            backend="auto",
            doc_ids=None,
            window=None,
        )

    errors, ran = _compare(
        cp_attention,
        lambda q_, k_, v_: attention(q_, k_, v_, causal=True, backend="reference"),
        q,
        k,
        v,
        dtype=torch.bfloat16,
    )
    assert max(errors) < 2e-2, (mode, errors)
    if mode == "all_to_all":
        assert ran.get("attention") and "reference" not in ran["attention"], ran
    else:  # every chunk pair on one rank is unmasked or the kernel's causal one
        assert ran.get("attention_block") == {"flash"}, ran


def test_moe_experts_take_the_grouped_gemm(monkeypatch):
    """The routed experts in bf16 run torch._grouped_mm (sm90+) and match the per-expert loop:
    output, input gradient and the experts' weight gradient."""
    from megaformer.config import MoEConfig
    from megaformer.model import moe as M

    if torch.cuda.get_device_capability() < (9, 0) or not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm needs an sm90+ GPU and torch >= 2.8")
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(
        torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or grouped_mm(*a, **kw)
    )
    cfg = ModelConfig(
        vocab_size=1000,
        d_model=256,
        n_layers=2,
        n_heads=4,
        max_seq_len=256,
        moe=MoEConfig(interval=1, num_experts=8, top_k=2, d_expert=512),
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = M.MoE(cfg, 0).to(torch.bfloat16)
    x = _randn(2, 128, 256).bfloat16()
    out = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(M, "_grouped_mm_ok", lambda *a: False)
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        y = layer(xi)
        y.float().square().mean().backward()
        out.append((y.detach(), xi.grad, layer.experts.w1.grad))
        if grouped:
            assert calls, "the grouped GEMM was not taken"
    assert max(_rel(a, b) for a, b in zip(*out)) < 2e-2


def test_expert_dispatch_never_waits_for_the_host(one_rank_group):
    """An MoE block whose experts are reached through the fixed-size exchange (a one-rank
    expert-parallel group: counts, rows and outputs through NCCL all-to-alls): forward and
    backward under torch's sync debug mode, and the same output as the block without dispatch.
    ``auto`` picks that exchange on this GPU."""
    from megaformer.config import MoEConfig
    from megaformer.model import moe as M
    from megaformer.parallel.experts import ExpertDispatch

    if torch.cuda.get_device_capability() < (9, 0) or not hasattr(torch, "_grouped_mm"):
        pytest.skip("the fixed-size exchange runs torch._grouped_mm: an sm90+ GPU")
    moe = MoEConfig(
        interval=1,
        num_experts=8,
        top_k=2,
        d_expert=512,
        num_shared_experts=1,
        d_shared=256,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
    )
    cfg = ModelConfig(vocab_size=1000, d_model=256, n_layers=2, n_heads=4, max_seq_len=256, moe=moe)
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = M.MoE(cfg, 0).to(torch.bfloat16).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = _randn(2, 128, 256).bfloat16()
    plain = layer(x).detach()
    layer.expert_dispatch = ExpertDispatch(one_rank_group, "auto")
    assert layer.expert_dispatch.padded(x.view(-1, 256), layer.experts, 2, True)
    for step in range(2):  # the first warms the caches
        torch.cuda.set_sync_debug_mode("error" if step == 1 else "default")
        try:
            xi = x.detach().requires_grad_()
            y = layer(xi)
            (y.float().square().mean() + layer.aux_loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert _rel(y.detach(), plain) < 2e-2


def test_real_fp8_gemms_match_their_emulation():
    """torch._scaled_mm FP8 GEMMs (tensorwise, rowwise) against the emulated casts and scales:
    forward and both gradients."""
    from megaformer.parallel.fp8 import Fp8Matmul, fp8_gemm_support

    ok, why = fp8_gemm_support("cuda")
    if not ok:
        pytest.skip(why)
    x0, w0, dy = _randn(512, 1024), _randn(768, 1024, scale=0.02), _randn(512, 768)
    for recipe in ("tensorwise", "rowwise"):
        got = []
        for emulate in (False, True):
            x = x0.bfloat16().requires_grad_()
            w = w0.bfloat16().requires_grad_()
            y = Fp8Matmul(recipe, emulate=emulate)(x, w)
            y.backward(dy.bfloat16())
            got.append((y, x.grad, w.grad))
        errors = [_rel(a, b) for a, b in zip(*got)]
        assert max(errors) < 3e-2 and all(t.dtype == torch.bfloat16 for t in got[0]), (
            recipe,
            errors,
        )


def test_real_fp8_grouped_experts_match_their_emulation():
    """The routed experts' FP8 grouped GEMM on CUDA (torchao's, token groups padded to 16 rows on
    the device; one group empty, the others of uneven sizes) against the emulated rowwise casts:
    forward and both gradients, with one shared cast of x for W1 and W3."""
    from megaformer.kernels.capabilities import fp8_grouped_status
    from megaformer.parallel.fp8 import Fp8Experts, Fp8Matmul, fp8_gemm_support

    ok, why = fp8_gemm_support("cuda")
    fn, why_not = fp8_grouped_status()
    if not ok or fn is None:
        pytest.skip(why or why_not)
    counts = torch.tensor([100, 0, 37, 275], device="cuda")
    x0, w0 = _randn(int(counts.sum()), 512), _randn(4, 1024, 512, scale=0.02)
    dy = _randn(int(counts.sum()), 1024)
    got = []
    for emulate in (False, True):
        mm = Fp8Matmul("rowwise", emulate)
        x = x0.bfloat16().requires_grad_()
        w = w0.bfloat16().requires_grad_()
        (y,) = Fp8Experts(mm, mm).grouped(x, [w], counts)
        y.backward(dy.bfloat16())
        got.append((y, x.grad, w.grad))
    errors = [_rel(a, b) for a, b in zip(*got)]
    assert max(errors) < 3e-2, errors
