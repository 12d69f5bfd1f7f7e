"""Local ranks for tests and benchmarks, forked from a server that has already imported torch.

    results = run_ranks(4, fn, arg1, arg2)        # -> [fn(0, 4, arg1, arg2), ..., fn(3, 4, ...)]
    proc = run_module(2, "megaformer", ["train", ...])   # ``torchrun --nproc-per-node 2 -m ...``

A fresh Python process that imports torch, ``torch._dynamo`` and DeepSpeed spends seconds of CPU
before it does anything; a suite that starts hundreds of ranks spends most of its time there. Here
the first call starts one server (multiprocessing's *forkserver*: a new, single-threaded
interpreter that imports :data:`PRELOAD` and :func:`configure`'s modules once) and every rank after
that is a ``fork()`` of it, which costs milliseconds. The server never runs a torch operation, so it
holds no OpenMP or gloo thread a fork could copy half-way through a lock; each rank sets one
intra-op thread, the caller's environment at the time of the call, and the call's own
``MASTER_PORT``.

``fn(rank, world_size, *args)`` must be importable at module level (it travels by name). A rank
that raises makes :func:`run_ranks` raise with that rank's traceback; a hang ends at ``timeout``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

#: Imported once by the server before any rank is forked.
PRELOAD: tuple[str, ...] = ("torch", "torch.distributed", "torch._dynamo", "deepspeed")

_extra_preload: list[str] = []
_server_env: dict[str, str] | None = None
_started = False


#: Ports drawn from below Linux's ephemeral range (32768-60999 by default), where the kernel
#: never places the client end of a connection: a port found free cannot be taken by one of the
#: many outgoing sockets gloo opens before the rendezvous store binds it.
_PORT_RANGE = (15000, 32000)


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now, chosen at random
    outside the ephemeral range so concurrent runs on one machine rarely meet."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configure(preload: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
    """Also preload ``preload`` (module names) in the server, and start it with ``env`` instead of
    this process's environment (what its imports read). Takes effect only before the first rank."""
    global _server_env
    _extra_preload.extend(m for m in preload if m not in _extra_preload)
    if env is not None:
        _server_env = dict(env)


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started on first use with this process's ``sys.path``
    (Python 3.11's server ignores the path it is handed, so it travels as ``PYTHONPATH``)."""
    global _started
    ctx = multiprocessing.get_context("forkserver")
    if not _started:
        ctx.set_forkserver_preload([*PRELOAD, *_extra_preload])
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(_server_env if _server_env is not None else saved)
        os.environ["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _started = True
    return ctx


def _enter(env: Mapping[str, str]) -> None:
    """The caller's environment, and the intra-op thread count a fresh process would read from it
    (one unless ``OMP_NUM_THREADS`` says otherwise)."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))


def _enter_rank(env: Mapping[str, str], rank: int, world: int, port: int) -> None:
    _enter({**env, "OMP_NUM_THREADS": "1"})
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )


def _worker(
    rank: int,
    world: int,
    port: int,
    env: Mapping[str, str],
    fn: Callable,
    args: tuple,
    out: Any,
    backend: str = "gloo",
) -> None:
    os.setpgid(0, 0)  # a group of its own: a rank stopped at the timeout takes its children along
    _enter_rank(env, rank, world, port)
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # plain pickle: tensors travel by value, not as shared memory that dies with this process
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including assertion errors, to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop(procs: Sequence[multiprocessing.process.BaseProcess], grace: float) -> None:
    """Join each process for up to ``grace`` seconds in all, then kill what is left (with its
    process group when it leads one)."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            try:
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.kill()
            p.join()


def run_ranks(
    world_size: int, fn: Callable, *args: Any, timeout: float = 300, backend: str = "gloo"
) -> list[Any]:
    """``[fn(r, world_size, *args) for r in ranks]``, each rank a forked process in one default
    group (``init_process_group`` done, ``destroy_process_group`` after): gloo's, or ``backend``
    (``"cuda:gloo"``: gloo serving CUDA tensors only, NCCL's device map, so a host tensor on it
    fails as it would on NCCL)."""
    ctx = _context()
    out = ctx.Queue()
    port, env = free_port(), dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, env, fn, args, out, backend), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, payload = out.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)  # our own child processes' results
    except queue.Empty:
        raise AssertionError(
            f"ranks {sorted(set(range(world_size)) - set(results))} did not "
            f"finish within {timeout}s"
        ) from None
    finally:
        _stop(procs, grace=10)
    return [results[r] for r in range(world_size)]


# ----------------------------------------------------------------------------- a module as __main__

#: What torchrun sets beside the rendezvous variables (no agent store: rank 0 hosts it).
_TORCHRUN_ENV = {
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "ROLE_NAME": "default",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RUN_ID": "none",
}


def _module_rank(
    rank: int,
    world: int,
    port: int,
    env: Mapping[str, str],
    module: str,
    argv: Sequence[str],
    cwd: str,
    out_dir: str,
    torchrun: bool,
) -> None:
    """``python -m module argv`` in this forked process: its own process group, stdout and stderr
    (the file descriptors) to ``out_dir``, exit code as the interpreter would give it."""
    import atexit
    import io
    import runpy
    import threading

    os.setpgid(0, 0)
    if torchrun:
        _enter_rank(env, rank, world, port)
        os.environ.update(_TORCHRUN_ENV, ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world))
    else:
        _enter(env)
    os.chdir(cwd)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(os.path.join(out_dir, f"{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(
        os.fdopen(2, "wb", closefd=False), line_buffering=True, errors="backslashreplace"
    )
    sys.argv = [module, *argv]
    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads,
    atexit._run_exitfuncs()  # then run the exit handlers (logging.shutdown among them)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_module(
    world_size: int,
    module: str,
    argv: Sequence[str],
    *,
    torchrun: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """``python -m module argv`` on ``world_size`` forked ranks, reported as ``subprocess.run``
    reports a launcher: ``torchrun=True`` gives each rank torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_*); ``torchrun=False`` with one rank is
    a plain ``python -m``. When a rank fails the others are stopped, as torchrun stops them. The
    result's stdout and stderr are the ranks' in rank order; its exit code is the process's with
    one rank, else 0 when every rank exited 0 and 1 otherwise (torchrun's). Raises
    ``subprocess.TimeoutExpired`` at ``timeout``."""
    ctx = _context()
    port, env = free_port(), dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    with tempfile.TemporaryDirectory(prefix="ranks-") as out_dir:
        procs = [
            ctx.Process(
                target=_module_rank,
                args=(r, world_size, port, env, module, list(argv), cwd, out_dir, torchrun),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline, timed_out = time.monotonic() + timeout, False
        try:
            from multiprocessing.connection import wait

            pending = list(procs)
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                wait([p.sentinel for p in pending], timeout=left)
                pending = [p for p in pending if p.exitcode is None]
                if any(p.exitcode for p in procs):
                    break  # a rank failed: torchrun stops the others
        finally:
            _stop(procs, grace=0 if timed_out else 5)
        outs = [
            (Path(out_dir, f"{r}.stdout"), Path(out_dir, f"{r}.stderr")) for r in range(world_size)
        ]
        stdout = "".join(o.read_text(errors="replace") for o, _ in outs if o.exists())
        stderr = "".join(e.read_text(errors="replace") for _, e in outs if e.exists())
    cmd = [sys.executable, "-m", module, *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    codes = [p.exitcode for p in procs]
    code = codes[0] if world_size == 1 else int(any(codes))
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)
