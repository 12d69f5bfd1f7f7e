"""build_model: the one way the model is built (seed -> Transformer on the device -> weights -> TP
plan -> recompute -> compile -> pipeline), and activation recomputation as wrapper modules."""

from __future__ import annotations

import pytest
import torch

from megaformer.config import Config, ParallelConfig, TrainConfig
from megaformer.parallel.build import build_model
from megaformer.parallel.recompute import CheckpointedAttentionCore, CheckpointedBlock
from tests.dist_harness import run_ranks
from tests.helpers import tiny_model


def _cfg(recompute: str = "none", tensor: int = 1, **model) -> Config:
    return Config(model=tiny_model(**model), parallel=ParallelConfig(tensor=tensor),
                  train=TrainConfig(seed=7, recompute=recompute))


def test_meta_build_allocates_nothing_on_the_host():
    from megaformer.analysis.measure import measure

    cfg = _cfg()
    on_cpu = measure(lambda: build_model(cfg, device="cpu"))
    on_meta = measure(lambda: build_model(cfg, device="meta"))
    model = on_meta.result.model
    assert {p.device.type for p in model.parameters()} == {"meta"}
    n_bytes = sum(p.numel() * p.element_size() for p in on_cpu.result.model.parameters())
    assert on_cpu.peak >= n_bytes  # the CPU build holds the fp32 model...
    assert on_meta.peak < n_bytes / 100  # ...the meta build none of it (a scalar or two)


def test_built_on_the_device_it_is_given():
    """The Transformer is created under the target device (no fp32 host copy moved over):
    every parameter and buffer lands there, and a CPU build draws the seeded weights."""
    cfg = _cfg(position="sinusoidal")
    a, b = build_model(cfg, device="cpu").plain, build_model(cfg, device="cpu").plain
    assert all(t.device.type == "cpu" for t in [*a.parameters(), *a.buffers()])
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n
    meta = build_model(cfg, device=torch.device("meta")).plain
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    assert [n for n, _ in meta.named_parameters()] == [n for n, _ in a.named_parameters()]


def test_weights_are_loaded_and_vocabulary_padded():
    cfg = _cfg()
    src = build_model(_cfg(), device="cpu").plain
    weights = {k: v[:cfg.model.vocab_size] if k == "tok_embeddings.weight" else v
               for k, v in src.state_dict().items() if k != "lm_head.weight"}
    weights = {k: torch.randn_like(v) for k, v in weights.items()}
    built = build_model(cfg, device="cpu", weights=weights, weights_source="test")
    got = built.plain.state_dict()
    assert built.plain.padded_vocab_size == 128  # parallel.vocab_multiple
    for k, v in weights.items():
        assert torch.equal(got[k][:v.shape[0]], v), k
    assert got["tok_embeddings.weight"][cfg.model.vocab_size:].abs().sum() == 0
    gen = build_model(cfg, device="cpu", weights=weights, weights_source="test", training=False)
    assert gen.plain.padded_vocab_size == cfg.model.vocab_size and not gen.model.training


def test_recompute_wrappers_keep_names_and_show_in_print():
    plain = build_model(_cfg("none"), device="cpu").model
    full = build_model(_cfg("full"), device="cpu").model
    sel = build_model(_cfg("selective"), device="cpu").model
    names = list(plain.state_dict())
    assert list(full.state_dict()) == names == list(sel.state_dict())
    assert [n for n, _ in full.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(isinstance(b, CheckpointedBlock) for b in full.layers)
    assert all(isinstance(b.attn.core_attention, CheckpointedAttentionCore) for b in sel.layers)
    assert "CheckpointedBlock" in repr(full) and "CheckpointedAttentionCore" in repr(sel)
    assert "CheckpointedBlock" not in repr(plain)
    # a state dict saved with recomputation loads without it, and the other way round
    plain.load_state_dict(full.state_dict())
    full.load_state_dict(plain.state_dict())
    full.eval()
    assert not full.layers[0].block.training and not full.layers[0].attn.training


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_replays_dropout_exactly(mode):
    """Same seed, dropout on: the recomputed model's loss and gradients equal the plain model's."""
    kw = dict(dropout=0.1, attention_dropout=0.1)
    x = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for m in ("none", mode):
        model = build_model(_cfg(m, **kw), device="cpu").model.train()
        torch.manual_seed(3)
        loss = model(x, x)
        loss.backward()
        out[m] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert torch.equal(out["none"][0], out[mode][0])
    for n, g in out["none"][1].items():
        torch.testing.assert_close(out[mode][1][n], g, rtol=1e-6, atol=1e-7, msg=n)


def _tp_shards(rank: int, world: int) -> dict:
    from megaformer.parallel.plan import full_state_dict
    from megaformer.parallel.topology import build_topology

    cfg = _cfg(tensor=world)
    topo = build_topology(world, rank, world, 1)
    built = build_model(cfg, topo, device="cpu")
    local = {n: p.detach().clone() for n, p in built.plain.named_parameters()}
    return {"local": local, "full": full_state_dict(built.plain, topo)}


def test_tensor_parallel_shards_are_slices_of_the_tp1_model():
    """TP=2 starts from exactly TP=1's weights: each rank's shard is its slice of them."""
    ref_cfg = Config(model=tiny_model(), parallel=ParallelConfig(vocab_multiple=256),
                     train=TrainConfig(seed=7))
    ref = build_model(ref_cfg, device="cpu").plain  # TP=1, the same padded vocabulary (256 rows)
    ref_sd = dict(ref.named_parameters())
    ranks = run_ranks(2, _tp_shards)
    for r, got in enumerate(ranks):
        for name, shard in got["local"].items():
            full = ref_sd[name].detach()
            if shard.shape == full.shape:
                assert torch.equal(shard, full), name
                continue
            dim = next(d for d in range(full.dim()) if shard.shape[d] != full.shape[d])
            assert torch.equal(shard, full.chunk(2, dim=dim)[r]), name
        for name, w in got["full"].items():
            assert torch.equal(w, ref_sd[name].detach()[:w.shape[0]]), name


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_diagnostics_pass_sees_through_recompute_wrappers(mode):
    """The residual-stream pass (block attributes, attention-core swap, train/eval flags) gives the
    same numbers on a recomputed model as on the plain one, and leaves the wrappers in place."""
    from megaformer.diagnostics.metrics import residual_diagnostics

    x = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = build_model(_cfg("none", residual="parallel"), device="cpu").model.train()
    wrapped = build_model(_cfg(mode, residual="parallel"), device="cpu").model.train()
    assert wrapped.layers[0].parallel is True  # a plain attribute of the block, through the wrapper
    assert residual_diagnostics(wrapped, x, x) == residual_diagnostics(plain, x, x)
    assert wrapped.training and all(b.training and b.attn.training for b in wrapped.layers)
    if mode == "selective":
        assert all(isinstance(b.attn.core_attention, CheckpointedAttentionCore) for b in wrapped.layers)
    else:
        assert all(isinstance(b, CheckpointedBlock) and b.block.training for b in wrapped.layers)
