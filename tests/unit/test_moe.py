"""Mixture-of-Experts FFN: routing, dispatch, router losses, aux-loss-free bias, capacity, TP, training.

One process unless marked: a dropless block's output for a sequence does not depend on the batch
around it; the load-balancing and z losses equal hand-computed values on a fixed router; the
aux-loss-free bias moves a skewed router's load toward balance; a capacity drops and counts
exactly the assignments past it. Two gloo ranks: TP=2 (with and without SP) equals one process
(loss, every gathered gradient). Through the CLI: a run logs the MoE metrics and resumes exactly
from a checkpoint, aux-loss-free biases included.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from megaformer.config import ModelConfig, MoEConfig, load_config
from megaformer.errors import ConfigError
from megaformer.model.moe import MoE, end_of_step
from megaformer.model.transformer import Transformer
from tests.dist_harness import run_ranks
from tests.helpers import full_gradients, reference_and_tensor_parallel, run_cli, tiny_overrides


def _cfg(**moe) -> ModelConfig:
    base = dict(interval=1, num_experts=4, top_k=2)
    base.update(moe)
    return ModelConfig(
        vocab_size=37, d_model=16, n_layers=2, n_heads=2, max_seq_len=16, moe=MoEConfig(**base)
    )


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.moe.top_k=5", "model.moe.top_k=5: more than model.moe.num_experts=4"),
        ("model.moe.top_k=0", "model.moe.top_k=0: must be in 1..8"),
        ("model.moe.capacity_factor=1.25", "set model.moe.dropless=false"),
        ("model.moe.dropless=false", "needs model.moe.capacity_factor"),
        ("model.moe.interval=3", "model.moe.interval=3: no block would be MoE"),
        ("model.moe.interval=-1", "model.moe.interval=-1: must be >= 0"),
        ("model.moe.score=relu", "model.moe.score='relu': must be one of softmax, sigmoid"),
        ("model.moe.d_expert=0", "model.moe.d_expert=0: must be > 0"),
        ("model.moe.expert=2", "unknown config key 'model.moe.expert'"),
    ],
)
def test_config_errors_are_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(
            "configs/quickstart.yaml",
            ["model.n_layers=2", "model.moe.interval=1", "model.moe.num_experts=4", override],
        )
    assert message in str(e.value) and "\n" not in str(e.value)


def test_interval_picks_blocks_and_config_round_trips():
    cfg = load_config("configs/moe-tiny.yaml")
    m = cfg.model
    assert [m.is_moe_layer(i) for i in range(m.n_layers)] == [i % 2 == 1 for i in range(m.n_layers)]
    import yaml

    from megaformer.config import config_from_dict

    assert config_from_dict(yaml.safe_load(cfg.to_yaml()), name=cfg.name) == cfg
    model = Transformer(ModelConfig(**{**m.__dict__, "vocab_size": 37}))
    kinds = [type(b.mlp).__name__ for b in model.layers]
    assert kinds == ["MLP" if i % 2 == 0 else "MoE" for i in range(m.n_layers)]


# ----------------------------------------------------------------------------- routing


@pytest.mark.parametrize(
    "moe",
    [
        dict(),
        dict(score="sigmoid", num_shared_experts=1, d_shared=8),
        dict(top_k=1, renormalize=False),
    ],
)
def test_dropless_output_is_independent_of_the_batch(moe):
    torch.manual_seed(0)
    model = Transformer(_cfg(**moe)).eval()
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 37, (4, 16), generator=gen)
    with torch.no_grad():
        together = model(batch)
        for i in range(4):
            alone = model(batch[i : i + 1])
            assert torch.allclose(alone[0], together[i], atol=1e-6, rtol=0), i
        # the batch does mix experts: every expert gets tokens from several sequences
        block = model.layers[0].mlp
        x = model.embed(batch)[0]
        idx = block.route(model.layers[0].mlp_norm(x).reshape(-1, 16))[1].reshape(4, -1)
        for e in range(4):
            assert len({i for i in range(4) if (idx[i] == e).any()}) >= 2


def _hand_losses(x: torch.Tensor, W: torch.Tensor, k: int) -> tuple[float, float, list[int]]:
    """The Switch/Mixtral load-balancing loss and the z-loss, element by element."""
    n, E = x.shape[0], W.shape[0]
    counts, mean_p, z = [0] * E, [0.0] * E, 0.0
    for t in range(n):
        logits = [sum(float(x[t, j]) * float(W[e, j]) for j in range(x.shape[1])) for e in range(E)]
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        probs = [v / sum(exps) for v in exps]
        for e in sorted(range(E), key=lambda e: -probs[e])[:k]:
            counts[e] += 1
        for e in range(E):
            mean_p[e] += probs[e] / n
        z += (top + math.log(sum(exps))) ** 2 / n
    aux = E * sum(counts[e] / (n * k) * mean_p[e] for e in range(E))
    return aux, z, counts


def test_router_losses_equal_hand_computed_values():
    torch.manual_seed(0)
    moe = MoE(_cfg(num_experts=5, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01), layer=0)
    with torch.no_grad():
        moe.router.weight.copy_(torch.linspace(-1, 1, 5 * 16).reshape(5, 16).sin() * 2)
        for p in moe.experts.parameters():
            p.normal_(0, 0.1)
        moe.reset_state()
    x = torch.randn(3, 7, 16)
    moe.train()
    moe(x)
    aux, z, counts = _hand_losses(x.reshape(-1, 16), moe.router.weight.detach(), 2)
    assert moe.aux_loss.item() == pytest.approx(0.1 * aux + 0.01 * z, rel=1e-5)
    assert moe.step_load.tolist() == counts
    stats = end_of_step(moe)
    assert stats["moe/aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert stats["moe/z_loss"] == pytest.approx(z, rel=1e-5)
    assert stats["moe/load_max/0"] == max(counts) and stats["moe/load_min/0"] == min(counts)
    mean = sum(counts) / 5
    cv = math.sqrt(sum((c - mean) ** 2 for c in counts) / 5) / mean
    assert stats["moe/load_cv/0"] == pytest.approx(cv, rel=1e-9)
    assert moe.step_load.sum() == 0  # counters reset for the next step
    # the router losses reach the training loss (and only in training)
    model = Transformer(_cfg(aux_loss_coef=0.5, z_loss_coef=0.1))
    ids = torch.randint(0, 37, (2, 16))
    with_router = model(ids, ids)
    plain = model.lm_head.loss(model.lm_head(model._hidden(ids, None, 0)), ids)
    blocks = [b.mlp for b in model.layers]
    extra = sum(b.aux_loss for b in blocks)
    assert with_router.item() == pytest.approx((plain + extra).item(), rel=1e-6)
    assert extra.item() > 0.5  # aux >= 1 per block at coefficient 0.5
    model.eval()
    assert model(ids, ids).item() == pytest.approx(plain.item(), rel=1e-6)


def test_aux_free_bias_moves_a_skewed_router_toward_balance():
    torch.manual_seed(0)
    moe = MoE(_cfg(num_experts=4, top_k=1, aux_loss_coef=0.0, bias_update_rate=0.02), layer=3)
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.3)
        moe.router.weight[0] += 0.5  # x has a positive mean: expert 0 wins most tokens
        for p in moe.experts.parameters():
            p.normal_(0, 0.1)
        moe.reset_state()
    moe.train()
    x = torch.randn(8, 16, 16) + 0.3
    cvs, max_loads = [], []
    for _ in range(40):
        moe(x)
        stats = end_of_step(moe)
        cvs.append(stats["moe/load_cv/3"])
        max_loads.append(stats["moe/load_max/3"])
    assert cvs[0] > 1.0 and max_loads[0] > 0.7 * 128  # skewed to begin with
    assert max(cvs[-10:]) < 0.2 and max(max_loads[-10:]) < 0.35 * 128  # 32 = balanced
    assert moe.expert_bias[0] < -0.4 and (moe.expert_bias[1:] > 0.4).all()
    # the same forward without the bias stays skewed (the bias keeps choosing with the update
    # rule off: DeepSeek-V3's last phase has rate 0 and its learned bias)
    learned = moe.expert_bias.clone()
    moe.bias_rate = 0.0
    moe(x)
    assert end_of_step(moe)["moe/load_cv/3"] < 0.2
    moe.expert_bias.zero_()
    moe(x)
    assert end_of_step(moe)["moe/load_cv/3"] > 1.0
    moe.expert_bias.copy_(learned)
    moe.bias_rate = 0.02
    # the bias chooses the experts; it does not weight them: gates are the plain scores
    _, idx, gates = moe.route(x.reshape(-1, 16))
    assert torch.allclose(gates, torch.ones_like(gates) * 1.0)  # top-1 renormalised
    # the bias stays fp32 when the module is cast (bf16 training)
    moe.to(torch.bfloat16)
    assert moe.expert_bias.dtype == torch.float32 and moe.router.weight.dtype == torch.bfloat16


def test_capacity_drops_and_counts_assignments_past_it():
    torch.manual_seed(0)
    moe = MoE(_cfg(num_experts=4, top_k=2, dropless=False, capacity_factor=0.5), layer=0)
    with torch.no_grad():
        moe.router.weight.normal_(0, 1.0)
        moe.router.weight[1] += 1.0
        for p in moe.experts.parameters():
            p.normal_(0, 0.3)
        moe.reset_state()
    moe.train()
    x = torch.randn(1, 16, 16) + 0.3
    out = moe(x)[0]
    n, k, E = 16, 2, 4
    cap = math.ceil(0.5 * n * k / E)  # 4 assignments per expert
    _, idx, gates = moe.route(x[0])
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    dropped = int((counts - counts.clamp(max=cap)).sum())
    assert dropped > 0
    # expected: expert e computes its first `cap` tokens in token order, the rest add nothing
    want = torch.zeros(n, 16)
    seen = [0] * E
    ex = moe.experts
    for t in range(n):
        for j in range(k):
            e = int(idx[t, j])
            if seen[e] < cap:
                h = torch.nn.functional.silu(x[0, t] @ ex.w1[e].t()) * (x[0, t] @ ex.w3[e].t())
                want[t] += gates[t, j] * (h @ ex.w2[e].t())
            seen[e] += 1
    # assignments of one token are in sorted order by expert, not by j: both counted above
    assert torch.allclose(out, want, atol=1e-5)
    assert end_of_step(moe)["moe/dropped"] == dropped


# ----------------------------------------------------------------------------- tensor parallel


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return float((a - b).norm() / max(float(b.norm()), floor, 1e-30))


def _tp_case(rank: int, world: int, moe: dict, sp: bool) -> dict:
    cfg = ModelConfig(
        vocab_size=37,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=16,
        moe=MoEConfig(**{"interval": 1, "num_experts": 4, "top_k": 2, **moe}),
    )
    ref, tp, topo, init = reference_and_tensor_parallel(cfg, world, rank, sp)
    assert all(
        torch.equal(init[n], p.detach()[:37] if "emb" in n or "lm_head" in n else p.detach())
        for n, p in ref.named_parameters()
    )
    # a small lr, as in tests/distributed/test_tensor_parallel.py: AdamW amplifies round-off in tiny gradients
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-4) for m in (ref, tp)]
    gen = torch.Generator().manual_seed(1)
    losses, errs = [], []
    for _ in range(3):
        x = torch.randint(0, 37, (2, 16), generator=gen)
        pair = []
        for model, opt in zip((ref, tp), opts):
            opt.zero_grad()
            loss = model(x, x)
            loss.backward()
            pair.append(loss.item())
        losses.append(pair)
        ref_g = {
            n: p.grad[:37] if "emb" in n or "lm_head" in n else p.grad
            for n, p in ref.named_parameters()
        }
        total = float(torch.stack([g.norm() for g in ref_g.values()]).norm())
        worst = 0.0
        for n, g in full_gradients(tp, world, topo.group("tp")).items():
            g = g[:37] if "emb" in n or "lm_head" in n else g
            worst = max(worst, _rel(g, ref_g[n], 1e-3 * total))
        errs.append(worst)
        for opt in opts:
            opt.step()
        stats = [end_of_step(m) for m in (ref, tp)]  # the same routing, the same bias updates
        assert stats[0].keys() == stats[1].keys()
        for key, value in stats[0].items():
            assert stats[1][key] == pytest.approx(value, rel=1e-5, abs=1e-9), (key, stats)
    biases = [[b.mlp.expert_bias.tolist() for b in m.layers] for m in (ref, tp)]
    return {"losses": losses, "errs": errs, "biases": biases}


def _tp_suite(rank: int, world: int) -> dict:
    cases = {
        "swiglu-gated-shared-aux-z-bias": dict(
            num_shared_experts=1,
            shared_gate=True,
            aux_loss_coef=0.1,
            z_loss_coef=0.01,
            bias_update_rate=0.01,
        ),
        "sigmoid-capacity": dict(
            score="sigmoid", dropless=False, capacity_factor=1.0, aux_loss_coef=0.1
        ),
    }
    return {
        f"{name}/{sp}": _tp_case(rank, world, moe, sp)
        for name, moe in cases.items()
        for sp in (False, True)
    }


@pytest.mark.multiprocess
def test_tensor_parallel_moe_equals_one_process():
    for result in run_ranks(2, _tp_suite):
        for case, r in result.items():
            for ref_loss, tp_loss in r["losses"]:
                assert abs(tp_loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, r["losses"])
            assert max(r["errs"]) < 1e-5, (case, r["errs"])
            assert r["biases"][0] == r["biases"][1], case


# ----------------------------------------------------------------------------- training


def _records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


MOE_ARGS = tiny_overrides(
    "stdlib",
    **{
        "train.steps": 4,
        "eval.interval": 0,
        "eval.at_end": "false",
        "checkpoint.interval": 2,
        "data.max_bytes": 50000,
        "model.moe.interval": 1,
        "model.moe.num_experts": 4,
        "model.moe.top_k": 2,
        "model.moe.d_expert": 32,
        "model.moe.z_loss_coef": 0.001,
        "model.moe.bias_update_rate": 0.003,
    },
)


@pytest.mark.multiprocess
def test_training_logs_moe_metrics_and_resumes_exactly(tmp_path):
    full = tmp_path / "full"
    out = run_cli("train", "configs/quickstart.yaml", *MOE_ARGS, "--run-dir", str(full))
    assert out.returncode == 0, out.stderr[-3000:]
    records = _records(full)
    for step in (1, 2, 3, 4):
        r = records[step]
        assert 0.5 < r["moe/aux_loss"] < 4 and r["moe/z_loss"] > 0, r  # 1: uniform load
        assert r["moe/dropped"] == 0
        for layer in (0, 1):
            # tokens per step: 8 sequences x 32 positions x top-2 over 4 experts
            assert r[f"moe/load_min/{layer}"] <= 128 <= r[f"moe/load_max/{layer}"]
            assert r[f"moe/load_cv/{layer}"] >= 0
    from safetensors.torch import load_file

    saved = load_file(str(full / "checkpoints/step_0000002/moe_router/stage_000.safetensors"))
    assert sorted(saved) == ["layers.0.mlp.expert_bias", "layers.1.mlp.expert_bias"]
    assert all(float(t.abs().max()) > 1e-3 for t in saved.values())  # the bias moved

    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000004")
    (resumed / "checkpoints" / "latest").write_text("step_0000002\n")
    out = run_cli("train", "configs/quickstart.yaml", *MOE_ARGS, "--run-dir", str(resumed))
    assert out.returncode == 0 and "resumed from" in out.stdout + out.stderr, out.stderr[-3000:]
    a, b = _records(full), _records(resumed)
    for step in (3, 4):
        for key in ("loss", "grad_norm", "moe/aux_loss", "moe/load_max/0", "moe/load_cv/1"):
            assert b[step][key] == a[step][key], (step, key)
    final = [
        load_file(str(run / "checkpoints/step_0000004/moe_router/stage_000.safetensors"))
        for run in (full, resumed)
    ]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


# ----------------------------------------------------------------------------- counting


@pytest.mark.parametrize(
    "moe,model",
    [
        (dict(), dict()),
        (
            dict(num_shared_experts=2, d_shared=24, d_expert=40, top_k=3),
            dict(activation="gelu", bias=True),
        ),
        (dict(interval=2, top_k=1), dict(n_layers=4, tie_embeddings=False)),
    ],
)
def test_parameters_total_and_active_and_flops_count_active(moe, model):
    from torch.utils.flop_counter import FlopCounterMode

    from megaformer.analysis.flops import forward_flops, matmul_parameters
    from megaformer.analysis.memory import Layout, params_per_rank
    from megaformer.analysis.params import count_parameters

    base = dict(vocab_size=37, d_model=16, n_layers=2, n_heads=2, max_seq_len=16)
    cfg = ModelConfig(
        **{**base, **model}, moe=MoEConfig(**{"interval": 1, "num_experts": 4, "top_k": 2, **moe})
    )
    net = Transformer(cfg)
    counts = count_parameters(cfg)
    assert counts["total"] == net.num_parameters() == sum(p.numel() for p in net.parameters())
    blocks = [b.mlp for b in net.layers if isinstance(b.mlp, MoE)]
    assert len(blocks) == cfg.moe_layers >= 1
    k, E = cfg.moe.top_k, cfg.moe.num_experts
    idle = sum(p.numel() for b in blocks for p in b.experts.parameters()) * (E - k) // E
    assert counts["active"] == counts["total"] - idle
    # the FLOPs of the MoE FFNs' forward are those of the active parameters, as counted
    x = torch.randn(2, 16, 16)
    dense = forward_flops(ModelConfig(**{**base, **model}), 16)
    with FlopCounterMode(display=False) as fc:
        for b in blocks:
            b(x[:1])
    n_dense = cfg.n_layers - cfg.moe_layers
    mlp_moe = forward_flops(cfg, 16).mlp - n_dense * dense.mlp // cfg.n_layers
    assert fc.get_total_flops() == mlp_moe
    assert matmul_parameters(cfg) == (
        counts["active"] - counts["embedding"] - _norms(net) - _biases(net) + 37 * 16
    )
    assert params_per_rank(cfg, Layout(), 37) == counts["total"]  # memory: every expert
    half = params_per_rank(cfg, Layout(tp=2), 37)  # experts split over TP, the router not
    router = sum(b.router.weight.numel() for b in blocks)
    experts = sum(p.numel() for b in blocks for p in b.experts.parameters())
    assert half < counts["total"] - experts // 2 + router


def _norms(net) -> int:
    return sum(p.numel() for n, p in net.named_parameters() if "norm" in n)


def _biases(net) -> int:
    return sum(
        p.numel() for n, p in net.named_parameters() if n.endswith("bias") and "norm" not in n
    )


# ----------------------------------------------------------------------------- conversion

HF_COMMON = dict(
    vocab_size=300,
    bos_token_id=256,
    eos_token_id=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
)
HF_MOE = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, sliding_window=8),
        dict(interval=1, d_expert=96),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=4,
            moe_intermediate_size=32,
            head_dim=32,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            mlp_only_layers=[],
        ),
        dict(interval=2, d_expert=32),
    ),
    # a shared expert behind a sigmoid gate; Qwen2's q/k/v biases; no renormalisation
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
            norm_topk_prob=False,
            mlp_only_layers=[],
        ),
        dict(
            interval=1,
            d_expert=32,
            renormalize=False,
            num_shared_experts=1,
            d_shared=48,
            shared_gate=True,
        ),
    ),
}


@pytest.mark.parametrize("kind", list(HF_MOE))
def test_mixtral_and_qwen3_moe_import_with_logit_parity_and_export_identically(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from megaformer.checkpoint.hf.convert import export_to_hf, import_from_hf
    from megaformer.checkpoint.hf.tokenizer_files import byte_tokenizer_as_hf
    from megaformer.generation import load_checkpoint_model

    config_cls, model_cls, extra, want = HF_MOE[kind]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**HF_COMMON, **extra))
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:  # norm gains of 1 would hide a wrong mapping
                p.add_(0.2 * torch.randn_like(p))
    hf.eval().save_pretrained(tmp_path / "hf")
    byte_tokenizer_as_hf().save(str(tmp_path / "hf" / "tokenizer.json"))
    run = import_from_hf(tmp_path / "hf", tmp_path / "run")
    ours, _, cfg, _ = load_checkpoint_model(run)
    moe = cfg.model.moe
    assert (moe.interval, moe.num_experts, moe.top_k, moe.d_expert, moe.renormalize) == (
        want["interval"],
        4,
        2,
        want["d_expert"],
        want.get("renormalize", True),
    )
    assert (moe.num_shared_experts, moe.d_shared, moe.shared_gate) == (
        want.get("num_shared_experts", 0),
        want.get("d_shared"),
        want.get("shared_gate", False),
    )
    ids = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits
        assert (ours(ids) - theirs).abs().max().item() <= 1e-5 and theirs.std().item() > 0.1
    back = export_to_hf(run, tmp_path / "back")
    a, b = (
        {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        for d in (tmp_path / "hf", back)
    )
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    again = transformers.AutoModelForCausalLM.from_pretrained(
        back, local_files_only=True, dtype=torch.float32
    ).eval()
    assert type(again).__name__ == model_cls
    with torch.no_grad():
        assert (again(ids).logits - theirs).abs().max().item() == 0.0


def test_export_refuses_moe_options_the_class_lacks():
    from megaformer.checkpoint.hf.convert import choose_architecture
    from megaformer.config import config_from_dict
    from megaformer.errors import ConversionError

    def cfg(**moe):
        return config_from_dict(
            {
                "model": {
                    "vocab_size": 300,
                    "n_layers": 2,
                    "moe": {"interval": 1, "num_experts": 4, **moe},
                }
            }
        )

    assert choose_architecture(cfg(), None).hf_class == "MixtralForCausalLM"
    with pytest.raises(
        ConversionError, match="model.moe.interval=1 cannot be expressed by LlamaForCausalLM"
    ):
        choose_architecture(cfg(), "llama")
    with pytest.raises(
        ConversionError,
        match="model.moe.num_shared_experts=1 cannot be expressed by MixtralForCausalLM",
    ):
        choose_architecture(cfg(num_shared_experts=1), "mixtral")
    with pytest.raises(
        ConversionError,
        match="model.moe.bias_update_rate=0.001 cannot be expressed by Qwen3MoeForCausalLM",
    ):
        choose_architecture(cfg(bias_update_rate=0.001), "qwen3_moe")
    with pytest.raises(ConversionError, match="no Hugging Face class can express this model"):
        choose_architecture(cfg(score="sigmoid"), None)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_gemm_path_equals_the_loop_over_experts(activation):
    """The CUDA path (torch._grouped_mm, bf16) against the loop, run on CPU where torch has it."""
    from megaformer.model.moe import Experts

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    torch.manual_seed(0)
    ex = Experts(4, 16, 24, activation).to(torch.bfloat16)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.2)
    counts = torch.tensor([5, 0, 9, 2])  # an expert without tokens too
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    grads = []
    for path in (ex.loop, ex.grouped):
        ex.zero_grad()
        xi = x.clone().requires_grad_()
        y = path(xi, counts)
        y.float().square().sum().backward()
        grads.append(
            (y.detach().float(), xi.grad.float(), [p.grad.float() for p in ex.parameters()])
        )
    (ya, xa, pa), (yb, xb, pb) = grads
    assert torch.allclose(ya, yb, rtol=2e-2, atol=2e-2) and ya.abs().max() > 0.1
    assert torch.allclose(xa, xb, rtol=2e-2, atol=5e-2)
    for a, b in zip(pa, pb):
        assert (a - b).norm() <= 2e-2 * a.norm()
    assert float(pa[0][1].abs().max()) == float(pb[0][1].abs().max()) == 0.0  # expert 1: no rows


@pytest.mark.parametrize(
    "coefs",
    [dict(aux_loss_coef=0.1, z_loss_coef=0.01), dict(aux_loss_coef=0.0, bias_update_rate=0.01)],
)
def test_full_recompute_gives_the_same_gradients_and_counts_the_load_once(coefs):
    from megaformer.parallel.recompute import apply_recompute

    cfg = _cfg(**coefs)
    torch.manual_seed(0)
    plain = Transformer(cfg)
    torch.manual_seed(0)
    ckpt = Transformer(cfg)
    apply_recompute(ckpt.layers, "full", 1, None)
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    for model in (plain, ckpt):
        loss = model(ids, ids)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    grads = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7), name
    for model in (plain, ckpt):  # 2 x 16 tokens, 2 experts each: counted once, not re-counted
        assert [int(b.mlp.step_load.sum()) for b in model.layers] == [64, 64]
    a, b = end_of_step(plain), end_of_step(ckpt)
    assert a == pytest.approx(b)


def test_router_runs_in_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    moe = MoE(_cfg(num_shared_experts=1), layer=0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe.reset_state()
    x = torch.randn(2, 5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
        logits, _, gates = moe.route(x.reshape(-1, 16))
    assert y.dtype == torch.bfloat16 and logits.dtype == gates.dtype == torch.float32
    assert torch.allclose(logits, x.reshape(-1, 16) @ moe.router.weight.t(), atol=1e-6)
    y.float().sum().backward()
    assert float(moe.router.weight.grad.abs().sum()) > 0


@pytest.mark.multiprocess
def test_pipeline_stages_split_moe_blocks_and_equal_one_process(tmp_path):
    """PP=2 (a block per stage) with the aux-loss-free bias: the losses of one process, and each
    stage writes its own block's bias into the checkpoint."""
    from safetensors.torch import load_file

    from tests.helpers import run_torchrun

    args = [
        *MOE_ARGS,
        "model.moe.aux_loss_coef=0",
        "model.moe.z_loss_coef=0",
        "checkpoint.interval=0",
    ]
    one, pp = tmp_path / "one", tmp_path / "pp"
    assert run_cli("train", "configs/quickstart.yaml", *args, "--run-dir", str(one)).returncode == 0
    out = run_torchrun(
        2, "train", "configs/quickstart.yaml", *args, "parallel.pipeline=2", "--run-dir", str(pp)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = _records(one), _records(pp)
    for step in (1, 2, 3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
        assert b[step]["moe/load_cv/0"] == pytest.approx(a[step]["moe/load_cv/0"], rel=1e-6)
    files = sorted(p.name for p in (pp / "checkpoints/step_0000004/moe_router").iterdir())
    assert files == ["stage_000.safetensors", "stage_001.safetensors"]
    ref = load_file(str(one / "checkpoints/step_0000004/moe_router/stage_000.safetensors"))
    got = {}
    for f in files:
        got.update(load_file(str(pp / "checkpoints/step_0000004/moe_router" / f)))
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize(
    "activation,moe",
    [
        (
            "swiglu",
            dict(
                interval=1, num_experts=8, top_k=2, d_expert=64, num_shared_experts=1, d_shared=128
            ),
        ),
        ("gelu", dict(interval=2, num_experts=4, top_k=1, d_expert=128)),
    ],
)
def test_memory_estimate_matches_measured_cpu_memory(activation, moe):
    """Activations held after the forward and the peak of an AdamW step, against the CPU
    allocator's record (as tests/unit/test_memory.py does for dense models)."""
    from megaformer.analysis.memory import Layout, activation_bytes, estimate
    from tests.unit.test_memory import _measured

    cfg = ModelConfig(
        vocab_size=64,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=64,
        activation=activation,
        moe=MoEConfig(**moe),
    )
    act, peak = _measured(cfg, 4, 64, "none", None)
    layout = Layout(micro_batch=4, device="cpu")
    assert abs(activation_bytes(cfg, 64, layout)["total"] / act - 1) < 0.02
    assert abs(estimate(cfg, 64, layout).total / peak - 1) < 0.08


def test_inspect_reports_the_expert_load_of_a_prompt():
    """megaformer inspect's expert load: every block routes each token to top_k experts."""
    from megaformer.diagnostics.inspect import _expert_load, format_expert_load

    torch.manual_seed(0)
    model = Transformer(_cfg(top_k=2)).eval()
    ids = torch.randint(0, 37, (1, 11), generator=torch.Generator().manual_seed(2))
    load: dict = {}
    with torch.no_grad(), _expert_load(model, load):
        model(ids)
    assert sorted(load) == [0, 1] and all(
        sum(row) == 11 * 2 and len(row) == 4 for row in load.values()
    )
    text = format_expert_load(load, 11, 2)
    assert text.splitlines()[0] == "expert load: tokens routed to each expert (11 tokens x top-2)"
    assert len(text.splitlines()) == 3 and "cv" in text.splitlines()[1]
    assert not model.layers[0].mlp._forward_pre_hooks  # the hooks are gone afterwards


# ----------------------------------------------------------------------------- no host reads


def _bf16_autocast_block():
    """An MoE block with fp32 weights run under CPU bf16 autocast (what ``bench`` runs)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=37,
        d_model=16,
        n_layers=1,
        n_heads=2,
        max_seq_len=16,
        d_ffn=32,
        moe=MoEConfig(interval=1, num_experts=4, top_k=2),
    )
    return Transformer(cfg).layers[0], torch.randn(2, 16, 16, requires_grad=True)


def test_compiled_moe_block_is_one_graph_on_the_grouped_path():
    """The routing, counts, dispatch, grouped GEMMs, combine and load counters trace as one graph
    (bincount, the graph-task id and the counts' host read each broke it before)."""
    import torch._dynamo

    from megaformer.kernels.selection import mark_constant_for_compile, track

    block, x = _bf16_autocast_block()
    with torch.autocast("cpu", dtype=torch.bfloat16), track() as ran:
        block(x)
    assert ran["experts"] == {"grouped"}
    mark_constant_for_compile()
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(block)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_moe_forward_and_backward_read_nothing_back_to_the_host(monkeypatch):
    """No .tolist() / .item() on the non-expert-parallel path (expert parallelism still reads the
    all-to-all split sizes once per block: torch takes them as Python ints)."""
    block, x = _bf16_autocast_block()

    def trap(*_args, **_kwargs):
        raise AssertionError("host read inside the MoE block")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = block(x)
    monkeypatch.setattr(torch.Tensor, "tolist", trap)
    monkeypatch.setattr(torch.Tensor, "item", trap)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    y.float().square().sum().backward()
    monkeypatch.undo()
    assert torch.equal(y, ref) and x.grad.abs().max().item() > 0
    assert block.mlp.step_load.sum().item() == 2 * 2 * 16 * 2  # two forwards of 32 tokens x top-2


def test_experts_rule_names_what_the_experts_run():
    from megaformer.kernels.selection import choose, model_plan

    assert choose("experts", "cpu", torch.float32, d_model=16, d_ffn=32).impl == "loop"
    assert (
        choose(
            "experts", "cpu", torch.float32, compute_dtype=torch.bfloat16, d_model=16, d_ffn=32
        ).impl
        == "grouped"
    )
    assert choose("experts", "cpu", torch.bfloat16, d_model=16, d_ffn=36).impl == "loop"
    plan = dict(model_plan(_cfg(), "cpu", torch.bfloat16, autocast=True))
    assert plan["experts"].impl == ("grouped" if hasattr(torch, "_grouped_mm") else "loop")


def test_combine_accumulates_the_top_k_outputs_in_fp32():
    """y_n = sum_j g_nj FFN_ej(x_n) summed in fp32 and rounded to bf16 once."""
    moe = MoE(_cfg(top_k=2), 0).to(torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 8, 16, dtype=torch.bfloat16)
    _, idx, gates = moe.route(x.reshape(-1, 16))
    want = torch.zeros(8, 16)
    for n in range(8):
        for j in range(2):
            e = int(idx[n, j])
            xe = x[0, n : n + 1]
            h = moe.experts._act(xe @ moe.experts.w1[e].t(), xe @ moe.experts.w3[e].t())
            want[n] += gates[n, j].float() * (h @ moe.experts.w2[e].t()).float()[0]
    assert torch.equal(moe(x)[0], want.to(torch.bfloat16))
