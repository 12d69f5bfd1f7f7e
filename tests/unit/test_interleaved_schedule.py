"""The interleaved 1F1B schedule's rounds and the instructions the engine runs from them: each rank
runs its passes in Megatron's order, nothing is used before it arrives, every send is received in
the same round by the rank it names, and the activations in flight are what the order implies."""

from __future__ import annotations

import pytest

from megaformer.parallel.interleaved_schedule import check_interleaved, rank_units, rounds

LAYOUTS = [(2, 2, 2), (2, 4, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2), (4, 12, 4), (8, 16, 2), (3, 9, 3)]


def _stage(p: int, r: int, c: int) -> int:
    return c * p + r


@pytest.mark.parametrize("p,m,v", LAYOUTS)
@pytest.mark.parametrize("forward_only", [False, True])
def test_every_input_arrives_in_an_earlier_round(p, m, v, forward_only):
    """Replay the rounds: a forward of stage s > 0 needs stage s-1's forward of the same
    micro-batch from an earlier round (or this rank's own, when both stages are here: never, as
    neighbouring stages are on different ranks); a backward of stage s < vp-1 needs stage s+1's
    backward; the last stage's backward its own forward. Each rank runs exactly its units, in
    order, and every pass once."""
    plan = rounds(p, m, v, forward_only)
    done: dict[tuple[str, int, int], int] = {}
    ran: list[list] = [[] for _ in range(p)]
    for t, rnd in enumerate(plan):
        for r, passes in enumerate(rnd.passes):
            if passes:
                ran[r].append(list(passes))
            for kind, c, j in passes:
                s = _stage(p, r, c)
                if kind == "F" and s > 0:
                    assert done[("F", s - 1, j)] < t
                if kind == "B":
                    if s == v * p - 1:
                        assert ("F", s, j) in done  # the loss: this rank's own forward
                    else:
                        assert done[("B", s + 1, j)] < t
                assert (kind, s, j) not in done
                done[(kind, s, j)] = t
    for r in range(p):
        assert ran[r] == rank_units(p, m, v, r, forward_only)
    assert len(done) == (1 if forward_only else 2) * m * v * p


@pytest.mark.parametrize("p,m,v", LAYOUTS)
def test_each_output_is_sent_once_to_its_consumer_in_the_round_it_is_made(p, m, v):
    plan = rounds(p, m, v)
    for rnd in plan:
        made = {(r, k, c, j) for r, ps in enumerate(rnd.passes) for k, c, j in ps}
        for t in rnd.transfers:
            assert (t.src, t.kind, t.chunk, t.micro_batch) in made
            # the next stage (forward) or the previous one (backward), wrapping around the ranks
            step = 1 if t.kind == "F" else -1
            assert _stage(p, t.dst, t.dst_chunk) == _stage(p, t.src, t.chunk) + step
            assert t.boundary == min(_stage(p, t.dst, t.dst_chunk), _stage(p, t.src, t.chunk))
        # two messages between the same ranks in one round (an activation and a gradient, same
        # shape) cross different boundaries: both ranks queue them in boundary order, so the
        # batches pair them the same way
        pairs = [(t.src, t.dst, t.boundary) for t in rnd.transfers]
        assert len({(a, b) for a, b, _ in pairs}) <= len(pairs)
        assert len(pairs) == len(set(pairs))
        for a, b, _ in pairs:
            bounds = [x for x in pairs if x[:2] == (a, b)]
            assert len({x[2] for x in bounds}) == len(bounds)


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_the_order_and_the_activations_in_flight(p, v):
    """Rank r warms up with 2 (p-1-r) + (v-1) p forwards (Megatron's count), so it holds at most
    that many chunks' activations plus one; forwards take chunks 0..v-1 for each group of p
    micro-batches, backwards v-1..0."""
    m = 2 * p
    for r in range(p):
        units = rank_units(p, m, v, r)
        flat = [x for u in units for x in u]
        fwd = [(c, j) for k, c, j in flat if k == "F"]
        assert fwd[: 2 * p] == [(c, j) for c in range(v) for j in range(p)][: 2 * p]
        bwd = [(c, j) for k, c, j in flat if k == "B"]
        assert bwd[:p] == [(v - 1, j) for j in range(p)]
        held = peak = 0
        for k, _, _ in flat:
            held += 1 if k == "F" else -1
            peak = max(peak, held)
        assert peak == min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4)])
def test_ranks_wait_only_to_fill_and_drain(p, m, v):
    """With m >= 2p every rank r waits exactly its 2r rounds of the pipeline's fill and drain."""
    plan = rounds(p, m, v)
    for r in range(p):
        idle = [t for t, rnd in enumerate(plan) if not rnd.passes[r]]
        assert len(idle) == 2 * r, (r, idle)


def test_bad_layouts_are_refused_in_one_line():
    for args, needle in [
        ((1, 4, 2), "at least 2 ranks"),
        ((2, 4, 1), "at least 2 stages per rank, got 1"),
        ((4, 6, 2), "multiple of pipeline = 4 micro-batches per step, got 6"),
        ((4, 2, 2), "multiple of pipeline = 4 micro-batches per step, got 2"),
    ]:
        with pytest.raises(ValueError, match=needle):
            check_interleaved(*args)
    check_interleaved(4, 6, 2, forward_only=True)  # evaluation takes any number


def _engine_steps(p: int, m: int, v: int, r: int, forward_only: bool = False) -> list[list]:
    from megaformer.parallel.interleaved_engine import InterleavedSchedule

    return list(InterleavedSchedule(m, p, r, v, forward_only=forward_only).steps())


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (2, 4, 4), (4, 4, 3)])
@pytest.mark.parametrize("forward_only", [False, True])
def test_engine_instructions_send_what_the_peer_receives(p, m, v, forward_only):
    """The engine's instruction lists of all ranks: between any two ranks, the messages one
    queues to send are, in order, the messages the other queues to receive (point-to-point
    matches in that order, and an activation and a gradient have the same shape, so an order
    slip would swap them silently); within one launch (CommitP2P) they are queued in boundary
    order; every launch is in a round's lists; and the step ends with the gradient reductions and
    the optimizer step."""
    from deepspeed.runtime.pipe import schedule as ds

    steps = [_engine_steps(p, m, v, r, forward_only) for r in range(p)]
    assert len({len(s) for s in steps}) == 1
    if not forward_only:
        for s in steps:
            assert [type(c) for c in s[-1]] == [
                ds.ReduceTiedGrads,
                ds.ReduceGrads,
                ds.OptimizerStep,
            ]
    sends: dict = {}
    recvs: dict = {}
    edge = {ds.SendActivation: 0, ds.RecvGrad: 0, ds.SendGrad: -1, ds.RecvActivation: -1}
    for r in range(p):
        queued: list = []
        for cmd in (c for step in steps[r] for c in step):
            if isinstance(cmd, ds.CommitP2P):
                assert queued and queued == sorted(queued)  # boundary order within a launch
                queued = []
                continue
            if type(cmd) not in edge:
                continue
            c, slot = cmd.kwargs["phase"], cmd.buffer_id
            assert slot // m == c
            j, s = slot % m, _stage(p, r, c)
            queued.append(s + edge[type(cmd)])
            if isinstance(cmd, ds.SendActivation):
                sends.setdefault((r, (r + 1) % p), []).append(("F", s, j))
            elif isinstance(cmd, ds.SendGrad):
                sends.setdefault((r, (r - 1) % p), []).append(("B", s, j))
            elif isinstance(cmd, ds.RecvActivation):
                recvs.setdefault(((r - 1) % p, r), []).append(("F", s - 1, j))
            else:
                recvs.setdefault(((r + 1) % p, r), []).append(("B", s + 1, j))
        assert not queued  # nothing left unlaunched
    assert sends == recvs
    assert sum(len(x) for x in sends.values()) == (1 if forward_only else 2) * m * (v * p - 1)
    loads = [
        sum(isinstance(c, ds.LoadMicroBatch) for step in steps[r] for c in step) for r in range(p)
    ]
    assert loads == [m] + [0] * (p - 2) + [m]  # the inputs on rank 0, the labels on rank p-1


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4)])
def test_a_steady_round_sends_the_forward_output_before_the_backward(p, m, v):
    """In a round of [F, B] the forward's output is exchanged right after the forward (it crosses
    while the backward runs), the backward's after the backward."""
    from deepspeed.runtime.pipe import schedule as ds

    for r in range(p):
        for step in _engine_steps(p, m, v, r)[:-1]:
            kinds = [type(c) for c in step]
            if ds.BackwardPass in kinds and ds.ForwardPass in kinds:
                f, b = kinds.index(ds.ForwardPass), kinds.index(ds.BackwardPass)
                sent = [i for i, k in enumerate(kinds) if k is ds.SendActivation]
                assert all(f < i < b for i in sent), kinds
