"""bf16 gradients are accumulated in fp32 under every ZeRO stage megaformer runs, and bf16 training
follows fp32 training within bf16 rounding; bf16 without ZeRO (DeepSpeed's bf16-accumulating fp16
optimizer) is refused by name."""

from __future__ import annotations

import os

import pytest
import torch

from megaformer.config import Config, ParallelConfig, TrainConfig
from megaformer.errors import ConfigError
from megaformer.training.deepspeed_config import build_deepspeed_config
from tests.dist_harness import run_ranks
from tests.helpers import assert_one_line_error, cli_main, tiny_model, tiny_overrides

ACCUM, STEPS = 4, 3


def _cfg(precision: str, stage: int) -> Config:
    return Config(
        model=tiny_model(),
        parallel=ParallelConfig(zero_stage=stage),
        train=TrainConfig(
            seed=5,
            precision=precision,
            micro_batch_size=2,
            global_batch_size=2 * ACCUM,
            lr=3e-3,
            warmup_steps=0,
            grad_clip=1.0,
        ),
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_config_accumulates_in_fp32(stage):
    ds = build_deepspeed_config(_cfg("bf16", stage), ACCUM)
    assert ds["bf16"]["enabled"] and ds["data_types"]["grad_accum_dtype"] == "fp32"
    assert "data_types" not in build_deepspeed_config(_cfg("fp32", stage), ACCUM)


def test_bf16_without_zero_is_refused():
    from megaformer.config import validate_for_training

    with pytest.raises(ConfigError, match="parallel.zero_stage=0.*parallel.zero_stage=1"):
        validate_for_training(_cfg("bf16", 0))
    for extra in ((), ("--dry-run",)):  # refused when the config is read, before any run starts
        proc = cli_main(
            "train",
            "configs/quickstart.yaml",
            *tiny_overrides(),
            "train.precision=bf16",
            "parallel.zero_stage=0",
            "--run-dir",
            "/nonexistent/never-created",
            *extra,
        )
        assert_one_line_error(proc, "train.precision=bf16 with parallel.zero_stage=0")


def _train_each(rank: int, world: int) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import logging

    import deepspeed

    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import build_topology
    from megaformer.runtime.optimizer import build_optimizer
    from megaformer.training.distributed import disable_cpu_shm_comm_op

    disable_cpu_shm_comm_op()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    topo = build_topology(world, rank)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 37, (2, 16), generator=gen) for _ in range(STEPS * ACCUM)]
    out = {}
    for precision, stage in [("fp32", 0), ("bf16", 1), ("bf16", 2), ("bf16", 3)]:
        cfg = _cfg(precision, stage)
        model = build_model(cfg, topo, device="cpu").model
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=build_optimizer(model, cfg.train),
            config=build_deepspeed_config(cfg, ACCUM),
            mpu=topo,
            dist_init_required=False,
        )
        opt = engine.optimizer
        accum = (
            torch.float32
            if type(opt).__name__ == "BF16_Optimizer"  # fp32 hp gradients
            else getattr(opt, "gradient_accumulation_dtype", None)
        )
        losses = []
        for s in range(STEPS):
            step = []
            for x in data[s * ACCUM : (s + 1) * ACCUM]:
                loss = engine(x, x)
                engine.backward(loss)
                engine.step()
                step.append(float(loss))
            losses.append(sum(step) / len(step))
        out[(precision, stage)] = {
            "losses": losses,
            "accum": accum,
            "optimizer": type(opt).__name__,
        }
    return out


@pytest.mark.slow
def test_bf16_follows_fp32_under_every_zero_stage():
    runs = run_ranks(1, _train_each)[0]
    ref = runs[("fp32", 0)]["losses"]
    assert ref[-1] < ref[0]  # it trains
    for stage in (1, 2, 3):
        run = runs[("bf16", stage)]
        assert run["accum"] == torch.float32, (stage, run["optimizer"])
        for a, b in zip(run["losses"], ref):
            assert a == pytest.approx(b, rel=5e-3), (stage, run["losses"], ref)
