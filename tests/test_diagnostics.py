"""Residual-stream diagnostics: the decomposition identities, TP = 1 process, training logs,
``megaformer inspect`` and the report's per-layer plots."""

from __future__ import annotations

import math

import pytest
import torch

from megaformer.config import ModelConfig
from megaformer.diagnostics.metrics import residual_diagnostics
from megaformer.diagnostics.residual import (eval_mode, head_write_sq_norms, head_writes,
                                             logit_lens_logits, trace_layers)
from megaformer.model.transformer import Transformer
from tests.dist_harness import run_ranks

VARIANTS = {
    "sequential-rope-gqa": dict(residual="sequential", n_heads=4, n_kv_heads=2),
    "parallel-learned-bias": dict(residual="parallel", n_heads=4, position="learned", bias=True,
                                  norm="layernorm", activation="gelu", tie_embeddings=False),
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
        writes = head_writes(t).detach()                           # [B, h, T, d]
        bias = model.layers[t.index].attn.wo.bias
        bias = bias.detach() if bias is not None else None
        summed = writes.sum(dim=1) + (bias if bias is not None else 0)
        assert float((summed - t.attn_write).abs().max()) <= 1e-6
        assert torch.allclose(head_write_sq_norms(t), writes.pow(2).sum(-1), rtol=1e-5, atol=1e-9)
        assert torch.allclose(t.probs.sum(-1), torch.ones(()), atol=1e-6)
        assert float(t.probs.triu(1).abs().max()) == 0.0          # causal
    with torch.no_grad():
        lens = logit_lens_logits(model, traces[-1].resid)[..., :61]
    assert float((lens - logits).abs().max()) <= 1e-5


def test_metrics_names_and_values():
    """Names as documented; values equal to direct computations from the trace."""
    model = _model(**VARIANTS["sequential-rope-gqa"])
    gen = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, 61, (2, 16), generator=gen), torch.randint(0, 61, (2, 16), generator=gen)
    m = residual_diagnostics(model, ids, labels)
    assert len(m) == 1 + 3 * (4 + 1 + 2 * 4)
    with eval_mode(model):
        x0, rope = model.embed(ids)
        traces = list(trace_layers(model, x0, rope))
        model_loss = float(model(ids, labels))
    assert m["resid/embed/rms"] == pytest.approx(float(x0.pow(2).mean().sqrt()), rel=1e-6)
    t = traces[1]
    assert m["resid/layer_01/rms"] == pytest.approx(float(t.resid.pow(2).mean().sqrt()), rel=1e-6)
    assert m["mlp_write/layer_01/rms"] == pytest.approx(float(t.mlp_write.pow(2).mean().sqrt()), rel=1e-6)
    p = t.probs[:, 3]
    ent = float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())
    assert m["attn/layer_01/entropy/head_03"] == pytest.approx(ent, rel=1e-5)
    assert 0 < m["attn/layer_01/entropy/head_03"] < math.log(16)
    w = head_writes(t)[:, 2]
    assert m["attn_write/layer_01/head_02/norm"] == pytest.approx(
        float(w.pow(2).sum(-1).mean().sqrt()), rel=1e-5)
    q_scores = t.scores[torch.isfinite(t.scores)]
    assert m["attn/layer_01/max_logit"] == pytest.approx(float(q_scores.max()), rel=1e-6)
    assert m["logit_lens/layer_02/loss"] == pytest.approx(model_loss, rel=1e-6)
    with torch.no_grad():
        lens0 = torch.nn.functional.cross_entropy(
            model.lm_head(model.final_norm(traces[0].resid)).flatten(0, 1), labels.flatten())
    assert m["logit_lens/layer_00/loss"] == pytest.approx(float(lens0), rel=1e-6)


def _tp_diagnostics(rank: int, world: int) -> dict:
    from megaformer.parallel.plan import padded_vocab_size, parallelize
    from megaformer.parallel.topology import build_topology

    topo = build_topology(world, rank, world, 1)
    single = build_topology(world, rank, 1, 1).group("tp")  # TP groups of one rank each
    gen = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, 61, (2, 16), generator=gen), torch.randint(0, 61, (2, 16), generator=gen)
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
            out[f"{variant}/{'sp' if sp else 'tp'}"] = residual_diagnostics(tp, ids, labels,
                                                                             topo.group("tp"))
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
                bad = {k: (got[k], ref[k]) for k in ref
                       if abs(got[k] - ref[k]) > 1e-5 * max(1.0, abs(ref[k]))}
                assert not bad, (variant, mode, bad)
