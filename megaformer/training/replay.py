"""``megaformer replay RUN --steps A..B``: re-run steps A..B of a run from its last checkpoint
before A, bit for bit, with per-layer diagnostics, and say where a spike started.

The replay trains, in ``RUN/replay_A-B/``, from checkpoint c = the latest complete checkpoint with
c < A (its files hard-linked, not copied) with the run's own ``config.yaml`` at the run's layout
(resuming at the same layout is bitwise), logging every step with

* the residual-stream diagnostics (``log.diagnostics`` every step: per layer the residual RMS and
  the largest attention logit, :mod:`megaformer.diagnostics`);
* per layer l, :class:`LayerNorms`: the gradient norm ||g_l|| (the accumulated gradient of the
  step's last micro-batch, before the data-parallel average) and the update norm ||W_l(n) -
  W_l(n-1)||, reported as ||ΔW_l|| / lr (Adam's step per unit of learning rate: flat through
  warm-up and decay, so a jump in it is the weights, not the schedule).

Then it compares the replayed losses with ``RUN/metrics.jsonl`` over the logged windows that lie
inside c+1..B (the same mean over the same steps): equal to the bit, the run is reproducible and a
spike is in the data or the model; different, the original steps computed something else than the
same code on the same data computes now -- suspect the hardware. Last, for each quantity
q in {residual RMS, max attention logit, update norm / lr} and layer l, step n leaves the band when

    |log(q_l(n) / median_{c < m < n} q_l(m))| > log(BAND)        (at least two earlier steps)

and the report names the first such step and, at it, the layer and quantity furthest out.

Micro-batches: before each replayed step trains, the same diagnostics run on each of its training
micro-batches (x_j, y_j) at the step's starting weights (the weights every micro-batch of the step
sees), giving per micro-batch j and layer l the residual RMS and max attention logit, and the loss of
the micro-batch (the last block's logit lens: the model's loss without dropout). Each
data-parallel rank judges its own micro-batches by the same rule, against the median over its
micro-batches of the earlier replayed steps, and the report names the first step where a
micro-batch left its band: the micro-batch (and data-parallel rank), layer and quantity furthest
out. A spike that one micro-batch's data caused shows there while the step's figures (a fixed
held-out micro-batch) stay in band; a weight blow-up moves every micro-batch.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from megaformer.errors import UserError
from megaformer.safe_files import make_dir, refuse_link, write_atomic
from megaformer.training.loop import StepHook, StepState

BAND = 4.0  # a factor of 4 from the median of the earlier replayed steps
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
QUANTITIES = (
    ("resid/{layer}/rms", "residual RMS"),
    ("attn/{layer}/max_logit", "max attention logit"),
    ("update_per_lr/{layer}", "update norm / lr"),
)


MICRO_QUANTITIES = (
    ("resid/{layer}/rms", "residual RMS"),
    ("attn/{layer}/max_logit", "max attention logit"),
)


class ReplayError(UserError):
    """The run cannot be replayed as asked (no checkpoint before A, a bad range...)."""


def parse_steps(text: str) -> tuple[int, int]:
    """``A..B`` (or ``A``) -> (A, B) with 1 <= A <= B."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:\.\.\s*(\d+)\s*)?", text)
    if m is None or int(m.group(1)) < 1 or int(m.group(2) or m.group(1)) < int(m.group(1)):
        raise ReplayError(f"--steps {text!r}: expected A..B with 1 <= A <= B (or one step A)")
    return int(m.group(1)), int(m.group(2) or m.group(1))


# ----------------------------------------------------------------------------- per-layer norms


class LayerNorms(StepHook):
    """Per layer: gradient norm and update norm / lr of each step into the record (a collective
    over the tensor- and pipeline-parallel groups: the layer's parts are summed)."""

    def __init__(
        self, named_params: list[tuple[str, torch.nn.Parameter]], n_layers: int, topo: Any
    ):
        self.n_layers, self.topo = n_layers, topo
        self.params = []
        for name, p in named_params:
            m = LAYER.search(name)
            self.params.append((int(m.group(1)) if m else n_layers, p))  # n_layers: the rest
        self.grad_sq: dict[int, torch.Tensor] = {}
        self.before: list[torch.Tensor] = []
        self.handles = [
            p.register_post_accumulate_grad_hook(self._grad_hook(i))
            for i, (_, p) in enumerate(self.params)
            if p.requires_grad
        ]

    def _grad_hook(self, i: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:  # the last micro-batch's call holds the accumulated gradient
                self.grad_sq[i] = p.grad.detach().float().pow(2).sum()

        return hook

    def before_step(self, step: int) -> None:
        self.grad_sq = {}
        self.before = [p.detach().float().clone() for _, p in self.params]

    def after_step(self, state: StepState, record: dict) -> None:
        from megaformer.diagnostics.metrics import layer_name

        n = self.n_layers + 1
        sums = torch.zeros(2, n, dtype=torch.float64)
        for i, ((layer, p), old) in enumerate(zip(self.params, self.before)):
            sums[1, layer] += float((p.detach().float() - old).pow(2).sum())
            if i in self.grad_sq:
                sums[0, layer] += float(self.grad_sq[i])
        for group in (self.topo.groups.tp, self.topo.groups.pp):
            if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(sums, group=group)
        lr = state.result.get("lr") or float("nan")
        if not record:
            record["step"] = state.step
        for layer in range(self.n_layers):
            name = layer_name(layer, self.n_layers)
            record[f"grad_norm/{name}"] = math.sqrt(float(sums[0, layer]))
            record[f"update_per_lr/{name}"] = math.sqrt(float(sums[1, layer])) / lr
        self.before = []

    def close(self) -> None:
        for h in self.handles:
            h.remove()


# ----------------------------------------------------------------------------- per micro-batch


class _Given:
    """A loader whose next step is the micro-batches already read."""

    def __init__(self, batches: list, loader: Any) -> None:
        self.batches, self.loader = batches, loader

    def next_step(self) -> list:
        return self.batches

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class MicroBatchProbe:
    """The train step, wrapped: before step n trains, the diagnostics pass (a no-grad forward
    each) on every micro-batch of n, kept in ``figures[n][j]``: per layer the residual RMS and max
    attention logit, and ``loss``."""

    def __init__(self, stepper: Any, diagnostics: Any, faults: Any, model: Any, n_layers: int):
        self.stepper, self.diagnostics, self.faults = stepper, diagnostics, faults
        self.model, self.n_layers = model, n_layers
        self.figures: dict[int, list[dict[str, float]]] = {}

    def __call__(self, step: int, loader: Any) -> dict[str, Any]:
        from megaformer.diagnostics.metrics import layer_name

        batches = loader.next_step()
        last = layer_name(self.n_layers - 1, self.n_layers)
        keys = [
            p.format(layer=layer_name(i, self.n_layers))
            for i in range(self.n_layers)
            for p, _ in MICRO_QUANTITIES
        ]
        figures = []
        for j, (x, y) in enumerate(batches):
            with self.faults.micro_batch(step, j, self.model):
                out = self.diagnostics.on_batch(x, y)
            figures.append({k: out[k] for k in keys if k in out})
            figures[-1]["loss"] = out.get(f"logit_lens/{last}/loss", float("nan"))
        self.figures[step] = figures
        return self.stepper(step, _Given(batches, loader))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stepper, name)


def first_micro_anomaly(
    figures: dict[int, list[dict[str, float]]], n_layers: int
) -> Optional[dict]:
    """The first step where one of its micro-batches left the band (see the module docstring),
    with the micro-batch, layer and quantity furthest out; ``median`` over the micro-batches of the
    earlier steps (at least two steps)."""
    from megaformer.diagnostics.metrics import layer_name

    quantities = [("loss", "", "loss")] + [
        (p.format(layer=layer_name(i, n_layers)), layer_name(i, n_layers), label)
        for i in range(n_layers)
        for p, label in MICRO_QUANTITIES
    ]
    steps = sorted(figures)
    for i, n in enumerate(steps[2:], start=2):
        out = []
        for key, layer, label in quantities:
            earlier = [f[key] for m in steps[:i] for f in figures[m] if _finite(f.get(key))]
            if not earlier or statistics.median(earlier) <= 0:
                continue
            median = statistics.median(earlier)
            for j, f in enumerate(figures[n]):
                value = f.get(key)
                if _finite(value) and value > 0 and abs(math.log(value / median)) > math.log(BAND):
                    out.append(
                        {
                            "step": n,
                            "micro": j,
                            "layer": layer,
                            "quantity": label,
                            "value": value,
                            "median": median,
                            "ratio": value / median,
                            "since": steps[0],
                        }
                    )
        if out:
            top = max(out, key=lambda x: abs(math.log(x["ratio"])))
            return dict(top, n_out=len({x["micro"] for x in out}), n_micro=len(figures[n]))
    return None


def earliest_micro_anomaly(found: list[Optional[dict]]) -> Optional[dict]:
    """Of each data-parallel rank's first micro-batch anomaly (in rank order), the earliest step's
    furthest out, with its rank as ``dp_rank``, ``n_out`` the micro-batches out at that step on all
    ranks and ``n_micro`` those of the step."""
    hits = [dict(x, dp_rank=r) for r, x in enumerate(found) if x is not None]
    if not hits:
        return None
    first = [x for x in hits if x["step"] == min(x["step"] for x in hits)]
    top = max(first, key=lambda x: abs(math.log(x["ratio"])))
    return dict(top, n_out=sum(x["n_out"] for x in first), n_micro=top["n_micro"] * len(found))


# ----------------------------------------------------------------------------- preparing


def checkpoint_before(run_dir: Path, first: int) -> Path:
    """The latest complete checkpoint of ``run_dir`` with a step before ``first``."""
    from megaformer.checkpoint.layout import CHECKPOINTS, complete_checkpoints, step_of

    found = [c for c in complete_checkpoints(run_dir / CHECKPOINTS) if step_of(c) < first]
    if not found:
        raise ReplayError(
            f"{run_dir}: no complete checkpoint before step {first} in {run_dir / CHECKPOINTS}: "
            "a replay starts from one (save more often with checkpoint.interval)"
        )
    return found[-1]


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` as a copy of ``src`` made of hard links (copies across file systems); a link in
    ``src`` is refused."""
    make_dir(dst, error=ReplayError)
    for entry in sorted(src.iterdir()):
        refuse_link(entry, ReplayError)
        target = dst / entry.name
        if entry.is_dir():
            _link_tree(entry, target)
        else:
            try:
                os.link(entry, target)
            except OSError:
                shutil.copy2(entry, target)


def prepare(run_dir: Path, first: int, last: int, out: Optional[Path]) -> tuple[Path, Path]:
    """(the replay's run directory, the checkpoint it starts from): a new folder holding the
    checkpoint (hard links) as its latest."""
    from megaformer.checkpoint.layout import CHECKPOINTS, LATEST

    source = checkpoint_before(run_dir, first)
    replay_dir = out or run_dir / f"replay_{first}-{last}"
    refuse_link(replay_dir, ReplayError)
    if replay_dir.exists():
        raise ReplayError(f"{replay_dir}: exists; remove it or choose another --out")
    _link_tree(source, replay_dir / CHECKPOINTS / source.name)
    write_atomic(replay_dir / CHECKPOINTS / LATEST, source.name + "\n", error=ReplayError)
    if (run_dir / "data_cache").is_dir():
        _link_tree(run_dir / "data_cache", replay_dir / "data_cache")
    return replay_dir, source


REPLAY_OVERRIDES = {
    "log.interval": 1,
    "log.diagnostics_interval": 1,
    "log.tensorboard": False,
    "log.progress_bar": False,
    "log.sample_tokens": 0,
    "log.wandb": False,
    "log.straggler_interval": 0,
    "log.profile_steps": None,
    "log.memory_snapshot_step": None,
    "checkpoint.interval": 0,
    "checkpoint.save_at_end": False,
    "checkpoint.resume": True,
    "eval.interval": 0,
    "eval.at_end": False,
    "eval.tasks": None,
}


def replay_config(config_yaml: Path) -> Any:
    """The run's config for the replay: every step logged, diagnostics on where the run's config
    allows them, nothing else (no validation, no saves). ``train.steps`` stays the run's (the
    learning-rate schedule and the data's end depend on it)."""
    from megaformer.config.loading import load_config

    def word(v: Any) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    words = [f"{k}={word(v)}" for k, v in REPLAY_OVERRIDES.items()]
    cfg = load_config(config_yaml, words)
    diag = not (cfg.parallel.zero_stage == 3 or cfg.model.document_mask or cfg.model.moe.interval)
    return load_config(config_yaml, words + [f"log.diagnostics={word(diag)}"])


def _micro_note(cfg: Any, diagnostics: Any) -> str:
    """Why the micro-batches cannot be judged at this layout ("" when they can)."""
    if diagnostics is None:
        return "the diagnostics pass is off at this run's config"
    if cfg.parallel.pipeline > 1 or cfg.parallel.context > 1:
        return "under pipeline or context parallelism"
    return ""


def _wait_for(path: Path, timeout_s: float = 600.0) -> None:
    """Until ``path`` exists (rank 0 is preparing the replay's folder)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise ReplayError(f"{path}: not written by rank 0 within {timeout_s:.0f} s")
        time.sleep(0.2)


# ----------------------------------------------------------------------------- judging


@dataclass
class ReplayReport:
    run_dir: Path
    replay_dir: Path
    start: int
    steps: tuple[int, int]
    compared: list[tuple[int, float, float]] = field(default_factory=list)  # step, logged, replay
    anomaly: Optional[dict] = None
    micro: Optional[dict] = None
    micro_note: str = ""  # why micro-batches were not judged ("" when they were)
    micro_figures: list[dict[str, float]] = field(default_factory=list)  # at ``micro``'s step
    dp: int = 1

    @property
    def reproduced(self) -> bool:
        return all(_same(a, b) for _, a, b in self.compared)

    def lines(self) -> list[str]:
        a, b = self.steps
        out = [
            f"replay of steps {a}-{b} of {self.run_dir} from checkpoint step {self.start}: "
            f"{self.replay_dir}"
        ]
        bad = [(s, x, y) for s, x, y in self.compared if not _same(x, y)]
        if not self.compared:
            out.append("losses: no logged loss window lies inside the replayed steps to compare")
        elif not bad:
            out.append(
                f"losses: reproduced bit for bit at all {len(self.compared)} logged steps "
                "(the same code on the same data computes the same: a spike is in the data "
                "or the model)"
            )
        else:
            s, x, y = bad[0]
            out.append(
                f"losses: NOT reproduced at {len(bad)} of {len(self.compared)} logged steps, "
                f"first step {s} (logged {x!r}, replayed {y!r}): the run computed something else "
                "than the same code on the same data does now; suspect the hardware of that run"
            )
        if self.anomaly is None:
            out.append(
                f"bands: no layer's residual RMS, max attention logit or update norm / lr left "
                f"its band (x{BAND:g} from the median of the earlier replayed steps)"
            )
        else:
            x = self.anomaly
            out.append(
                f"bands: first left at step {x['step']}, {x['layer']} (blocks.{x['index']}): "
                f"{x['quantity']} {x['value']:.4g}, {x['ratio']:.3g}x the median {x['median']:.4g} "
                f"of steps {x['since']}-{x['step'] - 1}"
                + (f"; also out at that step: {', '.join(x['also'])}" if x["also"] else "")
            )
        out.append(self.micro_line())
        return out

    def micro_line(self) -> str:
        if self.micro_note:
            return f"micro-batches: not judged ({self.micro_note})"
        if self.micro is None:
            return (
                "micro-batches: none left its band (residual RMS, max attention logit or loss "
                f"x{BAND:g} from the median of the earlier replayed steps' micro-batches)"
            )
        x = self.micro
        where = f", {x['layer']}" if x["layer"] else ""
        rank = f" of data-parallel rank {x['dp_rank']}" if self.dp > 1 else ""
        return (
            f"micro-batches: first left at step {x['step']}, micro-batch {x['micro']}{rank}"
            f"{where}: {x['quantity']} {x['value']:.4g}, {x['ratio']:.3g}x the median "
            f"{x['median']:.4g} of the micro-batches of steps {x['since']}-{x['step'] - 1} "
            f"({x['n_out']} of the step's {x['n_micro']} micro-batches out: "
            + _verdict(x["n_out"], x["n_micro"])
            + ")"
        )


def _verdict(n_out: int, n_micro: int) -> str:
    if n_out == 1 < n_micro:
        return "suspect that micro-batch's data"
    if n_out == n_micro:
        return "suspect the weights rather than one micro-batch's data"
    return "several micro-batches"


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def compare_losses(
    logged: list[dict], replayed: dict[int, float], start: int, last: int
) -> list[tuple[int, float, float]]:
    """(step, logged loss, replayed loss) for each logged step s in start+1..last whose window
    (the steps since the previous logged step) was replayed: the mean of the replayed losses over
    the window, as the run computed it (the skipped steps' losses left out)."""
    steps = sorted({r["step"] for r in logged if "loss" in r and isinstance(r["step"], int)})
    by_step = {r["step"]: r for r in logged if "loss" in r}
    out = []
    previous = 0
    for s in steps:
        window = range(previous + 1, s + 1)
        previous = s
        if window.start <= start or s > last or any(n not in replayed for n in window):
            continue
        good = [replayed[n] for n in window if math.isfinite(replayed[n])]
        mean = sum(good) / len(good) if good else float("nan")
        out.append((s, float(by_step[s]["loss"]), mean))
    return out


def first_anomaly(records: dict[int, dict], n_layers: int) -> Optional[dict]:
    """The first replayed step where a layer's quantity left its band (see the module docstring),
    with the layer and quantity furthest out at that step."""
    from megaformer.diagnostics.metrics import layer_name

    steps = sorted(records)
    for i, n in enumerate(steps):
        out = []
        for index in range(n_layers):
            layer = layer_name(index, n_layers)
            for pattern, label in QUANTITIES:
                key = pattern.format(layer=layer)
                earlier = [records[m][key] for m in steps[:i] if _finite(records[m].get(key))]
                value = records[n].get(key)
                if len(earlier) < 2 or not _finite(value):
                    continue
                median = statistics.median(earlier)
                if median <= 0 or value <= 0:
                    continue
                ratio = value / median
                if abs(math.log(ratio)) > math.log(BAND):
                    out.append(
                        {
                            "step": n,
                            "layer": layer,
                            "index": index,
                            "quantity": label,
                            "value": value,
                            "median": median,
                            "ratio": ratio,
                            "since": steps[0],
                        }
                    )
        if out:
            out.sort(key=lambda x: -abs(math.log(x["ratio"])))
            top = out[0]
            top["also"] = [f"{x['layer']} {x['quantity']} {x['ratio']:.3g}x" for x in out[1:]]
            return top
    return None


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# ----------------------------------------------------------------------------- running


def replay(run_dir: Path, first: int, last: int, out: Optional[Path] = None) -> ReplayReport:
    """Replay steps ``first``..``last`` of ``run_dir`` (every rank calls, at the run's layout) and
    write ``replay.md`` into the replay's folder (rank 0)."""
    from megaformer.checkpoint.layout import step_of
    from megaformer.training import distributed as dist
    from megaformer.training.metrics import read_metrics
    from megaformer.training.trainer import Trainer

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ReplayError(f"{run_dir}: not a run directory (it holds no config.yaml)")
    cfg = replay_config(run_dir / "config.yaml")
    logged = read_metrics(run_dir)
    if last > cfg.train.steps:
        raise ReplayError(f"--steps {first}..{last}: the run trains to step {cfg.train.steps}")
    rank = int(os.environ.get("RANK", "0"))
    replay_dir = out or run_dir / f"replay_{first}-{last}"
    if rank == 0:
        replay_dir, source = prepare(run_dir, first, last, out)
    else:  # the other ranks read the folder rank 0 makes
        source = checkpoint_before(run_dir, first)
        _wait_for(replay_dir / "checkpoints" / "latest")
    trainer = Trainer(cfg, replay_dir)
    trainer.stop_after = last
    probe = None
    try:
        trainer.setup()
        trainer.add_hook(
            LayerNorms(trainer._local_params(), trainer.cfg.model.n_layers, trainer.topo)
        )
        note = _micro_note(cfg, trainer.diagnostics)
        if not note:
            probe = MicroBatchProbe(
                trainer.stepper,
                trainer.diagnostics,
                trainer.faults,
                trainer.plain_model,
                cfg.model.n_layers,
            )
            trainer.stepper = probe
        trainer.run()
        dist.barrier()
    finally:
        if getattr(trainer, "run_lock", None) is not None:
            trainer.run_lock.release()
    records = {r["step"]: r for r in read_metrics(replay_dir) if isinstance(r.get("step"), int)}
    report = ReplayReport(run_dir, replay_dir, step_of(source), (first, last))
    replayed = {s: float(r["loss"]) for s, r in records.items() if "loss" in r}
    report.compared = compare_losses(logged, replayed, report.start, last)
    report.anomaly = first_anomaly(records, cfg.model.n_layers)
    report.micro_note, report.dp = note, trainer.topo.dp
    if probe is not None:
        from megaformer.comm import all_gather_objects

        mine = first_micro_anomaly(probe.figures, cfg.model.n_layers)
        dp = trainer.topo.groups.dp
        report.micro = earliest_micro_anomaly(all_gather_objects(mine, dp))
        if report.micro is not None:  # the figures of that step's micro-batches on that rank
            x = report.micro
            held = probe.figures[x["step"]] if trainer.topo.dp_rank == x["dp_rank"] else None
            report.micro_figures = next(f for f in all_gather_objects(held, dp) if f is not None)
    if rank == 0:
        text = "# Replay\n\n" + "\n".join(f"- {line}" for line in report.lines()) + "\n"
        write_atomic(replay_dir / "replay.md", text, fsync=False, error=ReplayError)
        write_atomic(
            replay_dir / "replay.json",
            json.dumps(
                {
                    "compared": report.compared,
                    "anomaly": report.anomaly,
                    "micro": report.micro,
                    "micro_figures": report.micro_figures,
                }
            ),
            fsync=False,
            error=ReplayError,
        )
    return report
