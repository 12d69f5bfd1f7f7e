"""The diagnostics pass inside training: every ``log.diagnostics_interval`` steps, on a fixed
held-out micro-batch (the first validation micro-batch, the same on every rank).

Layouts:

* tensor parallelism: every TP rank runs the pass on its shards; per-head numbers are gathered over
  the TP group (:mod:`megaformer.diagnostics.metrics`);
* pipeline parallelism: the pass runs stage by stage. Stage s runs its own blocks (the live modules
  DeepSpeed's pipeline engine trains) from the stream stage s-1 sends, sends its last stream to
  stage s+1, and sends the stream after each of its blocks to the last stage, which holds the
  final norm and the output layer and computes every layer's logit-lens loss. The stages'
  numbers are then gathered over the pipeline group;
* data parallelism: every replica computes the same numbers (same weights, same batch); rank 0
  logs them. Context parallelism likewise: every context rank runs the whole sequences.

ZeRO-3 partitions the parameters between steps, so the pass has no whole weights to run with;
the config refuses diagnostics with ``parallel.zero_stage=3``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megaformer.comm import all_gather_objects
from megaformer.diagnostics.metrics import layer_metrics, layer_name, residual_diagnostics, rms
from megaformer.diagnostics.residual import eval_mode, logit_lens_logits
from megaformer.parallel.context import context_disabled


class DiagnosticsHook:
    """``hook.due(step)`` -> bool; ``hook()`` -> the metrics (collective over all ranks)."""

    def __init__(
        self,
        model: nn.Module,
        batch: tuple[torch.Tensor, torch.Tensor],
        interval: int,
        topo: Any,
        pipeline_module: Optional[nn.Module] = None,
        demotion: Any = None,
    ) -> None:
        self.model, self.interval, self.topo = model, interval, topo
        self.demotion = demotion  # per-layer FP8 demotion (megaformer.diagnostics.fp8_demotion)
        # (under PP the plain model's other stages hold no values: the device of a local one)
        device = next((pipeline_module or model).parameters()).device
        self.ids, self.labels = (t.to(device) for t in batch)
        self.owned: Optional[list[int]] = None
        if pipeline_module is not None:
            live = {id(m) for m in pipeline_module.modules()}
            self.owned = [i for i, block in enumerate(model.layers) if id(block) in live]
            self.firsts = all_gather_objects(
                self.owned[0], topo.groups.pp
            )  # every stage's first block

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def __call__(self, step: int = 0) -> dict[str, float]:
        t0 = time.perf_counter()
        tp = self.topo.groups.tp
        # under context parallelism every context rank runs the whole batch (exact, no exchange)
        with context_disabled(self.model):
            if self.owned is None:
                out = residual_diagnostics(self.model, self.ids, self.labels, tp)
            else:
                out = self._pipeline_pass(tp)
            if self.demotion is not None:
                out.update(self.demotion(self.model, self.ids, tp, step))
        out["diag_time_s"] = time.perf_counter() - t0
        return out

    def on_batch(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """The same pass on another micro-batch (every rank of the TP and PP groups calls, each
        with its own), without the FP8 demotion check."""
        kept = self.ids, self.labels, self.demotion
        self.ids, self.labels, self.demotion = (
            ids.to(kept[0].device),
            labels.to(kept[0].device),
            None,
        )
        try:
            return self()
        finally:
            self.ids, self.labels, self.demotion = kept

    # ------------------------------------------------------------------ pipeline

    def _peer(self, stage: int) -> int:
        """Global rank of this rank's counterpart (same TP, CP and DP coordinates) on ``stage``."""
        return self.topo.rank_of(
            tp=self.topo.tp_rank, cp=self.topo.cp_rank, dp=self.topo.dp_rank, pp=stage
        )

    def _send(self, x: torch.Tensor, stage: int) -> None:
        dist.send(x.float().contiguous(), self._peer(stage))

    def _recv(self, stage: int) -> torch.Tensor:
        B, T = self.ids.shape
        buf = torch.empty(B, T, self.model.cfg.d_model, dtype=torch.float32, device=self.ids.device)
        dist.recv(buf, self._peer(stage))
        return buf

    def _stream_dtype(self) -> torch.dtype:
        return self.model.layers[self.owned[0]].attn.wq.weight.dtype

    def _pipeline_pass(self, tp: Any) -> dict[str, float]:
        model, stage, stages = self.model, self.topo.pp_rank, self.topo.pp
        last = stages - 1
        out: dict[str, float] = {}
        with eval_mode(model):
            if stage == 0:
                x, rope = model.embed(self.ids)
                out["resid/embed/rms"] = float(rms(x))
            elif stage < last:
                x, rope = self._recv(stage - 1).to(self._stream_dtype()), self._rope()
            else:  # every earlier block's stream arrives here; the last one is this stage's input
                lens, x = self._lens_of_earlier_stages()
                out.update(lens)
                x, rope = x.to(self._stream_dtype()), self._rope()
            metrics, streams = layer_metrics(
                model, x, rope, self.owned, self.labels, tp, lens=stage == last
            )
            out.update(metrics)
            if stage < last:
                for s in streams:
                    self._send(s, last)
                if stage + 1 < last:
                    self._send(streams[-1], stage + 1)
        merged: dict[str, float] = {}
        for piece in all_gather_objects(out, self.topo.groups.pp):
            merged.update(piece)
        return dict(sorted(merged.items()))

    def _rope(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        rotary = self.model.rotary
        if rotary is None:
            return None
        return rotary(torch.arange(self.ids.shape[1], device=self.ids.device))

    def _lens_of_earlier_stages(self) -> tuple[dict[str, float], torch.Tensor]:
        """On the last stage: the logit-lens losses of blocks 0..first-1 (run by the earlier
        stages, received in order), and the stream after the last of them."""
        n_layers = self.model.cfg.n_layers
        out, resid = {}, None
        for index in range(self.owned[0]):
            resid = self._recv(self._stage_of(index))
            loss = self.model.loss_fn(
                logit_lens_logits(self.model, resid.to(self._stream_dtype())), self.labels
            )
            out[f"logit_lens/{layer_name(index, n_layers)}/loss"] = float(loss)
        return out, resid

    def _stage_of(self, index: int) -> int:
        return max(s for s, first in enumerate(self.firsts) if first <= index)
