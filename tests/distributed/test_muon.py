"""Muon under every layout equals one-process Muon (losses, gradient norms and the weights after 3
steps within 1e-5); its sharded checkpoint resumes at another layout with the same momentum."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli, run_torchrun, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ARGS = {
    "train.optimizer": "muon",
    "model.n_layers": 2,
    "train.steps": 3,
    "train.micro_batch_size": 2,
    "train.global_batch_size": 8,
    "train.lr": 1e-3,
    "train.warmup_steps": 0,
    "eval.interval": 3,
    "eval.iters": 1,
}
MOE = {
    "model.moe.interval": 1,
    "model.moe.num_experts": 4,
    "model.moe.top_k": 2,
    "model.moe.d_expert": 32,
    "model.moe.aux_loss_coef": 0.0,
    "model.moe.z_loss_coef": 0.0,
}
LAYOUTS = {  # name: (world, overrides, MoE model)
    "tp2xdp2-zero1": (
        4,
        {"parallel.tensor": 2, "parallel.zero_stage": 1, "parallel.sequence_parallel": "true"},
        False,
    ),
    "pp2": (2, {"parallel.pipeline": 2}, False),
    "ep2-zero1": (2, {"parallel.expert": 2, "parallel.zero_stage": 1}, True),
}


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _train(run: Path, world: int, *extra: str, **over) -> None:
    args = ["train", "configs/quickstart.yaml", *tiny_overrides("stdlib", **{**ARGS, **over})]
    args += [*extra, "--run-dir", str(run)]
    proc = run_cli(*args) if world == 1 else run_torchrun(world, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run of the dense or the MoE model, trained once when first asked for."""
    root, runs = tmp_path_factory.mktemp("muon"), {}

    def get(moe: bool) -> Path:
        if moe not in runs:
            runs[moe] = root / ("moe" if moe else "dense")
            _train(runs[moe], 1, **(MOE if moe else {}))
        return runs[moe]

    return get


def _compare(ref: Path, run: Path) -> None:
    from megaformer.checkpoint.weights import load_weights

    a, b = _records(ref), _records(run)
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
    wa = load_weights(ref / "checkpoints/step_0000003")
    wb = load_weights(run / "checkpoints/step_0000003")
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).norm() / wa[k].norm()) for k in wa)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(reference, tmp_path, layout):
    world, extra, moe = LAYOUTS[layout]
    run = tmp_path / layout
    _train(run, world, **extra, **(MOE if moe else {}))
    _compare(reference(moe), run)
