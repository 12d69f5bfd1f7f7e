"""``megaformer replay``: a clean window of a run is replayed bit for bit from the checkpoint before
it and nothing is reported; a weight blow-up injected into block 2 at step 7 is attributed to step
7 and block 2; one micro-batch scaled out of range at step 7 is attributed to that micro-batch."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli, subprocess_env, tiny_overrides

BASE = {
    "train.steps": 9,
    "checkpoint.interval": 4,
    "checkpoint.save_at_end": "false",
    "model.n_layers": 4,
}


def train_then_replay(run, steps: str, fault: str = ""):
    env = subprocess_env(MEGAFORMER_FAULT=fault) if fault else None
    args = ["train", "configs/quickstart.yaml", *tiny_overrides(**BASE), "--run-dir", str(run)]
    trained = run_cli(*args, env=env)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    replayed = run_cli("replay", str(run), "--steps", steps, env=env)
    out = replayed.stdout + replayed.stderr
    assert replayed.returncode == 0, out[-3000:]
    lines = [
        line
        for line in replayed.stdout.splitlines()
        if line.startswith(("replay of", "losses:", "bands:", "micro-batches:"))
    ]
    print("\n".join(lines))
    return lines


@pytest.mark.slow
def test_a_clean_window_replays_bit_for_bit_and_reports_nothing(tmp_path):
    run = tmp_path / "run"
    lines = train_then_replay(run, "6..8")
    assert lines[0].startswith(f"replay of steps 6-8 of {run} from checkpoint step 4")
    assert lines[1].startswith("losses: reproduced bit for bit at all 4 logged steps"), lines
    assert lines[2].startswith("bands: no layer's"), lines
    assert lines[3].startswith("micro-batches: none left its band"), lines
    records = [
        json.loads(x) for x in (run / "replay_6-8" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert all(
        f"update_per_lr/layer_0{i}" in r and f"grad_norm/layer_0{i}" in r
        for r in records
        for i in range(4)
    )
    assert all("resid/layer_03/rms" in r for r in records)
    assert not (run / "replay_6-8" / "checkpoints" / "step_0000008").exists()  # saves nothing


@pytest.mark.slow
def test_a_weight_blow_up_in_block_2_is_attributed_to_its_step_and_block(tmp_path):
    run = tmp_path / "run"
    lines = train_then_replay(run, "6..9", fault="blowup@step=7,layer=2,factor=10")
    assert lines[1].startswith("losses: reproduced bit for bit"), lines
    assert lines[2].startswith("bands: first left at step 7, layer_02 (blocks.2)"), lines
    assert lines[3].startswith("micro-batches: first left at step 7, micro-batch "), lines
    assert "(2 of the step's 2 micro-batches out: suspect the weights" in lines[3], lines


@pytest.mark.slow
def test_one_micro_batch_out_of_range_is_attributed_to_its_step_and_micro_batch(tmp_path):
    # train.global_batch_size 8 = 2 micro-batches of 4 on one rank; micro-batch 1 of step 7 has
    # its token embeddings times 20 (the step's held-out diagnostics batch does not see it)
    run = tmp_path / "run"
    lines = train_then_replay(run, "6..9", fault="scale@step=7,micro=1,factor=20")
    assert lines[1].startswith("losses: reproduced bit for bit"), lines
    assert lines[3].startswith("micro-batches: first left at step 7, micro-batch 1, layer_"), lines
    assert "residual RMS" in lines[3], lines
    assert "(1 of the step's 2 micro-batches out: suspect that micro-batch's data)" in lines[3]
    report = json.loads((run / "replay_6-9" / "replay.json").read_text())
    assert (report["micro"]["step"], report["micro"]["micro"]) == (7, 1)
    clean, scaled = report["micro_figures"]  # step 7's two micro-batches, as the diagnostics saw
    assert scaled["resid/layer_00/rms"] > 4 * clean["resid/layer_00/rms"]
    # each micro-batch's loss is its training loss: their mean is the step's logged loss
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step7 = next(r["loss"] for r in logged if r.get("step") == 7 and "loss" in r)
    assert (clean["loss"] + scaled["loss"]) / 2 == pytest.approx(step7, rel=1e-5)


def _train_and_replay_dp2(rank: int, world: int, run, overrides: list[str]) -> list[str]:
    from pathlib import Path

    from megaformer.config import load_config
    from megaformer.training.replay import replay
    from megaformer.training.trainer import train

    train(load_config(Path("configs/quickstart.yaml"), overrides), run)
    return replay(run, 6, 9).lines()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_rank_replay_names_the_micro_batch_and_its_data_parallel_rank(tmp_path, monkeypatch):
    # DP2, 2 micro-batches of 2 per rank: rank 1's micro-batch 1 of step 7 is scaled; rank 1 waits
    # for rank 0 to prepare the replay's folder
    from tests.dist_harness import run_ranks

    monkeypatch.setenv("MEGAFORMER_FAULT", "scale@step=7,micro=1,rank=1,factor=20")
    overrides = tiny_overrides(**BASE, **{"train.micro_batch_size": 2})
    run = tmp_path / "run"
    r0, r1 = run_ranks(2, _train_and_replay_dp2, run, overrides, timeout=300)
    print("\n".join(r0))
    assert r0 == r1  # every rank judges the same
    assert r0[1].startswith("losses: reproduced bit for bit"), r0
    assert r0[3].startswith(
        "micro-batches: first left at step 7, micro-batch 1 of data-parallel rank 1, layer_"
    ), r0
    assert "(1 of the step's 4 micro-batches out: suspect that micro-batch's data)" in r0[3], r0
