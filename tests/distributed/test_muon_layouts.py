"""Muon under every layout equals one-process Muon (losses, gradient norms and the weights after 3
steps within 1e-5); its sharded checkpoint resumes at another layout with the same momentum."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import keep_only, run_cli, run_torchrun, tiny_overrides

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
MHA = {"model.n_kv_heads": 4}  # key/value heads TP4 can split
LAYOUTS = {  # name: (world, overrides, the model's overrides)
    "tp2xdp2-zero1": (
        4,
        {"parallel.tensor": 2, "parallel.zero_stage": 1, "parallel.sequence_parallel": "true"},
        {},
    ),
    "tp4": (4, {"parallel.tensor": 4}, MHA),  # each TP rank orthogonalises 1/4 of the matrices
    "pp2": (2, {"parallel.pipeline": 2}, {}),
    "pp2xtp2": (4, {"parallel.pipeline": 2, "parallel.tensor": 2}, {}),
    "ep2-zero1": (2, {"parallel.expert": 2, "parallel.zero_stage": 1}, MOE),
    "ep2xtp2": (4, {"parallel.expert": 2, "parallel.tensor": 2}, MOE),  # experts split by TP
    "cp2xdp2-zero2": (4, {"parallel.context": 2, "parallel.zero_stage": 2}, {}),
    "dp2-zero0": (2, {"parallel.zero_stage": 0}, {}),  # every rank keeps all of Muon's state
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
    """The one-process run of a model (its overrides), trained once when first asked for."""
    root, runs = tmp_path_factory.mktemp("muon"), {}

    def get(model: dict) -> Path:
        key = tuple(sorted(model.items()))
        if key not in runs:
            runs[key] = root / f"model{len(runs)}"
            _train(runs[key], 1, **model)
        return runs[key]

    return get


def _state(run: Path, step: int):
    from megaformer.checkpoint.sharded import ShardedState

    return ShardedState(run / "checkpoints" / f"step_{step:07d}")


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
    x, y = _state(ref, 3), _state(run, 3)  # and the optimizer state each layout saved
    assert x.names() and sorted(x.names()) == sorted(y.names())
    for name in x.names():
        assert x.keys_of(name) == y.keys_of(name)
        for key in x.keys_of(name)[1:]:
            u, v = x.whole(name, key), y.whole(name, key)
            assert float((u - v).norm()) <= 1e-5 * float(u.norm()), (name, key)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(reference, tmp_path, layout):
    world, extra, model = LAYOUTS[layout]
    run = tmp_path / layout
    _train(run, world, **extra, **model)
    _compare(reference(model), run)


# ----------------------------------------------------------------------------- checkpoint

RESUME = {
    "checkpoint.interval": 2,
    "checkpoint.keep_last": "null",
    "eval.interval": 0,
    "train.lr_schedule": "constant",
}
TP2_DP2 = {"parallel.tensor": 2, "parallel.zero_stage": 1}
TP1_DP4 = {"parallel.zero_stage": 1}


@pytest.fixture(scope="module")
def saved_tp2_dp2(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("muon_ckpt") / "tp2xdp2"
    _train(run, 4, **RESUME, **TP2_DP2, **{"train.steps": 4})
    return run


def test_checkpoint_stores_muon_state_under_its_own_names(saved_tp2_dp2, tmp_path):
    state = _state(saved_tp2_dp2, 2)
    assert state.index["optimizer"] == "muon"
    assert state.keys_of("layers.0.attn.wq.weight") == ("master", "momentum")
    assert state.keys_of("tok_embeddings.weight") == ("master", "exp_avg", "exp_avg_sq")
    assert state.keys_of("layers.0.attn_norm.weight") == ("master", "exp_avg", "exp_avg_sq")
    # the momentum saved at TP2 x DP2 is one process's, whole
    one = tmp_path / "one"
    _train(one, 1, **RESUME, **{"train.steps": 2})
    ref = _state(one, 2)
    assert ref.index["optimizer"] == "muon"
    for name in ref.names():
        for key in ref.keys_of(name):
            a, b = state.whole(name, key), ref.whole(name, key)
            assert float((a - b).norm()) <= 1e-5 * float(b.norm()), (name, key)
    m = state.whole("layers.1.mlp.w2.weight", "momentum")
    assert float(m.norm()) > 0


def _resume(saved: Path, run: Path, layout: dict) -> tuple:
    """``saved`` cut back to step 2 and resumed at ``layout`` to step 4: (the saved run's records,
    the resumed run's, their states at step 4)."""
    import shutil

    shutil.copytree(saved, run)
    keep_only(run, 2)
    _train(run, 4, **RESUME, **layout, **{"train.steps": 4})
    return _records(saved), _records(run), _state(saved, 4), _state(run, 4)


def test_resume_at_another_layout_keeps_the_momentum(saved_tp2_dp2, tmp_path):
    a, b, x, y = _resume(saved_tp2_dp2, tmp_path / "tp1xdp4", TP1_DP4)
    for step in (3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
    for name in x.names():
        for key in x.keys_of(name):
            u, v = y.whole(name, key), x.whole(name, key)
            assert float((u - v).norm()) <= 1e-5 * float(v.norm()), (name, key)


def test_resume_at_the_same_layout_is_bitwise(saved_tp2_dp2, tmp_path):
    import torch

    a, b, x, y = _resume(saved_tp2_dp2, tmp_path / "again", TP2_DP2)
    assert [b[s]["loss"] for s in (3, 4)] == [a[s]["loss"] for s in (3, 4)]
    for name in x.names():
        for key in x.keys_of(name):
            assert torch.equal(y.whole(name, key), x.whole(name, key)), (name, key)


def test_another_optimizer_is_refused_unless_reset(saved_tp2_dp2, tmp_path):
    import shutil

    from tests.helpers import assert_one_line_error

    run = tmp_path / "adamw"
    shutil.copytree(saved_tp2_dp2, run)
    keep_only(run, 2)
    args = tiny_overrides("stdlib", **{**ARGS, **RESUME, **TP1_DP4, "train.steps": 4})
    args += ["train.optimizer=adamw", "checkpoint.resume=true"]
    proc = run_cli("train", "configs/quickstart.yaml", *args, "--run-dir", str(run))
    assert_one_line_error(proc, "train.optimizer=adamw differs from the checkpoint", "(muon)")
    args += ["train.optimizer_reset=true", "--run-dir", str(run)]
    proc = run_torchrun(4, "train", "configs/quickstart.yaml", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "optimizer state not loaded (train.optimizer_reset=true)" in proc.stdout + proc.stderr
    assert _state(run, 4).index["optimizer"] == "adamw"
