"""``eval.tasks`` during training: lm-evaluation-harness on the live model, every
``eval.tasks_interval`` steps and after the last step (with ``eval.at_end``).

The model is the engine's own (no copy, no gather): under PP = 1 the engine's forward gives the
logits (the tensor-parallel head gathers them; ZeRO-3 gathers each layer's weights as in
training), under PP > 1 the stages run in order, under any schedule, passing activations point to point
(:class:`~megaformer.evaluation.forward.PipelineRunner`). The requests are split over the
data-parallel ranks; under context parallelism the model runs whole sequences on every rank
(the context group switched off, as the diagnostics do: exact, and without gradients nothing is
saved for backward) and the requests are split over the data x context ranks. The model is in eval mode for the pass (no dropout), and every random
stream (torch, CUDA, NumPy, Python) is restored afterwards, so evaluating does not change the
training that follows.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torch

from megaformer.config import Config
from megaformer.evaluation import tasks as task_lib
from megaformer.evaluation.forward import PipelineRunner, PlainRunner
from megaformer.evaluation.harness import make_lm
from megaformer.parallel.context import context_disabled
from megaformer.parallel.stage_walk import StageWalk


class TaskEvaluator:
    """Built at setup (an unknown task or a missing lm-eval fails before training starts)."""

    def __init__(self, cfg: Config) -> None:
        e = cfg.eval
        self.tasks = task_lib.parse_tasks(e.tasks or [])
        self.limit, self.interval = e.tasks_limit, e.tasks_interval
        self.last, self.at_end = cfg.train.steps, e.at_end
        self.manager = task_lib.task_manager(self.tasks, e.tasks_include_path)
        p = self.parallel = cfg.parallel
        self.seq_multiple = p.tensor if p.sequence_parallel and p.tensor > 1 else 1
        # ranks of the replica (data x context) group that must run their forwards together
        self.lockstep = p.zero_stage == 3 or p.expert > 1
        self.batch_size = cfg.train.micro_batch_size

    @classmethod
    def from_config(cls, cfg: Config) -> Optional["TaskEvaluator"]:
        return cls(cfg) if cfg.eval.tasks else None

    def due(self, step: int, stopping: bool) -> bool:
        return not stopping and bool(
            (self.interval and step % self.interval == 0) or (self.at_end and step == self.last)
        )

    @torch.no_grad()
    def run(
        self, engine: Any, plain: Any, topo: Any, tokenizer: Any, device: torch.device
    ) -> tuple[dict[str, float], str]:
        """({'eval/TASK/METRIC': value}, the table) on every rank (collective)."""
        module = engine.module
        if topo.pp > 1:
            runner: Any = PipelineRunner(
                module,
                plain,
                topo,
                device,
                self.seq_multiple,
                StageWalk.of_layout(self.parallel, topo),
            )
        else:
            runner = PlainRunner(
                module, forward=engine, seq_multiple=self.seq_multiple, device=device
            )
        lm = make_lm(
            runner,
            tokenizer,
            batch_size=self.batch_size,
            dp_group=topo.groups.replica,  # DP x CP: the context ranks take requests of their own
            lockstep=self.lockstep,
        )
        states = _rng_states()
        was_training = module.training
        module.eval()
        try:
            with context_disabled(module):
                results = task_lib.run_tasks(lm, self.tasks, self.manager, limit=self.limit)
        finally:
            module.train(was_training)
            _restore_rng(states)
        return task_lib.flat_scores(results), task_lib.format_table(results)


def _rng_states() -> dict:
    import numpy as np

    out = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _restore_rng(states: dict) -> None:
    import numpy as np

    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
