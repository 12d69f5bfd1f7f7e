"""The TP x PP x DP grid: Megatron's rank order, every rank in exactly one group of each kind."""

from __future__ import annotations

import pytest
import torch

from megaformer.parallel.plan import padded_vocab_size
from megaformer.parallel.topology import layout_groups
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
    t = layout_groups(world, tp, pp)
    for groups, size in ((t.tp_groups, tp), (t.dp_groups, world // (tp * pp)), (t.pp_groups, pp)):
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    for rank in range(world):
        t.rank = rank
        assert t.rank_of(t.tp_rank, t.dp_rank, t.pp_rank) == rank
        assert t.tp_group_ranks[t.tp_rank] == rank and t.dp_group_ranks[t.dp_rank] == rank
        assert t.get_model_parallel_world_size() == tp * pp


def test_impossible_world_size():
    with pytest.raises(ValueError, match="not divisible by TP\\*PP = 4"):
        layout_groups(6, 2, 2)


def test_summary_names_the_groups():
    t = layout_groups(4, 2, 1)
    text = t.summary()
    assert "world 4 = TP 2 x PP 1 x DP 2" in text and "[0,1] [2,3]" in text and "[0,2] [1,3]" in text


@pytest.mark.parametrize("vocab,tp,mult,expected", [(257, 1, 128, 384), (257, 2, 128, 512),
                                                    (50257, 1, 128, 50304), (32000, 4, 128, 32256),
                                                    (32000, 1, 128, 32000)])
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


@pytest.mark.parametrize("world,tp,pp,cp,ep", [(8, 1, 1, 2, 2), (16, 2, 1, 2, 2), (16, 1, 2, 2, 1),
                                               (8, 2, 1, 1, 4), (4, 1, 1, 4, 1)])
def test_context_and_expert_groups(world, tp, pp, cp, ep):
    t = layout_groups(world, tp, pp, cp, ep)
    dp = world // (tp * pp * cp)
    assert t.dp == dp and t.replicas == dp * cp
    for groups, size in ((t.tp_groups, tp), (t.cp_groups, cp), (t.dp_groups, dp), (t.pp_groups, pp),
                         (t.replica_groups, dp * cp), (t.ep_groups, ep), (t.edp_groups, dp // ep)):
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    for rank in range(world):
        t.rank = rank
        assert t.rank_of(t.tp_rank, t.dp_rank, t.pp_rank, t.cp_rank) == rank
        assert t.dp_rank == t.ep_rank + ep * t.edp_rank
        # DeepSpeed's data-parallel group is DP x CP: the ranks that share (tp, pp)
        same = [r for r in range(world) if r % tp == t.tp_rank and r // (world // pp) == t.pp_rank]
        assert t.get_data_parallel_group_ranks() == same
        assert t.get_data_parallel_world_size() == dp * cp
    # TP ranks adjacent, then CP: the first TP group's neighbour in its CP group is tp ranks away
    assert t.cp_groups[0] == [i * tp for i in range(cp)]


def test_expert_groups_are_consecutive_data_parallel_ranks():
    t = layout_groups(8, 1, 1, 1, 4)
    assert t.ep_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.edp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_degree_must_divide_data_parallel():
    with pytest.raises(ValueError, match="data-parallel size 3 is not divisible by the expert"):
        layout_groups(6, 2, 1, 1, 2)
