"""The diagnostics pass inside training: every ``log.diagnostics_interval`` steps, on a fixed
held-out micro-batch (the first validation micro-batch, the same on every rank).

Layouts:

* tensor parallelism: every TP rank runs the pass on its shards; per-head numbers are gathered over
  the TP group (:mod:`megaformer.diagnostics.metrics`);
* pipeline parallelism, under any schedule: the pass runs the stages in order
  (:class:`~megaformer.parallel.stage_walk.StageWalk`). Stage s's holder runs its blocks (the
  live modules DeepSpeed's pipeline engine trains) from the stream stage s-1 ended with, passes
  its last stream to the holder of stage s+1 (no send where one rank holds both), and sends the
  stream after each of its blocks to the rank of the last stage, which holds the final norm and
  the output layer and computes every layer's logit-lens loss. The numbers are then gathered over
  the pipeline group;
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
from megaformer.parallel.pipeline import stage_pieces
from megaformer.parallel.stage_walk import StageWalk


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
        walk: Optional[StageWalk] = None,
    ) -> None:
        self.model, self.interval, self.topo = model, interval, topo
        self.demotion = demotion  # per-layer FP8 demotion (megaformer.diagnostics.fp8_demotion)
        # (under PP the plain model's other stages hold no values: the device of a local one)
        device = next((pipeline_module or model).parameters()).device
        self.ids, self.labels = (t.to(device) for t in batch)
        self.walk: Optional[StageWalk] = None
        if pipeline_module is not None:
            self.walk = walk or StageWalk.of("1f1b", topo.pp, topo.pp_rank)
            self.walk.check_module(pipeline_module)
            parts, n = pipeline_module.parts, model.cfg.n_layers
            # the blocks of each stage (layer i of the pipeline is block i - 1)
            self.blocks = [
                sorted(stage_pieces(parts, s, n, tied=False).blocks)
                for s in range(self.walk.stages)
            ]

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def __call__(self, step: int = 0) -> dict[str, float]:
        t0 = time.perf_counter()
        tp = self.topo.groups.tp
        # under context parallelism every context rank runs the whole batch (exact, no exchange)
        with context_disabled(self.model):
            if self.walk is None:
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

    def _peer(self, pp_rank: int) -> int:
        """Global rank of this rank's counterpart (same TP, CP and DP coordinates) on pipeline
        rank ``pp_rank``."""
        return self.topo.rank_of(
            tp=self.topo.tp_rank, cp=self.topo.cp_rank, dp=self.topo.dp_rank, pp=pp_rank
        )

    def _send(self, x: torch.Tensor, pp_rank: int) -> None:
        dist.send(x.float().contiguous(), self._peer(pp_rank))

    def _recv(self, pp_rank: int) -> torch.Tensor:
        B, T = self.ids.shape
        buf = torch.empty(B, T, self.model.cfg.d_model, dtype=torch.float32, device=self.ids.device)
        dist.recv(buf, self._peer(pp_rank))
        return buf

    def _stream_dtype(self, stage: int) -> torch.dtype:
        return self.model.layers[self.blocks[stage][0]].attn.wq.weight.dtype

    def _pipeline_pass(self, tp: Any) -> dict[str, float]:
        """The stages in order (:meth:`StageWalk.walk`): stage s's holder runs its blocks from the
        stream and passes the last one on; the holder of the output layer (``head``) computes
        every block's logit lens, its own blocks' as they run, the others' from the streams their
        holders send it while the walk is at their stage. A stage before one of the head's own
        sends it nothing more: its last stream is the next stage's input."""
        model, walk = self.model, self.walk
        head = walk.last
        out: dict[str, float] = {}
        rope = self._rope()
        # the last stream of the stage just run, when it went to the head's rank for the lens
        lens_sent: list[bool] = [False]
        lens_kept: list[torch.Tensor] = []

        def run(stage: int, chunk: int, x: Optional[torch.Tensor]) -> torch.Tensor:
            lens_sent[0] = False
            if stage == 0:
                x, _ = model.embed(self.ids)
                out["resid/embed/rms"] = float(rms(x))
            if not self.blocks[stage]:
                return x
            metrics, streams = layer_metrics(
                model,
                x.to(self._stream_dtype(stage)),
                rope,
                self.blocks[stage],
                self.labels,
                tp,
                lens=walk.rank == head,
            )
            out.update(metrics)
            if walk.rank != head:
                for stream in streams:
                    self._send(stream, head)
                lens_sent[0] = True
            return streams[-1]

        def lens_of(stage: int, holder: int) -> None:
            """On the head's rank: the logit lens of stage ``stage``'s blocks, from its holder."""
            lens_kept.clear()
            if walk.rank != head:
                return
            for index in self.blocks[stage]:
                received = self._recv(holder)
                resid = received.to(self._stream_dtype(stage))
                loss = model.loss_fn(logit_lens_logits(model, resid), self.labels)
                out[f"logit_lens/{layer_name(index, model.cfg.n_layers)}/loss"] = float(loss)
                lens_kept[:] = [received]

        def send(x: torch.Tensor, pp_rank: int) -> None:
            if not (pp_rank == head and lens_sent[0]):
                self._send(x, pp_rank)

        def recv(pp_rank: int) -> torch.Tensor:
            return lens_kept.pop() if walk.rank == head and lens_kept else self._recv(pp_rank)

        with eval_mode(model):
            walk.walk(run, None, send, recv, between=lens_of)
        merged: dict[str, float] = {}
        for piece in all_gather_objects(out, self.topo.groups.pp):
            merged.update(piece)
        return dict(sorted(merged.items()))

    def _rope(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        rotary = self.model.rotary
        if rotary is None:
            return None
        return rotary(torch.arange(self.ids.shape[1], device=self.ids.device))
