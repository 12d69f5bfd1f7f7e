"""The interleaved engine on its own (a pipeline of small linear layers): its gradients equal one
process's, it holds no more activations than the schedule's warm-up implies, a step after the
first reads nothing on the host and sends each boundary's activation and gradient once per
micro-batch (2 (v p - 1) messages), and it leaves no buffer behind after a step or an
evaluation."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks

D, BATCH = 8, 2


def _layers(n: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(n)]


def _batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)) for _ in range(m)
    ]


def _one_process_grads(n: int, m: int) -> list[torch.Tensor]:
    layers = _layers(n)
    model = torch.nn.Sequential(*layers)
    for x, y in _batches(m):
        (torch.nn.functional.mse_loss(model(x), y) / m).backward()
    return [p.grad.clone() for layer in layers for p in layer.parameters()]


def _engine_step(rank: int, world: int, n: int, m: int, v: int) -> dict:
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from megaformer.parallel.interleaved_engine import InterleavedModule, engine_for
    from megaformer.training.distributed import disable_cpu_shm_comm_op

    disable_cpu_shm_comm_op()
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    per = n // (v * world)

    class Chunks(InterleavedModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            self.num_stages = v * world
            self.parts = [s * per for s in range(v * world + 1)]
            r = self._topo.get_coord(self.global_rank).pipe
            self.phase_bounds = [
                (self.parts[c * world + r], self.parts[c * world + r + 1]) for c in range(v)
            ]
            self._set_bounds(*self.phase_bounds[0])

    pipe = Chunks(
        layers=_layers(n),
        topology=PipeDataParallelTopology(num_pp=world, num_dp=1),
        loss_fn=torch.nn.functional.mse_loss,
    )
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": m,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": 0},  # the gradients stay on the parameters until the step
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False},
        "steps_per_print": 10**9,
    }
    with engine_for(pipe):
        engine, *_ = deepspeed.initialize(
            model=pipe, config=config, model_parameters=pipe.parameters()
        )
    held = peak = 0
    forward, backward = type(engine)._exec_forward_pass, type(engine)._exec_backward_pass

    def count_forward(self, buffer_id, phase):
        nonlocal held, peak
        forward(self, buffer_id, phase)
        held += 1
        peak = max(peak, held)

    def count_backward(self, buffer_id, phase):
        nonlocal held
        backward(self, buffer_id, phase)
        held -= 1

    from deepspeed.runtime.pipe import schedule as ds

    grads = {}
    step = type(engine)._INSTRUCTION_MAP[ds.OptimizerStep]

    def keep_grads(self):  # the accumulated gradients, before the optimizer consumes them
        for lo, hi in pipe.phase_bounds:
            for i in range(lo, hi):
                grads[i] = [p.grad.clone() for p in pipe._modules[str(i)].parameters()]
        step(self)

    engine._INSTRUCTION_MAP = {
        **type(engine)._INSTRUCTION_MAP,
        ds.ForwardPass: count_forward,
        ds.BackwardPass: count_backward,
        ds.OptimizerStep: keep_grads,
    }
    loss = engine.train_batch(iter(_batches(m)))
    train_peak, after = peak, held  # after the step: every forward met its backward
    # a second step: the shapes are known, so nothing is read on the host; the bytes it sends
    sent, reads = [0], [0]
    queue, item = engine._queue_p2p, torch.Tensor.item

    def count_queue(op, tensors, stage):
        if op is ds_comm.isend:
            sent[0] += sum(t.numel() * t.element_size() for t in tensors)
        queue(op, tensors, stage)

    def count_item(t):
        reads[0] += 1
        return item(t)

    engine._queue_p2p, torch.Tensor.item = count_queue, count_item
    try:
        engine.train_batch(iter(_batches(m)))
    finally:
        torch.Tensor.item = item
        del engine._queue_p2p
    left = {k: sum(x is not None for x in b) for k, b in engine.pipe_buffers.items()}
    val = engine.eval_batch(iter(_batches(m + 1)), num_micro_batches=m + 1)
    left_eval = {k: sum(x is not None for x in b) for k, b in engine.pipe_buffers.items()}
    return {
        "loss": float(loss),
        "val": float(val),
        "peak": train_peak,
        "after": after,
        "sent": sent[0],
        "host_reads": reads[0],
        "left": left,
        "left_eval": left_eval,
        "grads": grads,
        "type": type(engine).__name__,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,n,m,v", [(2, 4, 4, 2), (4, 8, 8, 2), (2, 8, 4, 4)])
def test_engine_step_equals_one_process_and_frees_its_buffers(world, n, m, v):
    out = run_ranks(world, _engine_step, n, m, v, timeout=300)
    assert {o["type"] for o in out} == {"InterleavedEngine"}
    layers = _layers(n)
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        ref_loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in _batches(m)) / m
        ref_val = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in _batches(m + 1)) / (
            m + 1
        )
    ref = _one_process_grads(n, m)
    for o in out:
        assert o["loss"] == pytest.approx(float(ref_loss), rel=1e-6)
        assert o["val"] == pytest.approx(float(ref_val), rel=1e-6)
        for i, grads in o["grads"].items():
            for k, g in enumerate(grads):
                assert torch.allclose(g, ref[2 * i + k], atol=1e-7), (i, k)  # weight, bias
        assert o["after"] == 0
        assert all(v == 0 for v in o["left"].values()), o["left"]
        assert all(v == 0 for v in o["left_eval"].values()), o["left_eval"]
    covered = sorted(i for o in out for i in o["grads"])
    assert covered == list(range(n))
    # every stage boundary is crossed once forward and once backward per micro-batch
    assert sum(o["sent"] for o in out) == 2 * (v * world - 1) * m * BATCH * D * 4
    assert [o["host_reads"] for o in out] == [0] * world
    for r, o in enumerate(out):  # Megatron's warm-up: 2 (p-1-r) + (v-1) p forwards, then 1F1B
        assert o["peak"] == min(2 * (world - 1 - r) + (v - 1) * world + 1, m * v), (r, o["peak"])
