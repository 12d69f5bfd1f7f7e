"""Resume through the :class:`Checkpointer` alone, no Trainer, for each format it reads; its save
collectives under NCCL's device map; and the one pinned staging arena per rank.

Formats (the model, config and first-release run of ``tests/data/previous_release_run``):

* ``engine``: the first release's DeepSpeed files at the saved layout (ZeRO-0, fp32);
* ``portable``: the same checkpoint at another layout (ZeRO-1), from its layout-free ``optimizer/``;
* ``sharded``: the current format, written by :meth:`Checkpointer.save`, at the saved layout (with
  its RNG streams) and at another (ZeRO-1);
* ``weights``: a weights-only checkpoint (``megaformer convert``): weights, fresh optimizer, step 0.

Each resumed master weight and Adam moment equals, bit for bit, what the checkpoint holds (or what
the saving engine held).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from megaformer.checkpoint.checkpointer import Checkpointer, Trained, TrainState
from megaformer.checkpoint.optimizer_state import OptimizerAccess, local_parameters
from megaformer.checkpoint.sharded import VOCAB_TABLES, ShardedState
from megaformer.config import load_config
from tests.dist_harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS = ROOT / "tests" / "data" / "previous_release_run"
VOCAB = 257
MODEL = (
    "data.source=stdlib",
    f"model.vocab_size={VOCAB}",
    "model.d_model=16",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.max_seq_len=16",
    "data.max_bytes=20000",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr=3e-3",
    "train.warmup_steps=1",
    "model.dropout=0.0",
    "model.attention_dropout=0.0",
    "train.steps=4",
    "log.tensorboard=false",
)


def _cfg(*extra: str) -> Any:
    return load_config(ROOT / "configs" / "quickstart.yaml", [*MODEL, *extra])


def _full_state(engine: Any, topo: Any) -> dict[str, torch.Tensor]:
    """name/key -> this process's whole fp32 tensor (vocabulary padding cut), from the engine."""
    from megaformer.checkpoint.legacy.portable import KEYS, get_full

    access = OptimizerAccess(engine, topo)
    access.link()
    out = {}
    for name, p in local_parameters(engine.module):
        for key in KEYS:
            t = get_full(access, p, key).clone()
            out[f"{name}/{key}"] = t[:VOCAB] if name in VOCAB_TABLES else t
    return out


def _file_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """name/key -> tensor of a first-release checkpoint's layout-free state."""
    from safetensors.torch import load_file

    return load_file(str(ckpt / "optimizer" / "stage_00.safetensors"))


def _engine(cfg: Any, topo: Any, weights: Any, source: Any) -> tuple[Any, Any, Any]:
    import deepspeed

    from megaformer.checkpoint.safe_load import install_safe_checkpoint_engine
    from megaformer.config import validate_for_world
    from megaformer.parallel.build import build_model
    from megaformer.runtime.optimizer import build_optimizer
    from megaformer.training.deepspeed_config import build_deepspeed_config
    from megaformer.training.schedule import lr_lambda

    built = build_model(cfg, topo, device="cpu", weights=weights, weights_source=source)
    opt = build_optimizer(built.model, cfg.train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train))
    engine, _, _, sched = deepspeed.initialize(
        model=built.model,
        optimizer=opt,
        lr_scheduler=sched,
        mpu=topo,
        dist_init_required=False,
        config=build_deepspeed_config(cfg, validate_for_world(cfg, 1)),
    )
    install_safe_checkpoint_engine(engine)
    return engine, sched, built


def _resume(cfg: Any, run: Path, topo: Any) -> tuple[Checkpointer, Any, Any, Any]:
    """A checkpointer on ``run``, the model built from what it gives, the engine attached and
    resumed: (checkpointer, TrainState or None, engine, scheduler)."""
    ckpt = Checkpointer(cfg, run, 1, 0)
    engine, sched, built = _engine(cfg, topo, *ckpt.model_weights(cfg.model))
    ckpt.attach(
        cfg,
        topo,
        Trained(
            engine,
            sched,
            lambda: local_parameters(engine.module),
            built.plain.padded_vocab_size,
            tp_rng=built.tp_rng,
        ),
    )
    return ckpt, ckpt.resume(), engine, sched


class _Tokenizer:
    def save(self, path: Path) -> None:
        shutil.copyfile(PREVIOUS / "checkpoints" / "step_0000002" / "tokenizer.json", path)


def _every_format(rank: int, world: int, tmp: Path) -> dict:
    """One process (a DeepSpeed engine per resume): what each format's resume restored."""
    import logging
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    from safetensors.torch import load_file

    from megaformer.checkpoint.weights import save_weights_checkpoint
    from megaformer.parallel.topology import build_topology
    from megaformer.training.distributed import disable_cpu_shm_comm_op

    disable_cpu_shm_comm_op()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    topo = build_topology(1, 0, tp=1, pp=1)
    saved = PREVIOUS / "checkpoints" / "step_0000002"
    expected = {
        **_file_state(saved),
        **{
            f"{k}/master": v
            for k, v in load_file(str(saved / "model.safetensors")).items()
            if k != "lm_head.weight"
        },
    }
    out: dict[str, Any] = {"expected_first_release": expected}

    # the first release, at its own layout: DeepSpeed's files
    shutil.copytree(PREVIOUS, tmp / "engine")
    ckpt, state, engine, sched = _resume(_cfg("parallel.zero_stage=0"), tmp / "engine", topo)
    out["engine"] = {
        "kind": ckpt.kind,
        "state": state,
        "values": _full_state(engine, topo),
        "lr": sched.get_last_lr(),
    }

    # the current format, written by the checkpointer that resumed, after one more step
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # grad_accum 2: one optimizer step
        engine.backward(engine(x, x))
        engine.step()
    before = {
        "values": _full_state(engine, topo),
        "rng": torch.get_rng_state(),
        "lr": sched.get_last_lr(),
    }
    path = ckpt.save(TrainState(3, 12, 1))
    torch.rand(7)  # moves the stream on: the resume must put it back
    ckpt, state, engine, sched = _resume(_cfg("parallel.zero_stage=0"), tmp / "engine", topo)
    out["sharded"] = {
        "kind": ckpt.kind,
        "state": state,
        "values": _full_state(engine, topo),
        "rng_restored": torch.equal(torch.get_rng_state(), before["rng"]),
        "lr": sched.get_last_lr(),
        "before": before,
        "path": path,
        "index": json.loads((path / "state" / "index.json").read_text()),
    }
    ckpt, state, engine, _ = _resume(_cfg("parallel.zero_stage=1"), tmp / "engine", topo)
    out["sharded_zero1"] = {
        "kind": ckpt.kind,
        "changes": ckpt.changes,
        "state": state,
        "values": _full_state(engine, topo),
    }

    # the first release at another layout: its layout-free optimizer/ state
    shutil.copytree(PREVIOUS, tmp / "portable")
    ckpt, state, engine, sched = _resume(_cfg("parallel.zero_stage=1"), tmp / "portable", topo)
    out["portable"] = {
        "kind": ckpt.kind,
        "changes": ckpt.changes,
        "state": state,
        "values": _full_state(engine, topo),
        "lr": sched.get_last_lr(),
    }

    # weights only (megaformer convert): weights, a fresh optimizer, step 0
    weights = load_file(str(saved / "model.safetensors"))
    save_weights_checkpoint(tmp / "weights", 0, weights, _cfg().to_yaml(), _Tokenizer(), {})
    ckpt, state, engine, _ = _resume(_cfg(), tmp / "weights", topo)
    out["weights"] = {
        "kind": ckpt.kind,
        "state": state,
        "values": _full_state(engine, topo),
        "adam_step": OptimizerAccess(engine).adam_step(),
    }
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    return run_ranks(1, _every_format, tmp_path_factory.mktemp("formats"))[0]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k].float()), k


@pytest.mark.slow
def test_first_release_engine_files_resume_at_the_saved_layout(resumed):
    r = resumed["engine"]
    assert r["kind"] == "engine" and r["state"] == TrainState(2, 8, 0)
    _assert_equal(r["values"], resumed["expected_first_release"])  # = its layout-free copy


@pytest.mark.slow
def test_first_release_resumes_at_another_layout_from_its_layout_free_state(resumed):
    r = resumed["portable"]
    assert r["kind"] == "portable" and r["changes"] == ["zero_stage 0 -> 1"]
    assert r["state"] == TrainState(2, 8, 0) and r["lr"] == resumed["engine"]["lr"]
    _assert_equal(r["values"], resumed["expected_first_release"])


@pytest.mark.slow
def test_sharded_checkpoint_resumes_exactly_at_its_layout_and_at_another(resumed):
    r = resumed["sharded"]
    assert r["path"].name == "step_0000003" and r["index"]["format"] == 2
    assert r["kind"] == "sharded" and r["state"] == TrainState(3, 12, 1)
    assert r["rng_restored"] and r["lr"] == r["before"]["lr"]
    _assert_equal(r["values"], r["before"]["values"])
    # the step changed the state: the comparison is not against the first release's values
    assert not torch.equal(
        r["values"]["tok_embeddings.weight/master"],
        resumed["expected_first_release"]["tok_embeddings.weight/master"],
    )
    z1 = resumed["sharded_zero1"]
    assert z1["kind"] == "sharded" and z1["changes"] == ["zero_stage 0 -> 1"]
    assert z1["state"] == TrainState(3, 12, 1)
    _assert_equal(z1["values"], r["before"]["values"])


@pytest.mark.slow
def test_weights_only_checkpoint_seeds_the_model_with_a_fresh_optimizer(resumed):
    r = resumed["weights"]
    assert r["kind"] == "weights" and r["state"] is None and r["adam_step"] == 0.0
    masters = {k: v for k, v in r["values"].items() if k.endswith("/master")}
    _assert_equal(
        masters,
        {k: v for k, v in resumed["expected_first_release"].items() if k.endswith("/master")},
    )
    assert all(not v.any() for k, v in r["values"].items() if not k.endswith("/master"))


# ----------------------------------------------------------------------------- NCCL's device map


class PlainEngine:
    """What the checkpointer reads of DeepSpeed's engine when it steps torch's AdamW as is
    (ZeRO-0, fp32): the module and the optimizer (no DeepSpeed: it needs real CUDA for
    ``cuda:gloo``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.global_steps = self.global_samples = 0


def _plain_run(cfg: Any, run: Path, world: int, rank: int) -> tuple[Checkpointer, Any]:
    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import layout_groups
    from megaformer.training.schedule import lr_lambda

    ckpt = Checkpointer(cfg, run, world, rank)
    weights, source = ckpt.model_weights(cfg.model)
    model = build_model(cfg, device="cpu", weights=weights, weights_source=source).model
    engine = PlainEngine(model)
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lr_lambda(cfg.train))
    topo = layout_groups(world, tp=1, pp=1)
    topo.rank = rank
    ckpt.attach(
        cfg, topo, Trained(engine, sched, lambda: local_parameters(model), model.padded_vocab_size)
    )
    return ckpt, engine


def _one_step(engine: PlainEngine) -> None:
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    engine.module(x, x).backward()
    engine.optimizer.step()


def _save_and_resume_on_nccl_device_map(rank: int, world: int, run: Path) -> dict:
    """Under a default group that serves CUDA tensors only (as NCCL's), two ranks save a sharded
    checkpoint (existence broadcast, barriers, the gather of shard descriptions, the seal) and
    resume from it."""
    import torch.distributed as dist

    try:  # what crashed every CUDA run's first save: a host tensor on the default group
        dist.broadcast(torch.tensor([0]), src=0)
        host_tensor_error = None
    except RuntimeError as e:
        host_tensor_error = str(e)
    ckpt, engine = _plain_run(_cfg(), run, world, rank)
    _one_step(engine)
    before = {
        n: (p.detach().clone(), engine.optimizer.state[p]["exp_avg_sq"].clone())
        for n, p in local_parameters(engine.module)
    }
    path = ckpt.save(TrainState(1, 4))
    again = ckpt.save(TrainState(1, 4))  # exists already: every rank learns it from rank 0
    ckpt, engine = _plain_run(_cfg(), run, world, rank)
    state = ckpt.resume()
    after = {
        n: (p.detach().clone(), engine.optimizer.state[p]["exp_avg_sq"].clone())
        for n, p in local_parameters(engine.module)
    }
    return {
        "error": host_tensor_error,
        "path": path,
        "again": again,
        "state": state,
        "equal": all(torch.equal(before[n][i], after[n][i]) for n in before for i in (0, 1)),
        "files": sorted(f.name for f in (path / "state").iterdir()),
    }


@pytest.mark.slow
def test_save_and_resume_collectives_run_under_nccls_device_map(tmp_path):
    """A default group made as ``cuda:gloo`` refuses host tensors as NCCL does ("No backend type
    associated with device type cpu"); the checkpointer's collectives run on a group that takes
    them, so two ranks save, find the existing checkpoint, and resume exactly."""
    results = run_ranks(
        2, _save_and_resume_on_nccl_device_map, tmp_path / "run", backend="cuda:gloo"
    )
    for r in results:
        assert "No backend type associated with device type cpu" in r["error"]
        assert r["path"].name == "step_0000001" and r["again"] is None
        assert r["state"] == TrainState(1, 4, 0) and r["equal"]
        assert r["files"] == ["index.json", "rank_00000.safetensors", "rank_00001.safetensors"]


def test_collective_device_follows_the_backend(monkeypatch):
    import torch.distributed as dist

    from megaformer.runtime import collectives

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for config, types in [
        ("gloo", ["cpu"]),
        ("nccl", ["cuda"]),
        ("cuda:gloo", ["cuda"]),
        ("cpu:gloo,cuda:nccl", ["cpu", "cuda"]),
    ]:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, c=config: c)
        assert collectives.device_types() == types
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert collectives.collective_device() == torch.device("cpu")


# ----------------------------------------------------------------------------- pinned staging


def test_pinned_staging_is_one_arena_reused_by_every_save(tmp_path, monkeypatch):
    """Two saves (one synchronous, one in the background) pin one buffer of exactly the rank's
    staging bytes, 12 x the elements it owns, not one power-of-two block per box."""
    from megaformer.checkpoint import staging

    pinned: list[int] = []

    def pin_host(nbytes: int) -> torch.Tensor:  # a CPU has no pinned memory: count the calls
        pinned.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(staging, "pin_host", pin_host)
    cfg = _cfg("checkpoint.async_save=true")
    ckpt, engine = _plain_run(cfg, tmp_path, 1, 0)
    ckpt.staging = staging.HostStaging()  # what a run whose model is on a GPU gets
    _one_step(engine)
    ckpt.save(TrainState(1, 4))
    _one_step(engine)
    before = {n: p.detach().clone() for n, p in local_parameters(engine.module)}
    ckpt.save(TrainState(2, 8))
    ckpt.wait()
    d = cfg.model.d_model
    owned = sum(p.numel() for n, p in local_parameters(engine.module) if n not in VOCAB_TABLES)
    owned += VOCAB * d  # the embedding's real rows (tied: the head is the same tensor)
    assert pinned == [12 * owned] and ckpt.staging.pinned_bytes == 12 * owned
    assert (12 * owned) & (12 * owned - 1) != 0  # not a power of two: nothing rounded it
    index = json.loads(
        (tmp_path / "checkpoints" / "step_0000002" / "state" / "index.json").read_text()
    )
    state = ShardedState(tmp_path / "checkpoints" / "step_0000002")
    assert index["format"] == 2 and sum(len(b) for b in state.listed().values()) > 3  # one arena
    cfg = _cfg("checkpoint.async_save=true", "checkpoint.resume=true")
    ckpt, engine = _plain_run(cfg, tmp_path, 1, 0)
    assert ckpt.resume() == TrainState(2, 8, 0)
    assert all(torch.equal(p.detach(), before[n]) for n, p in local_parameters(engine.module))
