"""``train.compile`` under context parallelism: a block with the ring (or all-to-all) attention
core traces into one graph with no break (the ring and the all-to-all are operators whose
communication the compiler does not look into), and the compiled model's loss and gradients at CP
2 equal one process within 1e-5, with document masks and grouped-query attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks

VOCAB, EOD = 97, 7


def _case(rank: int, world: int, mode: str) -> dict:
    from megaformer.config import ModelConfig
    from megaformer.kernels.selection import mark_constant_for_compile
    from megaformer.model.block import compile_blocks
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.context import apply_context
    from megaformer.parallel.topology import build_topology

    topo = build_topology(world, rank, cp=world)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=16,
        d_ffn=64,
        document_mask=True,
    )
    models = []
    for _ in range(3):  # one process; CP eager; CP compiled
        torch.manual_seed(0)
        models.append(Transformer(cfg))
        models[-1].eod_id = EOD
    ref, eager, compiled = models
    apply_context(eager, topo, mode)
    cp = apply_context(compiled, topo, mode)
    compile_blocks(compiled.layers, backend="aot_eager")

    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (2, 16), generator=gen)
    y = torch.randint(0, VOCAB, (2, 16), generator=gen)
    x[0, [3, 10]] = EOD
    x[1, 6] = EOD
    ref_loss = ref(x, y)
    ref_loss.backward()
    out = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        loss = cp.scale_loss(model(cp.split(x), cp.split(y)), cp.split(y))
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        err = 0.0
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            g = p.grad.clone()
            dist.all_reduce(g)
            err = max(err, float((g / world - q.grad).abs().max()))
        out[name] = {"loss": abs(float(mean) / world - ref_loss.item()), "grad": err}

    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    hook = eager.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    eager(cp.split(x))
    hook.remove()
    args, kwargs = seen["call"]
    mark_constant_for_compile()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(eager.layers[0])(*args, **kwargs)
    out["graphs"] = (explained.graph_count, explained.graph_break_count)
    out["breaks"] = [str(b.reason) for b in explained.break_reasons]
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_compiled_blocks_under_context_parallelism_equal_one_process(mode):
    for r in run_ranks(2, _case, mode):
        assert r["graphs"] == (1, 0), r["breaks"]
        for name in ("eager", "compiled"):
            assert r[name]["loss"] < 1e-5 and r[name]["grad"] < 1e-5, (name, r)
