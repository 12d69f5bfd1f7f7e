"""Atomic checkpoints in the run directory, and finding them again.

Layout::

    RUN_DIR/checkpoints/
      step_0000100/
        state/                     the training state, one file per rank (:mod:`.sharded`)
        model.safetensors          consolidated weights, only with checkpoint.export_weights
        config.yaml                the resolved config,
        tokenizer.json             the tokenizer,
        rng/rank_N.pt              every rank's RNG state,
        meta.json                  step, consumed samples/tokens, layout, version.
      latest                       the name of the newest complete checkpoint

Checkpoints of the first release instead hold DeepSpeed's engine files, ``model.safetensors`` and
the layout-free ``optimizer/`` (:mod:`.portable`); they still load. fp16 runs still write
DeepSpeed's files (its loss scaler lives there).

A checkpoint is written into ``.tmp-step_...``, flushed to disk, then renamed; ``latest`` is replaced
(write + rename) only after that. An interrupted save leaves a ``.tmp-`` folder that is never
mistaken for a checkpoint, and an existing checkpoint is never overwritten.

Run directories are downloaded and shared, so what is read back is checked: ``latest`` may hold only
``step_<digits>`` (a name inside ``checkpoints/``), checkpoints are real folders named ``step_<digits>``
(never links), they are ordered by step number, and ``keep_last`` never deletes the checkpoint just
sealed or a link. DeepSpeed's own files are loaded with weights-only unpickling only
(:mod:`.safe_load`), and its unpickling recovery scripts are not left in the folder.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megaformer import __version__, deepspeed_attrs
from megaformer.checkpoint.safe_load import safe_torch_load, weights_only_forced
from megaformer.errors import CheckpointError
from megaformer.safe_files import (check_run_dir, make_dir, read_text_bounded,  # noqa: F401
                                   read_text_inside, refuse_link, refuse_links_below,
                                   refuse_read_link, regular_files, write_atomic)

log = logging.getLogger("megaformer")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"
TMP_PREFIX = ".tmp-"
STEP_NAME = re.compile(r"step_(\d+)")
README = "README.md"
README_TEXT = """\
This folder is a megaformer checkpoint. Read its weights with `megaformer generate`, or turn it
into a Hugging Face model folder with `megaformer convert CHECKPOINT --to hf OUT`; resume training
with `megaformer train CONFIG --run-dir RUN_DIR`. Its `.pt` files are loaded by megaformer with
weights-only unpickling; do not load them with scripts that unpickle arbitrary objects.
"""
# DeepSpeed's recovery scripts: they unpickle the checkpoint's files with weights_only=False.
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text``: a random exclusive temporary, flushed, renamed (a link at
    ``path`` is refused, never written through)."""
    write_atomic(path, text)
    _fsync_dir(path.parent)


def step_of(ckpt: Path) -> Optional[int]:
    """The step of a folder named ``step_<digits>``, else None."""
    m = STEP_NAME.fullmatch(ckpt.name)
    return int(m.group(1)) if m else None


def is_complete(ckpt: Path) -> bool:
    return (not ckpt.is_symlink() and ckpt.is_dir() and not ckpt.name.startswith(TMP_PREFIX)
            and (ckpt / META).is_file())


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` (real folders named ``step_<digits>``), oldest first by
    step number."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and is_complete(p)]
    return sorted(found, key=lambda p: (step_of(p), p.name))


def half_written(root: Path) -> list[Path]:
    """``.tmp-`` folders under ``root``: saves that were interrupted (never loaded)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX + "step_"))


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names; the newest complete one (with a warning) if that is broken."""
    pointer = root / LATEST
    found = complete_checkpoints(root)
    if pointer.is_symlink():
        raise CheckpointError(f"{pointer}: is a symbolic link; expected a file naming a checkpoint")
    if pointer.is_file():
        name = read_text_bounded(pointer, 4096).strip()
        if STEP_NAME.fullmatch(name) is None:
            raise CheckpointError(f"{pointer}: names {name[:80]!r}; expected step_<digits>, a "
                                  f"checkpoint inside {root}")
        named = root / name
        if is_complete(named):
            return named
        if found:
            log.warning("%s names %s, which is missing or incomplete; using %s instead",
                        pointer, named.name, found[-1].name)
    return found[-1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run directory, its checkpoints/ folder, or one checkpoint -> the checkpoint to load."""
    p = Path(path).expanduser()
    if p.is_symlink():  # the path the user named may be a link; links inside it are not followed
        p = p.resolve()
    if not p.exists():
        raise CheckpointError(f"{p}: no such run directory or checkpoint")
    if is_complete(p):
        if not (p / WEIGHTS).is_file() and not (p / "state" / "index.json").is_file():
            raise CheckpointError(f"{p}: checkpoint has neither {WEIGHTS} nor a sharded state "
                                  "(state/index.json)")
        refuse_links_below(p)
        return p
    refuse_read_link(p / CHECKPOINTS)
    for root in (p / CHECKPOINTS, p):
        if root.is_dir():
            found = latest_checkpoint(root)
            if found is not None:
                refuse_links_below(found)
                return found
    raise CheckpointError(f"{p}: not a megaformer run directory or checkpoint (no {CHECKPOINTS}/ "
                          f"with a complete checkpoint, no {META})")


def read_config_yaml(ckpt: Path) -> Any:
    """The raw mapping of a checkpoint's config.yaml: a regular file of bounded size, YAML without
    anchors/aliases (CheckpointError otherwise)."""
    from megaformer.config import MAX_CONFIG_BYTES, safe_yaml_load
    from megaformer.errors import ConfigError

    try:
        return safe_yaml_load(read_text_inside(ckpt, CONFIG, MAX_CONFIG_BYTES), str(ckpt / CONFIG))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def read_config(ckpt: Path) -> Any:
    """The resolved :class:`~megaformer.config.Config` a checkpoint was saved with."""
    from megaformer.config import config_from_dict
    from megaformer.errors import ConfigError

    raw = read_config_yaml(ckpt)
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"{ckpt}: invalid {CONFIG}: {e}") from None


def read_meta(ckpt: Path) -> dict:
    try:
        meta = json.loads(read_text_inside(ckpt, META, 1 << 20))
    except (CheckpointError, OSError, ValueError, RecursionError):  # a link, not JSON, too deep
        raise CheckpointError(f"{ckpt}: {META} is missing or corrupt") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{ckpt}: {META} is not a JSON object")
    return meta


# ----------------------------------------------------------------------------- RNG state

def rng_state() -> dict:
    import random

    import numpy as np

    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype("uint32"), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- save

def write_payload(path: Path, payload: Any, metadata: Optional[dict[str, str]] = None) -> None:
    """One file of a checkpoint: tensors as safetensors, or text; written under a ``.partial``
    name, flushed to disk, then renamed, so a file that exists is a whole file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    if isinstance(payload, dict):  # sorted metadata keys: the bytes do not depend on hash order
        save_file(payload, str(partial), metadata={"format": "pt", **(metadata or {})})
    else:
        partial.write_text(payload)
    with open(partial, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(partial, path)


def _wait_for(folder: Path, names: list[str], timeout_s: float) -> None:
    """Until every file in ``names`` (written by other ranks' writer threads) exists."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [n for n in names if not (folder / n).is_file()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"{folder}: other ranks did not write {missing[:3]} within "
                                  f"{timeout_s:.0f} s")
        time.sleep(0.02)


def _seal(tmp: Path, final: Path, keep_last: Optional[int]) -> None:
    """fsync everything, rename the folder into place, then point ``latest`` at it."""
    root = final.parent
    _fsync_tree(tmp)
    os.rename(tmp, final)
    _fsync_dir(root)
    write_text_atomic(root / LATEST, final.name + "\n")
    if keep_last is not None:
        prune(root, keep_last, final)


def prune(root: Path, keep_last: int, sealed: Path) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints by step number, never ``sealed`` (the
    one just written: a planted later-named folder cannot push it out) and never a link."""
    sealed_step = step_of(sealed)
    older = [p for p in complete_checkpoints(root)
             if p.name != sealed.name and (sealed_step is None or step_of(p) < sealed_step)]
    newer = [p for p in complete_checkpoints(root) if p.name != sealed.name and p not in older]
    if newer:
        log.warning("%s holds checkpoints with steps after %s (%s); keep_last leaves them alone",
                    root, sealed.name, ", ".join(p.name for p in newer[:3]))
    doomed = older[:max(0, len(older) - (keep_last - 1))]
    for old in doomed:
        if not old.is_symlink():
            shutil.rmtree(old)
    return doomed


def save_checkpoint(engine: Any, run_dir: Path, step: int, *, rank: int, world_size: int,
                    client_state: dict, snapshot: Callable[[Path, Optional[dict]], dict[str, Any]],
                    keep_last: Optional[int], barrier: Any,
                    extra_rng: Optional[dict] = None, background: Any = None,
                    wait_timeout_s: float = 1800.0,
                    before_commit: Optional[Callable[[], None]] = None,
                    engine_files: bool = True,
                    before_seal: Optional[Callable[[Path], None]] = None) -> Optional[Path]:
    """Collective: every rank calls it. Returns the checkpoint path (None if it already existed).

    Synchronous on every rank: DeepSpeed's ``engine.save_checkpoint``, the RNG files, and
    ``snapshot(tmp_dir, memo)`` -> {relative path: tensors (on the host) or text}, this rank's
    share of the remaining files (``memo``: None for a synchronous save, else the host copies
    already taken, by tensor view, to share instead of copying twice). Those are then written, flushed and renamed into place; rank 0 seals the
    checkpoint (fsync, rename, ``latest``, keep-last) once every rank is done.

    With ``background`` (a :class:`BackgroundWriter`) the writing runs on its thread and training
    continues: DeepSpeed's files too, when its checkpoint engine is megaformer's (it then keeps a
    host copy of each state instead of writing it); each rank's thread ends by writing
    ``.rank_N.done``, and rank 0's thread seals once all of them exist. Without it, in line,
    with barriers.

    ``before_commit`` runs on every rank once its files are written, before the checkpoint is
    sealed (the fault-injection tests kill a rank there). ``engine_files=False``: DeepSpeed's own
    files are not written (the state is all in ``snapshot``'s files). ``before_seal(tmp)`` runs on
    rank 0 once every rank's files exist, before the seal (it writes what describes them all)."""
    if background is not None:
        background.wait()  # the previous save is sealed (or its failure raised) first
    root = run_dir / CHECKPOINTS
    tag = tag_for(step)
    final = root / tag
    tmp = root / f"{TMP_PREFIX}{tag}"
    exists = torch.tensor([1 if final.exists() else 0])
    if torch.distributed.is_initialized():
        torch.distributed.broadcast(exists, src=0)
    if exists.item():
        if rank == 0:
            log.warning("checkpoint %s already exists; not overwriting it", final)
        return None
    if rank == 0:
        make_dir(root)
        refuse_link(tmp)
        if tmp.exists():  # left by an interrupted save of ours: never a complete checkpoint
            shutil.rmtree(tmp)
    barrier()
    ds_files = deepspeed_attrs.checkpoint_engine(engine)
    defer = engine_files and background is not None and hasattr(ds_files, "take_pending")
    memo: Optional[dict] = {} if background is not None else None
    if defer:
        ds_files.deferring = True
        ds_files.memo = memo
    if engine_files:
        try:
            engine.save_checkpoint(str(root), tag=tmp.name, client_state=client_state,
                                   save_latest=False)
        finally:
            if defer:
                ds_files.deferring = False
    pending = ds_files.take_pending() if defer else []
    tmp.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        for script in RECOVERY_SCRIPTS:  # in case DeepSpeed copied them (they unpickle)
            (tmp / script).unlink(missing_ok=True)
        (tmp / README).write_text(README_TEXT)
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    torch.save({**rng_state(), **(extra_rng or {})}, tmp / "rng" / f"rank_{rank}.pt")
    files = snapshot(tmp, memo)

    def write() -> None:
        for state, path in pending:
            ds_files.write_now(state, path)
        for rel, payload in files.items():
            if isinstance(payload, tuple):  # (tensors, safetensors metadata)
                write_payload(tmp / rel, *payload)
            else:
                write_payload(tmp / rel, payload)

    if background is None:
        write()
        barrier()
        if before_commit is not None:
            before_commit()
        if rank == 0:
            if before_seal is not None:
                before_seal(tmp)
            _seal(tmp, final, keep_last)
        barrier()
        return final

    markers = [f".rank_{r}.done" for r in range(world_size)]

    def write_and_seal() -> None:
        write()
        if before_commit is not None:
            before_commit()
        write_payload(tmp / markers[rank], "")
        if rank == 0:
            _wait_for(tmp, markers, wait_timeout_s)
            for m in markers:
                (tmp / m).unlink()
            if before_seal is not None:
                before_seal(tmp)
            _seal(tmp, final, keep_last)
            log.info("saved checkpoint %s (in the background)", final)

    background.submit(write_and_seal, f"checkpoint {final}")
    return final


class BackgroundWriter:
    """One checkpoint write at a time on a background thread.

    ``submit`` first waits for the previous write; ``check`` (at every step boundary) re-raises a
    failed write as CheckpointError; ``wait`` blocks until the current write is done."""

    def __init__(self) -> None:
        self._thread: Optional[Any] = None
        self._error: Optional[BaseException] = None
        self._what = ""

    def submit(self, job: Callable[[], None], what: str) -> None:
        import threading

        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as e:  # reported on the training thread by check()/wait()
                self._error = e

        self._what = what
        self._thread = threading.Thread(target=run, name="megaformer-checkpoint", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, CheckpointError):
                raise e
            raise CheckpointError(f"writing {self._what} failed: {type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:300]}") from None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()


def save_weights_checkpoint(run_dir: Path, step: int,
                            weights: dict[str, torch.Tensor] | Callable[[Path], None],
                            config_yaml: str, tokenizer: Any, meta: dict) -> Path:
    """A weights-only checkpoint (one process): what ``megaformer convert`` writes.

    Same layout as a training checkpoint minus the engine state and RNG: ``model.safetensors``
    (unsharded, unpadded), ``config.yaml``, ``tokenizer.json`` and ``meta.json`` with
    ``"weights_only": true``. ``megaformer train`` on such a run directory starts from these
    weights with a fresh optimizer, at any parallel layout. Refuses to replace a checkpoint.
    ``weights`` may also be a function that writes the weights file at the path it is given
    (a converter streaming tensor by tensor)."""
    from safetensors.torch import save_file

    root = run_dir / CHECKPOINTS
    tag = tag_for(step)
    final, tmp = root / tag, root / f"{TMP_PREFIX}{tag}"
    if final.exists() or final.is_symlink():
        raise CheckpointError(f"{final}: already exists; not overwriting it")
    make_dir(root)
    refuse_link(tmp)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if callable(weights):
        weights(tmp / WEIGHTS)
    else:
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS),
                  metadata={"format": "pt", "megaformer_version": __version__})
    (tmp / CONFIG).write_text(config_yaml)
    tokenizer.save(tmp / "tokenizer.json")
    full_meta = {"megaformer_version": __version__, "step": step, "weights_only": True,
                 "consumed_samples": 0, "consumed_tokens": 0,
                 "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta}
    (tmp / META).write_text(json.dumps(full_meta, indent=2))
    _seal(tmp, final, keep_last=None)
    return final


def is_weights_only(ckpt: Path) -> bool:
    """True for a checkpoint with weights but no engine state (from ``megaformer convert``)."""
    return bool(read_meta(ckpt).get("weights_only", False))


# ----------------------------------------------------------------------------- load

def load_engine_state(engine: Any, ckpt: Path, rank: int) -> tuple[dict, dict]:
    """Restore model, optimizer and scheduler into ``engine`` and this rank's RNG streams.

    Returns (client state, this rank's saved RNG dict — empty when the checkpoint has none)."""
    if ckpt.is_symlink() or STEP_NAME.fullmatch(ckpt.name) is None:
        raise CheckpointError(f"{ckpt}: not a checkpoint folder named step_<digits>")
    try:
        with weights_only_forced():  # every torch.load inside DeepSpeed is weights-only
            path, client = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name,
                                                  load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
    except CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError, AssertionError, pickle.UnpicklingError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{ckpt}: cannot restore the training state ({first[:300]})") from None
    if path is None or client is None:
        raise CheckpointError(f"{ckpt}: DeepSpeed found no engine state for this layout")
    return client, load_rng_state(ckpt, rank)


def load_rng_state(ckpt: Path, rank: int) -> dict:
    """Restore this rank's saved RNG streams (weights-only unpickling); returns the saved dict
    (empty, with a warning, when the checkpoint has none for this rank)."""
    rng_file = ckpt / "rng" / f"rank_{rank}.pt"
    if rng_file.is_symlink() or not rng_file.is_file():
        log.warning("%s has no RNG state for rank %d; dropout will not replay exactly", ckpt, rank)
        return {}
    try:
        rng = safe_torch_load(str(rng_file))
        set_rng_state(rng)
    except (RuntimeError, KeyError, ValueError, TypeError, AttributeError, IndexError,
            pickle.UnpicklingError) as e:
        raise CheckpointError(f"{rng_file}: corrupt RNG state ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
    return rng


def expected_shapes(model_cfg: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the (unpadded) model ``model_cfg`` describes, computed on
    the ``meta`` device: no memory is allocated whatever sizes the config names."""
    from megaformer.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_shapes(specs: Any, expected: dict[str, tuple[int, ...]], where: str,
                 error: type = CheckpointError) -> None:
    """Every (name, shape) in ``specs`` named in ``expected`` has exactly that shape, checked on
    shapes alone, before any tensor is read or allocated: a config describing a huge model beside
    small tensors (a "shape bomb") is refused instead of building what the config says."""
    for name, shape in specs:
        want = expected.get(name)
        if want is not None and tuple(shape) != tuple(want):
            raise error(f"{where}: tensor {name} has shape {list(shape)}, the config describes "
                        f"{list(want)}")


def check_weights(ckpt: Path, model_cfg: Any) -> None:
    """The checkpoint's weight file is a regular, well-formed safetensors file whose tensors have
    the shapes ``model_cfg`` gives them (headers only: nothing is loaded or allocated); for a
    sharded checkpoint, its index names exactly the model's parameters with their shapes."""
    from megaformer.checkpoint.safetensors_check import read_header

    f = ckpt / WEIGHTS
    if not f.exists():
        from megaformer.checkpoint.sharded import ShardedState

        ShardedState(ckpt).check_model(expected_shapes(model_cfg))
        return
    regular_files([f])
    header = read_header(f)
    header.pop("__metadata__", None)
    if len(header) < model_cfg.n_layers:  # every block has tensors: bounds the meta model too
        raise CheckpointError(f"{f}: {len(header)} tensors cannot hold the {model_cfg.n_layers} "
                              f"blocks {ckpt / CONFIG} describes")
    check_shapes(((n, e["shape"]) for n, e in header.items()), expected_shapes(model_cfg), str(f))


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Whole, unpadded weights (one process: generation, tools): ``model.safetensors``, or the
    master weights assembled from a sharded checkpoint's shards."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from megaformer.checkpoint.safetensors_check import read_header

    f = ckpt / WEIGHTS
    if not f.exists():
        from megaformer.checkpoint.sharded import ShardedState, has_sharded_state

        if has_sharded_state(ckpt):
            state = ShardedState(ckpt)
            return {name: state.whole(name) for name in state.names()}
        raise CheckpointError(f"{ckpt}: no {WEIGHTS} and no sharded state")
    regular_files([f])
    read_header(f)
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{f}: corrupt weights file ({str(e)[:200]})") from None
