"""No rank builds the whole model: ZeRO-3 keeps each module's partition as soon as it has its
values, expert parallelism each block's experts of this rank.

Each rank's build is measured (:func:`megaformer.analysis.measure.measure`: the peak of the live
tensor bytes the build allocates) and its values compared with one process's: ZeRO-3 at DP = D
holds about 1/D of the fp32 model plus one whole module at its peak; EP = P holds its experts plus
one whole block. Both start from exactly the one-process weights and train as it does.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks

STEPS = 3
V = 64


def _dense_config(zero: int, dp: int):
    from megaformer.config import load_config

    over = {
        "model.vocab_size": V,
        "model.d_model": 64,
        "model.n_layers": 8,
        "model.n_heads": 4,
        "model.max_seq_len": 16,
        "data.seq_len": 16,
        "model.tie_embeddings": "false",
        "train.micro_batch_size": 2,
        "train.global_batch_size": 2 * dp,
        "train.lr": 3e-4,
        "train.warmup_steps": 0,
        "train.grad_clip": 0.5,
        "train.precision": "fp32",
        "parallel.zero_stage": zero,
        "parallel.vocab_multiple": 8,
    }
    return load_config("configs/quickstart.yaml", [f"{k}={v}" for k, v in over.items()])


def _moe_config(tp: int, ep: int, dp: int):
    from megaformer.config import load_config

    over = {
        "model.vocab_size": V,
        "model.d_model": 32,
        "model.n_layers": 4,
        "model.n_heads": 4,
        "model.n_kv_heads": 2,
        "model.max_seq_len": 16,
        "data.seq_len": 16,
        "model.moe.interval": 1,
        "model.moe.num_experts": 8,
        "model.moe.top_k": 2,
        "model.moe.d_expert": 64,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 2 * dp,
        "parallel.tensor": tp,
        "parallel.expert": ep,
        "parallel.vocab_multiple": 8,
    }
    return load_config("configs/quickstart.yaml", [f"{k}={v}" for k, v in over.items()])


def _init(rank: int) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import logging

    import deepspeed

    from megaformer.training.distributed import disable_cpu_shm_comm_op

    disable_cpu_shm_comm_op()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)


def _nbytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _largest_module(cfg) -> int:
    """fp32 bytes of the largest module built whole (a block, the embedding or the output layer)."""
    from megaformer.parallel.build import build_model

    plain = build_model(cfg, None, device="meta").plain
    return max(_nbytes(m) for m in (*plain.layers, plain.tok_embeddings, plain.lm_head))


def _zero3(rank: int, world: int, train: bool) -> dict:
    import deepspeed

    from megaformer.analysis.measure import measure
    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import build_topology
    from megaformer.runtime.optimizer import build_optimizer
    from megaformer.training.deepspeed_config import build_deepspeed_config, zero3_partitioner

    _init(rank)
    cfg = _dense_config(3, world)
    topo = build_topology(world, rank)
    ds_config = build_deepspeed_config(cfg, 1)
    built = measure(
        lambda: build_model(cfg, topo, partition=zero3_partitioner(cfg, ds_config, topo))
    )
    model = built.result.model
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    ref = build_model(cfg, None).model  # one process, the same seed
    same = True
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        with deepspeed.zero.GatheredParameters([p]):
            same = same and torch.equal(p.data, r.data)
    out = {"peak": built.peak, "end": built.end, "held": held, "same": same}
    if not train:
        return out
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=build_optimizer(model, cfg.train),
        config=ds_config,
        mpu=topo,
        dist_init_required=False,
    )
    losses = []
    for x in _batches(world)[:, rank]:
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    out["losses"] = losses
    return out


def _batches(dp: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, V, (STEPS, dp, 2, 16), generator=gen)


def _one_process_losses(cfg, dp: int) -> list[float]:
    """ZeRO-0 on one process: each step averages the loss over every DP rank's micro-batch."""
    from megaformer.parallel.build import build_model
    from megaformer.parallel.grad_norm import clip_grads_
    from megaformer.runtime.optimizer import build_optimizer

    model = build_model(cfg, None).model
    opt = build_optimizer(model, cfg.train)
    losses = []
    for step in _batches(dp):
        opt.zero_grad()
        loss = sum(model(x, x) for x in step) / len(step)
        loss.backward()
        norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())))
        clip_grads_(model.parameters(), cfg.train.grad_clip, norm)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp", [2, 4])
def test_zero3_build_holds_its_partitions_and_one_module(dp):
    """ZeRO-3 at DP = 2 and 4: each rank's build peak is about 1/DP of the fp32 model plus one
    whole module (not the whole model), it keeps exactly its 1/DP, the gathered values are the
    one-process build's, and (DP2) the first 3 steps' losses equal ZeRO-0 on one process."""
    cfg = _dense_config(0, dp)
    whole = _nbytes(build_model_meta(cfg))
    module = _largest_module(cfg)
    ranks = run_ranks(dp, _zero3, dp == 2, timeout=600)
    for r in ranks:
        assert r["same"]
        assert r["held"] == pytest.approx(whole / dp, rel=0.02)
        # 1/DP of the model, the whole module being partitioned, and DeepSpeed's own bookkeeping
        # (a few blocks of this model's size whatever the model's). The previous module's whole
        # tensors are sometimes still alive when the next one is built: DeepSpeed's converted
        # parameters are freed by the garbage collector, and from run to run the peak of the same
        # build measured 1.05-1.41 MB at DP2 and 0.59-1.00 MB at DP4 (whole model 1.74 MB,
        # largest module 0.21 MB), so the bound allows modules still in flight, and the estimator
        # (partitions + one module) is a lower bound here rather than a match.
        assert r["peak"] <= whole / dp + 3 * module + 0.1 * whole, (r["peak"], whole, module)
        assert r["peak"] < 0.9 * whole, (r["peak"], whole)
        assert r["peak"] >= 0.85 * _estimate(cfg, dp=dp, zero=3), r["peak"]
    if dp == 2:
        ref = _one_process_losses(cfg, dp)
        for r in ranks:
            for a, b in zip(r["losses"], ref):
                assert abs(a - b) <= 1e-5 * abs(b), (r["losses"], ref)


def _estimate(cfg, **layout) -> float:
    """The memory estimator's build peak for this layout (fp32)."""
    from megaformer.analysis.memory import Layout, build_bytes
    from megaformer.parallel.plan import padded_vocab_size

    lay = Layout(precision="fp32", **layout)
    return build_bytes(cfg.model, lay, padded_vocab_size(V, lay.tp, cfg.parallel.vocab_multiple))


def build_model_meta(cfg) -> torch.nn.Module:
    from megaformer.parallel.build import build_model

    return build_model(cfg, None, device="meta").plain


def _experts(rank: int, world: int, tp: int, ep: int) -> dict:
    from megaformer.analysis.measure import measure
    from megaformer.parallel import experts
    from megaformer.parallel.build import build_model
    from megaformer.parallel.plan import full_state_dict
    from megaformer.parallel.topology import build_topology

    _init(rank)
    cfg = _moe_config(tp, ep, world // tp)
    topo = build_topology(world, rank, tp=tp, ep=ep)
    built = measure(lambda: build_model(cfg, topo))
    model = built.result.plain
    local = [p for p in model.parameters()]
    full = full_state_dict(model, topo)  # gathered over TP and EP
    ref = build_model(cfg, None).plain.state_dict()
    same = all(torch.equal(v, ref[k][: v.shape[0]]) for k, v in full.items())
    return {
        "peak": built.peak,
        "end": built.end,
        "held": _nbytes(model),
        "same": same,
        "expert_rows": sorted({p.shape[0] for p in local if experts.is_expert_param(p)}),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,ep,world", [(1, 2, 2), (2, 2, 4)], ids=["ep2", "tp2xep2"])
def test_expert_parallel_build_holds_its_experts_and_one_block(tp, ep, world):
    """EP2 and TP2 x EP2: each rank's build holds its experts (1/EP of each MoE block's, at 1/TP)
    and at most one whole block more at its peak, never the whole model; gathered, the weights
    are one process's."""
    cfg = _moe_config(1, 1, 1)
    whole = _nbytes(build_model_meta(cfg))
    block = max(_nbytes(b) for b in build_model_meta(cfg).layers)
    for r in run_ranks(world, _experts, tp, ep, timeout=600):
        assert r["same"] and r["expert_rows"] == [8 // ep]
        assert r["end"] == pytest.approx(r["held"], rel=0.05)
        assert r["peak"] <= r["held"] + block * 1.05, (r["peak"], r["held"], block)
        assert r["peak"] < 0.7 * whole, (r["peak"], whole)
        assert r["peak"] == pytest.approx(_estimate(cfg, tp=tp, dp=world // tp, ep=ep), rel=0.15)
