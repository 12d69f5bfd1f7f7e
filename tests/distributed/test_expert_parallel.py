"""Expert parallelism equals one process: loss, router statistics, every gradient, the global norm.

Each rank builds the whole model from the seed (the reference, trained in-process on every rank
on all data-parallel ranks' micro-batches) and its expert-parallel layout under DeepSpeed (the
engine set up as the trainer does: DeepSpeed's expert groups are the topology's, expert
parameters in their own optimizer groups, reduced over their expert-data group). Both take 3
AdamW steps on the same batches; the distributed gradients (after DeepSpeed's reduction, before
the update) are gathered over TP and EP to whole shape and compared with the reference's, and the
global gradient norm with the reference's. Then: a sharded checkpoint written at one EP degree
resumes at another, and the all-to-all dispatch moves exactly the rows it should.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from megaformer.checkpoint.sharded import ShardedState
from tests.dist_harness import run_ranks
from tests.helpers import run_torchrun, tiny_overrides

STEPS = 3
V = 64  # vocabulary: a multiple of 8 * TP, so every layout pads it alike (not at all)


class Layout(NamedTuple):
    """One layout under test (written as a plain tuple in the tests, the trailing fields left
    out where they are the defaults)."""

    tp: int
    pp: int
    ep: int
    zero: int
    sp: bool
    dispatch: str = "auto"  # parallel.expert_dispatch
    cp: int = 1
    capacity: float = 0.0  # > 0: model.moe.dropless=false with this capacity factor


def _config(lay: Layout, dp: int):
    from megaformer.config import load_config

    tp, pp, ep, zero, sp, dispatch, cp, capacity = lay

    moe = {
        "model.moe.interval": 1,
        "model.moe.num_experts": 4,
        "model.moe.top_k": 2,
        "model.moe.d_expert": 32,
        "model.moe.num_shared_experts": 1,
        "model.moe.d_shared": 16,
        "model.moe.shared_gate": True,
        "model.moe.aux_loss_coef": 0.0 if pp > 1 else 0.05,
        "model.moe.z_loss_coef": 0.0 if pp > 1 else 0.01,
        "model.moe.bias_update_rate": 0.01 if pp > 1 else 0.0,
    }
    if capacity:  # each expert keeps its first ceil(capacity N k / E) assignments
        moe.update({"model.moe.dropless": False, "model.moe.capacity_factor": capacity})
    over = {
        "model.vocab_size": V,
        "model.d_model": 32,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.n_kv_heads": 2,
        "model.max_seq_len": 16,
        "data.seq_len": 16,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 2 * dp,
        # a small lr: AdamW divides by sqrt(v), which amplifies fp32 round-off in near-zero
        # gradients (as in tests/distributed/test_tensor_parallel.py)
        "train.lr": 3e-4,
        "train.warmup_steps": 0,
        "train.grad_clip": 0.5,
        "parallel.tensor": tp,
        "parallel.pipeline": pp,
        "parallel.expert": ep,
        "parallel.zero_stage": zero,
        "parallel.sequence_parallel": sp,
        "parallel.expert_dispatch": dispatch,
        "parallel.context": cp,
        "parallel.vocab_multiple": 8,
        **moe,
    }
    return load_config("configs/quickstart.yaml", [f"{k}={v}" for k, v in over.items()])


def _reference(cfg, batches: list[list[torch.Tensor]]) -> list[dict]:
    """One process: each step averages the loss over every DP rank's micro-batch."""
    from megaformer.model.moe import end_of_step
    from megaformer.parallel.build import build_model
    from megaformer.parallel.grad_norm import clip_grads_
    from megaformer.runtime.optimizer import build_optimizer

    model = build_model(cfg, None).model
    opt = build_optimizer(model, cfg.train)
    out = []
    for step in batches:
        opt.zero_grad()
        loss = sum(model(x, x) for x in step) / len(step)
        loss.backward()
        norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        clip_grads_(model.parameters(), cfg.train.grad_clip, norm)
        opt.step()
        out.append(
            {"loss": float(loss.detach()), "norm": norm, "grads": grads, "moe": end_of_step(model)}
        )
    return out


def _whole(p: torch.nn.Parameter, g: torch.Tensor, topo) -> torch.Tensor:
    """A gradient gathered over TP (its split dim) and EP (dim 0 of expert parameters)."""
    from megaformer.parallel.plan import gather_experts

    if getattr(p, "tensor_model_parallel", False) and topo.tp > 1:
        parts = [torch.empty_like(g) for _ in range(topo.tp)]
        dist.all_gather(parts, g.contiguous(), group=topo.group("tp"))
        g = torch.cat(parts, dim=p.partition_dim)
    return gather_experts(p, g, topo)


def _one_layout(rank: int, world: int, lay: Layout) -> dict:
    import deepspeed

    from megaformer.model.moe import end_of_step
    from megaformer.parallel import experts
    from megaformer.parallel.build import build_model
    from megaformer.parallel.context import split_sequence
    from megaformer.parallel.grad_norm import GradNormClipper
    from megaformer.parallel.topology import build_topology
    from megaformer.runtime.optimizer import build_optimizer
    from megaformer.training import deepspeed_adapter as ds_adapter
    from megaformer.training.deepspeed_config import build_deepspeed_config

    tp, pp, ep, cp = lay.tp, lay.pp, lay.ep, lay.cp
    dp = world // (tp * pp * cp)
    cfg = _config(lay, dp)
    topo = build_topology(world, rank, tp=tp, pp=pp, ep=ep, cp=cp)
    gen = torch.Generator().manual_seed(7)
    batches = [
        [torch.randint(0, V, (2, 16), generator=gen) for _ in range(dp)] for _ in range(STEPS)
    ]
    ref = _reference(cfg, batches)

    built = build_model(cfg, topo)
    experts.deepspeed_groups(topo)
    with experts.recognised_by_deepspeed(ep > 1):
        engine, *_ = deepspeed.initialize(
            model=built.model,
            optimizer=build_optimizer(built.model, cfg.train),
            config=build_deepspeed_config(cfg, 1),
            mpu=topo if pp == 1 else None,
            dist_init_required=False,
        )
    names = built.param_names
    params = [(names[id(p)] if names else n, p) for n, p in engine.module.named_parameters()]
    if ep > 1:
        assert engine.has_moe_layers and any(experts.is_expert_param(p) for _, p in params)
    plain = isinstance(engine.optimizer, torch.optim.Optimizer)
    seen: dict = {}
    if plain:  # ZeRO-0: the trainer's clipping by megaformer's norm; the gradients before it
        clipper = GradNormClipper(
            engine.module.parameters,
            topo.group("tp"),
            topo.group("pp"),
            cfg.train.grad_clip,
            topo.group("ep"),
        )

        def clip() -> None:
            seen["grads"] = {n: p.grad.clone() for n, p in params}
            clipper.measure_and_clip()
            seen["norm"] = clipper.norm

        ds_adapter.replace_fp32_clipping(engine, clip)
    errs, losses, norms, stats = [], [], [], []
    for s in range(STEPS):
        x = batches[s][topo.dp_rank]
        if pp > 1:
            loss = float(engine.train_batch(iter([(x, x)])))
        else:
            if cp > 1:  # this rank's part of the sequence, its loss weighted as the train step does
                x = split_sequence(x, topo.cp_rank, cp, cfg.parallel.context_mode)
            loss = built.weigh_loss(engine(x, x), x)
            engine.backward(loss)
            if not plain:  # ZeRO 1/2: each parameter's reduced gradient from its partitions
                seen["grads"] = {n: deepspeed.utils.safe_get_full_grad(p) for n, p in params}
            engine.step()
            t = loss.detach().clone()
            dist.all_reduce(t, group=topo.group("replica"))
            loss = float(t) / (dp * cp)
        norm = seen["norm"] if plain else float(engine.get_global_grad_norm())
        worst = 0.0
        for n, p in params:
            g = _whole(p, seen["grads"][n], topo)
            r = ref[s]["grads"][n]
            assert g.shape == r.shape, (n, tuple(g.shape), tuple(r.shape))
            e = float((g - r).norm() / max(float(r.norm()), 1e-3 * ref[s]["norm"]))
            worst = max(worst, e)
        errs.append(worst)
        losses.append((loss, ref[s]["loss"]))
        norms.append((norm, ref[s]["norm"]))
        got = end_of_step(engine.module, topo.group("replica"))
        if pp > 1:  # a stage's router means cover its own blocks: compare the per-block loads
            got = {k: v for k, v in got.items() if k.startswith("moe/load")}
        stats.append((got, {k: v for k, v in ref[s]["moe"].items() if k in got}))
    return {
        "errs": errs,
        "losses": losses,
        "norms": norms,
        "stats": stats,
        "experts": sorted({tuple(p.shape) for n, p in params if experts.is_expert_param(p)}),
    }


def _layouts(rank: int, world: int, layouts: list[tuple]) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import logging

    import deepspeed

    from megaformer.training.distributed import disable_cpu_shm_comm_op

    disable_cpu_shm_comm_op()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    return {layout: _one_layout(rank, world, Layout(*layout)) for layout in layouts}


def _check(results: list[dict]) -> None:
    for r in results:
        for layout, got in r.items():
            for a, b in got["losses"]:
                assert abs(a - b) <= 1e-5 * abs(b), (layout, got["losses"])
            for a, b in got["norms"]:
                assert abs(a - b) <= 1e-5 * b, (layout, got["norms"])
            assert max(got["errs"]) < 1e-5, (layout, got["errs"])
            for have, want in got["stats"]:
                assert set(want) == set(have) and len(want) > 2
                for k in want:
                    assert have[k] == pytest.approx(want[k], rel=1e-5, abs=1e-9), (layout, k)
            ep = layout[2]
            # each rank holds E / EP experts of every MoE block (w1/w3 [E/EP, f/TP, d])
            assert ep == 1 or got["experts"][0][0] == 4 // ep, got["experts"]


@pytest.mark.multiprocess
def test_ep2_equals_one_process():
    # (tp, pp, ep, zero, sp): 2 ranks, both data-parallel ranks one EP group
    _check(run_ranks(2, _layouts, [(1, 1, 2, 0, False)], timeout=300))


@pytest.mark.multiprocess
def test_ep2_with_dp_zero12_tp_sp_and_pp_equals_one_process():
    layouts = [
        (1, 1, 2, 1, False),  # EP 2 x DP 2 (expert-data groups of 2), ZeRO-1
        (1, 1, 2, 2, False),  # the same with ZeRO-2 (gradients partitioned too)
        (2, 1, 2, 0, True),  # EP 2 x TP 2 with sequence parallelism
        (1, 2, 2, 0, False),
    ]  # EP 2 x PP 2 (aux-loss-free bias)
    _check(run_ranks(4, _layouts, layouts, timeout=600))


@pytest.mark.multiprocess
def test_ep2_tp2_token_split_equals_one_process_with_both_exchanges():
    # each TP rank dispatches its share of the tokens, the TP ranks of an EP rank gather them
    layouts = [
        (2, 1, 2, 0, False, "splits"),  # EP 2 x TP 2, replicated activations
        (2, 1, 2, 0, False, "padded"),  # the fixed-size exchange (no host read)
        (2, 1, 2, 0, True, "padded"),  # with sequence parallelism
    ]
    _check(run_ranks(4, _layouts, layouts, timeout=600))


@pytest.mark.multiprocess
def test_capacity_with_both_exchanges_and_the_token_split_equals_one_process():
    # (tp, pp, ep, zero, sp, dispatch, cp, capacity): assignments dropped where routed, over the
    # whole micro-batch; the padded exchange sends them nowhere and they come back as zeros
    layouts = [
        (2, 1, 2, 0, False, "padded", 1, 0.75),
        (2, 1, 2, 0, True, "splits", 1, 0.75),
    ]
    results = run_ranks(4, _layouts, layouts, timeout=600)
    _check(results)
    for got in results[0].values():  # the capacity did drop assignments
        assert any(want["moe/dropped"] > 0 for _, want in got["stats"])


@pytest.mark.multiprocess
def test_zero3_moe_equals_one_process():
    # ZeRO-3 partitions the (unsplit) experts with every other parameter over DP 2
    _check(run_ranks(2, _layouts, [(1, 1, 1, 3, False)], timeout=300))


@pytest.mark.multiprocess
def test_context_parallel_moe_with_and_without_ep_equals_one_process():
    # (tp, pp, ep, zero, sp, dispatch, cp): the router's statistics summed over the context group
    _check(run_ranks(2, _layouts, [(1, 1, 1, 0, False, "auto", 2)], timeout=300))
    layouts = [
        (1, 1, 2, 1, False, "splits", 2),  # EP 2 x CP 2, ZeRO-1 (experts averaged over CP too)
        (1, 1, 2, 0, False, "padded", 2),  # the same with the fixed-size exchange, ZeRO-0
    ]
    _check(run_ranks(4, _layouts, layouts, timeout=600))


# ----------------------------------------------------------------------------- bad input

MOE = ["model.n_layers=2", "model.moe.interval=1", "model.moe.num_experts=4"]


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.expert=3"], 6, "parallel.expert=3: must divide model.moe.num_experts=4"),
        (["parallel.expert=4"], 2, "parallel.expert=4: must divide the data-parallel size 2"),
        (
            ["parallel.expert=2", "parallel.tensor=2"],
            6,
            "parallel.expert=2: must divide the data-parallel size 3 (world size 6 / parallel.tensor",
        ),
        (
            ["parallel.expert=2", "parallel.tensor=2"],
            5,
            "world size 5: not divisible by parallel.tensor * parallel.pipeline = 2",
        ),
        (
            ["parallel.expert=2", "parallel.zero_stage=3"],
            2,
            "model.moe with parallel.zero_stage=3 and parallel.expert=2: DeepSpeed's ZeRO-3",
        ),
        (
            ["parallel.context=2", "model.moe.dropless=false", "model.moe.capacity_factor=1.5"],
            2,
            "parallel.context=2 with model.moe.dropless=false: a capacity keeps",
        ),
        (
            ["parallel.expert=2", "parallel.tensor=2", "data.seq_len=9"],
            4,
            "each tensor-parallel rank dispatches its share of the sequence",
        ),
        (
            ["parallel.expert=2", "parallel.expert_dispatch=padded", "model.moe.d_expert=20"],
            2,
            "parallel.expert_dispatch=padded: the experts run as grouped GEMMs",
        ),
        (
            ["parallel.expert=2", "train.precision=fp16"],
            2,
            "parallel.expert=2 with train.precision=fp16",
        ),
        (
            ["model.moe.interval=0", "parallel.expert=2"],
            2,
            "parallel.expert=2: needs a mixture-of-experts",
        ),
        (["model.moe.top_k=5"], 1, "model.moe.top_k=5: more than model.moe.num_experts=4"),
        (["model.moe.capacity_factor=1.25"], 1, "set model.moe.dropless=false"),
        (["model.moe.shared_gate=true"], 1, "model.moe.shared_gate=true: gates the shared experts"),
    ],
)
def test_bad_expert_parallel_input_is_one_line(overrides, world, message):
    from megaformer.config import load_config, validate_for_world
    from megaformer.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        validate_for_world(load_config("configs/quickstart.yaml", MOE + overrides), world)
    assert message in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- dispatch


class _Doubling(torch.nn.Module):
    """Stand-in experts: y = 2 x, recording what they were given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict = {}

    def forward(self, rows, per_expert):
        self.seen["rows"], self.seen["local"] = rows.detach().clone(), per_expert.clone()
        return rows * 2.0

    def grouped(self, rows, per_expert, dtype=None):
        return self.forward(rows, per_expert)


def _dispatch_counts(rank: int, world: int, mode: str) -> dict:
    """Skewed routing, uneven splits (one rank sends nothing to one expert): the rows each rank
    receives are exactly the rows routed to its experts, in expert order (padded: zero rows
    after them), and the CommCounter sees exactly the rows that left each rank."""
    from megaformer.comm import CommCounter
    from megaformer.parallel.experts import ExpertDispatch

    group = dist.new_group(list(range(world)))
    E = 2 * world
    counts = torch.tensor([[3, 0, 1, 5], [0, 2, 4, 1]][rank])
    x = torch.arange(int(counts.sum()), dtype=torch.float32).unsqueeze(1) + 100 * rank
    x.requires_grad_()
    experts = _Doubling()
    dispatch = ExpertDispatch(group, mode)
    events = _record_in_flight()

    def shared() -> torch.Tensor:
        events.append("shared experts")
        return torch.zeros(())

    with CommCounter() as c:
        if mode == "splits":
            y, _ = dispatch._splits(x, counts, experts, None, shared)
        else:  # at most 6 rows to one rank: the bound C the caller computes
            y, _ = dispatch._padded(x, counts, counts, 6, experts, None, shared)
        y.sum().backward()
    assert E == counts.numel()
    return {
        "rows": experts.seen["rows"].squeeze(1).tolist(),
        "local": experts.seen["local"].tolist(),
        "y": y.detach().squeeze(1).tolist(),
        "x": x.detach().squeeze(1).tolist(),
        "grad": x.grad.squeeze(1).tolist(),
        "bytes": c.bytes["all_to_all"],
        "events": events,
    }


def _record_in_flight() -> list[str]:
    """Wrap the started all-to-all so that it logs its start and the wait on it."""
    from megaformer import comm

    events: list[str] = []
    start = comm.AllToAllStart.apply

    class Logged:
        def __init__(self, work) -> None:
            self.work = work

        def wait(self) -> None:
            events.append("wait")
            self.work.wait()

    def logged(*args):
        out = start(*args)
        pending = args[-1]
        pending.append(Logged(pending.pop()))
        events.append("start")
        return out

    comm.AllToAllStart.apply = logged  # this rank process only
    return events


@pytest.mark.multiprocess
def test_all_to_all_dispatch_moves_exactly_the_routed_rows():
    r0, r1 = run_ranks(2, _dispatch_counts, "splits", timeout=120)
    # rank 0 holds experts 0, 1 (expert-major: expert 0's rows from ranks 0, 1, then expert 1's)
    assert r0["local"] == [3, 2] and r1["local"] == [5, 6]
    assert r0["rows"] == [0, 1, 2, 100, 101]
    assert r1["rows"] == [3, 102, 103, 104, 105, 4, 5, 6, 7, 8, 106]
    for r in (r0, r1):  # every row comes back to its place, doubled; gradient 2
        assert r["y"] == [2 * v for v in r["x"]] and r["grad"] == [2.0] * len(r["x"])
        # the shared experts ran while the dispatch was in flight
        assert r["events"] == ["start", "shared experts", "wait"]
    # rows leaving rank 0 (4 bytes each): forward its 6 rows of experts 2, 3 out and rank 1's 2
    # results back; backward the gradients of the same 6 + 2 rows. Rank 1 mirrors it.
    assert r0["bytes"] == r1["bytes"] == 4 * (6 + 2) * 2


@pytest.mark.multiprocess
def test_padded_dispatch_moves_the_routed_rows_in_fixed_blocks():
    r0, r1 = run_ranks(2, _dispatch_counts, "padded", timeout=120)
    # the same rows in the same order, then the zero rows (counted to the last local expert)
    assert r0["rows"] == [0, 1, 2, 100, 101] + [0.0] * 7 and r0["local"] == [3, 2 + 7]
    assert r1["rows"] == [3, 102, 103, 104, 105, 4, 5, 6, 7, 8, 106] + [0.0]
    assert r1["local"] == [5, 6 + 1]
    for r in (r0, r1):
        assert r["y"] == [2 * v for v in r["x"]] and r["grad"] == [2.0] * len(r["x"])
        assert r["events"] == ["start", "shared experts", "wait"]
    # a block of 6 rows to the other rank and back, forward and backward, whatever the routing
    assert r0["bytes"] == r1["bytes"] == 4 * 6 * 2 * 2


# ----------------------------------------------------------------------------- checkpoints


def _records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


ARGS = tiny_overrides(
    "stdlib",
    **{
        "train.steps": 6,
        "eval.interval": 0,
        "eval.at_end": "false",
        "checkpoint.interval": 2,
        "checkpoint.keep_last": "null",
        "data.max_bytes": 50000,
        "model.moe.interval": 1,
        "model.moe.num_experts": 4,
        "model.moe.top_k": 2,
        "model.moe.d_expert": 32,
        "model.moe.z_loss_coef": 0.001,
        "model.moe.bias_update_rate": 0.003,
        "parallel.zero_stage": 1,
    },
)


def _resume(src: Path, dst: Path, step: int, ep: int) -> None:
    """Copy run ``src`` to ``dst`` with its checkpoint ``step`` as the latest and train on at
    ``parallel.expert=ep`` to the end."""
    shutil.copytree(src, dst)
    for later in sorted((dst / "checkpoints").glob("step_*")):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (dst / "checkpoints" / "latest").write_text(f"step_{step:07d}\n")
    out = run_torchrun(
        2, "train", "configs/quickstart.yaml", *ARGS, f"parallel.expert={ep}", "--run-dir", str(dst)
    )
    assert out.returncode == 0 and "resumed from" in out.stdout + out.stderr, out.stderr[-3000:]


@pytest.mark.multiprocess
def test_sharded_checkpoint_resumes_at_another_expert_degree(tmp_path):
    """EP 2 trains 6 steps; from its step-2 checkpoint EP 1 trains steps 3-6, and from the step-4
    checkpoint that EP 1 wrote, EP 2 trains steps 5-6: the losses and norms of the uninterrupted
    run."""
    from safetensors.torch import load_file

    full, down, up = tmp_path / "full", tmp_path / "ep2_to_1", tmp_path / "ep1_to_2"
    out = run_torchrun(
        2, "train", "configs/quickstart.yaml", *ARGS, "parallel.expert=2", "--run-dir", str(full)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "expert-parallel groups:   [0,1]" in out.stdout, out.stdout[-2000:]
    _resume(full, down, 2, ep=1)
    _resume(down, up, 4, ep=2)
    a = _records(full)
    for run, steps in ((down, (3, 4, 5, 6)), (up, (5, 6))):
        b = _records(run)
        for step in steps:
            for key in ("loss", "grad_norm", "moe/aux_loss", "moe/load_cv/1"):
                assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (run, step, key)
    # the state EP 1 wrote holds whole expert tensors [E, f, d]; EP 2 wrote them in halves
    for run, boxes in ((down, 1), (full, 2)):
        index = json.loads((run / "checkpoints/step_0000004/state/index.json").read_text())
        assert index["shapes"]["layers.0.mlp.experts.w1"] == [4, 32, 32]
        state = ShardedState(run / "checkpoints/step_0000004")
        rows = sorted(b[2][0] for b in state.boxes_of("layers.0.mlp.experts.w1", "master"))
        assert len(rows) >= boxes and (boxes == 1 or rows[-1] == 2), rows
    biases = [
        load_file(str(r / "checkpoints/step_0000006/moe_router/stage_000.safetensors"))
        for r in (full, up)
    ]
    for k in biases[0]:
        assert torch.allclose(biases[0][k], biases[1][k])


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world,layout",
    [
        # ZeRO-0: the expert-data ranks, CP included, write each expert byte once; one rank
        # writes the router biases
        (4, ["parallel.expert=2", "parallel.context=2", "parallel.zero_stage=0"]),
        # ZeRO-3 builds the model partitioned, the experts with the rest (DP 2, EP 1)
        (2, ["parallel.zero_stage=3"]),
    ],
    ids=["ep2_cp2", "zero3"],
)
def test_megaformer_train_equals_one_process_and_resumes(tmp_path, world, layout):
    """megaformer train gives one process's losses, norms and router statistics, and resumed
    from its step-2 checkpoint continues the run."""
    args = [
        *ARGS,
        "parallel.zero_stage=0",
        "train.steps=4",
        "model.moe.aux_loss_coef=0.01",
        "model.moe.bias_update_rate=0.003",
    ]
    one, run, resumed = tmp_path / "one", tmp_path / "run", tmp_path / "resumed"
    out = run_torchrun(1, "train", "configs/quickstart.yaml", *args, "--run-dir", str(one))
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_torchrun(
        world, "train", "configs/quickstart.yaml", *args, *layout, "--run-dir", str(run)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000004")
    (resumed / "checkpoints" / "latest").write_text("step_0000002\n")
    out = run_torchrun(
        world, "train", "configs/quickstart.yaml", *args, *layout, "--run-dir", str(resumed)
    )
    assert out.returncode == 0 and "resumed from" in out.stdout + out.stderr, out.stderr[-3000:]
    a, b, c = _records(one), _records(run), _records(resumed)
    for step in (1, 2, 3, 4):
        for key in ("loss", "grad_norm", "moe/aux_loss", "moe/z_loss", "moe/load_cv/1"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
            if step > 2:
                assert c[step][key] == pytest.approx(b[step][key], rel=1e-5), (step, key)


def _norm_with_expert_share(rank: int, world: int) -> tuple[float, float]:
    """(megaformer's global norm, the hand-computed one) of one replicated parameter and one
    expert parameter whose gradients differ per rank and carry most of the norm."""
    from megaformer.parallel.grad_norm import global_grad_norm

    dense = torch.nn.Parameter(torch.zeros(3))
    dense.grad = torch.tensor([1.0, 2.0, 2.0])  # ||.||^2 = 9 on every rank
    expert = torch.nn.Parameter(torch.zeros(2, 2))
    expert.allreduce = False  # DeepSpeed's mark of an expert
    expert.grad = torch.full((2, 2), 3.0 * (rank + 1))  # 36 (rank 0), 144 (rank 1)
    norm = global_grad_norm([dense, expert], None, None, dist.new_group(list(range(world))))
    return norm, (9.0 + sum(36.0 * (r + 1) ** 2 for r in range(world))) ** 0.5


@pytest.mark.multiprocess
def test_gradient_norm_counts_every_ranks_experts_once():
    for got, want in run_ranks(2, _norm_with_expert_share, timeout=120):
        assert got == pytest.approx(want, rel=1e-12)  # sqrt(9 + 36 + 144) = 13.75
