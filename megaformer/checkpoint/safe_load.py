"""Loading DeepSpeed checkpoint files without executing pickled code.

DeepSpeed's own checkpoint engine calls ``torch.load(..., weights_only=False)``, which runs whatever
a pickle asks for. megaformer swaps in an engine that loads with ``weights_only=True`` and allowlists
only the few plain-data DeepSpeed classes its files contain (loss-scaler state, the ZeRO stage enum,
fragment addresses). A file that needs anything else is refused. Around DeepSpeed's own checkpoint
loading, :func:`weights_only_forced` makes every other ``torch.load`` of the process weights-only too.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from typing import Any, Iterator, Optional

import torch

from megaformer import deepspeed_attrs
from megaformer.errors import CheckpointError


def deepspeed_safe_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_torch_load(path: str, map_location: Any = "cpu") -> Any:
    """``torch.load`` with ``weights_only=True`` (plus DeepSpeed's plain-data classes)."""
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}") from None
    except Exception as e:  # unpickling errors, truncated zip archives, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot load checkpoint file {path}: {first[:300]}") from None


_FORCE_LOCK = threading.RLock()


@contextlib.contextmanager
def weights_only_forced() -> Iterator[None]:
    """Within the block every ``torch.load`` in the process loads with ``weights_only=True``, even
    one that asks for ``weights_only=False`` (as DeepSpeed's universal-checkpoint and ZeRO loaders
    do), with DeepSpeed's plain-data classes allowlisted: a second wall behind the checkpoint engine
    of :func:`install_safe_checkpoint_engine`. It uses torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
    switch, read by ``torch.load`` at every call."""
    with _FORCE_LOCK:
        saved = {
            k: os.environ.get(k)
            for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
        }
        os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
        os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        try:
            with torch.serialization.safe_globals(deepspeed_safe_globals()):
                yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def host_copy(obj: Any, memo: Optional[dict] = None) -> Any:
    """``obj`` with every tensor copied to host memory (containers rebuilt, other leaves kept).
    Tensors that are the same view of the same storage (tied weights) stay one tensor. ``memo``
    keeps each source tensor alive beside its copy, so no address is reused while it is in use."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = (
            obj.untyped_storage().data_ptr(),
            obj.storage_offset(),
            tuple(obj.shape),
            obj.stride(),
            obj.dtype,
            obj.device,
        )
        if key not in memo:
            memo[key] = (obj, obj.detach().to("cpu", copy=True))
        return memo[key][1]
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = host_copy(v, memo)
        return out
    if isinstance(obj, list):
        return [host_copy(v, memo) for v in obj]
    if isinstance(obj, tuple):
        items = [host_copy(v, memo) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def install_safe_checkpoint_engine(engine: Any) -> None:
    """Replace ``engine.checkpoint_engine`` by one whose ``load`` is :func:`safe_torch_load`.

    It can also defer DeepSpeed's writes (asynchronous save): while ``deferring`` is set, ``save``
    keeps a host copy of the state and its path; :meth:`take_pending` hands them over to be written
    later with :meth:`write_now`."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        deferring = False

        def __init__(self, config_params: Any = None) -> None:
            super().__init__(config_params)
            self.pending: list[tuple[Any, str]] = []
            self.memo: dict = {}  # host copies by tensor view, shared with the rest of the save

        def load(self, path: str, map_location: Any = None) -> Any:
            return safe_torch_load(path, map_location=map_location)

        def save(self, state_dict: Any, path: str) -> None:
            if self.deferring:
                self.pending.append((host_copy(state_dict, self.memo), path))
            else:
                super().save(state_dict, path)

        def take_pending(self) -> list[tuple[Any, str]]:
            pending, self.pending, self.memo = self.pending, [], {}
            return pending

        def write_now(self, state_dict: Any, path: str) -> None:
            super().save(state_dict, path)

    current = deepspeed_attrs.checkpoint_engine(engine)
    safe = SafeTorchCheckpointEngine(deepspeed_attrs.engine_config(engine))
    # no zero_to_fp32.py in the checkpoints: megaformer's are converted by `megaformer convert`
    deepspeed_attrs.skip_recovery_scripts(engine)
    if current is not None and hasattr(current, "zipfile_serialization"):
        safe.zipfile_serialization = current.zipfile_serialization
    deepspeed_attrs.set_checkpoint_engine(engine, safe)
