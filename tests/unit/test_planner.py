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
    # the ring keeps what a fused kernel keeps (its output in bf16, the fp32 log-sum-exp)
    assert ring["layers"] == pytest.approx(one["layers"] / 4, rel=1e-6)
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
    from megaformer.analysis.attention_time import kernel_efficiency
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
    # the attention core (not FP8) at its kernel's rate on whole sequences of s tokens
    eff = kernel_efficiency(s)

    def at_peak(t: dict) -> float:
        return t["compute"] - t["attention"] * (1 - eff)

    assert at_peak(a["time"]) == pytest.approx(total / (8 * 989.5e12 * 0.5))
    assert at_peak(b["time"]) == pytest.approx(((total - f8) / 989.5e12 + f8 / 1979e12) / (8 * 0.5))
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
    """Every PP > 1 layout is tried under 1F1B, interleaved and DualPipeV: DualPipeV's step has
    the shorter bubble of its timeline, twice the p2p sends, PP + 1/2 micro-batches in flight on
    every rank and the embedding with the head on rank 0; too few micro-batches or layers are
    reasons."""
    from megaformer.analysis.memory import Layout, activation_bytes, params_per_rank
    from megaformer.analysis.planner import evaluate
    from megaformer.analysis.schedules import formula_bubble

    hw = Hardware(16, 8, 80, 989.5, 450, 50, 0.6)
    small = load_config(
        "configs/llama-7b.yaml", ["train.global_batch_size=16", "model.n_layers=24"]
    )
    r = plan(small, hw, micro_batches=(1, 2))
    scheds = {x["layout"]["schedule"] for x in r["feasible"] if x["layout"]["pp"] > 1}
    assert scheds == {"1f1b", "interleaved", "dualpipev"}
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


def test_ring_and_all_to_all_are_priced_by_what_they_run():
    """The ring's kernels see chunks of s / 2CP tokens (a lower kernel rate than all-to-all's whole
    sequences), its K/V passes hide behind a step's kernels when they are shorter, its fp32 dK/dV
    passes do not; all-to-all runs one whole-sequence kernel and exposes its exchange."""
    from megaformer.analysis.attention_time import attention_seconds, kernel_efficiency
    from megaformer.analysis.memory import Layout
    from megaformer.config import load_config

    s = 8192
    cfg = load_config("configs/llama-70b.yaml", [f"data.seq_len={s}", f"model.max_seq_len={s}"])
    m, rate = cfg.model, 989.5e12 * 0.6
    ring, a2a = (Layout(cp=8, precision="bf16", cp_mode=mode) for mode in ("ring", "all_to_all"))
    r, a = attention_seconds(m, s, ring, rate, 450), attention_seconds(m, s, a2a, rate, 450)
    assert r["compute"] / a["compute"] == pytest.approx(  # s^2/2 pairs vs s(s+1)/2
        kernel_efficiency(s) / kernel_efficiency(s / 16) * s / (s + 1)
    )
    assert a["exposed"] == 0
    kv = s / 8 * 2 * m.kv_heads * m.head_dim  # one K/V block, elements
    t_f = r["compute"] / 8 / 3  # one forward step (balanced): a third of (forward + backward)
    assert kv * 2 / 450e9 < t_f  # the K/V pass hides behind a step's kernels ...
    assert r["exposed"] == pytest.approx(8 * kv * 4 / 450e9)  # ... the fp32 dK/dV passes do not
    slow = attention_seconds(m, s, ring, rate, 0.5)  # a network slower than the kernels
    t_kv = kv * 2 / 0.5e9
    assert slow["exposed"] == pytest.approx(
        7 * (t_kv - t_f) + 7 * (t_kv - 2 * t_f) + 8 * kv * 4 / 0.5e9
    )


def test_plan_prices_the_ring_above_all_to_all_where_its_chunks_are_short():
    """70B at 8192 tokens on 64 GPUs, the same TP1 x PP8 x CP8 layout: the ring's chunks of 512
    tokens run its kernels slower than all-to-all's whole sequences."""
    from megaformer.analysis.memory import Layout
    from megaformer.analysis.planner import Hardware, evaluate
    from megaformer.config import load_config

    s = 8192
    cfg = load_config("configs/llama-70b.yaml", [f"data.seq_len={s}", f"model.max_seq_len={s}"])
    hw = Hardware(64, 8, 80, 989.5, 450, 50, 0.6)
    kw = dict(cp=8, pp=8, grad_accum=1024, precision="bf16")
    ring, a2a = (
        evaluate(cfg, hw, Layout(cp_mode=mode, **kw))["time"] for mode in ("ring", "all_to_all")
    )
    assert ring["attention"] > a2a["attention"] * 1.3
    assert ring["compute"] - ring["attention"] == pytest.approx(a2a["compute"] - a2a["attention"])


def test_ring_steps_are_priced_on_their_busiest_rank():
    """Without a window every ring step of every rank is two C x C blocks (balanced); document
    masks make the diagonal pairs explicit masks (the kernel computes them whole); a sliding
    window unbalances the steps, and each is priced on its busiest rank."""
    from megaformer.analysis.attention_time import attention_seconds, kernel_efficiency
    from megaformer.analysis.memory import Layout
    from megaformer.config import load_config
    from megaformer.parallel.context import ring_step_work

    assert all(ring_step_work(r, 4, 1024) == [2.0] * 4 for r in range(4))
    assert ring_step_work(1, 4, 1024, documents=True) == [3.0, 2.0, 2.0, 2.0]
    work = [ring_step_work(r, 8, 1024, window=1500) for r in range(8)]
    assert work[0] == [1.0, 0, 0, 0, 0, 1.0, 1.0, 1.0] and work[7][0] == 2.0
    busiest = [max(w[i] for w in work) for i in range(8)]
    s = 8192
    cfg = load_config(
        "configs/llama-7b.yaml",
        [f"data.seq_len={s}", f"model.max_seq_len={s}", "model.sliding_window=1500"],
    )
    m, c = cfg.model, s / 16
    r = attention_seconds(m, s, Layout(cp=8, precision="bf16"), 1e15, 450)
    block = 4 * c * c * m.n_heads * m.head_dim / (1e15 * kernel_efficiency(c))
    assert r["compute"] == pytest.approx(3 * sum(busiest) * block)


def test_plan_searches_the_interleaved_schedule_and_its_stages_per_rank():
    """Every PP > 1 layout is tried interleaved with v = 2 .. 4 stages per rank; a count of
    micro-batches that is not a multiple of PP, or more stages than layers, is a reason; the
    table names the schedule with its v."""
    from megaformer.analysis.planner import format_plan

    hw = Hardware(16, 8, 80, 989.5, 450, 50, 0.6)
    small = load_config(
        "configs/llama-7b.yaml", ["train.global_batch_size=24", "model.n_layers=24"]
    )
    r = plan(small, hw, micro_batches=(1, 2))
    tried = {
        (x["layout"]["pp"], x["layout"]["virtual_stages"])
        for x in r["feasible"]
        if x["layout"]["schedule"] == "interleaved"
    }
    assert {(2, 2), (2, 3), (2, 4), (4, 2), (4, 3)} <= tried
    for x in r["feasible"]:
        L = x["layout"]
        if L["schedule"] == "interleaved":
            assert L["grad_accum"] % L["pp"] == 0 and L["virtual_stages"] * L["pp"] <= 24
    reasons = {x["reason"] for x in r["rejected"] if x.get("schedule") == "interleaved"}
    # 24 = 1 x DP 8 x 3 micro-batches on PP 2; on PP 8 (DP 2): 24 / (2 x 2) = 6
    needs = "interleaved needs a multiple of PP = {} micro-batches per step, this layout has {}"
    assert needs.format(2, 3) in reasons and needs.format(8, 6) in reasons
    assert "interleaved with v = 4 cuts 32 stages from 24 layers" in reasons
    assert "interleaved with v = 3 cuts 48 stages from 24 layers" in reasons
    text = format_plan(r, top=len(r["feasible"]))
    assert " interleaved v=2 " in text and " interleaved v=4 " in text
    # each kind of reason once among the examples: both interleaved rules show
    assert "interleaved with v =" in text and "interleaved needs a multiple" in text


def test_the_interleaved_schedule_is_priced_by_its_timeline():
    """Interleaved with v stages per rank: the bubble (p-1)/(vm+p-1) shortens the compute, the
    p2p sends grow to 2 (vp-1) per micro-batch, rank 0 holds (2(p-1) + (v-1)p + 1)/v stages'
    activations (5.5 at p = 4, v = 2; 1F1B: 4), and the embedding and the head stay on
    different ranks (the same parameters per rank as 1F1B)."""
    from megaformer.analysis.memory import Layout, activation_bytes, params_per_rank
    from megaformer.analysis.planner import evaluate
    from megaformer.analysis.schedules import formula_bubble

    hw = Hardware(16, 8, 80, 989.5, 450, 50, 0.6)
    cfg = load_config("configs/llama-7b.yaml", ["train.global_batch_size=64"])
    base = dict(tp=2, pp=4, dp=2, zero=1, micro_batch=1, grad_accum=32, precision="bf16")
    one = evaluate(cfg, hw, Layout(**base))
    two, four = (
        evaluate(cfg, hw, Layout(**base, schedule="interleaved", virtual_stages=v)) for v in (2, 4)
    )
    for r, v in ((two, 2), (four, 4)):
        assert r["pipeline"]["bubble"] == pytest.approx(formula_bubble("interleaved", 4, 32, v))
        assert r["pipeline"]["bubble"] == pytest.approx(3 / (v * 32 + 3))
        # the p2p time and volume scale with the sends: 2 (4v - 1) against 1F1B's 2 x 3
        assert r["time"]["pp_comm"] == pytest.approx(one["time"]["pp_comm"] * (4 * v - 1) / 3)
        assert r["pipeline"]["p2p_gb_per_rank"] == pytest.approx(
            one["pipeline"]["p2p_gb_per_rank"] * (4 * v - 1) / 3
        )
        # the compute shrinks by the bubble: (1 + 3/(32v)) / (1 + 3/32)
        ratio = (1 + 3 / (32 * v)) / (1 + 3 / 32)
        assert r["time"]["compute"] == pytest.approx(one["time"]["compute"] * ratio)
    assert four["pipeline"]["bubble"] < two["pipeline"]["bubble"] < one["pipeline"]["bubble"]
    assert (one["pipeline"]["in_flight"], two["pipeline"]["in_flight"]) == (4, 5.5)
    assert four["pipeline"]["in_flight"] == pytest.approx((6 + 3 * 4 + 1) / 4)
    m = cfg.model
    a1, a2 = (
        activation_bytes(m, cfg.seq_len, Layout(**base, **kw))
        for kw in ({}, {"schedule": "interleaved", "virtual_stages": 2})
    )
    assert a2["layers"] == pytest.approx(a1["layers"] * 5.5 / 4)
    assert two["memory"]["activations"] > one["memory"]["activations"]
    assert params_per_rank(m, Layout(**base, schedule="interleaved")) == params_per_rank(
        m, Layout(**base)
    )


def test_pipeline_layouts_the_config_refuses_are_rejected_with_its_reason():
    """Every feasible pipeline layout passes the config's own checks at that layout (bf16 needs
    ZeRO-1 on a pipeline; multi-token prediction runs on one last stage, which DualPipeV does not
    have); the refused ones are rejected with the config's one-line message."""
    from dataclasses import replace

    from megaformer.config import ConfigError
    from megaformer.config.checks.model import check_mtp
    from megaformer.config.checks.parallel import check_pipeline, check_pipeline_schedule

    def refusal(cfg, L):
        parallel = replace(
            cfg.parallel,
            tensor=L["tp"],
            pipeline=L["pp"],
            zero_stage=L["zero"],
            sequence_parallel=L["tp"] > 1,
            pipeline_schedule=L["schedule"],
            pipeline_virtual_stages=max(L["virtual_stages"], 2),
        )
        try:
            for check in (check_pipeline, check_pipeline_schedule, check_mtp):
                check(replace(cfg, parallel=parallel))
        except ConfigError as e:
            return str(e)
        return None

    hw = Hardware(16, 8, 80, 989.5, 450, 50, 0.6)
    over = ["train.global_batch_size=32", "model.n_layers=24", "model.mtp_depth=1"]
    over.append("parallel.zero_stage=1")
    cfg = load_config("configs/llama-7b.yaml", over)  # bf16
    r = plan(cfg, hw, (1,))
    piped = [x["layout"] for x in r["feasible"] if x["layout"]["pp"] > 1]
    assert piped and all(refusal(cfg, L) is None for L in piped)
    assert {L["zero"] for L in piped} == {1}
    assert "1f1b" in {L["schedule"] for L in piped} and "dualpipev" not in {
        L["schedule"] for L in piped
    }
    reasons = {x["reason"] for x in r["rejected"]}
    zero0 = dict(piped[0], zero=0)
    dual = dict(piped[0], schedule="dualpipev")
    assert refusal(cfg, zero0).startswith("train.precision=bf16 with parallel.pipeline=")
    assert refusal(cfg, zero0) in reasons
    assert refusal(cfg, dual).startswith("model.mtp_depth=1 with parallel.pipeline=")
    assert refusal(cfg, dual) in reasons
