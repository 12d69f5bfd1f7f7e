"""Pipeline parallelism (DeepSpeed's engine) and 3D layouts equal one process; recomputation is free
of numerical change and lowers activation memory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import cli_main, run_cli, run_torchrun, tiny_model, tiny_overrides

ARGS = {
    "model.n_layers": 4,
    "model.d_ffn": 64,
    "train.steps": 3,
    "train.micro_batch_size": 2,
    "train.lr": 1e-3,
    "train.global_batch_size": 8,
    "eval.interval": 3,
    "eval.iters": 1,
    "log.sample_tokens": 5,
}


def _records(run_dir: Path) -> dict[int, dict]:
    return {
        r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pp") / "ref"
    proc = run_cli(
        "train", "configs/quickstart.yaml", *tiny_overrides("stdlib", **ARGS), "--run-dir", str(run)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _compare(ref: Path, run: Path) -> None:
    a, b = _records(ref), _records(run)
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (
                step,
                key,
                a[step],
                b[step],
            )
    assert b[3]["val_loss"] == pytest.approx(a[3]["val_loss"], rel=1e-5)
    from megaformer.checkpoint.weights import load_weights

    wa = load_weights(ref / "checkpoints/step_0000003")
    wb = load_weights(run / "checkpoints/step_0000003")
    assert wa.keys() == wb.keys()
    for k in wa:  # weights after 3 AdamW steps: every parameter's gradient history agrees
        assert float((wa[k] - wb[k]).norm() / wa[k].norm()) < 1e-5, k


LAYOUTS = {  # name: (world, overrides)
    "pp2": (2, {"parallel.pipeline": 2}),
    "pp4": (4, {"parallel.pipeline": 4}),
    "pp2xtp2-sp": (
        4,
        {"parallel.pipeline": 2, "parallel.tensor": 2, "parallel.sequence_parallel": "true"},
    ),
    "pp2xdp2-zero1": (
        4,
        {"parallel.pipeline": 2, "parallel.zero_stage": 1, "parallel.pipeline_partition": "1,3"},
    ),
    "tp2xpp2xdp2": (
        8,
        {
            "parallel.pipeline": 2,
            "parallel.tensor": 2,
            "parallel.zero_stage": 1,
            "parallel.sequence_parallel": "true",
            "train.recompute": "full",
        },
    ),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(reference, tmp_path, layout):
    world, extra = LAYOUTS[layout]
    run = tmp_path / layout
    proc = run_torchrun(
        world,
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides("stdlib", **{**ARGS, **extra}),
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _compare(reference, run)
    gen = cli_main(
        "generate", str(run), "--prompt", "def", "--max-new-tokens", "5", "--temperature", "0"
    )
    ref_gen = cli_main(
        "generate", str(reference), "--prompt", "def", "--max-new-tokens", "5", "--temperature", "0"
    )
    assert gen.returncode == 0 and gen.stdout == ref_gen.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_under_pipeline_and_tensor_parallelism_is_exact(tmp_path):
    """PP2 x TP2 with sequence parallelism and dropout (both RNG streams, every stage's): stop at
    step 2, resume from the shards, same losses bit for bit. (Data parallelism's part of resume
    is tested in tests/distributed/test_sharded_checkpoint.py.)"""
    args = tiny_overrides(
        "stdlib",
        **{
            **ARGS,
            **LAYOUTS["pp2xtp2-sp"][1],
            "train.steps": 4,
            "checkpoint.interval": 2,
            "eval.interval": 0,
            "model.dropout": 0.1,
            "log.sample_tokens": 0,
        },
    )
    full = tmp_path / "full"
    proc = run_torchrun(4, "train", "configs/quickstart.yaml", *args, "--run-dir", str(full))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000004")
    (resumed / "checkpoints" / "latest").write_text("step_0000002\n")
    proc = run_torchrun(4, "train", "configs/quickstart.yaml", *args, "--run-dir", str(resumed))
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    a, b = _records(full), _records(resumed)
    assert [b[s]["loss"] for s in (3, 4)] == [a[s]["loss"] for s in (3, 4)]


# ----------------------------------------------------------------------------- recomputation


def _saved_bytes_and_grads(mode: str, every: int = 1, dropout: float = 0.1):
    """Loss, gradients and the bytes autograd keeps for backward (saved-tensor hooks count every
    tensor saved during the forward pass: the activation memory of the micro-batch)."""
    from megaformer.config import ModelConfig
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.recompute import apply_recompute

    cfg = ModelConfig(
        vocab_size=64,
        d_model=64,
        n_layers=4,
        n_heads=4,
        max_seq_len=64,
        dropout=dropout,
        attention_dropout=dropout,
        attention_backend="reference",
    )
    torch.manual_seed(0)
    model = Transformer(cfg).train()
    apply_recompute(model.layers, mode, every)
    x = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(5)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.item(), grads, sum(saved.values())


def test_recompute_changes_no_number_and_saves_memory():
    base_loss, base_grads, base_mem = _saved_bytes_and_grads("none")
    results = {}
    for mode, every in (("full", 1), ("full", 2), ("selective", 1)):
        loss, grads, mem = _saved_bytes_and_grads(mode, every)
        assert loss == base_loss, mode  # bitwise, dropout included
        assert all(torch.equal(a, b) for a, b in zip(grads, base_grads)), mode
        results[(mode, every)] = mem
    assert results[("full", 1)] < results[("full", 2)] < base_mem
    assert results[("selective", 1)] < base_mem


def _tp_recompute(rank: int, world: int) -> dict:
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.plan import parallelize
    from megaformer.parallel.random import TensorParallelRNG
    from megaformer.parallel.recompute import apply_recompute
    from megaformer.parallel.topology import build_topology

    topo = build_topology(world, rank, tp=world)
    cfg = tiny_model(vocab_size=64, dropout=0.2, attention_dropout=0.2)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        rng = TensorParallelRNG(0, rank)
        model = parallelize(Transformer(cfg), topo, True, rng)
        apply_recompute(model.layers, mode, 1, rng)
        torch.manual_seed(3)
        loss = model(x, x)
        loss.backward()
        out[mode] = (loss.item(), [p.grad.clone() for p in model.parameters()])
    return out


@pytest.mark.multiprocess
def test_recompute_replays_tensor_parallel_dropout():
    from tests.dist_harness import run_ranks

    for r in run_ranks(2, _tp_recompute):
        base_loss, base_grads = r["none"]
        for mode in ("full", "selective"):
            loss, grads = r[mode]
            assert loss == base_loss and all(
                torch.equal(a, b) for a, b in zip(grads, base_grads)
            ), mode
