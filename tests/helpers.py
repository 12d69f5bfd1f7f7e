"""Helpers shared by the tests: the tiny configs, running the CLI (in this process or a fresh one),
torchrun launches and reading a run's metrics.

"A fresh process" and "torchrun" are, by default, ranks forked from
:mod:`megaformer.runtime.spawn`'s server, which has imported torch, DeepSpeed and megaformer once
per session; ``fresh=True`` / ``launcher=True`` start real interpreters (for tests about the
entry point or the launcher itself).

Fixtures and markers live in ``tests/conftest.py``; everything importable lives here.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from megaformer.runtime.spawn import free_port, run_module, run_ranks  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from megaformer.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# ----------------------------------------------------------------------------- the tiny config

#: The tiny run every training test starts from (dotted config keys): a ~30k-parameter model that
#: trains in about a second per few steps on CPU.
TINY: dict[str, Any] = {
    "model.d_model": 32,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.max_seq_len": 32,
    "data.source": "stdlib",
    "data.max_bytes": 200000,
    "train.steps": 6,
    "train.micro_batch_size": 4,
    "train.global_batch_size": 8,
    "train.lr": 3e-3,
    "train.warmup_steps": 2,
    "eval.interval": 3,
    "eval.iters": 2,
    "checkpoint.interval": 0,
    "log.interval": 1,
    "log.progress_bar": False,
    "log.tensorboard": False,
    "log.sample_tokens": 0,
}


def tiny_overrides(corpus: Path | str = "stdlib", **extra: Any) -> list[str]:
    """:data:`TINY` with ``data.source=corpus`` and ``extra`` as CLI ``KEY=VALUE`` overrides."""
    base = {**TINY, "data.source": str(corpus), **extra}
    return [f"{k}={v}" for k, v in base.items()]


def short_documents(folder: Path) -> Path:
    """``folder`` filled with 300 documents of 20-60 bytes (every 32-token sample holds
    end-of-document tokens: document masks cut it)."""
    import random

    folder.mkdir()
    rng = random.Random(0)
    for i in range(300):
        words = " ".join(
            rng.choice(["def", "x", "return", "(", ")", "+", "1", ":"])
            for _ in range(rng.randint(6, 20))
        )
        (folder / f"d{i}.txt").write_text(words[:60])
    return folder


def tiny_model(**kw: Any) -> ModelConfig:
    """:data:`TINY`'s width, depth and heads as a :class:`~megaformer.config.ModelConfig` for
    in-process model tests: vocabulary 37, 16 positions, one key/value head per query head (MHA);
    ``kw`` overrides any field."""
    from megaformer.config import ModelConfig

    base = {
        "vocab_size": 37,
        "d_model": TINY["model.d_model"],
        "n_layers": TINY["model.n_layers"],
        "n_heads": TINY["model.n_heads"],
        "max_seq_len": 16,
    }
    return ModelConfig(**{**base, **kw})


def cluster_overrides(**extra: Any) -> list[str]:
    """The tiny 2-rank run shared by the launcher and fault tests: 6 steps, checkpoints every 2."""
    return tiny_overrides(
        "stdlib",
        **{
            "checkpoint.interval": 2,
            "checkpoint.keep_last": "null",
            "eval.interval": 0,
            "eval.at_end": "false",
            **extra,
        },
    )


# ----------------------------------------------------------------------------- running the CLI


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a CLI subprocess: one thread, the CPU accelerator, no rank
    variables, and the repository first on ``PYTHONPATH`` -- followed by what ``PYTHONPATH`` held
    already (where a machine's packages live on it, the subprocess imports them too)."""
    env = dict(os.environ)
    paths = [str(ROOT)] + [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and os.path.abspath(p) != str(ROOT)
    ]
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(paths),
            "DS_ACCELERATOR": "cpu",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONUNBUFFERED": "1",
        }
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra)
    return env


def run_process(
    cmd: list[str],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` with output captured, in a session of its own: when it times out (or
    the test is interrupted) the whole process group is killed, so no rank or launcher outlives
    the test."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd or ROOT,
        env=env or subprocess_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (started with ``start_new_session=True``) and reap it."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def run_cli(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 600,
    env: dict | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """``python -m megaformer ARGS`` in a process of its own (for the exit-code and no-traceback
    contract, and for runs that must not share this process's state): forked from the preloaded
    server, or with ``fresh=True`` a new interpreter."""
    if fresh:
        return run_process(
            [sys.executable, "-m", "megaformer", *args], cwd=cwd, env=env, timeout=timeout
        )
    return run_module(
        1,
        "megaformer",
        args,
        torchrun=False,
        env=env or subprocess_env(),
        cwd=cwd or ROOT,
        timeout=timeout,
    )


@contextlib.contextmanager
def _cli_environment(cwd: Path | None, env: dict[str, str] | None) -> Iterator[None]:
    """What a fresh process would start with, restored afterwards: :func:`subprocess_env`'s
    variables, the working directory, the ``megaformer`` logger, torch's global RNG and thread
    count, and no default process group (a run that got as far as creating one has it destroyed)."""
    import logging

    import torch
    import torch.distributed as dist

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_rng, saved_threads = torch.get_rng_state(), torch.get_num_threads()
    logger = logging.getLogger("megaformer")
    saved_log = (list(logger.handlers), logger.level, logger.propagate)
    had_group = dist.is_available() and dist.is_initialized()
    os.environ.clear()
    os.environ.update(subprocess_env(**(env or {})))
    os.chdir(cwd or ROOT)
    try:
        yield
    finally:
        torch.set_rng_state(saved_rng)
        torch.set_num_threads(saved_threads)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        for h in logger.handlers:
            if h not in saved_log[0]:
                h.close()
        logger.handlers[:] = saved_log[0]
        logger.setLevel(saved_log[1])
        logger.propagate = saved_log[2]
        if not had_group and dist.is_available() and dist.is_initialized():
            ds_comm = sys.modules.get("deepspeed.comm.comm")
            if ds_comm is not None and ds_comm.cdb is not None:
                ds_comm.destroy_process_group()  # also drops DeepSpeed's references to the groups
            else:
                dist.destroy_process_group()


def cli_main(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``megaformer.cli.main(ARGS)`` in this process, reported as :func:`run_cli` reports a fresh
    one: exit code (argparse's ``SystemExit`` included), stdout and stderr. ``env`` adds variables
    to :func:`subprocess_env`'s; ``cwd`` defaults to the repository root."""
    from megaformer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with (
        _cli_environment(cwd, env),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: --help exits 0, a usage error exits 2
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(["megaformer", *args], code, out.getvalue(), err.getvalue())


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A user error: exit 2, one line on stderr naming the problem, no traceback."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err
    lines = [line for line in err.splitlines() if line.startswith("megaformer: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------- several processes


def run_torchrun(
    nproc: int, *args: str, timeout: float = 600, launcher: bool = False
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N -m megaformer ARGS`` on this machine (gloo): ranks forked
    from the preloaded server with torchrun's environment, or with ``launcher=True`` the real
    torchrun (for tests of the launcher's own behaviour)."""
    if not launcher:
        return run_module(
            nproc, "megaformer", args, env=subprocess_env(), cwd=ROOT, timeout=timeout
        )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "megaformer",
        *args,
    ]
    return run_process(cmd, timeout=timeout)


def torchrun_cmd(nproc: int, *args: str, restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        "-m",
        "megaformer",
        *args,
    ]


# ----------------------------------------------------------------------------- reading a run


def step_records(run_dir: Path) -> dict[int, dict]:
    """``metrics.jsonl``'s training records by step."""
    import json

    return {
        r["step"]: r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }


def reference_and_tensor_parallel(cfg: Any, world: int, rank: int, sp: bool) -> tuple:
    """(one-process model, this rank's TP=world model, topology, the TP model's gathered weights)
    of ``cfg``, both built from seed 0 (vocabulary padded to multiples of 8 x TP): the pair every
    tensor-parallel equivalence test trains side by side. Call inside a gloo rank."""
    import torch

    from megaformer.model.transformer import Transformer
    from megaformer.parallel.plan import full_state_dict, padded_vocab_size, parallelize
    from megaformer.parallel.topology import build_topology

    topo = build_topology(world, rank, tp=world)
    torch.manual_seed(0)
    ref = Transformer(cfg, padded_vocab_size=padded_vocab_size(cfg.vocab_size, 1, 8))
    torch.manual_seed(0)
    tp = Transformer(cfg, padded_vocab_size=padded_vocab_size(cfg.vocab_size, world, 8))
    parallelize(tp, topo, sp, None)
    return ref, tp, topo, full_state_dict(tp, topo)


def full_gradients(model: Any, tp: int, tp_group: Any, cp: int = 1, cp_group: Any = None) -> dict:
    """Every gradient of ``model`` (a rank's tensor- and context-parallel copy) at one process's
    full shape, by name: first averaged over the context group as DeepSpeed averages over DP x CP
    (in place: the optimizer steps on the average), then the tensor-parallel shards concatenated
    along each parameter's partition dimension. One all-reduce and one all-gather of flattened
    buffers: a collective per parameter had the equivalence tests wait on thousands of them."""
    import torch
    import torch.distributed as dist

    named = list(model.named_parameters())
    if cp > 1:
        flat = torch.cat([p.grad.reshape(-1) for _, p in named])
        dist.all_reduce(flat, group=cp_group)
        flat.div_(cp)
        for (_, p), g in zip(named, flat.split([p.numel() for _, p in named])):
            p.grad.copy_(g.view_as(p.grad))
    grads = {n: p.grad for n, p in named}
    sharded = [(n, p) for n, p in named if getattr(p, "tensor_model_parallel", False)]
    if tp > 1 and sharded:
        flat = torch.cat([p.grad.reshape(-1) for _, p in sharded])
        parts = [torch.empty_like(flat) for _ in range(tp)]
        dist.all_gather(parts, flat, group=tp_group)
        sizes = [p.numel() for _, p in sharded]
        pieces = [part.split(sizes) for part in parts]
        for i, (n, p) in enumerate(sharded):
            grads[n] = torch.cat([piece[i].view_as(p.grad) for piece in pieces], p.partition_dim)
    return grads


def keep_only(run: Path, step: int) -> None:
    """Keep only the checkpoint of ``step`` in ``run``, as if the run had stopped there."""
    import shutil

    from megaformer.checkpoint import layout as ckpt_layout

    tag = ckpt_layout.tag_for(step)
    for ckpt in (run / "checkpoints").glob("step_*"):
        if ckpt.name != tag:
            shutil.rmtree(ckpt)
    (run / "checkpoints" / "latest").write_text(tag + "\n")
