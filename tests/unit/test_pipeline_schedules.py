"""The pipeline schedules on paper (megaformer.analysis.schedules) are the ones DeepSpeed runs, and
their timelines give the published idle fractions."""

from __future__ import annotations

import pytest

from megaformer.analysis.schedules import (
    formula_bubble,
    p2p_sends_per_micro_batch,
    rank_passes,
    simulate,
    step_factor,
)


def _deepspeed_passes(schedule: str, p: int, m: int, r: int) -> list[tuple[str, int]]:
    from deepspeed.runtime.pipe import schedule as ds

    sched = (
        ds.DualPipeVSchedule(micro_batches=m, stages=p, stage_id=r)
        if schedule == "dualpipev"
        else ds.TrainSchedule(micro_batches=m, stages=p, stage_id=r)
    )
    out = []
    for step in sched.steps():
        for cmd in step:
            if isinstance(cmd, (ds.ForwardPass, ds.BackwardPass)):
                kind = "F" if isinstance(cmd, ds.ForwardPass) else "B"
                out.append((kind, getattr(cmd, "phase", 0)))
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
@pytest.mark.parametrize("p,m", [(2, 4), (2, 7), (4, 8), (4, 13), (8, 16)])
def test_pass_order_is_deepspeeds(schedule, p, m):
    for r in range(p):
        assert rank_passes(schedule, p, m, r) == _deepspeed_passes(schedule, p, m, r), r


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 64)])
def test_1f1b_timeline_gives_the_formula(p, m):
    t = simulate("1f1b", p, m)
    assert t.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert step_factor("1f1b", p, m) == pytest.approx(1 + (p - 1) / m)
    assert t.in_flight == tuple(float(p - r) for r in range(p))  # the first stage holds p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_dualpipev_timeline_idles_less_and_holds_p_and_a_half_stages(p, m):
    t = simulate("dualpipev", p, m)
    assert t.bubble == pytest.approx(formula_bubble("dualpipev", p, m))
    assert all(i == pytest.approx(t.bubble) for i in t.idle)  # every rank idles (p-1)B - F/2
    assert t.makespan - t.busy[0] == pytest.approx(2 * (p - 1) - 0.5)
    assert t.bubble < formula_bubble("1f1b", p, m)
    # 2p + 1 chunks of half a stage in flight on every rank (1F1B's first stage: p stages)
    assert t.in_flight == tuple(p + 0.5 for _ in range(p))
    assert p2p_sends_per_micro_batch("dualpipev", p) == 2 * p2p_sends_per_micro_batch("1f1b", p)


def test_too_few_micro_batches_for_dualpipev():
    with pytest.raises(ValueError, match="at least 2 \\* 4 micro-batches, got 7"):
        rank_passes("dualpipev", 4, 7, 0)


def test_a_dualpipev_checkpoint_is_evaluated_with_its_stages_in_order():
    """megaformer eval runs the stages one after the other (1F1B's cut), whatever schedule trained
    the checkpoint; an explicit split of 2 PP stages does not carry over."""
    from megaformer.config import config_from_dict
    from megaformer.evaluation.checkpoint import eval_layout
    from megaformer.parallel.topology import Degrees

    cfg = config_from_dict(
        {
            "model": {"n_layers": 4},
            "parallel": {
                "pipeline": 2,
                "pipeline_schedule": "dualpipev",
                "pipeline_partition": "1,1,1,1",
            },
        }
    )
    topo = Degrees(1, 1, 1, 2, 1)
    p = eval_layout(cfg, topo).parallel
    assert (p.pipeline, p.pipeline_schedule, p.pipeline_partition) == (2, "1f1b", "layers")
