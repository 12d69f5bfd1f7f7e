"""What several subcommands share: the CONFIG and KEY=VALUE arguments, and loading them; the
--tp/--pp layout of a checkpoint's model under a launcher (``eval``, ``generate``)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Iterator


def config_args(p: argparse.ArgumentParser) -> None:
    """CONFIG, KEY=VALUE overrides and --json."""
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted config overrides, e.g. train.global_batch_size=512",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def load(args: argparse.Namespace) -> Any:
    """The validated config of ``args.config`` with ``args.overrides``."""
    from megaformer.config import load_config

    return load_config(args.config, args.overrides)


def layout_args(p: argparse.ArgumentParser, experts: bool = False) -> None:
    """--tp and --pp (and with ``experts`` --ep): how a launch splits the model (the rest of the
    world is data-parallel; experts are split over --ep of the data-parallel ranks); --schedule
    and --virtual-stages: how the blocks are cut into pipeline stages and placed on the ranks."""
    from megaformer.config.parallel import PIPELINE_SCHEDULES

    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size under a launcher (1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size under a launcher (1)")
    p.add_argument(
        "--schedule",
        choices=PIPELINE_SCHEDULES,
        default="1f1b",
        help="how the blocks are cut into stages and placed on the --pp ranks, as the training "
        "schedule of that name places them: 1f1b (one stage per rank, default), interleaved "
        "(--virtual-stages per rank) or dualpipev (two per rank, the embedding and the head on "
        "the first); the stages run one after the other in any case",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=2,
        metavar="V",
        help="stages per pipeline rank under --schedule interleaved (2)",
    )
    if experts:
        p.add_argument(
            "--ep",
            type=int,
            default=1,
            help="expert-parallel size under a launcher (1): divides the data-parallel "
            "ranks and the number of experts",
        )


def check_layout_args(args: argparse.Namespace) -> None:
    """--schedule and --virtual-stages against --pp (one-line UserError, before any launch)."""
    from megaformer.errors import UserError

    if args.schedule != "1f1b" and args.pp < 2:
        raise UserError(f"--schedule {args.schedule}: needs a pipeline (--pp 2 or more)")
    if args.schedule == "interleaved" and args.virtual_stages < 2:
        raise UserError(
            f"--virtual-stages {args.virtual_stages}: --schedule interleaved needs 2 or more"
        )


def launch_process(command: str, device: str, tp: int, pp: int, ep: int = 1) -> Any:
    """This process of the launch (torchrun, srun, ...; no process group yet), once --tp, --pp
    and --ep are checked against the world size."""
    from megaformer.errors import UserError
    from megaformer.training.distributed import detect_process

    for flag, value in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be >= 1")
    proc = detect_process(device)
    if proc.world_size % (tp * pp):
        raise UserError(f"--tp {tp} x --pp {pp} does not divide the world size {proc.world_size}")
    if (proc.world_size // (tp * pp)) % ep:
        raise UserError(
            f"--ep {ep} does not divide the {proc.world_size // (tp * pp)} data-parallel ranks"
        )
    if proc.world_size == 1 and tp * pp * ep > 1:
        raise UserError(
            f"--tp {tp} --pp {pp} --ep {ep}: launch {tp * pp * ep} or more processes "
            f"(torchrun --nproc_per_node N -m megaformer {command} ...)"
        )
    return proc


@contextlib.contextmanager
def launched(proc: Any, tp: int, pp: int, ep: int = 1) -> Iterator[Any]:
    """The topology of ``proc``'s launch (None for one process), the process group created here
    (and destroyed after) unless one exists."""
    import torch

    from megaformer.training.distributed import init_distributed

    if proc.world_size == 1:
        yield None
        return
    from megaformer.parallel.topology import build_topology

    created = not torch.distributed.is_initialized()
    if created:
        init_distributed(proc)
    try:
        yield build_topology(proc.world_size, proc.rank, tp=tp, pp=pp, ep=ep)
    finally:
        if created:
            torch.distributed.destroy_process_group()
