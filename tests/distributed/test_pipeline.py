"""Pipeline parallelism (DeepSpeed's engine) and 3D layouts equal one process; recomputation is free
of numerical change and lowers activation memory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    cli_main,
    run_cli,
    run_torchrun,
    short_documents,
    tiny_model,
    tiny_overrides,
)

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


def _train(world: int, run: Path, args: dict) -> str:
    """``megaformer train`` on ``world`` ranks with the tiny model and ``args``; its output."""
    proc = run_torchrun(
        world,
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides("stdlib", **args),
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


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
    # DualPipeV (DeepSpeed's engine): each rank holds two stages, embedding and tied head on rank 0
    "pp2-dualpipev": (2, {"parallel.pipeline": 2, "parallel.pipeline_schedule": "dualpipev"}),
    # one sample per micro-batch: 4 micro-batches per DP rank; full recomputation
    "pp2xdp2-zero1-dualpipev": (
        4,
        {
            "parallel.pipeline": 2,
            "parallel.pipeline_schedule": "dualpipev",
            "parallel.zero_stage": 1,
            "train.micro_batch_size": 1,
            "train.recompute": "full",
        },
    ),
    "pp2xtp2-sp-dualpipev": (
        4,
        {
            "parallel.pipeline": 2,
            "parallel.pipeline_schedule": "dualpipev",
            "parallel.tensor": 2,
            "parallel.sequence_parallel": "true",
        },
    ),
    "pp2xcp2-ring-dualpipev": (
        4,
        {
            "parallel.pipeline": 2,
            "parallel.pipeline_schedule": "dualpipev",
            "parallel.context": 2,
            "train.micro_batch_size": 1,
        },
    ),
    # interleaved 1F1B: rank r runs stages r and r+2 of 4 (embedding on rank 0, tied head on 1)
    "pp2-interleaved": (2, {"parallel.pipeline": 2, "parallel.pipeline_schedule": "interleaved"}),
    "pp2xdp2-zero1-interleaved": (
        4,
        {
            "parallel.pipeline": 2,
            "parallel.pipeline_schedule": "interleaved",
            "parallel.zero_stage": 1,
            "train.micro_batch_size": 1,
            "train.recompute": "full",
        },
    ),
    "pp2xtp2-sp-interleaved": (
        4,
        {
            "parallel.pipeline": 2,
            "parallel.pipeline_schedule": "interleaved",
            "parallel.tensor": 2,
            "parallel.sequence_parallel": "true",
        },
    ),
    "pp2xcp2-ring-interleaved": (
        4,
        {
            "parallel.pipeline": 2,
            "parallel.pipeline_schedule": "interleaved",
            "parallel.context": 2,
            "train.micro_batch_size": 1,
        },
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
    _train(world, run, {**ARGS, **extra})
    _compare(reference, run)
    gen = cli_main(
        "generate", str(run), "--prompt", "def", "--max-new-tokens", "5", "--temperature", "0"
    )
    ref_gen = cli_main(
        "generate", str(reference), "--prompt", "def", "--max-new-tokens", "5", "--temperature", "0"
    )
    assert gen.returncode == 0 and gen.stdout == ref_gen.stdout


# what crosses the stages beyond the hidden states, or is computed on one of them
STAGE_FEATURES = {
    # the ids go along for the documents' masks; the last stage's loss reads the hidden states
    "documents-chunked-loss": {"model.document_mask": "true", "model.loss_chunk_tokens": 8},
    "moe-router-losses": {
        "model.moe.interval": 1,
        "model.moe.num_experts": 4,
        "model.moe.top_k": 2,
        "model.moe.d_expert": 32,
        "model.moe.aux_loss_coef": 0.01,
        "model.moe.z_loss_coef": 0.001,
    },
}
SCHEDULES = {
    "1f1b-pp2": (2, {"parallel.pipeline": 2}),
    "dualpipev-pp2": (2, {"parallel.pipeline": 2, "parallel.pipeline_schedule": "dualpipev"}),
    "interleaved-pp2": (2, {"parallel.pipeline": 2, "parallel.pipeline_schedule": "interleaved"}),
    "dualpipev-pp2xtp2-sp": (
        4,
        {
            "parallel.pipeline": 2,
            "parallel.pipeline_schedule": "dualpipev",
            "parallel.tensor": 2,
            "parallel.sequence_parallel": "true",
        },
    ),
}


def _feature_args(feature: str, docs: Path) -> dict:
    """ARGS with ``feature``; document masks train on short documents (every sample holds
    several end-of-document tokens)."""
    args = {**ARGS, **STAGE_FEATURES[feature]}
    if feature.startswith("documents"):
        args["data.source"] = str(docs)
    return args


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> Path:
    return short_documents(tmp_path_factory.mktemp("corpus") / "short_docs")


@pytest.fixture(scope="module")
def feature_references(tmp_path_factory, short_docs) -> dict:
    """One-process runs of each of STAGE_FEATURES (and its overrides), made on first use."""
    root, made = tmp_path_factory.mktemp("features"), {}

    def get(feature: str, **extra: str) -> Path:
        key = feature + repr(sorted(extra.items()))
        if key not in made:
            run = root / str(len(made))
            proc = run_cli(
                "train",
                "configs/quickstart.yaml",
                *tiny_overrides("stdlib", **{**_feature_args(feature, short_docs), **extra}),
                "--run-dir",
                str(run),
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            made[key] = run
        return made[key]

    return get


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("feature", list(STAGE_FEATURES))
def test_stage_features_equal_one_process(
    short_docs, feature_references, tmp_path, feature, schedule
):
    """Document masks with the chunked loss on the last stage, and MoE router losses from every
    stage, under each schedule: losses, gradient norms and weights after 3 AdamW steps equal one
    process's."""
    world, extra = SCHEDULES[schedule]
    run = tmp_path / schedule
    _train(world, run, {**_feature_args(feature, short_docs), **extra})
    ref = feature_references(feature)
    _compare(ref, run)
    if feature.startswith("documents"):  # the masks change the gradients: documents are cut
        unmasked = feature_references(feature, **{"model.document_mask": "false"})
        a, b = _records(ref)[2]["grad_norm"], _records(unmasked)[2]["grad_norm"]
        assert abs(a - b) > 5e-3 * a, (a, b)
    else:  # the router losses are a visible part of the loss
        assert _records(ref)[1]["moe/aux_loss"] > 0.5


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["dualpipev", "interleaved"])
def test_expert_parallelism_under_each_schedule_equals_one_process(
    feature_references, tmp_path, schedule
):
    """MoE blocks with router losses, their experts split over 2 data-parallel ranks, under
    DualPipeV and interleaved 1F1B at PP=2 (one sample per micro-batch: 4 per step and DP rank)."""
    extra = {
        "parallel.pipeline": 2,
        "parallel.pipeline_schedule": schedule,
        "parallel.expert": 2,
        "parallel.zero_stage": 1,
        "train.micro_batch_size": 1,
    }
    run = tmp_path / "ep"
    _train(4, run, {**ARGS, **STAGE_FEATURES["moe-router-losses"], **extra})
    # the router losses are statistics of each micro-batch: the reference's are of one sample too
    _compare(feature_references("moe-router-losses", **{"train.micro_batch_size": 1}), run)


def _init_gloo() -> None:
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    from megaformer.training.distributed import disable_cpu_shm_comm_op

    disable_cpu_shm_comm_op()
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)


def _eval_scores(rank: int, world: int, ckpt: Path) -> tuple:
    from megaformer.evaluation.checkpoint import load_runner
    from megaformer.parallel.topology import build_topology

    _init_gloo()
    cpu = torch.device("cpu")
    runner, tok, _ = load_runner(ckpt, build_topology(world, rank, pp=world), cpu)
    one, _, _ = load_runner(ckpt, None, cpu)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    ids[:, [5, 13]] = tok.eod_id  # three documents per row
    targets = torch.randint(0, 256, (2, 24), generator=g)
    return runner.scores(ids, targets), one.scores(ids, targets)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pipelined_evaluation_passes_the_ids_and_applies_the_head(feature_references):
    """megaformer eval's pipeline runner on a model with document masks and the chunked loss: the
    stages send the ids along, the last one applies the head to the hidden states; the scores
    equal one process's."""
    from tests.dist_harness import run_ranks

    ckpt = feature_references("documents-chunked-loss") / "checkpoints" / "step_0000003"
    for (logp, greedy), (ref_logp, ref_greedy) in run_ranks(2, _eval_scores, ckpt, timeout=300):
        assert torch.allclose(logp, ref_logp, rtol=1e-5, atol=1e-6)
        assert torch.equal(greedy, ref_greedy)


@pytest.fixture(scope="module")
def eight_blocks(tmp_path_factory) -> tuple[dict, Path]:
    """One process with 8 blocks and one sample per micro-batch (8 micro-batches per step)."""
    args = {**ARGS, "model.n_layers": 8, "train.micro_batch_size": 1}
    ref = tmp_path_factory.mktemp("eight") / "ref"
    proc = run_cli(
        "train", "configs/quickstart.yaml", *tiny_overrides("stdlib", **args), "--run-dir", str(ref)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return args, ref


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world,extra,shown",
    [
        # 8 stages of one block (rank r runs blocks r and 7-r), tied embeddings on rank 0
        (4, {"parallel.pipeline_schedule": "dualpipev"}, "PP 4 (dualpipev)"),
        # 8 stages of one block, rank r runs blocks r and r+4; the head on rank 3
        (4, {"parallel.pipeline_schedule": "interleaved"}, "PP 4 (interleaved, 2 stages"),
        # 8 stages on 2 ranks: rank 0 runs blocks 0, 2, 4, 6 (v = 4)
        (
            2,
            {"parallel.pipeline_schedule": "interleaved", "parallel.pipeline_virtual_stages": 4},
            "PP 2 (interleaved, 4 stages",
        ),
    ],
    ids=["dualpipev-pp4", "interleaved-pp4", "interleaved-pp2-v4"],
)
def test_eight_stages_equal_one_process(eight_blocks, tmp_path, world, extra, shown):
    args, ref = eight_blocks
    run = tmp_path / "run"
    out = _train(world, run, {**args, "parallel.pipeline": world, **extra})
    assert shown in out
    _compare(ref, run)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["dualpipev", "interleaved"])
def test_resume_at_another_schedule_continues_the_same_losses(tmp_path, schedule):
    """PP2 under 1F1B stops at step 2; resumed from its sharded checkpoint under DualPipeV or
    interleaved 1F1B (the stages cut anew: 4 instead of 2), steps 3 and 4 equal the uninterrupted
    1F1B run's."""
    args = {
        **ARGS,
        "parallel.pipeline": 2,
        "train.steps": 4,
        "checkpoint.interval": 2,
        "eval.interval": 0,
        "log.sample_tokens": 0,
    }
    full = tmp_path / "full"
    _train(2, full, args)
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000004")
    (resumed / "checkpoints" / "latest").write_text("step_0000002\n")
    out = _train(2, resumed, {**args, "parallel.pipeline_schedule": schedule})
    assert "resumed from" in out and f"PP 2 ({schedule}" in out
    a, b = _records(full), _records(resumed)
    for step in (3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
    assert a[4]["loss"] != a[3]["loss"]


def _stage_layout(rank: int, world: int, schedule: str) -> dict:
    _init_gloo()
    from deepspeed.pipe import DualPipeVModule

    from megaformer.config import load_config
    from megaformer.parallel.build import build_model
    from megaformer.parallel.interleaved_engine import InterleavedModule
    from megaformer.parallel.topology import build_topology

    over = tiny_overrides(
        "stdlib",
        **{
            **ARGS,
            "model.vocab_size": 64,
            "parallel.pipeline": world,
            "parallel.pipeline_schedule": schedule,
        },
    )
    cfg = load_config("configs/quickstart.yaml", over)
    built = build_model(cfg, build_topology(world, rank, pp=world))
    materialised = {
        n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("layers.") else "")
        for n, p in built.plain.named_parameters()
        if not p.is_meta
    }
    names = {built.param_names[id(p)] for p in built.model.parameters()}
    return {
        "module": {DualPipeVModule: "dual", InterleavedModule: "interleaved"}.get(
            type(built.model).__mro__[1]
        ),
        "materialised": materialised,
        "held": {
            n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("layers.") else "")
            for n in names
        },
    }


@pytest.mark.multiprocess
def test_dualpipev_ranks_hold_two_stages_and_rank0_the_embedding_and_head():
    """PP=2, 4 blocks: stages [embedding, block 0] [block 1] [block 2] [block 3, norm, head];
    rank 0 runs stages 0 and 3 (the tied embedding once), rank 1 stages 1 and 2; a rank builds
    only its stages' blocks."""
    from tests.dist_harness import run_ranks

    r0, r1 = run_ranks(2, _stage_layout, "dualpipev", timeout=300)
    assert r0["module"] == r1["module"] == "dual"
    assert r0["held"] == {"tok_embeddings", "layers.0", "layers.3", "final_norm"}
    assert r1["held"] == {"layers.1", "layers.2"}
    for r in (r0, r1):  # nothing of another rank's stages was allocated
        assert r["materialised"] - {"final_norm", "pos_embeddings"} == r["held"] - {"final_norm"}


@pytest.mark.multiprocess
def test_interleaved_ranks_hold_every_pth_stage_and_the_ends_on_the_end_ranks():
    """PP=2, v=2, 4 blocks: stages [embedding, block 0] [block 1] [block 2] [block 3, norm,
    head]; rank 0 runs stages 0 and 2, rank 1 stages 1 and 3 and the tied head (a second copy of
    the embedding, as under 1F1B); a rank builds only its stages' blocks."""
    from tests.dist_harness import run_ranks

    r0, r1 = run_ranks(2, _stage_layout, "interleaved", timeout=300)
    assert r0["module"] == r1["module"] == "interleaved"
    assert r0["held"] == {"tok_embeddings", "layers.0", "layers.2"}
    assert r1["held"] == {"tok_embeddings", "layers.1", "layers.3", "final_norm"}
    for r in (r0, r1):
        assert r["materialised"] - {"final_norm", "pos_embeddings"} == r["held"] - {"final_norm"}


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
