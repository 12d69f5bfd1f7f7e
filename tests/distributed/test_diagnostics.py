"""Residual-stream diagnostics: the decomposition identities, TP = 1 process, training logs,
``megaformer inspect`` and the report's per-layer plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megaformer.config import ModelConfig
from megaformer.diagnostics.metrics import residual_diagnostics
from megaformer.diagnostics.residual import (
    eval_mode,
    head_write_sq_norms,
    head_writes,
    logit_lens_logits,
    trace_layers,
)
from megaformer.model.transformer import Transformer
from tests.dist_harness import run_ranks
from tests.helpers import assert_one_line_error, cli_main, run_cli, run_torchrun, tiny_overrides

VARIANTS = {
    "sequential-rope-gqa": dict(residual="sequential", n_heads=4, n_kv_heads=2),
    "parallel-learned-bias": dict(
        residual="parallel",
        n_heads=4,
        position="learned",
        bias=True,
        norm="layernorm",
        activation="gelu",
        tie_embeddings=False,
    ),
}


def _model(**kw) -> Transformer:
    base = dict(vocab_size=61, d_model=32, n_layers=3, max_seq_len=16, d_ffn=48, dropout=0.1)
    base.update(kw)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**base))
    with torch.no_grad():  # non-trivial gains and biases, so none of them cancels by accident
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_writes_sum_to_the_final_residual_stream(variant):
    """x_0 + sum a_l + sum m_l = x_L (the stream the normal forward hands to the final norm), and
    the heads' writes plus the output bias sum to each attention write; fp32, 1e-6."""
    model = _model(**VARIANTS[variant])
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    final = {}
    hook = model.final_norm.register_forward_pre_hook(lambda m, args: final.update(x=args[0]))
    model.eval()
    with torch.no_grad():
        logits = model(ids)
    hook.remove()
    model.train()  # the pass must switch dropout off itself, and restore the flags after
    with eval_mode(model):
        x0, rope = model.embed(ids)
        traces = list(trace_layers(model, x0, rope))
    assert model.training and all(m.training for m in model.modules())
    total = x0 + sum(t.attn_write for t in traces) + sum(t.mlp_write for t in traces)
    scale = final["x"].abs().max()
    assert float((total - final["x"]).abs().max()) <= 1e-6 * max(1.0, float(scale))
    for t in traces:
        writes = head_writes(t).detach()  # [B, h, T, d]
        bias = model.layers[t.index].attn.wo.bias
        bias = bias.detach() if bias is not None else None
        summed = writes.sum(dim=1) + (bias if bias is not None else 0)
        assert float((summed - t.attn_write).abs().max()) <= 1e-6
        assert torch.allclose(head_write_sq_norms(t), writes.pow(2).sum(-1), rtol=1e-5, atol=1e-9)
        assert torch.allclose(t.probs.sum(-1), torch.ones(()), atol=1e-6)
        assert float(t.probs.triu(1).abs().max()) == 0.0  # causal
    with torch.no_grad():
        lens = logit_lens_logits(model, traces[-1].resid)[..., :61]
    assert float((lens - logits).abs().max()) <= 1e-5


def test_metrics_names_and_values():
    """Names as documented; values equal to direct computations from the trace."""
    model = _model(**VARIANTS["sequential-rope-gqa"])
    gen = torch.Generator().manual_seed(2)
    ids, labels = (
        torch.randint(0, 61, (2, 16), generator=gen),
        torch.randint(0, 61, (2, 16), generator=gen),
    )
    m = residual_diagnostics(model, ids, labels)
    assert len(m) == 1 + 3 * (4 + 1 + 2 * 4)
    with eval_mode(model):
        x0, rope = model.embed(ids)
        traces = list(trace_layers(model, x0, rope))
        model_loss = float(model(ids, labels))
    assert m["resid/embed/rms"] == pytest.approx(float(x0.pow(2).mean().sqrt()), rel=1e-6)
    t = traces[1]
    assert m["resid/layer_01/rms"] == pytest.approx(float(t.resid.pow(2).mean().sqrt()), rel=1e-6)
    assert m["mlp_write/layer_01/rms"] == pytest.approx(
        float(t.mlp_write.pow(2).mean().sqrt()), rel=1e-6
    )
    p = t.probs[:, 3]
    ent = float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())
    assert m["attn/layer_01/entropy/head_03"] == pytest.approx(ent, rel=1e-5)
    assert 0 < m["attn/layer_01/entropy/head_03"] < math.log(16)
    w = head_writes(t)[:, 2].detach()
    assert m["attn_write/layer_01/head_02/norm"] == pytest.approx(
        float(w.pow(2).sum(-1).mean().sqrt()), rel=1e-5
    )
    q_scores = t.scores[torch.isfinite(t.scores)]
    assert m["attn/layer_01/max_logit"] == pytest.approx(float(q_scores.max()), rel=1e-6)
    assert m["logit_lens/layer_02/loss"] == pytest.approx(model_loss, rel=1e-6)
    with torch.no_grad():
        lens0 = torch.nn.functional.cross_entropy(
            model.lm_head(model.final_norm(traces[0].resid)).flatten(0, 1), labels.flatten()
        )
    assert m["logit_lens/layer_00/loss"] == pytest.approx(float(lens0), rel=1e-6)


def test_moe_blocks_are_traced_with_their_router():
    """MoE blocks (log.diagnostics no longer refuses model.moe): the writes still sum to the
    final stream, the MLP write of an MoE block is its MoE FFN's output, and the router metrics
    are the max |z| of its logits and the std / mean of its expert loads on the micro-batch."""
    from megaformer.config import MoEConfig, load_config
    from megaformer.model.moe import expert_counts

    moe = MoEConfig(interval=1, num_experts=4, top_k=2, d_expert=32, num_shared_experts=1)
    model = _model(n_heads=4, n_kv_heads=2, dropout=0.0, moe=moe)
    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, 61, (2, 16), generator=gen) for _ in range(2))
    final = {}
    hook = model.final_norm.register_forward_pre_hook(lambda m, args: final.update(x=args[0]))
    with eval_mode(model):
        model(ids)
        x0, rope = model.embed(ids)
        traces = list(trace_layers(model, x0, rope))
    hook.remove()
    total = x0 + sum(t.attn_write for t in traces) + sum(t.mlp_write for t in traces)
    assert float((total - final["x"]).abs().max()) <= 1e-6 * max(1.0, float(final["x"].abs().max()))
    m = residual_diagnostics(model, ids, labels)
    for t in traces:
        block = model.layers[t.index].mlp
        h = t.resid - t.mlp_write  # sequential: the MLP read Norm_m(x + a)
        with torch.no_grad():
            z, idx, _ = block.route(model.layers[t.index].mlp_norm(h).reshape(-1, 32))
        load = expert_counts(idx.reshape(-1), 4).float()
        layer = f"layer_{t.index:02d}"
        assert m[f"router/{layer}/max_logit"] == pytest.approx(float(z.abs().max()), rel=1e-6)
        cv = float(load.std(unbiased=False) / load.mean())
        assert m[f"router/{layer}/load_cv"] == pytest.approx(cv, rel=1e-6, abs=1e-9)
        assert int(load.sum()) == 2 * 16 * 2
    over = ["model.n_layers=2", "model.moe.interval=1", "model.moe.num_experts=4"]
    assert load_config("configs/quickstart.yaml", [*over, "log.diagnostics=true"]).log.diagnostics


def _tp_diagnostics(rank: int, world: int) -> dict:
    from megaformer.parallel.plan import padded_vocab_size, parallelize
    from megaformer.parallel.topology import build_topology

    topo = build_topology(world, rank, tp=world)
    single = build_topology(world, rank).groups.tp  # TP groups of one rank each
    gen = torch.Generator().manual_seed(3)
    ids, labels = (
        torch.randint(0, 61, (2, 16), generator=gen),
        torch.randint(0, 61, (2, 16), generator=gen),
    )
    out = {}
    for variant, kw in VARIANTS.items():
        ref = _model(**kw)
        out[f"{variant}/ref"] = residual_diagnostics(ref, ids, labels, single)
        for sp in (False, True):
            tp = _model(**kw)
            tp.padded_vocab_size = padded_vocab_size(61, world, 8)  # as the trainer pads
            with torch.no_grad():
                for name in ("tok_embeddings", "lm_head"):
                    module = getattr(tp, name)
                    grown = torch.zeros(tp.padded_vocab_size, 32)
                    grown[:61] = module.weight
                    module.weight = torch.nn.Parameter(grown)
                tp.tie_weights()
            parallelize(tp, topo, sp, None)
            out[f"{variant}/{'sp' if sp else 'tp'}"] = residual_diagnostics(
                tp, ids, labels, topo.group("tp")
            )
    return out


@pytest.mark.multiprocess
def test_diagnostics_identical_under_tensor_parallelism():
    """TP = 2 (with and without sequence parallelism) gives every number of one process (1e-5)."""
    results = run_ranks(2, _tp_diagnostics)
    for variant in VARIANTS:
        ref = results[0][f"{variant}/ref"]
        for rank_result in results:
            for mode in ("tp", "sp"):
                got = rank_result[f"{variant}/{mode}"]
                assert got.keys() == ref.keys()
                bad = {
                    k: (got[k], ref[k])
                    for k in ref
                    if abs(got[k] - ref[k]) > 1e-5 * max(1.0, abs(ref[k]))
                }
                assert not bad, (variant, mode, bad)


# ---------------------------------------------------------------------------- through training

DIAG_RUN = {
    "model.n_layers": 4,
    "train.steps": 4,
    "eval.interval": 0,
    "log.diagnostics": "true",
    "log.diagnostics_interval": 2,
}


def _diag(record: dict) -> dict:
    return {k: v for k, v in record.items() if "/" in k}


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def diag_run(tmp_path_factory) -> Path:
    """One process, 4 layers, diagnostics every 2 steps, TensorBoard on, checkpoint at the end."""
    run = tmp_path_factory.mktemp("diag") / "run"
    proc = run_cli(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(**DIAG_RUN, **{"log.tensorboard": "true"}),
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


@pytest.mark.slow
def test_training_logs_diagnostics_every_interval(diag_run):
    recs = _records(diag_run)
    assert [bool(_diag(r)) for r in recs] == [False, True, False, True]  # steps 1..4, interval 2
    d = _diag(recs[1])
    assert len(d) == 1 + 4 * (5 + 2 * 4)  # embed + per layer (5 + 2 per head), 4 heads
    assert {
        "resid/layer_03/rms",
        "attn_write/layer_03/head_01/norm",
        "attn/layer_00/entropy/head_03",
        "attn/layer_02/max_logit",
        "logit_lens/layer_03/loss",
        "mlp_write/layer_01/rms",
    } <= d.keys()
    assert recs[1]["diag_time_s"] > 0
    assert all(math.isfinite(v) for v in d.values())
    assert all(0 < d[f"attn/layer_00/entropy/head_{h:02d}"] <= math.log(32) for h in range(4))
    from megaformer.analysis.report import read_tensorboard

    tb = {r["step"]: r for r in read_tensorboard(diag_run / "tensorboard")}
    assert tb[4]["logit_lens/layer_03/loss"] == pytest.approx(recs[3]["logit_lens/layer_03/loss"])
    assert "loss" in tb[4]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_diagnostics_under_tensor_and_pipeline_parallelism_equal_one_process(diag_run, tmp_path):
    """TP=2 x PP=2 (4 ranks): the pass runs stage by stage, heads gathered over TP; every number
    equals the one-process run's (1e-5)."""
    run = tmp_path / "tp_pp"
    proc = run_torchrun(
        4,
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(
            **{
                **DIAG_RUN,
                "train.steps": 2,
                "parallel.tensor": 2,
                "parallel.pipeline": 2,
                "checkpoint.save_at_end": "false",
            }
        ),
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(_records(run)) == 2 and _diag(_records(run)[1])
    for ref, got in zip(_records(diag_run), _records(run)):
        assert _diag(ref).keys() == _diag(got).keys()
        bad = {
            k: (got[k], v) for k, v in _diag(ref).items() if abs(got[k] - v) > 1e-5 * max(1, abs(v))
        }
        assert not bad, bad


@pytest.mark.slow
def test_inspect_prints_logit_lens_and_writes_heatmaps(diag_run, tmp_path):
    out = tmp_path / "inspect"
    prompt = "def f(x):"
    proc = cli_main("inspect", str(diag_run), "--prompt", prompt, "--out", str(out), "--top-k", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if "layer_" in line or "embed" in line]
    assert len(rows) == len(prompt) * 5  # embed + 4 layers per position
    assert sorted(p.name for p in out.iterdir()) == [
        f"attention_layer_{i:02d}.png" for i in range(4)
    ] + ["logit_lens.txt"]
    assert (out / "attention_layer_02.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the last layer's lens is the model's own next-token distribution
    from megaformer.diagnostics.inspect import inspect
    from megaformer.generation import load_checkpoint_model

    model, tok, _, _ = load_checkpoint_model(diag_run)
    r = inspect(diag_run, prompt, top_k=3)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([tok.encode(prompt)])), dim=-1)[0]
    for pos in range(len(prompt)):
        assert r.top[-1][pos][0][1] == pytest.approx(float(probs[pos].max()), rel=1e-5)
    assert r.table in proc.stdout  # the table the CLI printed


def test_inspect_bad_input_is_one_line_error(tmp_path):
    from megaformer.diagnostics.inspect import inspect
    from megaformer.errors import UserError

    with pytest.raises(UserError, match="no such run directory"):
        inspect(tmp_path / "nothing", "x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    assert_one_line_error(
        cli_main("inspect", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "used")),
        "--out",
        "not an empty folder",
    )
    assert (tmp_path / "used" / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_report_plots_the_per_layer_series(diag_run, tmp_path):
    from megaformer.analysis.report import write_report
    from megaformer.diagnostics.plots import _collect

    r = write_report(diag_run, tmp_path / "rep")
    names = {Path(p).name for p in r["plots"]}
    assert {
        "diag_resid_rms.png",
        "diag_attn_write_rms.png",
        "diag_mlp_write_rms.png",
        "diag_attn_max_logit.png",
        "diag_logit_lens_loss.png",
        "diag_attn_entropy.png",
        "diag_head_write_norm.png",
        "loss.png",
    } <= names
    series = _collect(_records(diag_run), r"resid/(layer_\d+|embed)/rms")
    assert list(series) == [("embed",), ("layer_00",), ("layer_01",), ("layer_02",), ("layer_03",)]
    assert series[("layer_02",)][0] == [2, 4]


def test_config_refuses_diagnostics_with_zero3_and_bad_interval():
    assert_one_line_error(
        cli_main(
            "train",
            "configs/quickstart.yaml",
            "log.diagnostics=true",
            "parallel.zero_stage=3",
            "--dry-run",
        ),
        "log.diagnostics",
        "ZeRO-3",
    )
    assert_one_line_error(
        cli_main("train", "configs/quickstart.yaml", "log.diagnostics_interval=0", "--dry-run"),
        "log.diagnostics_interval",
    )
    assert_one_line_error(
        cli_main(
            "train",
            "configs/quickstart.yaml",
            "log.diagnostics=true",
            "model.document_mask=true",
            "--dry-run",
        ),
        "model.document_mask",
    )
