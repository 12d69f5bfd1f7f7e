"""The TP x CP x DP x PP grid: Megatron's rank order, every rank in exactly one group of each kind,
and a real process group of every kind (a group of one at degree 1)."""

from __future__ import annotations

import pytest
import torch

from megaformer.comm import KINDS, UnknownGroupError
from megaformer.parallel.plan import padded_vocab_size
from megaformer.parallel.topology import DEGREES, Degrees, Topology, layout_groups
from tests.dist_harness import run_ranks
from tests.helpers import tiny_model


def test_tp_ranks_adjacent_then_dp_then_pp():
    t = layout_groups(8, tp=2, pp=2)
    assert t.dp == 2
    assert t.tp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.dp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.pp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.mp_groups == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (4, 2, 1), (8, 4, 2), (16, 2, 2), (6, 3, 1)])
def test_every_rank_in_one_group_of_each_kind(world, tp, pp):
    t = layout_groups(world, tp=tp, pp=pp)
    for groups, size in ((t.tp_groups, tp), (t.dp_groups, world // (tp * pp)), (t.pp_groups, pp)):
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    for rank in range(world):
        t.rank = rank
        assert t.rank_of(tp=t.tp_rank, dp=t.dp_rank, pp=t.pp_rank) == rank
        assert t.tp_group_ranks[t.tp_rank] == rank and t.dp_group_ranks[t.dp_rank] == rank
        assert t.get_model_parallel_world_size() == tp * pp


def test_impossible_world_size():
    with pytest.raises(ValueError, match="not divisible by TP\\*PP = 4"):
        layout_groups(6, tp=2, pp=2)


def test_summary_names_the_groups():
    t = layout_groups(4, tp=2)
    text = t.summary()
    assert (
        "world 4 = TP 2 x PP 1 x DP 2" in text and "[0,1] [2,3]" in text and "[0,2] [1,3]" in text
    )


@pytest.mark.parametrize(
    "vocab,tp,mult,expected",
    [
        (257, 1, 128, 384),
        (257, 2, 128, 512),
        (50257, 1, 128, 50304),
        (32000, 4, 128, 32256),
        (32000, 1, 128, 32000),
    ],
)
def test_vocab_padding(vocab, tp, mult, expected):
    assert padded_vocab_size(vocab, tp, mult) == expected


def test_padding_changes_nothing_the_model_computes():
    from megaformer.model.transformer import Transformer

    cfg = tiny_model(vocab_size=50, tie_embeddings=False)
    torch.manual_seed(3)
    plain = Transformer(cfg)
    torch.manual_seed(3)
    padded = Transformer(cfg, padded_vocab_size=128)
    x = torch.randint(0, 50, (2, 10))
    assert padded(x).shape[-1] == 50
    assert torch.equal(plain(x), padded(x)) and torch.equal(plain(x, x), padded(x, x))
    assert plain.num_parameters() == padded.num_parameters()
    out = padded.generate(x[:1, :3], 5, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert int(out.max()) < 50


@pytest.mark.parametrize(
    "world,tp,pp,cp,ep",
    [(8, 1, 1, 2, 2), (16, 2, 1, 2, 2), (16, 1, 2, 2, 1), (8, 2, 1, 1, 4), (4, 1, 1, 4, 1)],
)
def test_context_and_expert_groups(world, tp, pp, cp, ep):
    t = layout_groups(world, tp=tp, cp=cp, pp=pp, ep=ep)
    dp = world // (tp * pp * cp)
    assert t.dp == dp and t.replicas == dp * cp
    for groups, size in (
        (t.tp_groups, tp),
        (t.cp_groups, cp),
        (t.dp_groups, dp),
        (t.pp_groups, pp),
        (t.replica_groups, dp * cp),
        (t.ep_groups, ep),
        (t.edp_groups, dp // ep * cp),  # the ranks holding the same experts, over CP too
    ):
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    for rank in range(world):
        t.rank = rank
        assert t.rank_of(tp=t.tp_rank, cp=t.cp_rank, dp=t.dp_rank, pp=t.pp_rank) == rank
        assert t.dp_rank == t.ep_rank + ep * t.edp_rank
        mine = t._mine(t.edp_groups)  # the expert-data group, CP included
        assert len(mine) == t.expert_replicas and mine.index(rank) == t.expert_replica_rank
        # DeepSpeed's data-parallel group is DP x CP: the ranks that share (tp, pp)
        same = [r for r in range(world) if r % tp == t.tp_rank and r // (world // pp) == t.pp_rank]
        assert t.get_data_parallel_group_ranks() == same
        assert t.get_data_parallel_world_size() == dp * cp
    # TP ranks adjacent, then CP: the first TP group's neighbour in its CP group is tp ranks away
    assert t.cp_groups[0] == [i * tp for i in range(cp)]


def test_expert_groups_are_consecutive_data_parallel_ranks():
    t = layout_groups(8, ep=4)
    assert t.ep_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.edp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_degree_must_divide_data_parallel():
    with pytest.raises(ValueError, match="data-parallel size 3 is not divisible by the expert"):
        layout_groups(6, tp=2, ep=2)


def test_one_order_of_degrees_everywhere():
    """TP, CP, DP, PP, EP: the fields of the degrees, the topology and the analytic model's layout."""
    from dataclasses import fields

    from megaformer.analysis.memory import Layout

    assert DEGREES == ("tp", "cp", "dp", "pp", "ep")
    assert tuple(f.name for f in fields(Degrees)) == DEGREES
    assert tuple(f.name for f in fields(Topology))[2:7] == DEGREES
    assert tuple(f.name for f in fields(Layout))[:5] == DEGREES
    t = layout_groups(48, tp=2, cp=3, pp=2, ep=2)
    assert t.degrees == Degrees(2, 3, 4, 2, 2) and t.degrees.world == 48
    assert Layout(tp=2, cp=3, dp=4, pp=2, ep=2).degrees == t.degrees
    with pytest.raises(TypeError):
        layout_groups(8, 2, 2)  # degrees are named, never positional


def test_a_misspelled_group_kind_raises():
    t = layout_groups(4, tp=2)
    with pytest.raises(
        UnknownGroupError, match="unknown process group kind 'tpp': choose from tp, cp"
    ):
        t.group("tpp")
    with pytest.raises(RuntimeError, match="rank lists only"):
        t.group("tp")  # no process groups were created: not silently None (the whole world)


def _groups_of(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megaformer.parallel.topology import build_topology

    out = {}
    for degrees in ({"tp": 2}, {"cp": 2, "ep": 1}, {"ep": 2}, {}):
        topo = build_topology(world, rank, **degrees)
        g = topo.groups
        sizes = {k: dist.get_world_size(getattr(g, k)) for k in KINDS}
        members = {k: dist.get_process_group_ranks(getattr(g, k)) for k in KINDS}
        assert all(topo.group(k) is getattr(g, k) for k in KINDS)
        try:
            g.tp = None  # type: ignore[misc]
            frozen = False
        except AttributeError:
            frozen = True
        one = torch.ones(1) * (rank + 1)
        dist.all_reduce(one, group=g.cp)  # a group of one at degree 1: this rank's value alone
        out[str(degrees)] = {
            "sizes": sizes,
            "members": members,
            "frozen": frozen,
            "cp_sum": float(one),
            "replica_is_dp": g.replica is g.dp,
        }
    return out


def test_every_group_is_real_and_a_group_of_one_at_degree_one():
    results = run_ranks(2, _groups_of)
    for rank, r in enumerate(results):
        tp = r["{'tp': 2}"]
        assert tp["sizes"] == {
            "tp": 2,
            "cp": 1,
            "dp": 1,
            "pp": 1,
            "ep": 1,
            "edp": 1,
            "replica": 1,
            "mp": 2,
        }
        assert tp["members"]["tp"] == [0, 1] and tp["members"]["cp"] == [rank]
        assert tp["frozen"] and tp["cp_sum"] == rank + 1 and tp["replica_is_dp"]
        cp = r["{'cp': 2, 'ep': 1}"]
        assert cp["sizes"]["cp"] == 2 and cp["sizes"]["replica"] == 2 and cp["sizes"]["ep"] == 1
        assert cp["cp_sum"] == 3.0 and not cp["replica_is_dp"]
        ep = r["{'ep': 2}"]
        assert ep["sizes"]["ep"] == 2 and ep["sizes"]["edp"] == 1 and ep["sizes"]["dp"] == 2
        assert r["{}"]["sizes"]["dp"] == 2 and r["{}"]["members"]["ep"] == [rank]
