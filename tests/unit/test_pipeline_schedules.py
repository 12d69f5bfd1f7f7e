"""The pipeline schedules on paper (megaformer.analysis.schedules) are the ones the engines run
(DeepSpeed's 1F1B and DualPipeV, megaformer's interleaved 1F1B), and their timelines give the
published idle fractions."""

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


def _engine_passes(p: int, m: int, r: int, v: int) -> list[tuple[str, int, int]]:
    """(kind, chunk, micro-batch) of every pass the interleaved engine's schedule emits on
    rank r."""
    from deepspeed.runtime.pipe import schedule as ds

    from megaformer.parallel.interleaved_engine import InterleavedSchedule

    out = []
    for step in InterleavedSchedule(micro_batches=m, stages=p, stage_id=r, chunks=v).steps():
        for cmd in step:
            if isinstance(cmd, (ds.ForwardPass, ds.BackwardPass)):
                kind = "F" if isinstance(cmd, ds.ForwardPass) else "B"
                c, slot = cmd.kwargs["phase"], cmd.kwargs["buffer_id"]
                assert slot // m == c  # the engine's slot of (chunk c, micro-batch j): c m + j
                out.append((kind, c, slot % m))
    return out


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 6, 3), (4, 8, 2), (4, 12, 4), (8, 16, 2)])
def test_interleaved_pass_order_is_the_engines(p, m, v):
    for r in range(p):
        emitted = _engine_passes(p, m, r, v)
        assert rank_passes("interleaved", p, m, r, v) == [(k, c) for k, c, _ in emitted], r
        for kind in "FB":  # the timeline numbers each chunk's micro-batches in order
            for c in range(v):
                assert [j for k, cc, j in emitted if (k, cc) == (kind, c)] == list(range(m))


@pytest.mark.parametrize(
    "p,m,v", [(2, 2, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2), (8, 32, 4)]
)
def test_interleaved_timeline_gives_the_formula(p, m, v):
    t, one = simulate("interleaved", p, m, v=v), simulate("1f1b", p, m)
    assert t.bubble == pytest.approx(formula_bubble("interleaved", p, m, v))
    assert t.bubble == pytest.approx((p - 1) / (v * m + p - 1))
    assert all(i == pytest.approx(t.bubble) for i in t.idle)
    # the same work, idle (p-1)(F+B)/v per rank: 1F1B's idle time divided by v
    assert t.busy == one.busy
    assert t.makespan - t.busy[0] == pytest.approx((one.makespan - one.busy[0]) / v)
    assert step_factor("interleaved", p, m, v) == pytest.approx(1 + (p - 1) / (v * m))
    # rank r holds its warm-up forwards and one more, of 1/v of a stage each (at most all vm)
    held = tuple(min(2 * (p - 1 - r) + (v - 1) * p + 1, v * m) for r in range(p))
    assert t.chunks_in_flight == held
    assert t.in_flight == pytest.approx(tuple(h / v for h in held))
    if m > p:  # more than 1F1B's p stages on rank 0: (2(p-1) + (v-1)p + 1)/v
        assert t.in_flight[0] == pytest.approx((2 * (p - 1) + (v - 1) * p + 1) / v)
        assert t.in_flight[0] > one.in_flight[0]
    else:  # m = p: every forward is held before the first backward, p micro-batches as 1F1B
        assert t.in_flight[0] == one.in_flight[0] == p
    sends = p2p_sends_per_micro_batch("interleaved", p, v)
    assert sends == 2 * (v * p - 1) >= v * p2p_sends_per_micro_batch("1f1b", p)


def _rounds_idle(p: int, m: int, v: int, f: float = 1.0, b: float = 2.0) -> tuple[float, ...]:
    """Per rank, the idle fraction of the engine's rounds run with passes of f/v and b/v, each
    exchange a rendezvous: both ranks of a transfer go on when both have finished the round."""
    from megaformer.parallel.interleaved_schedule import rounds

    t = [0.0] * p
    for rnd in rounds(p, m, v):
        end = [
            t[r] + sum((f if k == "F" else b) / v for k, _, _ in rnd.passes[r]) for r in range(p)
        ]
        t = list(end)
        for x in rnd.transfers:
            both = max(end[x.src], end[x.dst])
            t[x.src], t[x.dst] = max(t[x.src], both), max(t[x.dst], both)
    return tuple(1 - (f + b) * m / max(t) for _ in range(p))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (2, 8, 3), (4, 8, 2), (4, 16, 3), (8, 16, 2)])
def test_the_engines_rounds_in_lockstep_idle_as_the_timeline(p, m, v):
    """Grouping the passes in rounds, each exchanged in one batch, costs no idle time: the rounds
    give the timeline's (and the formula's) bubble."""
    t = simulate("interleaved", p, m, v=v)
    assert _rounds_idle(p, m, v) == pytest.approx(t.idle)


@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 3.0), (2.0, 1.0)])
def test_interleaved_idles_the_1f1b_bubble_over_v_at_any_pass_costs(f, b):
    for p, m, v in ((4, 8, 2), (4, 16, 3), (8, 16, 2)):
        t = simulate("interleaved", p, m, f, b, v)
        assert [t.makespan - busy for busy in t.busy] == pytest.approx([(p - 1) * (f + b) / v] * p)


def test_more_stages_per_rank_idle_less_and_send_more():
    bubbles = [simulate("interleaved", 4, 16, v=v).bubble for v in (2, 3, 4)]
    assert simulate("1f1b", 4, 16).bubble > bubbles[0] > bubbles[1] > bubbles[2]
    sends = [p2p_sends_per_micro_batch("interleaved", 4, v) for v in (2, 3, 4)]
    assert sends == [14, 22, 30]


def test_interleaved_layout_rules():
    with pytest.raises(ValueError, match="multiple of pipeline = 4 micro-batches per step, got 6"):
        rank_passes("interleaved", 4, 6, 0, 2)
    with pytest.raises(ValueError, match="at least 2 stages per rank, got 1"):
        simulate("interleaved", 4, 8, v=1)


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
