"""Multi-token prediction under context, sequence and pipeline parallelism equals one process:

* the model at CP 2 (ring and all-to-all), TP 2 with sequence parallelism and TP 2 x CP 2: the
  loss (main + weighted MTP losses) averaged over the context group, every gradient (averaged
  over it as DeepSpeed does, gathered over TP) and the logged ``mtp/loss``, within 1e-5 over 3
  AdamW steps, with ignored labels all on one context rank;
* training through DeepSpeed at CP 2 in both modes, TP 2 with sequence parallelism, PP 2
  (1F1B, the modules on the last stage; with logits, the chunked loss, and TP 2 with sequence
  parallelism): losses, gradient norms, ``mtp/loss``, validation loss and weights; the pipeline
  stages other than the last do not allocate the modules; a PP 2 checkpoint resumes exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks
from tests.distributed.test_context_parallel import MODELS as CP_MODELS
from tests.distributed.test_context_parallel import _rel
from tests.distributed.test_pipeline import _compare
from tests.helpers import full_gradients, run_cli, run_torchrun, step_records, tiny_overrides

VOCAB = 257
MODELS = {name: CP_MODELS[name] for name in ("mha-rope", "mla")}


def _model_case(rank: int, topo, mode: str, variant: str, sp: bool) -> dict:
    from megaformer.config import ModelConfig
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.context import apply_context, loss_weighting
    from megaformer.parallel.plan import padded_vocab_size, parallelize

    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        max_seq_len=16,
        d_ffn=64,
        mtp_depth=2,
        mtp_loss_coef=0.3,
        **MODELS[variant],
    )
    torch.manual_seed(0)
    ref = Transformer(cfg, padded_vocab_size=padded_vocab_size(VOCAB, 1, 8))
    torch.manual_seed(0)
    model = Transformer(cfg, padded_vocab_size=padded_vocab_size(VOCAB, topo.tp, 8))
    parallelize(model, topo, sp, None)
    cp = apply_context(model, topo, mode)
    split = cp.split if cp is not None else (lambda t: t)
    weigh = loss_weighting(cp)  # as the train step
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (ref, model)]
    gen = torch.Generator().manual_seed(1)
    losses, mtp, errs = [], [], []
    for _ in range(3):
        x = torch.randint(0, VOCAB, (2, 16), generator=gen)
        y = torch.randint(0, VOCAB, (2, 16), generator=gen)
        y[0, :3] = -100  # ignored labels, all on one context rank: counted globally
        y[1, 13] = -100  # one that the shifted labels move across the ranks
        for opt in opts:
            opt.zero_grad()
        ref_loss = ref(x, y)
        ref_loss.backward()
        loss = weigh(model(split(x), split(y)), split(y))
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=topo.group("cp"))
        losses.append((ref_loss.item(), mean_loss.item() / topo.cp))
        mtp.append(
            (
                ref.mtp_metrics.take()["mtp/loss"],
                model.mtp_metrics.take(topo.group("cp"))["mtp/loss"],
            )
        )
        ref_grads = {
            n: p.grad[:VOCAB] if ("emb" in n or "lm_head" in n) else p.grad
            for n, p in ref.named_parameters()
        }
        # averaged over the context group as DeepSpeed averages over DP x CP, gathered over TP
        full = full_gradients(model, topo.tp, topo.group("tp"), topo.cp, topo.group("cp"))
        grads = {n: g[:VOCAB] if ("emb" in n or "lm_head" in n) else g for n, g in full.items()}
        assert grads.keys() == ref_grads.keys()
        assert all(float(g.norm()) > 0 for n, g in ref_grads.items() if n.startswith("mtp."))
        total = float(torch.stack([g.norm() for g in ref_grads.values()]).norm())
        errs.append(max(_rel(grads[n], ref_grads[n], 1e-3 * total) for n in ref_grads))
        for opt in opts:
            opt.step()
    return {"losses": losses, "mtp": mtp, "errs": errs}


CASES = {  # world: [(tp, cp, context mode, model, sequence parallelism)]
    2: [(1, 2, mode, variant, False) for mode in ("ring", "all_to_all") for variant in MODELS]
    + [(2, 1, "ring", variant, True) for variant in MODELS],
    4: [(2, 2, "ring", "mha-rope", True), (2, 2, "all_to_all", "mla", True)],
}


def _suite(rank: int, world: int) -> dict:
    from megaformer.parallel.topology import build_topology

    out, topos = {}, {}
    for tp, cp, mode, variant, sp in CASES[world]:
        if (tp, cp) not in topos:
            topos[tp, cp] = build_topology(world, rank, tp=tp, cp=cp)
        out[tp, cp, mode, variant, sp] = _model_case(rank, topos[tp, cp], mode, variant, sp)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_mtp_under_context_and_sequence_parallelism_equals_one_process(world):
    results = run_ranks(world, _suite)
    for case in CASES[world]:
        for r in results:
            for want, got in r[case]["losses"] + r[case]["mtp"]:
                assert abs(got - want) <= 1e-5 * abs(want), (case, r[case])
            assert max(r[case]["errs"]) < 1e-5, (case, r[case]["errs"])


TRAIN = {  # quickstart ties the embedding to the output head
    "train.steps": 3,
    "eval.interval": 3,
    "train.micro_batch_size": 2,
    "train.global_batch_size": 8,
    "model.d_ffn": 64,
    "model.mtp_depth": 2,
    "checkpoint.interval": 3,
}


def _train(world: int, run: Path, args: dict) -> Path:
    """``megaformer train`` of the tiny quickstart model with ``args`` on ``world`` ranks."""
    overrides = tiny_overrides("stdlib", **{**TRAIN, **args})
    if world == 1:
        proc = run_cli("train", "configs/quickstart.yaml", *overrides, "--run-dir", str(run))
    else:
        proc = run_torchrun(
            world, "train", "configs/quickstart.yaml", *overrides, "--run-dir", str(run)
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def _same(ref: Path, run: Path) -> None:
    """Losses, gradient norms, validation loss, weights and ``mtp/loss`` within 1e-5."""
    _compare(ref, run)
    a, b = step_records(ref), step_records(run)
    for step in (1, 2, 3):
        assert b[step]["mtp/loss"] == pytest.approx(a[step]["mtp/loss"], rel=1e-5), step


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_training_with_mtp_at_cp2_equals_one_process(tmp_path, mode):
    ref = _train(1, tmp_path / "ref", {})
    _same(ref, _train(2, tmp_path / "cp", {"parallel.context": 2, "parallel.context_mode": mode}))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world,chunked,extra",
    [
        (2, 0, {}),
        (2, 16, {}),
        (2, 0, {"model.tie_embeddings": "false"}),
        (2, 16, {"model.tie_embeddings": "false"}),
        (4, 0, {"parallel.tensor": 2, "parallel.sequence_parallel": "true"}),
        (2, 16, {"parallel.pipeline_schedule": "interleaved", "model.n_layers": 4}),
    ],
    ids=["logits", "chunked-loss", "untied", "untied-chunked-loss", "tp2-sp", "interleaved"],
)
def test_training_with_mtp_at_pp2_equals_one_process(tmp_path, world, chunked, extra):
    """1F1B over two stages (and interleaved 1F1B over four), the modules, the head and the
    embedding (tied to the first stage's) on the last (``mtp/loss`` is logged by the first)."""
    args = {"model.loss_chunk_tokens": chunked, **extra}
    ref = _train(1, tmp_path / "ref", {k: v for k, v in args.items() if "parallel" not in k})
    _same(ref, _train(world, tmp_path / "pp", {**args, "parallel.pipeline": 2}))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_training_with_mtp_at_tp2_with_sequence_parallelism_equals_one_process(tmp_path):
    ref = _train(1, tmp_path / "ref", {})
    sp = {"parallel.tensor": 2, "parallel.sequence_parallel": "true"}
    _same(ref, _train(2, tmp_path / "sp", sp))


def _pipeline_build(rank: int, world: int) -> dict:
    from megaformer.config import load_config
    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import build_topology
    from tests.distributed.test_partitioned_build import _init

    _init(rank)
    over = {**TRAIN, "model.vocab_size": 64, "model.n_layers": 2, "parallel.pipeline": 2}
    cfg = load_config("configs/quickstart.yaml", [f"{k}={v}" for k, v in over.items()])
    built = build_model(cfg, build_topology(world, rank, pp=world))
    mtp = list(built.plain.mtp.parameters())
    held = {id(p) for p in built.model.parameters()}
    return {
        "values": sum(not p.is_meta for p in mtp),
        "in_stage": sum(id(p) in held for p in mtp),
        "count": len(mtp),
    }


@pytest.mark.multiprocess
def test_pipeline_stages_hold_the_modules_on_the_last_stage_only():
    first, last = run_ranks(2, _pipeline_build)
    assert first["count"] == last["count"] > 0
    assert first["values"] == first["in_stage"] == 0  # meta, and not in the first stage's module
    assert last["values"] == last["in_stage"] == last["count"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_untied_checkpoint_resumes_exactly(tmp_path):
    """The step-2 checkpoint of PP 2 with untied embeddings (the embedding on both stages, the
    modules on the last) resumed: step 3 as the uninterrupted run's."""
    args = {"model.tie_embeddings": "false", "checkpoint.interval": 1, "parallel.pipeline": 2}
    run = _train(2, tmp_path / "pp", args)
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000003")
    (resumed / "checkpoints" / "latest").write_text("step_0000002\n")
    log = resumed / "metrics.jsonl"  # the copied step-3 record goes: the resumed run writes it
    log.write_text("".join(x for x in log.read_text().splitlines(True) if '"step": 3' not in x))
    assert 3 not in step_records(resumed)
    overrides = tiny_overrides("stdlib", **{**TRAIN, **args})
    proc = run_torchrun(
        2, "train", "configs/quickstart.yaml", *overrides, "--run-dir", str(resumed)
    )
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    a, b = step_records(run), step_records(resumed)
    for key in ("loss", "grad_norm", "mtp/loss"):
        assert b[3][key] == pytest.approx(a[3][key], rel=1e-5), key
