"""One way to build the model, for training, ``megaformer bench``, generation and the tools.

    seed -> Transformer (on the target device) -> [full weights] -> tensor-parallel plan
         -> activation recomputation -> torch.compile -> device -> [pipeline stages]

Every rank builds the whole model from ``train.seed`` and the plan then keeps this rank's shards,
so TP=N starts from exactly TP=1's weights (on the same device type: CPU and CUDA draw different
numbers from the same seed). The model is created directly on ``device`` (the Transformer makes
its submodules on the meta device and materialises them on the default device, which the build
sets): no rank holds an fp32 copy of the model in host memory on the way to its accelerator.
``device="meta"`` gives shapes only (no values, nothing allocated).

After the weights, the default RNG is reseeded with ``train.seed + 1``: the dropout stream is
independent of how the weights were initialised or loaded.

Weights come either whole (a mapping name -> unsharded tensor, copied in before the plan), or from
a sharded reader (an object with ``shard(name, shape, dim, tp_offset)``, e.g. a checkpoint's
:class:`~megaformer.checkpoint.sharded.ShardedState`): then each rank reads, once the layout is
built, only the tensor-parallel shards of the parameters its pipeline stage holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn

from megaformer.config import Config
from megaformer.kernels.selection import set_mode
from megaformer.model.block import compile_blocks
from megaformer.model.transformer import Transformer
from megaformer.parallel.pipeline import build_pipeline, original_names
from megaformer.parallel.plan import load_full_weights, padded_vocab_size, parallelize
from megaformer.parallel.random import TensorParallelRNG
from megaformer.parallel.recompute import apply_recompute
from megaformer.parallel.topology import Topology


@dataclass
class BuiltModel:
    """What :func:`build_model` returns.

    ``model``        what runs: the pipeline module under PP > 1, else ``plain``;
    ``plain``        the Transformer with this rank's tensor-parallel shards (every stage's layers);
    ``tp_rng``       the per-rank dropout stream for sharded activations (TP > 1), else None;
    ``param_names``  under PP > 1: id(parameter) -> its name in ``plain`` (the pipeline renames them).
    """

    model: nn.Module
    plain: Transformer
    tp_rng: Optional[TensorParallelRNG] = None
    param_names: Optional[dict[int, str]] = None


def build_model(cfg: Config, topology: Optional[Topology] = None, *,
                device: Union[str, torch.device] = "cpu",
                weights: Optional[dict[str, torch.Tensor]] = None, weights_source: object = None,
                eod_id: Optional[int] = None, training: bool = True) -> BuiltModel:
    """The model ``cfg`` describes, laid out for ``topology`` (None: one process), on ``device``.

    ``weights``: unsharded, unpadded full weights to start from (``weights_source`` names them in
    errors). ``eod_id``: the end-of-document token (``model.document_mask``). With
    ``training=False`` (generation, one process) the vocabulary is not padded and no
    recomputation, compilation or pipeline is applied; the model is in eval mode."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp = topology.tp if topology is not None else 1
    pp = topology.pp if topology is not None else 1
    device = torch.device(device)
    # the vocabulary is padded for training (TP splits, GEMM shapes); a model for generation
    # holds exactly the checkpoint's tables
    padded = (padded_vocab_size(m.vocab_size, tp, p.vocab_multiple) if training or tp > 1
              else None)
    set_mode(m.fused_kernels)  # the kernel mode of this process (megaformer.kernels.selection)
    torch.manual_seed(t.seed)
    with torch.device(device):
        model = Transformer(m, padded_vocab_size=padded)
    model.eod_id = eod_id
    reader = weights if weights is not None and hasattr(weights, "shard") else None
    if weights is not None and reader is None:
        load_full_weights(model, weights, weights_source)
    torch.manual_seed(t.seed + 1)  # dropout stream, independent of init
    tp_rng = TensorParallelRNG(t.seed, topology.tp_rank) if topology is not None and tp > 1 else None
    if topology is not None:
        parallelize(model, topology, p.sequence_parallel, tp_rng)
    if not training:
        if reader is not None:
            load_shards(model, None, topology, reader)
        return BuiltModel(model.to(device).eval(), model, tp_rng)
    apply_recompute(model.layers, t.recompute, t.recompute_every, tp_rng)
    if t.compile:
        compile_blocks(model.layers)
    model = model.to(device)
    if pp == 1:
        if reader is not None:
            load_shards(model, None, topology, reader)
        return BuiltModel(model, model, tp_rng)
    names = original_names(model)
    pipe = build_pipeline(model, topology, p.pipeline_partition, loss_fn=model.loss_fn)
    if reader is not None:  # this stage's parameters only
        load_shards(pipe, names, topology, reader)
    return BuiltModel(pipe, model, tp_rng, names)


@torch.no_grad()
def load_shards(module: nn.Module, names: Optional[dict[int, str]], topology: Optional[Topology],
                reader: object) -> None:
    """Copy each parameter's tensor-parallel shard (vocabulary padding rows zero) from ``reader``
    into ``module`` (``names``: id(parameter) -> its plain-model name, under PP)."""
    tp = topology.tp if topology is not None else 1
    rank = topology.tp_rank if topology is not None else 0
    for name, p in module.named_parameters():
        name = names[id(p)] if names is not None else name
        split = getattr(p, "tensor_model_parallel", False) and tp > 1
        dim = p.partition_dim if split else None
        shard = reader.shard(name, tuple(p.shape), dim,  # type: ignore[attr-defined]
                             rank * p.shape[dim] if split else 0)
        p.copy_(shard.to(p.dtype))
