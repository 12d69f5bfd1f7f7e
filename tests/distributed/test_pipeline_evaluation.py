"""Evaluation and the residual-stream diagnostics on a pipeline of any schedule: the stages run
one after the other (megaformer.parallel.stage_walk), each on the rank that holds it, so the
interleaved schedule (rank r holds stages r and r+p) and DualPipeV (r and 2p-1-r) give one
process's scores and diagnostics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.test_pipeline import (  # noqa: F401  (fixtures used below)
    _init_gloo,
    _train,
    feature_references,
    short_docs,
)
from tests.helpers import run_ranks, run_torchrun, tiny_overrides

SCHEDULES = ["interleaved", "dualpipev"]  # each cuts 4 blocks into 4 stages at PP = 2


def _scores_and_tokens(rank: int, world: int, ckpt: Path, schedule: str) -> tuple:
    from megaformer.evaluation.checkpoint import load_runner
    from megaformer.parallel.topology import build_topology

    _init_gloo()
    cpu = torch.device("cpu")
    topo = build_topology(world, rank, pp=world)
    runner, tok, cfg = load_runner(ckpt, topo, cpu, schedule=schedule)
    one, _, _ = load_runner(ckpt, None, cpu)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    ids[:, [5, 13]] = tok.eod_id  # three documents per row
    targets = torch.randint(0, 256, (2, 24), generator=g)
    prefix = ids[0, :7].tolist()
    held = sorted(s for s, r in enumerate(runner.walk.holders) if r == topo.pp_rank)
    return (
        runner.scores(ids, targets),
        one.scores(ids, targets),
        (runner.greedy(prefix, 4), one.greedy(prefix, 4)),
        (cfg.parallel.pipeline_schedule, held),
    )


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipelined_evaluation_under_each_schedule_equals_one_process(
    feature_references,  # noqa: F811  (the fixture imported above)
    schedule,
):
    """megaformer eval's runner on a checkpoint with tied embeddings, document masks and the
    chunked loss, its 4 blocks cut into 4 stages on 2 ranks: the scores and the greedy tokens
    equal one process's."""
    ckpt = feature_references("documents-chunked-loss") / "checkpoints" / "step_0000003"
    results = run_ranks(2, _scores_and_tokens, ckpt, schedule, timeout=300)
    held = {"interleaved": ([0, 2], [1, 3]), "dualpipev": ([0, 3], [1, 2])}[schedule]
    for rank, ((logp, greedy), (ref_logp, ref_greedy), (tokens, ref_tokens), layout) in enumerate(
        results
    ):
        assert layout == (schedule, list(held[rank]))
        assert torch.allclose(logp, ref_logp, rtol=1e-5, atol=1e-6)
        assert torch.equal(greedy, ref_greedy)
        assert tokens == ref_tokens and len(tokens) == 4


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory) -> Path:
    """One process, 4 blocks with 2 multi-token prediction modules (tied embeddings)."""
    from tests.distributed.test_pipeline import ARGS

    run = tmp_path_factory.mktemp("mtp") / "run"
    _train(1, run, {**ARGS, "model.mtp_depth": 2})
    return run / "checkpoints" / "step_0000003"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pipelined_evaluation_of_multi_token_prediction_equals_one_process(
    mtp_checkpoint, schedule
):
    """The stages pass the ids along for the prediction modules, and the last stage hands the
    head's output on with them; the runner scores the head's output (1F1B: 2 stages,
    interleaved: 4)."""
    for (logp, greedy), (ref_logp, ref_greedy), (tokens, ref_tokens), _ in run_ranks(
        2, _scores_and_tokens, mtp_checkpoint, schedule, timeout=300
    ):
        assert torch.allclose(logp, ref_logp, rtol=1e-5, atol=1e-6)
        assert torch.equal(greedy, ref_greedy) and tokens == ref_tokens


DIAG = {"model.n_layers": 4, "model.vocab_size": 96, "model.dropout": 0.1}


def _diagnostics(rank: int, world: int, schedule: str) -> tuple[dict, dict, list]:
    """(the pipeline's diagnostics under ``schedule`` at PP = world, one process's, the bytes of
    each send of this rank)."""
    from megaformer.config import load_config
    from megaformer.diagnostics.metrics import residual_diagnostics
    from megaformer.diagnostics.training import DiagnosticsHook
    from megaformer.parallel.build import build_model
    from megaformer.parallel.stage_walk import StageWalk
    from megaformer.parallel.topology import build_topology

    _init_gloo()
    cpu = torch.device("cpu")
    over = {**DIAG, "parallel.pipeline": world, "parallel.pipeline_schedule": schedule}
    cfg = load_config("configs/quickstart.yaml", tiny_overrides(**over))
    topo = build_topology(world, rank, pp=world)
    built = build_model(cfg, topo, device=cpu, training=True)
    one_cfg = load_config("configs/quickstart.yaml", tiny_overrides(**DIAG))
    one = build_model(one_cfg, None, device=cpu, training=True).plain
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g) for _ in range(2))
    hook = DiagnosticsHook(
        built.plain,
        (ids, labels),
        1,
        topo,
        built.model,
        walk=StageWalk.of_layout(cfg.parallel, topo),
    )
    sent = []  # the streams this rank sends (each [B, T, d] fp32)
    send = torch.distributed.send
    torch.distributed.send = lambda t, *a, **k: (sent.append(t.numel() * 4), send(t, *a, **k))[1]
    try:
        got = hook()
    finally:
        torch.distributed.send = send
    return got, residual_diagnostics(one, ids, labels, topo.groups.tp), sent  # a TP group of one


# streams sent per pipeline rank: each stage's blocks' streams to the head's rank for the logit
# lens, and a stage's last stream to the next stage's rank unless that is the same rank or the
# head's (which has it already)
DIAG_SENDS = {"1f1b": [2, 0], "interleaved": [2, 1], "dualpipev": [1, 2]}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", *SCHEDULES])
def test_diagnostics_under_each_schedule_equal_one_process(schedule):
    """The residual-stream pass over 4 blocks on 2 pipeline ranks (1F1B: 2 stages; interleaved
    and DualPipeV: 4, DualPipeV's turn-around on rank 1 and its logit lens on rank 0): every
    number of one process's, on every rank (1e-5), for the sends counted."""
    results = run_ranks(2, _diagnostics, schedule, timeout=300)
    for got, ref, _ in results:
        assert got.pop("diag_time_s") > 0
        assert got.keys() == ref.keys() and len(ref) == 1 + 4 * (5 + 2 * 4)
        bad = {k: (got[k], v) for k, v in ref.items() if abs(got[k] - v) > 1e-5 * max(1, abs(v))}
        assert not bad, bad
    stream = 2 * 32 * 32 * 4  # B x T x d fp32
    assert [sent for _, _, sent in results] == [[stream] * n for n in DIAG_SENDS[schedule]]


# ---------------------------------------------------------------------------- through training

TRAIN = {
    "model.n_layers": 4,
    "train.steps": 4,
    "train.micro_batch_size": 2,  # 4 micro-batches per step: DualPipeV needs 2 * PP
    "eval.interval": 0,
    "log.diagnostics": "true",
    "log.diagnostics_interval": 2,
    "eval.tasks_interval": 2,
    "eval.tasks_limit": 3,
}


def _task_args() -> dict:
    from tests.distributed.test_eval_harness import MC, PPL, TASKS_DIR

    return {"eval.tasks": f"[{MC},{PPL}]", "eval.tasks_include_path": str(TASKS_DIR)}


def _offline(mp: pytest.MonkeyPatch) -> None:
    from tests.distributed.test_eval_harness import OFFLINE

    for k, v in OFFLINE.items():
        mp.setenv(k, v)


def _records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> Path:
    pytest.importorskip("lm_eval")
    run = tmp_path_factory.mktemp("one") / "run"
    with pytest.MonkeyPatch.context() as mp:
        _offline(mp)
        _train(1, run, {**TRAIN, **_task_args()})
    return run


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_training_evaluates_tasks_and_logs_diagnostics_under_each_schedule(
    one_process_run, tmp_path, monkeypatch, schedule
):
    """eval.tasks and log.diagnostics while training on the live engine under the schedule
    (PP = 2, 4 stages): the losses, the task scores and every diagnostic (steps 2 and 4) equal
    the one-process run's, and so do megaformer eval's on the last checkpoint with its stages
    placed by the other schedule."""
    _offline(monkeypatch)
    run = tmp_path / "run"
    layout = {"parallel.pipeline": 2, "parallel.pipeline_schedule": schedule}
    _train(2, run, {**TRAIN, **_task_args(), **layout})
    runs, refs = _records(run), _records(one_process_run)
    assert sorted(runs) == sorted(refs) == [1, 2, 3, 4]
    for step, ref in refs.items():  # evaluating at step 2 changes nothing that follows
        got = runs[step]
        keys = [
            k
            for k in ref
            if k in ("loss", "grad_norm")
            or k.startswith(("eval/", "resid/", "attn", "mlp_write/", "logit_lens/"))
        ]
        tasks = [k for k in keys if k.startswith("eval/")]
        assert len(tasks) == (5 if step % 2 == 0 else 0), tasks  # the two tasks' metrics
        assert len(keys) == 2 + (len(tasks) + 1 + 4 * (5 + 2 * 4) if tasks else 0)
        bad = {
            k: (got.get(k), ref[k]) for k in keys if got.get(k) != pytest.approx(ref[k], rel=1e-5)
        }
        assert not bad, (step, bad)

    # megaformer eval on the checkpoint, its stages placed by the other schedule: the same scores
    other = next(s for s in SCHEDULES if s != schedule)
    tasks_dir = _task_args()["eval.tasks_include_path"]
    proc = run_torchrun(
        2,
        "eval",
        str(run),
        "--tasks",
        _task_args()["eval.tasks"].strip("[]"),
        "--limit",
        "3",
        "--include-path",
        tasks_dir,
        "--pp",
        "2",
        "--schedule",
        other,
        "--device",
        "cpu",
        "--output",
        str(tmp_path / "eval.json"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    scores = json.loads((tmp_path / "eval.json").read_text())["scores"]
    assert sorted(scores) == sorted(tasks)
    for key in tasks:
        assert scores[key] == pytest.approx(runs[4][key], rel=1e-5, abs=1e-9), key
