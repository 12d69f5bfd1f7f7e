"""``megaformer eval`` and ``megaformer generate``: a checkpoint's model at any TP x PP x DP layout.

The model is built as training builds it (:func:`megaformer.parallel.build.build_model`) for the
layout of the launch (tensor x pipeline from the command line, data parallelism from the rest of
the world, experts split over ``--ep`` of the data-parallel ranks): each rank reads only its
tensor-parallel shards of the layers its pipeline stage holds and its own experts, from a sharded
checkpoint's state or sliced out of a weights-only checkpoint's ``model.safetensors``
(:mod:`megaformer.checkpoint.sliced`). No Hugging Face conversion, no DeepSpeed engine.
Evaluation's results go beside the weights, into
``CKPT/eval/<tasks>.json`` (written atomically by rank 0), unless another path is given.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megaformer import __version__
from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import weights as ckpt_weights
from megaformer.config import Config, precision_dtype
from megaformer.config.checks.parallel import stages_per_rank
from megaformer.config.parallel import PIPELINE_SCHEDULES
from megaformer.errors import CheckpointError, UserError
from megaformer.evaluation import tasks as task_lib
from megaformer.evaluation.forward import PipelineRunner, PlainRunner
from megaformer.evaluation.harness import make_lm
from megaformer.parallel.build import build_model
from megaformer.parallel.stage_walk import StageWalk
from megaformer.safe_files import check_file

MAX_TOKENIZER_BYTES = 1 << 30


@dataclass
class EvalOutput:
    results: dict  # lm-eval's results dict
    scores: dict  # {'eval/TASK/METRIC': value}
    table: str
    path: Optional[Path]  # the JSON written (rank 0), else None
    seconds: float


def eval_layout(cfg: Config, topo: Any, schedule: str = "1f1b", virtual_stages: int = 2) -> Config:
    """``cfg`` with the launch's layout, the pipeline ``schedule`` asked for (whichever trained
    the checkpoint: the runner walks the stages of any schedule in order) and nothing that only
    training needs (no recomputation, compilation, sequence parallelism or training schedule).
    An explicit split of the blocks does not carry over (the stages may be others)."""
    tp, pp, ep = (topo.tp, topo.pp, topo.ep) if topo is not None else (1, 1, 1)
    if schedule not in PIPELINE_SCHEDULES or (schedule != "1f1b" and pp < 2):
        raise UserError(f"pipeline schedule {schedule!r} at pipeline size {pp}: use 1f1b")
    if schedule == "interleaved" and virtual_stages < 2:
        raise UserError(
            f"{virtual_stages} virtual stages: the interleaved schedule needs 2 or more"
        )
    if schedule == "dualpipev" and cfg.model.mtp_depth > 0:
        raise UserError(
            "the dualpipev schedule with multi-token prediction (model.mtp_depth="
            f"{cfg.model.mtp_depth}): its modules run on the last rank; use 1f1b or interleaved"
        )
    stages = pp * stages_per_rank(schedule, virtual_stages)
    if stages > cfg.model.n_layers:
        raise UserError(
            f"--pp {pp} under the {schedule} schedule: {stages} stages for the checkpoint's "
            f"{cfg.model.n_layers} blocks; use fewer"
        )
    partition = cfg.parallel.pipeline_partition
    parallel = dataclasses.replace(
        cfg.parallel,
        tensor=tp,
        pipeline=pp,
        context=1,
        expert=ep,
        sequence_parallel=False,
        pipeline_schedule=schedule,
        pipeline_virtual_stages=virtual_stages,
        pipeline_partition="layers" if "," in partition else partition,
    )
    train = dataclasses.replace(cfg.train, recompute="none", compile=False)
    return dataclasses.replace(cfg, parallel=parallel, train=train)


def load_runner(
    ckpt: Path,
    topo: Any,
    device: torch.device,
    dtype: str = "fp32",
    schedule: str = "1f1b",
    virtual_stages: int = 2,
) -> tuple[Any, Any, Config]:
    """(runner, tokenizer, config) of checkpoint ``ckpt`` for this rank of ``topo`` (None: one
    process), its pipeline stages cut and held as ``schedule`` holds them."""
    from megaformer.data.tokenizer import load_tokenizer

    cfg = ckpt_layout.read_config(ckpt)
    ckpt_weights.check_weights(ckpt, cfg.model)  # headers only, before anything is built
    tok_file = ckpt / "tokenizer.json"
    if not tok_file.exists():
        raise CheckpointError(
            f"{ckpt}: no tokenizer.json (a model converted without its "
            "tokenizer: convert it again with --tokenizer PATH)"
        )
    check_file(tok_file, MAX_TOKENIZER_BYTES)
    tokenizer = load_tokenizer(tok_file)
    cfg = eval_layout(cfg, topo, schedule, virtual_stages)
    if (ckpt / ckpt_layout.WEIGHTS).exists():  # each rank reads its own shards of the file
        from megaformer.checkpoint.sliced import SlicedWeights

        weights: Any = SlicedWeights.checkpoint(ckpt, cfg.model)
    else:  # each rank reads its own shards
        from megaformer.checkpoint.sharded import ShardedState

        weights = ShardedState(ckpt)
        weights.check_model(ckpt_weights.expected_shapes(cfg.model))
    pipeline = topo is not None and topo.pp > 1
    built = build_model(
        cfg,
        topo,
        device=device,
        weights=weights,
        weights_source=ckpt,
        eod_id=tokenizer.eod_id,
        training=pipeline,
    )
    built.model.to(precision_dtype(dtype)).eval()
    if pipeline:
        walk = StageWalk.of_layout(cfg.parallel, topo)
        return PipelineRunner(built.model, built.plain, topo, device, walk=walk), tokenizer, cfg
    return PlainRunner(built.model, device=device), tokenizer, cfg


def generate_from_checkpoint(
    path: str | Path,
    prompt: str,
    max_new_tokens: int,
    *,
    topo: Any = None,
    device: torch.device = torch.device("cpu"),
    dtype: Optional[str] = None,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    seed: int = 0,
    schedule: str = "1f1b",
    virtual_stages: int = 2,
) -> str:
    """Prompt + continuation by the checkpoint at ``path``, built as :func:`load_runner` builds it
    for this rank of ``topo`` (collective; every rank returns the same text) in ``dtype`` (default:
    the precision it trained in). Under tensor parallelism every rank samples the same token (the
    same gathered logits, the same seed); a pipeline decodes greedily only."""
    from megaformer.generation import continuation_text, generate_text, prompt_ids

    if temperature < 0:
        raise UserError(f"--temperature {temperature}: must be >= 0")
    if max_new_tokens < 0:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be >= 0")
    if topo is not None and topo.pp > 1 and temperature > 0:
        raise UserError(
            f"--temperature {temperature} with --pp {topo.pp}: a pipeline decodes "
            "greedily only (--temperature 0), or use --pp 1"
        )
    ckpt = ckpt_layout.resolve_checkpoint(path)
    dtype = dtype or ckpt_layout.read_config(ckpt).train.precision
    runner, tokenizer, _ = load_runner(ckpt, topo, device, dtype, schedule, virtual_stages)
    if isinstance(runner, PlainRunner):
        return generate_text(
            runner.model,
            tokenizer,
            prompt,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
        )
    eod = tokenizer.eod_id
    new = runner.greedy(
        prompt_ids(tokenizer, prompt), max_new_tokens, stop=lambda tokens: tokens[-1] == eod
    )
    return continuation_text(tokenizer, prompt, new)


def evaluate_checkpoint(
    path: str | Path,
    tasks: list[str],
    manager: Any = None,
    *,
    topo: Any = None,
    device: torch.device = torch.device("cpu"),
    is_main: bool = True,
    limit: Optional[int] = None,
    batch_size: int = 8,
    include_path: Optional[str] = None,
    output: Optional[str | Path] = None,
    dtype: str = "fp32",
    bootstrap_iters: int = 0,
    schedule: str = "1f1b",
    virtual_stages: int = 2,
) -> EvalOutput:
    """Run ``tasks`` on the checkpoint at ``path`` (collective over every rank of ``topo``);
    ``manager``: an lm-eval TaskManager that knows them (default: one built here)."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: must be >= 1")
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be >= 1")
    ckpt = ckpt_layout.resolve_checkpoint(path)
    out_path = Path(output) if output else ckpt / "eval" / task_lib.results_name(tasks)
    manager = manager or task_lib.task_manager(tasks, include_path)
    runner, tokenizer, cfg = load_runner(ckpt, topo, device, dtype, schedule, virtual_stages)
    dp_group = topo.groups.dp if topo is not None else None
    # expert parallelism: the ranks of an expert group exchange tokens in every forward, so the
    # data-parallel ranks run their forwards together
    lm = make_lm(
        runner,
        tokenizer,
        batch_size=batch_size,
        dp_group=dp_group,
        lockstep=topo is not None and topo.ep > 1,
    )
    t0 = time.perf_counter()
    results = task_lib.run_tasks(lm, tasks, manager, limit=limit, bootstrap_iters=bootstrap_iters)
    seconds = time.perf_counter() - t0
    scores = task_lib.flat_scores(results)
    written = None
    if is_main:
        payload = {
            "checkpoint": str(ckpt),
            "step": ckpt_layout.step_of(ckpt),
            "tasks": tasks,
            "limit": limit,
            "scores": scores,
            "megaformer_version": __version__,
            "layout": {
                "tensor": topo.tp if topo else 1,
                "pipeline": topo.pp if topo else 1,
                "data": topo.dp if topo else 1,
                "expert": topo.ep if topo else 1,
            },
            "dtype": dtype,
            "seconds": round(seconds, 3),
            "lm_eval": {
                k: results[k]
                for k in ("results", "versions", "n-shot", "higher_is_better", "n-samples")
                if k in results
            },
        }
        written = task_lib.write_results(out_path, payload)
    return EvalOutput(results, scores, task_lib.format_table(results), written, seconds)
