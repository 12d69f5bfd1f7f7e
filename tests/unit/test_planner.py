"""``megaformer plan``: feasibility rules, memory fit, ordering, JSON, errors."""

from __future__ import annotations

import json

import pytest

from megaformer.analysis.planner import Hardware, plan
from megaformer.config import load_config
from tests.helpers import assert_one_line_error, cli_main


def test_plan_rules_and_order():
    cfg = load_config("configs/llama-7b.yaml", ["train.global_batch_size=64"])
    hw = Hardware(
        gpus=16,
        gpus_per_node=8,
        memory_gb=80,
        peak_tflops=989.5,
        intra_gbps=450,
        inter_gbps=50,
        efficiency=0.6,
    )
    r = plan(cfg, hw, micro_batches=(1, 2))
    feasible = r["feasible"]
    assert feasible, r["rejected"][:3]
    times = [x["step_time_s"] for x in feasible]
    assert times == sorted(times)
    for x in feasible:
        L = x["layout"]
        assert L["tp"] * L["pp"] * L["dp"] == 16
        assert x["memory_gb"] + 2.0 <= 80
        assert not (L["zero"] == 3 and L["tp"] > 1) and not (L["zero"] >= 2 and L["pp"] > 1)
        assert 0 < x["mfu"] < 0.6 + 1e-9  # never above the assumed efficiency
    reasons = " ".join(x["reason"] for x in r["rejected"])
    assert "GB >" in reasons and "ZeRO-3 with TP" in reasons
    # 7B in bf16 without any sharding cannot fit 80 GB (16 bytes/param of states alone)
    assert not any(
        x["layout"]["tp"] == x["layout"]["pp"] == 1 and x["layout"]["zero"] == 0 for x in feasible
    )


def test_plan_cli_json_and_errors():
    r = cli_main(
        "plan",
        "configs/gpt2-124m.yaml",
        "--gpus",
        "8",
        "--gpu-mem",
        "40",
        "--gpu",
        "A100",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["feasible"] and out["assumptions"]["memory_gb"] == 40
    for x in out["feasible"]:  # ZeRO's memory table: model states per rank, each part named
        m, zero = x["memory"], x["layout"]["zero"]
        assert {"weights", "grads", "optimizer", "activations", "total"} <= set(m), sorted(m)
        assert m["weights"] > 0 and m["grads"] > 0 and m["optimizer"] > 0
        if zero == 0:  # bf16: 2 + 2 bytes/param, then fp32 master + Adam's two moments: 12
            assert x["layout"]["precision"] == "bf16"
            assert m["grads"] == pytest.approx(m["weights"])
            assert m["optimizer"] == pytest.approx(6 * m["weights"])
        assert m["total"] == pytest.approx(x["memory_gb"])
    assert_one_line_error(
        cli_main("plan", "configs/gpt2-124m.yaml", "--gpus", "8", "--gpu-mem", "40"),
        "--peak-tflops",
    )
    assert_one_line_error(
        cli_main("plan", "configs/gpt2-124m.yaml", "--gpus", "8", "--gpu", "XPU-9"), "unknown GPU"
    )


def test_long_sequences_get_context_parallel_layouts():
    """At 32K tokens the plan offers CP layouts; CP divides the activations and adds its exchange."""
    from megaformer.analysis.memory import Layout, activation_bytes, context_comm_bytes
    from megaformer.analysis.planner import Hardware, plan
    from megaformer.config import load_config

    cfg = load_config(
        "configs/llama-7b.yaml",
        ["data.seq_len=32768", "model.max_seq_len=32768", "train.global_batch_size=16"],
    )
    r = plan(cfg, Hardware(16, 8, 80, 989.5, 450, 50, 0.6), micro_batches=(1,))
    cps = {(x["layout"]["cp"], x["layout"]["cp_mode"]) for x in r["feasible"]}
    assert (2, "ring") in cps and (2, "all_to_all") in cps
    m = cfg.model
    one = activation_bytes(m, 32768, Layout(precision="bf16", tp=1))
    four = activation_bytes(m, 32768, Layout(precision="bf16", tp=1, cp=4, cp_mode="all_to_all"))
    assert four["layers"] == pytest.approx(one["layers"] / 4, rel=1e-6)
    ring = activation_bytes(m, 32768, Layout(precision="bf16", tp=1, cp=4))
    fp32_out = m.n_layers * 32768 // 4 * m.n_heads * m.head_dim * 2  # the ring keeps O in fp32
    assert ring["layers"] == pytest.approx(one["layers"] / 4 + fp32_out, rel=1e-6)
    # ring: K/V (bf16) passed cp - 1 times forward and backward, fp32 dK/dV cp times
    n, hkv = 32768 // 4, m.kv_heads * m.head_dim
    assert (
        context_comm_bytes(m, 32768, Layout(precision="bf16", cp=4))
        == 3 * n * 2 * hkv * 2 * 2 + 4 * n * 2 * hkv * 4
    )
    hq = m.n_heads * m.head_dim
    assert context_comm_bytes(
        m, 32768, Layout(precision="bf16", cp=4, cp_mode="all_to_all")
    ) == pytest.approx(2 * 0.75 * n * (2 * hq + 2 * hkv) * 2)


def test_moe_models_get_expert_parallel_layouts():
    from megaformer.analysis.memory import Layout, state_bytes
    from megaformer.analysis.planner import Hardware, plan
    from megaformer.config import load_config

    cfg = load_config("configs/moe-tiny.yaml", [])
    r = plan(cfg, Hardware(8, 8, 80, 989.5, 450, 50, 0.6), micro_batches=(1,))
    assert {x["layout"]["ep"] for x in r["feasible"]} >= {1, 2}
    m = cfg.model
    # ZeRO-1: expert optimizer states split over DP / EP ranks, dense ones over DP
    one = state_bytes(m, Layout(dp=8, zero=1, precision="bf16"), 384)
    two = state_bytes(m, Layout(dp=8, zero=1, precision="bf16", ep=2), 384)
    assert two["params"] < one["params"]
    assert two["optimizer"] == pytest.approx(one["optimizer"])  # half the experts, twice the copies


def test_fp8_gemms_run_at_the_fp8_peak():
    """train.fp8: the block GEMMs' share of the step at the FP8 peak, the rest at bf16's."""
    from megaformer.analysis.flops import fp8_forward_flops, step_flops
    from megaformer.analysis.memory import Layout
    from megaformer.analysis.planner import Hardware, evaluate

    base = load_config("configs/llama-7b.yaml", ["train.precision=bf16"])
    fp8 = load_config("configs/llama-7b.yaml", ["train.precision=bf16", "train.fp8=tensorwise"])
    hw = Hardware(8, 8, 80, 989.5, 450, 50, 0.5, fp8_tflops=1979.0)
    lay = Layout(tp=1, pp=1, dp=8, zero=1, micro_batch=1, grad_accum=128, precision="bf16")
    a, b = evaluate(base, hw, lay), evaluate(fp8, hw, lay)
    m, s, gbs = base.model, base.seq_len, base.train.global_batch_size
    total = step_flops(m, s, gbs).hardware  # the vocabulary here needs no padding
    f8 = 3 * fp8_forward_flops(m, s) * gbs
    assert a["time"]["compute"] == pytest.approx(total / (8 * 989.5e12 * 0.5))
    assert b["time"]["compute"] == pytest.approx(
        ((total - f8) / 989.5e12 + f8 / 1979e12) / (8 * 0.5)
    )
    assert b["mfu"] > a["mfu"]  # against the same bf16 peak
    assert_one_line_error(
        cli_main(
            "plan",
            "configs/llama-7b.yaml",
            "--gpus",
            "8",
            "--peak-tflops",
            "900",
            "--gpu-mem",
            "80",
            "--intra-bw",
            "400",
            "--inter-bw",
            "50",
            "train.fp8=rowwise",
        ),
        "needs a --gpu with an FP8 peak",
    )


def test_the_build_peak_is_counted():
    """The model's build is a layout's peak when it outgrows the step: ZeRO-3 at DP 512 builds its
    partitions plus one whole block (not the 276 GB fp32 model), ZeRO 0-2 their fp32 shard."""
    from megaformer.analysis.memory import largest_module_params
    from megaformer.analysis.params import count_parameters

    cfg = load_config("configs/llama-70b.yaml")
    hw = Hardware(
        gpus=512,
        gpus_per_node=8,
        memory_gb=80,
        peak_tflops=989.5,
        intra_gbps=450,
        inter_gbps=50,
        efficiency=0.6,
    )
    r = plan(cfg, hw, micro_batches=(1,))
    P, M = count_parameters(cfg.model)["total"], largest_module_params(cfg.model)
    assert M == 855_654_400  # one block: attention 151.0 M + SwiGLU 704.6 M + 2 norms
    zero3 = [x for x in r["feasible"] if x["layout"]["zero"] == 3 and x["layout"]["dp"] == 512]
    assert zero3
    for x in zero3:  # bf16 partitions + one block in fp32 and its bf16 cast: 5.4 GB
        assert x["memory"]["build"] == pytest.approx((2 * P / 512 + 6 * M) / 1e9, rel=1e-6)
        assert x["memory"]["build"] < 6
    for x in r["feasible"]:
        assert x["memory_gb"] >= x["memory"]["build"] - 1e-9
    # TP2 without PP holds a 138 GB fp32 shard while it builds: not feasible on 80 GB
    assert not [x for x in r["feasible"] if x["layout"]["tp"] == 2 and x["layout"]["pp"] == 1]


def test_plan_searches_the_pipeline_schedules():
    """Every PP > 1 layout is tried under 1F1B and DualPipeV: DualPipeV's step has the shorter
    bubble of its timeline, twice the p2p sends, PP + 1/2 micro-batches in flight on every rank and
    the embedding with the head on rank 0; too few micro-batches or layers are reasons."""
    from megaformer.analysis.memory import Layout, activation_bytes, params_per_rank
    from megaformer.analysis.planner import evaluate
    from megaformer.analysis.schedules import formula_bubble

    hw = Hardware(16, 8, 80, 989.5, 450, 50, 0.6)
    small = load_config(
        "configs/llama-7b.yaml", ["train.global_batch_size=16", "model.n_layers=24"]
    )
    r = plan(small, hw, micro_batches=(1, 2))
    scheds = {x["layout"]["schedule"] for x in r["feasible"] if x["layout"]["pp"] > 1}
    assert scheds == {"1f1b", "dualpipev"}
    reasons = {x["reason"] for x in r["rejected"] if x.get("schedule") == "dualpipev"}
    assert "DualPipeV needs 2 x PP = 16 micro-batches per step, this layout has 8" in reasons
    assert "DualPipeV cuts 32 stages from 24 layers" in reasons
    cfg = load_config("configs/llama-7b.yaml", ["train.global_batch_size=64"])

    base = dict(tp=2, pp=4, dp=2, zero=1, micro_batch=1, grad_accum=32, precision="bf16")
    one, dual = (evaluate(cfg, hw, Layout(**base, schedule=s)) for s in ("1f1b", "dualpipev"))
    assert one["pipeline"]["bubble"] == pytest.approx(formula_bubble("1f1b", 4, 32))
    assert dual["pipeline"]["bubble"] == pytest.approx(formula_bubble("dualpipev", 4, 32))
    assert dual["time"]["compute"] < one["time"]["compute"]
    assert dual["time"]["pp_comm"] == pytest.approx(2 * one["time"]["pp_comm"])
    assert (one["pipeline"]["in_flight"], dual["pipeline"]["in_flight"]) == (4, 4.5)
    m = cfg.model
    a1, a2 = (
        activation_bytes(m, cfg.seq_len, Layout(**base, schedule=s)) for s in ("1f1b", "dualpipev")
    )
    assert a2["layers"] == pytest.approx(a1["layers"] * 4.5 / 4)
    # rank 0 holds the embedding and the (untied) head under DualPipeV, one of them under 1F1B
    p1, p2 = (params_per_rank(m, Layout(**base, schedule=s)) for s in ("1f1b", "dualpipev"))
    assert p2 - p1 == pytest.approx(m.vocab_size * m.d_model // 2, rel=0.01)
