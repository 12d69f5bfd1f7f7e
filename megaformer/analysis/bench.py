"""``megaformer bench``: timed training steps of a config's model, optionally against transformers.

One process, random tokens, one micro-batch (train.micro_batch_size x seq_len) per step:

    forward + cross-entropy -> backward -> clip (train.grad_clip) -> AdamW step -> zero_grad

megaformer's model is built by the trainer's own :func:`megaformer.parallel.build.build_model`
(padded vocabulary, recompute mode, compilation; the trainer's AdamW parameter groups); with ``--compare-hf`` the same architecture is built as a
Hugging Face ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU, GQA) or ``GPT2LMHeadModel`` (learned
positions, LayerNorm, GELU, biases) from a config (no download), with the same weight-decay groups,
AdamW hyper-parameters and implementation (``train.adam_impl``), batch and SDPA attention. What
differs is each framework's own code: megaformer's layers, GEMM dispatch and (on fp32 CPU) its
native kernels (:mod:`megaformer.kernels.native`, whose status the output names) against
transformers' modules on torch's ops. After ``warmup`` steps of each, timed steps
alternate between the two (each going first every other step) so that both see the same machine
state; the reported figure is the median step time.

On CPU both models share one process and so one malloc heap: with glibc's defaults the step time
of either depends on what the other left in the heap (the second model faulting in fresh pages
every step while the first faults none). The bench
applies ``train.cpu_malloc`` (tuned by default, :mod:`megaformer.runtime.host_allocator`) to the
whole process, so both run without page faults in steady state, and prints each model's median
minor page faults per step.

FLOPs are megaformer's model FLOPs of the batch (identical architectures, so the same for both),
so TFLOP/s per device and MFU are comparable.

Peak memory: CUDA ``max_memory_allocated`` over one extra step; on CPU the allocator-measured peak
of one extra step (:func:`megaformer.analysis.measure.measure`) plus the parameters and optimizer
states already allocated.

A model that fails (CUDA out of memory, or any other error while it is built, stepped or
measured) gets a row with the error; the other models' rows are kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable, Optional

import torch

from megaformer.accelerators import find_accelerator, peak_tflops
from megaformer.analysis.flops import step_flops
from megaformer.analysis.summary import resolve_vocab
from megaformer.config import Config, ModelConfig, precision_dtype
from megaformer.errors import UserError
from megaformer.kernels import native
from megaformer.parallel.build import build_model
from megaformer.parallel.fp8 import check_fp8_device
from megaformer.runtime.host_allocator import configure_host_allocator
from megaformer.runtime.optimizer import build_optimizer

try:
    import resource
except ImportError:  # not a Unix: no page-fault counts
    resource = None  # type: ignore[assignment]


# ----------------------------------------------------------------------------- Hugging Face twin


def hf_model(cfg: ModelConfig) -> torch.nn.Module:
    """The transformers model with ``cfg``'s architecture (LlamaForCausalLM or GPT2LMHeadModel)."""
    llama = (
        cfg.position == "rope"
        and cfg.norm == "rmsnorm"
        and cfg.activation == "swiglu"
        and cfg.residual == "sequential"
        and cfg.rotary_fraction == 1.0
    )
    gpt2 = (
        cfg.position == "learned"
        and cfg.norm == "layernorm"
        and cfg.bias
        and cfg.activation in ("gelu", "gelu_tanh")
        and cfg.residual == "sequential"
        and cfg.tie_embeddings
        and cfg.kv_heads == cfg.n_heads
    )
    if llama:
        from transformers import LlamaConfig, LlamaForCausalLM

        hc = LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads,
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
            tie_word_embeddings=cfg.tie_embeddings,
            attention_bias=cfg.bias,
            mlp_bias=cfg.bias,
            hidden_act="silu",
            attention_dropout=cfg.attention_dropout,
            initializer_range=cfg.init_std,
        )
        hc._attn_implementation = "sdpa"
        return LlamaForCausalLM(hc)
    if gpt2:
        from transformers import GPT2Config, GPT2LMHeadModel

        hc = GPT2Config(
            vocab_size=cfg.vocab_size,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            n_positions=cfg.max_seq_len,
            n_inner=cfg.ffn_dim,
            activation_function="gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.attention_dropout,
            layer_norm_epsilon=cfg.norm_eps,
            initializer_range=cfg.init_std,
        )
        hc._attn_implementation = "sdpa"
        return GPT2LMHeadModel(hc)
    raise UserError(
        "bench --compare-hf: no transformers twin for this architecture (Llama: rope + "
        "rmsnorm + swiglu, full rotary; GPT-2: learned + layernorm + gelu + bias, tied, MHA)"
    )


# ----------------------------------------------------------------------------- one runner per model


@dataclasses.dataclass
class Runner:
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[torch.Tensor], torch.Tensor]
    grad_clip: float
    autocast: Callable[[], Any]
    times: list = dataclasses.field(default_factory=list)
    page_faults: list = dataclasses.field(default_factory=list)

    def step(self, x: torch.Tensor) -> float:
        with self.autocast():
            loss = self.loss(x)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def timed(self, x: torch.Tensor, device: torch.device) -> None:
        _sync(device)
        faults = _minor_faults()
        t0 = time.perf_counter()
        self.step(x)
        _sync(device)
        self.times.append(time.perf_counter() - t0)
        self.page_faults.append(_minor_faults() - faults)


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where the platform has no getrusage)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _adamw(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    return build_optimizer(model, cfg.train)


def _kernel_plan(cfg: Config, dev: torch.device) -> list[list[str]]:
    """[op, implementation, why] for each op of megaformer's training step under this config (the
    rule that runs them, :func:`megaformer.kernels.selection.model_plan`)."""
    from megaformer.kernels.selection import model_plan

    autocast = cfg.train.precision in ("bf16", "fp16")
    dtype = precision_dtype(cfg.train.precision)
    plan = model_plan(cfg.model, dev, dtype, compiled=cfg.train.compile, autocast=autocast)
    return [[op, c.impl, c.reason] for op, c in plan]


def _runner_factories(
    cfg: Config, device: torch.device, compare_hf: bool
) -> list[Callable[[], Runner]]:
    """Builders of the runners (megaformer, then optionally transformers), called when needed."""
    t = cfg.train
    if t.precision == "fp16" and device.type != "cuda":
        raise UserError("bench: fp16 needs CUDA; use fp32 or bf16 on CPU")
    dtype = precision_dtype(t.precision) if t.precision != "fp32" else None  # autocast

    def autocast() -> Any:
        return (
            torch.autocast(device.type, dtype=dtype)
            if dtype is not None
            else contextlib.nullcontext()
        )

    def megaformer_runner() -> Runner:
        # model.document_mask: random tokens, so documents end wherever id 0 falls
        mf = build_model(cfg, device=device, eod_id=0).model
        mf.train()
        return Runner("megaformer", mf, _adamw(mf, cfg), lambda x: mf(x, x), t.grad_clip, autocast)

    def hf_runner() -> Runner:
        torch.manual_seed(t.seed)
        hf = hf_model(cfg.model).to(device)
        hf.train()
        return Runner(
            f"transformers {type(hf).__name__}",
            hf,
            _adamw(hf, cfg),
            lambda x: hf(input_ids=x, labels=x).loss,
            t.grad_clip,
            autocast,
        )

    return [megaformer_runner] + ([hf_runner] if compare_hf else [])


def _peak_memory(r: Runner, x: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        r.step(x)
        return torch.cuda.max_memory_allocated(device) / 1e9
    from megaformer.analysis.measure import measure, optimizer_state_tensors, tensor_bytes

    base = tensor_bytes(list(r.model.parameters()) + optimizer_state_tensors(r.optimizer))
    return (base + measure(lambda: r.step(x)).peak) / 1e9


def _row(
    r: Runner,
    x: torch.Tensor,
    dev: torch.device,
    tokens: int,
    flops: float,
    peak_value: Optional[float],
) -> dict:
    t = statistics.median(r.times)
    row = {
        "name": r.name,
        "step_time_s": t,
        "step_times_s": r.times,
        "tokens_per_s": tokens / t,
        "tflops_per_device": flops / t / 1e12,
        "page_faults_per_step": statistics.median(r.page_faults),
        "parameters": (
            r.model.num_parameters()
            if hasattr(r.model, "num_parameters")
            else sum(p.numel() for p in r.model.parameters())
        ),
        "peak_mem_gb": _peak_memory(r, x, dev),
    }
    if peak_value:
        row["mfu"] = row["tflops_per_device"] / peak_value
    return row


def _error_row(name: str, e: BaseException) -> dict:
    """The row of a model that failed: its name and the error in one line."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return {"name": name, "error": "CUDA out of memory"}
    first = (str(e).splitlines() or [""])[0][:200]
    return {"name": name, "error": f"{type(e).__name__}: {first}" if first else type(e).__name__}


def _runner_name(make: Callable[[], Runner], r: Optional[Runner]) -> str:
    return r.name if r is not None else make.__name__


def _run_one(
    make: Callable[[], Runner],
    x: torch.Tensor,
    dev: torch.device,
    warmup: int,
    steps: int,
    tokens: int,
    flops: float,
    peak_value: Optional[float],
) -> dict:
    """Build, warm up, time and free one model; an error (CUDA out of memory or any other, except
    a user error in the configuration) is this model's result, not a crash of the bench."""
    r = None
    try:
        r = make()
        for _ in range(warmup):
            r.step(x)
        for _ in range(steps):
            r.timed(x, dev)
        return _row(r, x, dev, tokens, flops, peak_value)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - recorded in the model's row
        return _error_row(_runner_name(make, r), e)
    finally:
        del r
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _run_alternating(
    factories: list[Callable[[], Runner]],
    x: torch.Tensor,
    dev: torch.device,
    warmup: int,
    steps: int,
    tokens: int,
    flops: float,
    peak_value: Optional[float],
) -> list[dict]:
    """Build every model, then alternate their steps; a model that fails gets an error row and
    drops out, the others go on."""
    rows: list[Optional[dict]] = [None] * len(factories)
    runners: dict[int, Runner] = {}

    def guarded(i: int, fn: Callable[[], Any], r: Optional[Runner]) -> Any:
        try:
            return fn()
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - recorded in the model's row
            rows[i] = _error_row(_runner_name(factories[i], r), e)
            runners.pop(i, None)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            return None

    for i, make in enumerate(factories):
        r = guarded(i, make, None)
        if r is not None:
            runners[i] = r
    for _ in range(warmup):
        for i, r in list(runners.items()):
            guarded(i, lambda: r.step(x), r)
    for k in range(steps):
        order = list(runners.items())
        for i, r in order if k % 2 == 0 else order[::-1]:  # each goes first every other step
            if i in runners:
                guarded(i, lambda: r.timed(x, dev), r)
    for i, r in list(runners.items()):
        rows[i] = guarded(i, lambda: _row(r, x, dev, tokens, flops, peak_value), r) or rows[i]
    return [row for row in rows if row is not None]


def run_bench(
    cfg: Config,
    steps: int = 10,
    warmup: int = 2,
    compare_hf: bool = False,
    device: Optional[str] = None,
    gpu: Optional[str] = None,
    peak: Optional[float] = None,
    sequential: bool = False,
) -> dict:
    """Time ``steps`` training steps per model after ``warmup``; returns a dict.

    Steps of the two models alternate (same machine state for both); ``sequential`` instead builds,
    times and frees one model after the other (only one model's states in memory at a time: large
    models on one GPU)."""
    cfg = resolve_vocab(cfg)
    want = device or cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("bench --device cuda: no CUDA device is available")
    dev = torch.device(want)
    check_fp8_device(cfg.train, dev)  # before anything is built
    if gpu is None and dev.type == "cuda" and peak is None:
        name = torch.cuda.get_device_name(dev)
        try:
            gpu = find_accelerator(name).name
        except UserError:
            gpu = None  # not in the table: no MFU unless --peak-tflops (never a default)
    peak_value = peak_tflops(gpu, cfg.train.precision, peak)
    B, s = cfg.train.micro_batch_size or cfg.train.global_batch_size, cfg.seq_len  # one process
    gen = torch.Generator().manual_seed(cfg.train.seed)
    x = torch.randint(0, cfg.model.vocab_size, (B, s), generator=gen).to(dev)
    flops = step_flops(
        cfg.model, s, B, recompute=cfg.train.recompute, recompute_every=cfg.train.recompute_every
    ).model
    host_malloc = configure_host_allocator(cfg.train.cpu_malloc, dev)  # process-wide: both models
    factories = _runner_factories(cfg, dev, compare_hf)
    results = []
    if sequential:
        for make in factories:
            results.append(_run_one(make, x, dev, warmup, steps, B * s, flops, peak_value))
    else:
        results = _run_alternating(factories, x, dev, warmup, steps, B * s, flops, peak_value)
    out = {
        "config": cfg.name,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "precision": cfg.train.precision,
        "batch": [B, s],
        "steps": steps,
        "warmup": warmup,
        "model_flops_per_step": flops,
        "peak_tflops": peak_value,
        "results": results,
        "sequential": sequential,
        "host_malloc": host_malloc,
    }
    out["kernels"] = _kernel_plan(cfg, dev)
    if dev.type == "cpu":
        out["native_kernels"] = native.status()
    if compare_hf and all("tokens_per_s" in r for r in results):
        out["ratio"] = results[0]["tokens_per_s"] / results[1]["tokens_per_s"]
        if not sequential:
            # median of the per-pair ratios (step i of each, run back to back): robust to drift
            pairs = [h / m for m, h in zip(results[0]["step_times_s"], results[1]["step_times_s"])]
            out["ratio_paired"] = statistics.median(pairs)
            if (
                len(pairs) >= 4
            ):  # the spread of the pair ratios: how far one run's figure can be trusted
                q1, _, q3 = statistics.quantiles(pairs, n=4)
                out["ratio_paired_quartiles"] = [q1, q3]
    return out


def format_bench(r: dict) -> str:
    B, s = r["batch"]
    lines = [
        f"bench {r['config']}: {r['device']} ({r['threads']} threads), {r['precision']}, batch "
        f"{B} x {s} tokens, {r['warmup']} warm-up + {r['steps']} timed steps per model "
        f"({'one model after the other' if r.get('sequential') else 'alternating'}), "
        f"median step time",
        f"{'model':34s} {'params':>12s} {'ms/step':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s} "
        f"{'MFU':>6s} {'peak mem':>9s} {'faults':>8s}",
    ]
    for x in r["results"]:
        if "error" in x:
            lines.append(f"{x['name']:34s} {x['error']}")
            continue
        mfu = f"{100 * x['mfu']:.1f}%" if "mfu" in x else "-"
        lines.append(
            f"{x['name']:34s} {x['parameters']:>12,} {1000 * x['step_time_s']:>9.1f} "
            f"{x['tokens_per_s']:>10,.0f} {x['tflops_per_device']:>8.4f} {mfu:>6s} "
            f"{x['peak_mem_gb']:>7.3f}GB {x['page_faults_per_step']:>8,.0f}"
        )
    if "ratio_paired" in r:
        lines.append(
            f"megaformer / transformers tokens/s: {r['ratio']:.2f}x (median of back-to-back "
            f"pairs: {r['ratio_paired']:.2f}x"
            + (
                ", quartiles {:.2f}-{:.2f}x".format(*r["ratio_paired_quartiles"])
                if "ratio_paired_quartiles" in r
                else ""
            )
            + ")"
        )
    elif "ratio" in r:
        lines.append(
            f"megaformer / transformers tokens/s: {r['ratio']:.2f}x (one model after the other)"
        )
    if r["device"] == "cpu":
        lines.append(
            f"host allocator: {r.get('host_malloc', 'default')} (train.cpu_malloc; process-wide, "
            f"the same for both models); faults = minor page faults per step (median)"
        )
        if "native_kernels" in r:
            lines.append(r["native_kernels"])
    if "kernels" in r:
        lines.append(
            "megaformer side: " + ", ".join(f"{op} {impl}" for op, impl, _ in r["kernels"])
        )
    if r["peak_tflops"] is None:
        lines.append("MFU: no peak for this device (give --gpu NAME or --peak-tflops)")
    return "\n".join(lines)
