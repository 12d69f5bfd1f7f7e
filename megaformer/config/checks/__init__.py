"""Static checks: the cross-key rules a config must satisfy whatever runs it, one module per
concern. Checks that need the world size or the device are :mod:`megaformer.config.preflight`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaformer.config.checks.model import check_model, check_rope_scaling
from megaformer.config.checks.parallel import check_parallel
from megaformer.config.checks.run import check_data, check_deepspeed, check_outputs, check_train

if TYPE_CHECKING:
    from megaformer.config.root import Config

__all__ = ["check_rope_scaling", "validate"]


def validate(cfg: Config) -> None:
    """Cross-key checks that do not depend on the world size or the device."""
    for check in (
        check_model,
        check_parallel,
        check_data,
        check_train,
        check_outputs,
        check_deepspeed,
    ):
        check(cfg)
