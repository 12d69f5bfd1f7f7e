"""Muon in one process equals a hand-written reference of the algorithm; the split between Muon and
AdamW; the owners of a distributed step."""

from __future__ import annotations

import math

import pytest
import torch

from megaformer.config import TrainConfig
from megaformer.runtime.muon import Muon, assign_owners, newton_schulz, uses_muon
from megaformer.runtime.optimizer import build_optimizer


def reference_ns(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic Newton-Schulz iteration written out for one matrix."""
    x = g.clone()
    if g.shape[0] > g.shape[1]:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * (a @ a)) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def reference_muon(w, grads, lr, wd, mu, steps, nesterov=True):
    """Moonlight's Muon (bitwise) for one matrix over several gradients: momentum, Nesterov, NS, RMS-matching
    scale 0.2 sqrt(max(m, n)), decoupled weight decay."""
    w, m = w.clone(), torch.zeros_like(w)
    for g in grads:
        m = mu * m + g
        u = g.add(m, alpha=mu) if nesterov else m  # g + mu m, rounded once as the optimizer does
        o = reference_ns(u, steps)
        w = w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(w.shape)) * o
    return w, m


def test_newton_schulz_orthogonalises():
    torch.manual_seed(0)
    g = torch.randn(24, 40)
    o = newton_schulz(g, 5)
    s = torch.linalg.svdvals(o)
    assert float(s.min()) > 0.5 and float(s.max()) < 1.3  # the quintic's band around 1
    assert torch.allclose(o, reference_ns(g, 5), atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_equals_the_reference_on_a_few_matrices(nesterov):
    torch.manual_seed(0)
    shapes = [(16, 32), (48, 16), (20, 20)]
    weights = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for _ in range(3)] for s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    group = {
        "params": params,
        "use_muon": True,
        "lr": 0.02,
        "weight_decay": 0.1,
        "momentum": 0.95,
        "nesterov": nesterov,
        "ns_steps": 5,
    }
    opt = Muon([group], {"lr": 0.02})
    for step in range(3):
        for p, gs in zip(params, grads):
            p.grad = gs[step].clone()
        opt.step()
    for p, w, gs in zip(params, weights, grads):
        ref_w, ref_m = reference_muon(w, gs, 0.02, 0.1, 0.95, 5, nesterov)
        assert torch.equal(opt.state[p]["momentum"], ref_m)
        assert torch.equal(p.detach(), ref_w), float((p - ref_w).abs().max())
        assert not torch.allclose(p.detach(), w)


def test_expert_matrices_are_orthogonalised_each_on_its_own():
    torch.manual_seed(0)
    stacked = torch.randn(3, 8, 12)
    batched = newton_schulz(stacked, 5)
    for e in range(3):
        assert torch.allclose(batched[e], reference_ns(stacked[e], 5), atol=1e-6)


def test_the_split_between_muon_and_adamw():
    from megaformer.config import MoEConfig
    from megaformer.model.transformer import Transformer
    from tests.helpers import tiny_model

    cfg = tiny_model(
        position="learned",
        tie_embeddings=False,
        bias=True,
        moe=MoEConfig(interval=1, num_experts=4, num_shared_experts=1, shared_gate=True),
    )
    model = Transformer(cfg)
    opt = build_optimizer(model, TrainConfig(optimizer="muon", muon_adamw_params=["attn.wo"]))
    muon = {n for n, p in model.named_parameters() if opt.state_keys(p) == ("momentum",)}
    assert muon == {
        n
        for n, p in model.named_parameters()
        if n.startswith("layers.")
        and p.dim() >= 2
        and not any(k in n for k in ("router", "shared_gate", "attn.wo"))
    }
    assert any("experts.w1" in n for n in muon) and any("attn.wq" in n for n in muon)
    assert not uses_muon("tok_embeddings.weight", torch.zeros(4, 4))
    assert not uses_muon("layers.0.attn.wq.bias", torch.zeros(4))
    # Muon's learning rate follows train.lr unless set
    lrs = {g["use_muon"]: g["lr"] for g in opt.param_groups}
    assert lrs == {True: TrainConfig().lr, False: TrainConfig().lr}
    opt = build_optimizer(model, TrainConfig(optimizer="muon", muon_lr=0.05))
    assert {g["lr"] for g in opt.param_groups if g["use_muon"]} == {0.05}


def test_adamw_part_equals_torch_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8))
    ref = torch.nn.Embedding(10, 8)
    ref.load_state_dict(model[0].state_dict())
    t = TrainConfig(optimizer="muon", adam_impl="foreach")
    opt = build_optimizer(model, t)
    ref_opt = torch.optim.AdamW(
        ref.parameters(),
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        weight_decay=t.weight_decay,
        foreach=True,
    )  # "0.weight": a matrix outside the blocks, AdamW with decay
    for _ in range(3):
        g = torch.randn(10, 8)
        model[0].weight.grad, ref.weight.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert torch.equal(model[0].weight, ref.weight)


def test_owners_balance_whole_parameters():
    costs = [100, 10, 60, 50, 40, 10]
    owners = assign_owners(costs, 2)
    load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert sorted(load) == [130, 140]
    assert assign_owners(costs, 1) == [0] * 6


@pytest.mark.parametrize(
    "raw,message",
    [
        (
            {"train": {"optimizer": "muon"}, "parallel": {"zero_stage": 3}},
            "train.optimizer=muon with parallel.zero_stage=3: Newton-Schulz needs each whole",
        ),
        (
            {"train": {"optimizer": "muon", "precision": "bf16"}, "parallel": {"zero_stage": 1}},
            "use train.precision=fp32",
        ),
        ({"train": {"optimizer": "sgd"}}, "train.optimizer"),
        ({"train": {"muon_momentum": 1.0}}, "train.muon_momentum=1.0: must be in [0, 1)"),
        ({"train": {"muon_ns_steps": 0}}, "train.muon_ns_steps=0: must be > 0"),
    ],
)
def test_muon_config_errors_are_one_line(raw, message):
    from megaformer.config import config_from_dict
    from megaformer.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("moe", [False, True])
def test_memory_estimate_counts_muons_state(moe):
    """The estimator's optimizer bytes against the state Muon allocates in one process (within 5%;
    exact but for the AdamW step counters, scalars)."""
    from megaformer.analysis.measure import optimizer_state_tensors, tensor_bytes
    from megaformer.analysis.memory import Layout, state_bytes
    from megaformer.config import ModelConfig, MoEConfig
    from megaformer.model.transformer import Transformer

    extra = {"moe": MoEConfig(interval=2, num_experts=4, num_shared_experts=1)} if moe else {}
    cfg = ModelConfig(
        vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, **extra
    )
    model = Transformer(cfg)
    opt = build_optimizer(model, TrainConfig(optimizer="muon"))
    x = torch.zeros(1, 4, dtype=torch.long)
    model(x, x).backward()
    opt.step()
    est = state_bytes(cfg, Layout(optimizer="muon"))
    have = tensor_bytes(optimizer_state_tensors(opt))
    assert abs(est["optimizer"] / have - 1) < 0.05, (est["optimizer"], have)
    adamw = state_bytes(cfg, Layout())["optimizer"]
    assert est["optimizer"] < 0.75 * adamw  # one moment instead of two on the block matrices


def test_plan_counts_muons_state_and_refuses_zero3():
    from megaformer.analysis.memory import Layout
    from megaformer.analysis.planner import Hardware, evaluate, plan
    from megaformer.config import load_config

    over = ["train.global_batch_size=64", "train.precision=fp32", "parallel.zero_stage=1"]
    adamw = load_config("configs/llama-7b.yaml", over)
    muon = load_config("configs/llama-7b.yaml", [*over, "train.optimizer=muon"])
    hw = Hardware(16, 8, 80, 989.5, 450, 50, 0.6)
    lay = dict(tp=2, dp=8, zero=1, micro_batch=1, grad_accum=8, precision="fp32")
    a = evaluate(adamw, hw, Layout(**lay))
    m = evaluate(muon, hw, Layout(**lay, optimizer="muon"))
    assert m["memory"]["optimizer"] < 0.75 * a["memory"]["optimizer"]
    assert m["checkpoint"]["total_gb"] < 0.75 * a["checkpoint"]["total_gb"]
    assert m["time"]["optimizer_comm"] > 0 and a["time"]["optimizer_comm"] == 0
    r = plan(muon, hw, micro_batches=(1,))
    assert all(x["layout"]["optimizer"] == "muon" for x in r["feasible"])
    assert not any(x["layout"]["zero"] == 3 for x in r["feasible"])
    assert any("ZeRO-3 with Muon" in x["reason"] for x in r["rejected"])


@pytest.mark.slow
def test_crafted_state_names_are_refused(tmp_path):
    """index.json's per-parameter state names are checked before use: only known names, master
    first, none twice; a name the shard files do not hold is an error naming the file."""
    import json
    import shutil

    from megaformer.checkpoint.sharded import ShardedState
    from megaformer.errors import CheckpointError
    from tests.helpers import run_cli, tiny_overrides

    run = tmp_path / "run"
    over = tiny_overrides("stdlib", **{"train.steps": 2, "train.optimizer": "muon"})
    proc = run_cli("train", "configs/quickstart.yaml", *over, "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = run / "checkpoints" / "step_0000002"
    assert ShardedState(ckpt).optimizer == "muon"
    name = "layers.0.attn.wq.weight"
    for bad in (["master", "../x"], ["momentum"], ["master", "momentum", "momentum"], "x"):
        copy = tmp_path / "bad"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(ckpt, copy)
        path = copy / "state" / "index.json"
        index = json.loads(path.read_text())
        if isinstance(bad, list):
            index["keys"][name] = bad
        else:
            index["keys"] = bad
        path.write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="index.json: missing or corrupt"):
            ShardedState(copy)
    index = json.loads((ckpt / "state" / "index.json").read_text())
    index["keys"][name] = ["master", "exp_avg", "exp_avg_sq"]  # names its file does not hold
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="rank_00000.safetensors"):
        ShardedState(copy).whole(name, "exp_avg")


def test_buckets_bound_the_gathered_matrices_and_change_no_number(monkeypatch):
    """Newton-Schulz runs on whole matrices at most NS_BUCKET_BYTES at a time (one larger matrix
    alone); the update is the same bucketed or not."""
    from megaformer.runtime import muon

    torch.manual_seed(0)
    shapes = [(16, 32), (16, 32), (48, 16), (20, 20), (16, 32)]
    weights = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]

    def run(budget: int) -> tuple[list, list]:
        monkeypatch.setattr(muon, "NS_BUCKET_BYTES", budget)
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        group = {"params": params, "use_muon": True, "lr": 0.02, "weight_decay": 0.1}
        group.update(momentum=0.95, nesterov=True, ns_steps=5)
        opt = Muon([group], {"lr": 0.02})
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        return opt._buckets(params), params

    one, whole = run(1 << 30)
    split, parts = run(4 * 16 * 32 * 2)  # two of the largest matrices per bucket
    assert one == [(0, 5)] and split == [(0, 2), (2, 3), (3, 5)]
    assert max(4 * sum(shapes[i][0] * shapes[i][1] for i in range(a, b)) for a, b in split) <= (
        4 * 16 * 32 * 2
    )
    for a, b in zip(whole, parts):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_the_busiest_rank_holds_at_least_the_largest_parameters_state():
    from megaformer.analysis.memory import Layout, state_bytes
    from megaformer.config import ModelConfig

    cfg = ModelConfig(vocab_size=128000, d_model=64, n_layers=2, n_heads=4, max_seq_len=16)
    one = state_bytes(cfg, Layout(optimizer="muon"))["optimizer"]
    many = state_bytes(cfg, Layout(dp=64, zero=1, optimizer="muon"))["optimizer"]
    assert many == 8 * 128000 * 64 > one / 64  # the embedding's moments sit whole on one rank
