"""What a run prints: the start-up summary, the progress bar, and one line per logged step."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Optional

from megaformer.analysis.params import count_parameters
from megaformer.config import Config

log = logging.getLogger("megaformer")


class Console:
    """Rank 0's console: lines go through the progress bar when there is one (so it stays at the
    bottom), else to the ``megaformer`` logger. Other ranks print nothing."""

    def __init__(self, is_main: bool, progress_bar: bool, total: int, initial: int) -> None:
        self.is_main = is_main
        self.bar: Optional[Any] = None
        if is_main and progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                mininterval=0.5,
                file=sys.stderr,
            )

    def write(self, text: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            log.info(text)

    def advance(self, loss: float, tokens_per_s: float) -> None:
        """One step more on the bar, with the step's loss and throughput."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")

    def write_record(self, record: dict) -> None:
        """The step's line, when there is no bar (the bar shows loss and throughput already)."""
        if self.bar is None and "loss" in record:
            self.write(format_record(record))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_record(r: dict) -> str:
    """``step N: loss ... | lr ... | grad norm ... | tokens/s | ms/step [| TFLOP/s, MFU, mem]``."""
    return (
        f"step {r['step']}: loss {r['loss']:.4f} | lr {r['lr']:.3e} | grad norm "
        f"{r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tokens/s | "
        f"{r['step_time_s'] * 1000:.0f} ms/step"
        + (f" | {r['tflops_per_gpu']:.3g} TFLOP/s/GPU" if "tflops_per_gpu" in r else "")
        + (
            f" | MFU{' vs bf16 peak' if 'fp8_tflops_per_gpu' in r else ''} "
            f"{100 * r['mfu']:.1f}% HFU {100 * r['hfu']:.1f}%"
            if "mfu" in r
            else ""
        )
        + (f" (FP8 {r['fp8_tflops_per_gpu']:.3g} TFLOP/s/GPU)" if "fp8_tflops_per_gpu" in r else "")
        + (f" | mem {r['peak_mem_gb']:.2f} GB" if "peak_mem_gb" in r else "")
    )


def log_summary(
    cfg: Config,
    proc: Any,
    topo: Any,
    *,
    dp_size: int,
    grad_accum: int,
    padded_vocab: int,
    attention_backend: tuple[str, str],
    kernel_plan: Any,
    meter: Any,
    run_dir: Path,
) -> None:
    """The start-up summary: parameters, layout, precision, kernels, launch, batch, throughput model."""
    counts = count_parameters(cfg.model)
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    name, reason = attention_backend
    sp = (
        " + sequence parallel" if cfg.parallel.sequence_parallel and cfg.parallel.tensor > 1 else ""
    )
    if cfg.parallel.context > 1:
        sp += f" x CP {cfg.parallel.context} ({cfg.parallel.context_mode})"
    log.info(
        "megaformer: %s parameters (%s non-embedding; vocabulary %d padded to %d) | "
        "world %d = DP %d x TP %d%s x PP %d%s | ZeRO %d | %s | %s %s | attention %s (%s)",
        f"{counts['total']:,}",
        f"{counts['non_embedding']:,}",
        cfg.model.vocab_size,
        padded_vocab,
        proc.world_size,
        dp_size,
        tp,
        sp,
        pp,
        _schedule(cfg) if pp > 1 else "",
        cfg.parallel.zero_stage,
        cfg.train.optimizer,
        proc.device.type,
        cfg.train.precision,
        name,
        reason,
    )
    from megaformer.kernels.selection import format_plan

    log.info("kernels:\n%s", format_plan(kernel_plan))
    log.info(
        "launch: %s, rank %d of %d, local rank %d, collective timeout %g min",
        proc.launcher,
        proc.rank,
        proc.world_size,
        proc.local_rank,
        cfg.parallel.collective_timeout_minutes,
    )
    if proc.world_size > 1:
        log.info(topo.summary())
    log.info(
        "batch: %d sequences x %d tokens per step (micro %d x accumulation %d x DP %d) | "
        "%d steps | run dir %s",
        cfg.train.global_batch_size,
        cfg.seq_len,
        cfg.train.micro_batch_size,
        grad_accum,
        dp_size,
        cfg.train.steps,
        run_dir,
    )
    log.info(meter.summary())
    if "active" in counts:  # MoE: FLOPs, TFLOP/s and MFU count the active parameters
        log.info(
            "MoE: %s parameters held, %s active per token: FLOPs, TFLOP/s and MFU count "
            "the active ones (router, top-%d routed and the shared experts)%s",
            f"{counts['total']:,}",
            f"{counts['active']:,}",
            cfg.model.moe.top_k,
            f"; experts split over EP {cfg.parallel.expert}" if cfg.parallel.expert > 1 else "",
        )


def _schedule(cfg: Config) -> str:
    """' (1f1b)', ' (dualpipev)', ' (interleaved, 2 stages per rank)'."""
    p = cfg.parallel
    if p.pipeline_schedule == "interleaved":
        return f" (interleaved, {p.pipeline_virtual_stages} stages per rank)"
    return f" ({p.pipeline_schedule})"
