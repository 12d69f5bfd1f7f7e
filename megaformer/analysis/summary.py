"""``megaformer flops``: parameter counts, FLOPs per token and per step, and what a step time means.

    tokens/step      = global_batch_size * seq_len
    TFLOPs/GPU       = model FLOPs per step / step time / GPUs / 1e12
    MFU (HFU)        = model (hardware) TFLOPs/GPU / peak of the GPU for the training dtype

See :mod:`megaformer.analysis.flops` for what is counted.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megaformer.accelerators import find_accelerator, peak_tflops
from megaformer.analysis.flops import config_step_flops, matmul_parameters, utilisation
from megaformer.analysis.params import count_parameters
from megaformer.config import Config
from megaformer.errors import UserError


def resolve_vocab(cfg: Config) -> Config:
    """``cfg`` with model.vocab_size filled from data.tokenizer when it is null (no data read:
    byte = 257, bpe:N = N, a tokenizer.json is opened)."""
    if cfg.model.vocab_size is not None:
        return cfg
    spec = cfg.data.tokenizer
    if spec == "byte":
        from megaformer.data.tokenizer import ByteTokenizer

        vocab = ByteTokenizer.vocab_size
    elif spec.startswith("bpe:") and spec[4:].isdigit():
        vocab = int(spec[4:])
    else:
        from megaformer.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(spec).vocab_size
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def flops_summary(
    cfg: Config,
    gpu: Optional[str] = None,
    gpus: int = 1,
    step_time_s: Optional[float] = None,
    peak: Optional[float] = None,
    dtype: Optional[str] = None,
    causal: bool = True,
) -> dict:
    """Everything ``megaformer flops`` prints, as one JSON-able dict."""
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: must be >= 1")
    if step_time_s is not None and step_time_s <= 0:
        raise UserError(f"--step-time {step_time_s}: must be > 0")
    cfg = resolve_vocab(cfg)
    fp8 = cfg.train.fp8 != "off"
    dtype = dtype or ("bf16" if fp8 else cfg.train.precision)  # MFU vs bf16 under fp8
    peak_value = peak_tflops(gpu, dtype, peak)
    counts = count_parameters(cfg.model)
    flops = config_step_flops(cfg, causal=causal)
    out: dict = {
        "config": cfg.name,
        "parameters": dict(counts, matmul=matmul_parameters(cfg.model)),
        "tokens_per_step": flops.tokens,
        "conventions": {
            "causal": causal,
            "model_vocab": cfg.model.vocab_size,
            "hardware_vocab": None,
            "recompute": cfg.train.recompute,
            "recompute_every": cfg.train.recompute_every,
        },
        "per_token": {
            "model": flops.model_per_token,
            "hardware": flops.hardware_per_token,
            "six_n": 6 * counts["non_embedding"],
        },
        "step": flops.as_dict(),
        "gpu": None,
    }
    from megaformer.parallel.plan import padded_vocab_size

    out["conventions"]["hardware_vocab"] = padded_vocab_size(
        cfg.model.vocab_size, cfg.parallel.tensor, cfg.parallel.vocab_multiple
    )
    if gpu is not None or peak is not None:
        name = find_accelerator(gpu).name if gpu is not None and peak is None else (gpu or "custom")
        out["gpu"] = {"name": name, "dtype": dtype, "peak_tflops": peak_value, "count": gpus}
    if fp8:
        out["fp8"] = _fp8_summary(
            cfg, flops.model, gpu if peak is None else None, peak_value, gpus, causal
        )
    if step_time_s is not None:
        m = utilisation(flops, step_time_s, gpus, peak_value)
        m["step_time_s"] = step_time_s
        out["measured"] = m
    if peak_value is not None:
        # the step time at which MFU would be 100% / 50%: a sanity bound for measurements
        ideal = flops.model / (gpus * peak_value * 1e12)
        out["ideal_step_time_s"] = {"mfu_100": ideal, "mfu_50": 2 * ideal}
    return out


def _fp8_summary(
    cfg: Config,
    model_flops: int,
    gpu: Optional[str],
    peak: Optional[float],
    gpus: int,
    causal: bool,
) -> dict:
    """train.fp8: the FP8 share of the model FLOPs and, with a table GPU, its FP8 peak, the
    mixed peak (:func:`megaformer.analysis.flops.mixed_peak`) and the step time at 100% of it."""
    from megaformer.analysis.flops import fp8_share, mixed_peak

    share = fp8_share(cfg.model, cfg.seq_len, causal)
    out: dict = {
        "recipe": cfg.train.fp8,
        "share": share,
        "fp8_flops": share * model_flops,
        "fp8_peak_tflops": None,
        "mixed_peak_tflops": None,
    }
    fp8_peak = find_accelerator(gpu).peaks.get("fp8") if gpu is not None else None
    if fp8_peak and peak:
        mixed = mixed_peak(share, fp8_peak, peak)
        out.update(
            fp8_peak_tflops=fp8_peak,
            mixed_peak_tflops=mixed,
            ideal_step_time_s=model_flops / (gpus * mixed * 1e12),
        )
    return out


def _si(x: float) -> str:
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{x:.3f} "


def format_flops_summary(d: dict) -> str:
    p, s, c = d["parameters"], d["step"], d["conventions"]
    lines = [
        f"{d['config']}: {p['total']:,} parameters ({p['non_embedding']:,} non-embedding, "
        f"{p['embedding']:,} embedding; {p['matmul']:,} in matrix products)",
        f"tokens per step: {d['tokens_per_step']:,} ({s['tokens'] // s['seq_len']:,} sequences x "
        f"{s['seq_len']:,})",
        f"FLOPs per token: model {_si(d['per_token']['model'])}FLOP (6N = "
        f"{_si(d['per_token']['six_n'])}FLOP) | hardware {_si(d['per_token']['hardware'])}FLOP",
        f"FLOPs per step:  model {_si(s['model'])}FLOP (forward {_si(s['forward'])}FLOP, backward "
        f"2x) | hardware {_si(s['hardware'])}FLOP (recompute {_si(s['recompute'])}FLOP)",
        f"conventions: matmuls only, 2 FLOPs per multiply-add; attention "
        f"{'causal s(s+1)/2 pairs' if c['causal'] else 'non-causal s^2 pairs'}; model FLOPs with the "
        f"real vocabulary {c['model_vocab']:,}, hardware with the padded {c['hardware_vocab']:,} and "
        f"recompute={c['recompute']}",
    ]
    g = d.get("gpu")
    if g:
        lines.append(
            f"gpu: {g['count']} x {g['name']}, peak {g['peak_tflops']:g} TFLOP/s ({g['dtype']}, "
            "dense)"
        )
        ideal = d["ideal_step_time_s"]
        lines.append(
            f"step time at 100% MFU: {ideal['mfu_100']:.4g} s; at 50%: {ideal['mfu_50']:.4g} s"
        )
    f8 = d.get("fp8")
    if f8:
        line = (
            f"fp8 ({f8['recipe']}): {100 * f8['share']:.1f}% of the model FLOPs in FP8 GEMMs "
            "(block linears); MFU is against the bf16 peak"
        )
        if f8["mixed_peak_tflops"]:
            line += (
                f"; FP8 peak {f8['fp8_peak_tflops']:g}, mixed peak "
                f"{f8['mixed_peak_tflops']:.4g} TFLOP/s (step time at 100% of it: "
                f"{f8['ideal_step_time_s']:.4g} s)"
            )
        lines.append(line)
    m = d.get("measured")
    if m:
        line = (
            f"measured step {m['step_time_s']:g} s: {m['tokens_per_s']:,.0f} tokens/s | "
            f"{m['tflops_per_gpu']:.2f} TFLOP/s per GPU (hardware {m['hw_tflops_per_gpu']:.2f})"
        )
        if "mfu" in m:
            line += (
                f" | MFU{' vs bf16 peak' if f8 else ''} {100 * m['mfu']:.1f}% | "
                f"HFU {100 * m['hfu']:.1f}%"
            )
            if m["hfu"] > 1:
                line += " (above the peak: check --gpus, --step-time and the dtype)"
        else:
            line += " | MFU: give --gpu or --peak-tflops"
        lines.append(line)
    return "\n".join(lines)
