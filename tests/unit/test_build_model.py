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
    return Config(
        model=tiny_model(**model),
        parallel=ParallelConfig(tensor=tensor),
        train=TrainConfig(seed=7, recompute=recompute),
    )


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
    weights = {
        k: v[: cfg.model.vocab_size] if k == "tok_embeddings.weight" else v
        for k, v in src.state_dict().items()
        if k != "lm_head.weight"
    }
    weights = {k: torch.randn_like(v) for k, v in weights.items()}
    built = build_model(cfg, device="cpu", weights=weights, weights_source="test")
    got = built.plain.state_dict()
    assert built.plain.padded_vocab_size == 128  # parallel.vocab_multiple
    for k, v in weights.items():
        assert torch.equal(got[k][: v.shape[0]], v), k
    assert got["tok_embeddings.weight"][cfg.model.vocab_size :].abs().sum() == 0
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
    assert all(isinstance(b.attn.core, CheckpointedAttentionCore) for b in sel.layers)
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


def _tp_pp_shards(rank: int, world: int) -> dict:
    import os

    import deepspeed

    from megaformer.parallel.topology import build_topology
    from megaformer.training.distributed import disable_cpu_shm_comm_op

    os.environ["DS_ACCELERATOR"] = "cpu"
    disable_cpu_shm_comm_op()  # no JIT build of DeepSpeed's inference-only shared-memory op
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    cfg = Config(
        model=tiny_model(n_layers=4, tie_embeddings=False),
        parallel=ParallelConfig(tensor=2, pipeline=2, vocab_multiple=128),
        train=TrainConfig(seed=7),
    )
    topo = build_topology(world, rank, tp=2, pp=2)
    built = build_model(cfg, topo, device="cpu")
    names = built.param_names
    local = {names[id(p)]: p.detach().clone() for p in built.model.parameters()}
    meta = sorted(n for n, p in built.plain.named_parameters() if p.is_meta)
    return {"local": local, "meta": meta, "stage": topo.pp_rank}


@pytest.mark.multiprocess
def test_split_builds_hold_only_their_shards_of_the_one_process_weights():
    """TP2 x PP2 starts from exactly one process's weights: each rank's parameters are its
    tensor-parallel slices of them, and only its own stage's layers hold memory (the rest of the
    model stays on the meta device: nothing whole is built)."""
    ref_cfg = Config(
        model=tiny_model(n_layers=4, tie_embeddings=False),
        parallel=ParallelConfig(vocab_multiple=256),
        train=TrainConfig(seed=7),
    )
    ref = build_model(ref_cfg, device="cpu").plain  # the same padded vocabulary (256 rows)
    ref_sd = dict(ref.named_parameters())
    total = sum(p.numel() for p in ref.parameters())
    ranks = run_ranks(4, _tp_pp_shards)
    for r, got in enumerate(ranks):
        tp_rank, stage = r % 2, got["stage"]
        blocks = {n.split(".")[1] for n in got["local"] if n.startswith("layers.")}
        assert blocks == ({"0", "1"} if stage == 0 else {"2", "3"})
        assert ("tok_embeddings.weight" in got["local"]) == (stage == 0)
        assert ("lm_head.weight" in got["local"]) == (stage == 1)
        assert all(
            not n.startswith(f"layers.{b}.")
            for n in got["local"]
            for b in ({"2", "3"} if stage == 0 else {"0", "1"})
        )
        assert got["meta"] and not set(got["meta"]) & set(got["local"])
        assert sum(t.numel() for t in got["local"].values()) < 0.4 * total
        for name, shard in got["local"].items():
            full = ref_sd[name].detach()
            if shard.shape == full.shape:
                assert torch.equal(shard, full), name
                continue
            dim = next(d for d in range(full.dim()) if shard.shape[d] != full.shape[d])
            assert torch.equal(shard, full.chunk(2, dim=dim)[tp_rank]), name


def test_each_parameter_has_its_own_stream():
    """A parameter's initial values depend on the seed, its name and its shape only: the same
    tensor drawn alone equals the one in the built model, and other parameters differ."""
    from megaformer.model.transformer import Transformer

    torch.manual_seed(11)
    model = Transformer(tiny_model())
    w = model.layers[1].attn.wq.weight
    alone = model.init_parameter("layers.1.attn.wq.weight", torch.empty_like(w))
    assert torch.equal(alone, w)
    assert not torch.equal(model.layers[0].attn.wq.weight, w)
    torch.manual_seed(12)
    assert not torch.equal(Transformer(tiny_model()).layers[1].attn.wq.weight, w)


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
        assert all(isinstance(b.attn.core, CheckpointedAttentionCore) for b in wrapped.layers)
    else:
        assert all(isinstance(b, CheckpointedBlock) and b.block.training for b in wrapped.layers)
