"""``megaformer plan``: feasibility rules, memory fit, ordering, JSON, errors."""

from __future__ import annotations

import json

from megaformer.analysis.planner import Hardware, plan
from megaformer.config import load_config
from tests.helpers import assert_one_line_error, cli_main


def test_plan_rules_and_order():
    cfg = load_config("configs/llama-7b.yaml", ["train.global_batch_size=64"])
    hw = Hardware(gpus=16, gpus_per_node=8, memory_gb=80, peak_tflops=989.5, intra_gbps=450,
                  inter_gbps=50, efficiency=0.6)
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
        assert 0 < x["mfu"] < 0.6 + 1e-9                      # never above the assumed efficiency
    reasons = " ".join(x["reason"] for x in r["rejected"])
    assert "GB >" in reasons and "ZeRO-3 with TP" in reasons
    # 7B in bf16 without any sharding cannot fit 80 GB (16 bytes/param of states alone)
    assert not any(x["layout"]["tp"] == x["layout"]["pp"] == 1 and x["layout"]["zero"] == 0
                   for x in feasible)


def test_plan_cli_json_and_errors():
    r = cli_main("plan", "configs/gpt2-124m.yaml", "--gpus", "8", "--gpu-mem", "40", "--gpu",
                 "A100", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["feasible"] and out["assumptions"]["memory_gb"] == 40
    assert_one_line_error(cli_main("plan", "configs/gpt2-124m.yaml", "--gpus", "8", "--gpu-mem", "40"),
                          "--peak-tflops")
    assert_one_line_error(cli_main("plan", "configs/gpt2-124m.yaml", "--gpus", "8", "--gpu", "XPU-9"),
                          "unknown GPU")
