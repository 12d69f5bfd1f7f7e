"""Loading DeepSpeed checkpoint files without executing pickled code.

DeepSpeed's own checkpoint engine calls ``torch.load(..., weights_only=False)``, which runs whatever
a pickle asks for. megaformer swaps in an engine that loads with ``weights_only=True`` and allowlists
only the few plain-data DeepSpeed classes its files contain (loss-scaler state, the ZeRO stage enum,
fragment addresses). A file that needs anything else is refused.
"""

from __future__ import annotations

from typing import Any

import torch

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


def install_safe_checkpoint_engine(engine: Any) -> None:
    """Replace ``engine.checkpoint_engine`` by one whose ``load`` is :func:`safe_torch_load`."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            return safe_torch_load(path, map_location=map_location)

    current = getattr(engine, "checkpoint_engine", None)
    safe = SafeTorchCheckpointEngine(getattr(engine, "_config", None))
    if current is not None and hasattr(current, "zipfile_serialization"):
        safe.zipfile_serialization = current.zipfile_serialization
    engine.checkpoint_engine = safe
