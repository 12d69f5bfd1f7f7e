"""``megaformer bench`` keeps the rows it measured when another model fails: the failing model's
row carries its error, in both the alternating and the one-after-the-other mode."""

from __future__ import annotations

import pytest
import torch

from megaformer.analysis import bench
from megaformer.config import Config, TrainConfig
from megaformer.errors import UserError
from tests.helpers import tiny_model


def _cfg() -> Config:
    return Config(
        model=tiny_model(), train=TrainConfig(seed=1, micro_batch_size=2, recompute="none")
    )


def _broken_at_build() -> bench.Runner:
    raise RuntimeError("no such kernel\nsecond line")


def _broken_at_step(good):

    def broken_runner() -> bench.Runner:
        r = good()
        r.name = "breaks at its second step"
        calls = [0]
        step = r.step

        def failing(x: torch.Tensor) -> float:
            calls[0] += 1
            if calls[0] == 2:
                raise ValueError("NaN in the attention kernel")
            return step(x)

        r.step = failing  # type: ignore[method-assign]
        return r

    return broken_runner


@pytest.mark.parametrize("sequential", [False, True])
def test_a_failing_model_keeps_the_other_rows(monkeypatch, sequential):
    cfg = _cfg()
    real = bench._runner_factories

    def factories(cfg, device, compare_hf):
        megaformer = real(cfg, device, False)[0]
        return [_broken_at_build, megaformer, _broken_at_step(megaformer)]

    monkeypatch.setattr(bench, "_runner_factories", factories)
    out = bench.run_bench(cfg, steps=3, warmup=1, device="cpu", sequential=sequential)
    rows = {r["name"]: r for r in out["results"]}
    assert list(rows) == ["_broken_at_build", "megaformer", "breaks at its second step"]
    assert rows["_broken_at_build"]["error"] == "RuntimeError: no such kernel"
    assert rows["breaks at its second step"]["error"] == "ValueError: NaN in the attention kernel"
    good = rows["megaformer"]
    assert "error" not in good and len(good["step_times_s"]) == 3 and good["tokens_per_s"] > 0
    text = bench.format_bench(out)
    assert "RuntimeError: no such kernel" in text and "ValueError: NaN" in text


def test_a_user_error_is_not_a_row(monkeypatch):
    def factories(cfg, device, compare_hf):
        def no_twin() -> bench.Runner:
            raise UserError("bench --compare-hf: no transformers twin")

        return [no_twin]

    monkeypatch.setattr(bench, "_runner_factories", factories)
    with pytest.raises(UserError, match="no transformers twin"):
        bench.run_bench(_cfg(), steps=1, warmup=0, device="cpu")
