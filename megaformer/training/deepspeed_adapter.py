"""Every use of DeepSpeed's private or undocumented API, in one file to audit on an upgrade.

Engine-level (used by the trainer):

* ``engine._zero3_consolidated_16bit_state_dict()``  full weights gathered from ZeRO-3 partitions;
* ``engine.clip_fp32_gradients``                      the clipping hook of the plain (ZeRO-0 fp32)
                                                      path, replaced by megaformer's global norm;
* ``optimizer.overflow``                              read by the engine after a step: skipped or not;
* ``engine.get_global_grad_norm()``, ``engine.was_step_applied()``.

Parameter- and engine-attribute accessors (``ds_id``, ``ds_pipe_replicated``, ``_hp_mapping``,
``engine.checkpoint_engine``, ``engine._config``, ``engine._copy_recovery_script``) live in
:mod:`megaformer.deepspeed_attrs` and are re-exported here:
the model, the parallel layers and the checkpoint code sit below ``training`` and must not import
it, so the predicates live in a module at the bottom of the package (beside ``errors``, ``config``
and ``comm``) that imports nothing; this module is where they are listed for an audit.

Checkpoints read and write each rank's optimizer state in place, all of it in
:mod:`megaformer.checkpoint.optimizer_state` (below ``training``, so not re-exported here):

* ``p._hp_mapping.lp_fragment_address`` and ``p._hp_mapping.get_hp_fragment(key)``  ZeRO 1/2 and
  bf16: which range of the flat fp32 partition is this parameter's, and that fragment;
* ``optimizer._lazy_init_hp_params_optimizer_state()`` and ``optimizer._hp_optimizer_states_linked``
  (re-link the fragments to the current Adam state);
* ``p._z3_optimizer._get_param_partition_rank(p)``, ``p.ds_tensor`` (``ds_numel``), ``p.ds_shape``
  ZeRO-3: which partition this rank holds, and its size;
* ``optimizer.fp32_partitioned_groups_flat`` (ZeRO-3's flat groups, given their Adam state);
* ``engine.global_steps`` / ``engine.global_samples`` and torch's ``scheduler._step_count`` /
  ``_last_lr`` (the schedule put where the saved step leaves it).

Also part of the audit: :func:`megaformer.checkpoint.safe_load.install_safe_checkpoint_engine`
subclasses DeepSpeed's ``TorchCheckpointEngine`` (through the accessors above), and expert
parallelism (:mod:`megaformer.parallel.experts`) relies on two internals:

* ``deepspeed.utils.groups._EXPERT_PARALLEL_GROUP`` / ``_EXPERT_DATA_PARALLEL_GROUP`` (and their
  ``_RANKS`` dicts), filled with megaformer's own EP / expert-data groups after
  ``groups._get_expert_parallel_ranks`` confirms DeepSpeed would build the same ones
  (``deepspeed_groups``);
* ``deepspeed.runtime.engine.MoE``, the name the engine's ``isinstance`` check for MoE layers
  reads, widened to megaformer's MoE block while ``deepspeed.initialize`` runs
  (``recognised_by_deepspeed``).

The interleaved pipeline schedule (:mod:`megaformer.parallel.interleaved_engine`) subclasses
DeepSpeed's ``DualPipeVModule`` (its ``_build``/``activate_phase``/``phase_bounds``/
``phase_funcs``/``phase_checkpointable``) and ``DualPipeVEngine`` (its queued point-to-point
``_queue_p2p``/``_exec_commit_p2p``/``_exec_send_*``/``_exec_recv_*`` over ``_first_send`` and
``_recv_specs``, its ``_phase`` context and the ``grads``/``losses`` pipe buffers), calls
``PipelineEngine.__init__`` and its ``_exec_forward_pass``/``_exec_backward_pass``/
``_exec_load_micro_batch`` directly, and widens the name ``deepspeed.DualPipeVEngine`` (which
``deepspeed.initialize`` reads to pick the engine of a DualPipeV module) to its own engine while
``deepspeed.initialize`` runs (``engine_for``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from megaformer.deepspeed_attrs import (
    checkpoint_engine,
    engine_config,
    has_hp_mapping,
    pipe_replicated,
    set_checkpoint_engine,
    skip_recovery_scripts,
    zero3_partitioned,
)
from megaformer.training.bad_steps import guard_optimizer_step

__all__ = [
    "checkpoint_engine",
    "engine_config",
    "has_hp_mapping",
    "pipe_replicated",
    "set_checkpoint_engine",
    "skip_recovery_scripts",
    "zero3_partitioned",
    "reports_grad_norm",
    "replace_fp32_clipping",
    "skip_nonfinite_steps",
    "grad_norm",
    "step_applied",
    "zero3_full_state_dict",
]


def reports_grad_norm(engine: Any) -> bool:
    """DeepSpeed wrapped the torch optimizer (ZeRO, bf16, fp16): its wrapper measures the global
    gradient norm, clips and skips non-finite steps itself. A plain torch optimizer (fp32 without
    ZeRO) is stepped directly: megaformer measures, clips and skips. (The wrappers set
    ``_global_grad_norm`` only at their first step, so the type is the test, not that attribute.)"""
    return not isinstance(engine.optimizer, torch.optim.Optimizer)


def replace_fp32_clipping(engine: Any, clip: Callable[[], None]) -> None:
    """Run ``clip()`` where the engine clips the gradients of a plain torch optimizer."""
    engine.clip_fp32_gradients = clip


def skip_nonfinite_steps(engine: Any, grad_norm: Callable[[], float]) -> None:
    """The engine steps a plain torch optimizer directly: skip its non-finite steps (``overflow``)."""
    guard_optimizer_step(engine.optimizer, grad_norm)


def grad_norm(engine: Any) -> Optional[float]:
    """The global gradient norm DeepSpeed measured at the last step (None if it did not)."""
    gn = engine.get_global_grad_norm()
    return float(gn) if gn is not None else None


def step_applied(engine: Any) -> bool:
    return bool(engine.was_step_applied())


def zero3_full_state_dict(engine: Any) -> Optional[dict[str, torch.Tensor]]:
    """Full 16-bit weights gathered from the ZeRO-3 partitions (collective; rank 0 gets them)."""
    return engine._zero3_consolidated_16bit_state_dict()
