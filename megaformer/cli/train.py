"""``megaformer train``: pretrain a model from a YAML config (``--dry-run``: check and print it)."""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path
from typing import Any

from megaformer.errors import UserError

NAME = "train"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def _config_help() -> str:
    from megaformer.config import describe_keys

    lines = ["config keys (YAML sections; override any as SECTION.KEY=VALUE):", ""]
    for key, tp, default, doc in describe_keys():
        lines.append(f"  {key}  ({tp}, default {default})")
        lines.extend(textwrap.wrap(doc, 88, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    tr = sub.add_parser(
        "train",
        help="pretrain a model from a YAML config",
        description="Pretrain a model described by CONFIG. Resumes from the run directory's latest "
        "complete checkpoint when there is one; SIGTERM or SIGUSR1 saves a checkpoint "
        "and exits 0, Ctrl-C (SIGINT) saves one and exits 130 (a second Ctrl-C stops "
        "at once). Launch several processes with torchrun, srun, mpirun or the "
        "DeepSpeed launcher (scripts in launch/); "
        "parallel.tensor / parallel.context / parallel.pipeline split them into "
        "tensor, context, pipeline and data parallelism (DP = world / (TP*CP*PP)), "
        "parallel.expert splits the experts over data-parallel ranks and "
        "parallel.zero_stage the optimizer state (train.optimizer: adamw or muon).",
        epilog="example: megaformer train configs/quickstart.yaml train.steps=50 model.n_layers=2\n"
        "run `megaformer train --help-config` for every config key.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tr.add_argument("config", nargs="?", help="YAML config file (see configs/)")
    tr.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. train.steps=50 parallel.zero_stage=1",
    )
    tr.add_argument("--run-dir", help="run directory (default: runs/<config name>)")
    tr.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config (with train.device=cuda also the rules that need "
        "only the device type, e.g. FP8 needs train.compile) and that data.paths "
        "exist and match data.tokenizer, print the resolved config and parameter "
        "counts, exit",
    )
    tr.add_argument(
        "--init-from",
        metavar="HF_DIR",
        help="start from the weights of a Hugging Face model folder, read without a "
        "converted copy (sets model.init_from; its config.json gives the model)",
    )
    tr.add_argument("--help-config", action="store_true", help="list every config key and exit")
    tr.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="with --dry-run: also check the parallel layout for this many processes",
    )
    return tr


def run(args: argparse.Namespace) -> int:
    if args.help_config:
        print(_config_help())
        return 0
    if not args.config:
        raise UserError("train: missing CONFIG (a YAML file, e.g. configs/quickstart.yaml)")
    from megaformer.config import load_config

    overrides = list(args.overrides)
    if args.init_from is not None:
        overrides.append(f"model.init_from={args.init_from}")
    cfg = load_config(args.config, overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / cfg.name
    if args.world_size is not None:
        from megaformer.config import validate_for_world

        if args.world_size < 1:
            raise UserError(f"--world-size {args.world_size}: must be >= 1")
        accum = validate_for_world(cfg, args.world_size)
        print(f"# layout: world {args.world_size}, gradient accumulation {accum}")
    if args.dry_run:
        return _dry_run(cfg, run_dir)
    from megaformer.training.preemption import INTERRUPTED
    from megaformer.training.trainer import train  # its preflight checks the world and device

    _exit_with_launcher()
    result = train(cfg, run_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        _print_result(result, _resume_command(args, run_dir))
    return EXIT_INTERRUPTED if result.stopped == INTERRUPTED else 0


def _exit_with_launcher() -> None:
    """Under a launcher that starts one process per rank (torchrun, the DeepSpeed launcher), end
    this rank when the launcher dies (:func:`megaformer.runtime.parent.exit_with_parent`)."""
    if os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("LOCAL_RANK"):
        from megaformer.runtime.parent import exit_with_parent

        exit_with_parent()


def _resume_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The command that continues this run from its latest checkpoint."""
    import shlex

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    words = [args.config, *args.overrides, "--run-dir", str(run_dir)]
    if world == 1:
        return shlex.join([_venv_command("megaformer"), "train", *words])
    nodes = f"NNODES={world // per_node} ... " if per_node < world else ""
    return nodes + shlex.join(["launch/torchrun.sh", str(per_node), *words])


def _dry_run(cfg: Any, run_dir: Path) -> int:
    """Check what can be checked without the world, the device and training (the data paths exist,
    prepared data matches the tokenizer), print the resolved config."""
    from megaformer.analysis.params import count_parameters
    from megaformer.analysis.summary import resolve_vocab
    from megaformer.checkpoint.hf.init_from import with_hf_model
    from megaformer.config import validate_for_training
    from megaformer.data.setup import check_data_paths

    cfg = with_hf_model(cfg)  # model.init_from: the folder's model
    validate_for_training(cfg)
    check_data_paths(cfg)  # the data exists and matches the tokenizer
    model = resolve_vocab(cfg).model
    counts = count_parameters(model)
    print(cfg.to_yaml().rstrip())
    print(f"# run dir: {run_dir}")
    print(
        f"# parameters: {counts['total']:,} total | {counts['non_embedding']:,} non-embedding | "
        f"{counts['embedding']:,} embedding"
        + (f" | {counts['active']:,} active per token (MoE)" if "active" in counts else "")
    )
    return 0


def _print_result(r: Any, resume: str) -> None:
    import math

    if r.stopped is not None:
        print(
            f"\nstopped at step {r.step} ({r.stopped}); checkpoint: {r.checkpoint}\n"
            f"resume from it with the same command: {resume}"
        )
        return
    if math.isnan(r.train_loss) and r.val_loss is None:  # resumed at train.steps: no step ran
        print(
            f"\nnothing to train: {r.run_dir} is already at step {r.step} (train.steps); raise "
            "train.steps to continue, or give another --run-dir"
        )
        return
    print(f"\ndone: step {r.step} in {r.wall_s:.1f}s | {r.tokens_per_s:,.0f} tokens/s (training)")
    val = (
        f"val loss {r.val_loss:.4f} (ppl {math.exp(min(r.val_loss, 50)):.2f})"
        if r.val_loss is not None
        else "val loss not evaluated"
    )
    print(
        f"final: train loss {r.train_loss:.4f} | {val} | unigram baseline {r.unigram_loss:.4f} "
        "nats/token"
    )
    if r.checkpoint is not None:
        print(f"checkpoint: {r.checkpoint}")
    print(f"tensorboard: {_venv_command('tensorboard')} --logdir {r.run_dir / 'tensorboard'}")
    if r.sample is not None:
        print("sample (temperature 0.8, top-k 40):")
        print("-" * 72)
        print(r.sample)
        print("-" * 72)


def _venv_command(name: str) -> str:
    """``name`` as the user can run it: the path of the script beside this Python when that is
    not the one on PATH (a venv that is not activated), else the bare name."""
    import shutil
    import sys

    beside = Path(sys.executable).parent / name
    if beside.exists() and shutil.which(name) != str(beside):
        return str(beside)
    return name
