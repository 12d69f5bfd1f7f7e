"""One way to build the model, for training, ``megaformer bench``, generation and the tools.

    seed -> Transformer (meta) -> tensor-parallel plan, each block given its values just before
         it is split -> [FP8 GEMMs] -> activation recomputation -> [context parallelism around
         the attention cores] -> torch.compile -> [pipeline stages]

Each weight is drawn from its own stream, seeded by ``train.seed`` and its name
(:meth:`~megaformer.model.transformer.Transformer.init_parameter`), so TP=N and PP=N start from
exactly TP=1's weights (on the same device type: CPU and CUDA draw different numbers from the same
seed) while a rank allocates only what it keeps: under tensor or pipeline parallelism the model is
built on the meta device, and the blocks of this rank's pipeline stage, its embedding and its
output layer are allocated on ``device`` one at a time, initialised whole and split (at most one
unsplit block or vocabulary table is alive at once); values from a sharded reader are read as
this rank's shards only. Other stages' layers never hold memory.
Expert parallelism builds the same way, each MoE block keeping this rank's experts as soon as it
has its values; under ZeRO-3 each module is handed, once it has its values, to ``partition``
(DeepSpeed's ``zero.Init``), so a rank holds its partitions and one whole module at most.
One process (or weights given whole) builds the model directly on ``device``.
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
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from megaformer.config import Config
from megaformer.config.checks.parallel import pipeline_stage_count
from megaformer.kernels.selection import set_mode
from megaformer.model.block import compile_blocks
from megaformer.model.transformer import Transformer
from megaformer.parallel.context import (
    ContextParallel,
    apply_context,
    attach_inputs,
    loss_weighting,
    weighted_loss_fn,
)
from megaformer.parallel.experts import configure_routing, distribute_experts, expert_offset
from megaformer.parallel.fp8 import apply_fp8
from megaformer.parallel.pipeline import (
    RouterLosses,
    StagePieces,
    build_pipeline,
    original_names,
    rank_pieces,
    rank_stages,
    stage_parts,
)
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
    ``param_names``  under PP > 1: id(parameter) -> its name in ``plain`` (the pipeline renames them);
    ``weigh_loss``   ``weigh_loss(loss, labels)``: the loss of a forward as the train step
                     back-propagates it (context parallelism weights it; else unchanged).
    """

    model: nn.Module
    plain: Transformer
    tp_rng: Optional[TensorParallelRNG] = None
    param_names: Optional[dict[int, str]] = None
    weigh_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_weighting(None)


def build_model(
    cfg: Config,
    topology: Optional[Topology] = None,
    *,
    device: Union[str, torch.device] = "cpu",
    weights: Optional[dict[str, torch.Tensor]] = None,
    weights_source: object = None,
    eod_id: Optional[int] = None,
    training: bool = True,
    partition: Optional[Callable[[nn.Module], None]] = None,
) -> BuiltModel:
    """The model ``cfg`` describes, laid out for ``topology`` (None: one process), on ``device``.

    ``weights``: unsharded, unpadded full weights to start from (``weights_source`` names them in
    errors). ``eod_id``: the end-of-document token (``model.document_mask``). With
    ``training=False`` (generation, one process) the vocabulary is not padded and no
    recomputation, compilation or pipeline is applied; the model is in eval mode.

    ``partition(module)`` (ZeRO-3: :func:`megaformer.training.deepspeed_config.zero3_partitioner`)
    takes each module as soon as it holds its values (from the seed or a sharded reader) and keeps
    this rank's partition of its parameters: the model is built on the meta device and no rank
    holds more than its partitions and one whole module."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp = topology.tp if topology is not None else 1
    pp = topology.pp if topology is not None else 1
    device = torch.device(device)
    # the vocabulary is padded for training (TP splits, GEMM shapes); a model for generation
    # holds exactly the checkpoint's tables
    padded = padded_vocab_size(m.vocab_size, tp, p.vocab_multiple) if training or tp > 1 else None
    set_mode(m.kernels)  # the kernel mode of this process (megaformer.kernels.selection)
    reader = weights if weights is not None and hasattr(weights, "shard") else None
    # split layouts build on the meta device and give values one block at a time, to this rank's
    # shards and pipeline stage only (unless whole weights are to be copied in first)
    # (so do expert parallelism, each block keeping its experts, and ZeRO-3, each module its
    # partition, as soon as it has its values)
    lazy = (
        topology is not None
        and (tp > 1 or pp > 1 or topology.ep > 1 or partition is not None)
        and (weights is None or reader is not None)
    )
    torch.manual_seed(t.seed)
    with torch.device("meta" if lazy else device):
        model = Transformer(m, padded_vocab_size=padded)
    model.eod_id = eod_id
    fill: Optional[Materializer] = None
    if lazy:
        pieces = (
            rank_pieces(
                _stage_parts(cfg, topology, padded, model),
                rank_stages(p.pipeline_schedule, pp, topology.pp_rank, p.pipeline_virtual_stages),
                m.n_layers,
                m.tie_embeddings or m.mtp_depth > 0,  # the last stage holds the embedding
            )
            if pp > 1
            else None
        )
        fill = Materializer(
            model,
            device,
            pieces,
            init=reader is None,
            topology=topology,
            reader=reader if partition is not None else None,
            partition=partition,
        )
    if weights is not None and reader is None:
        load_full_weights(model, weights, weights_source)
    torch.manual_seed(t.seed + 1)  # dropout stream, independent of init
    tp_rng = (
        TensorParallelRNG(t.seed, topology.tp_rank) if topology is not None and tp > 1 else None
    )
    if topology is not None:
        parallelize(model, topology, p.sequence_parallel, tp_rng, materialize=fill)
        distribute_experts(model, topology)  # this rank's experts (expert parallelism)
        configure_routing(model, topology, p.expert_dispatch)
    loaded = partition is not None  # the Materializer copied the reader's values in already
    if not training:
        cp = _context(model, topology, p.context_mode)
        if reader is not None and not loaded:
            load_shards(model, None, topology, reader)
        return BuiltModel(
            (model if lazy else model.to(device)).eval(),
            model,
            tp_rng,
            weigh_loss=loss_weighting(cp),
        )
    apply_fp8(model, t.fp8, t.fp8_emulate, topology.groups.tp if topology is not None else None)
    apply_recompute(model.layers, t.recompute, t.recompute_every, tp_rng)
    # around the (recomputed) local core: the communication is not recomputed
    cp = _context(model, topology, p.context_mode)
    if t.compile:
        compile_blocks(model.layers)
    if not lazy:  # (a lazy build's values are on the device already; other stages' are not)
        model = model.to(device)
    if pp == 1:
        if reader is not None and not loaded:
            load_shards(model, None, topology, reader)
        return BuiltModel(model, model, tp_rng, weigh_loss=loss_weighting(cp))
    names = original_names(model)
    moe = m.moe
    pipe = build_pipeline(
        model,
        topology,
        p.pipeline_partition,
        # the chunked loss reads the last stage's hidden states, else its logits
        loss_fn=weighted_loss_fn(
            model.lm_head.hidden_loss if m.loss_chunk_tokens > 0 else model.loss_fn, cp
        ),
        inputs_hook=(lambda m: attach_inputs(cp, m)) if cp is not None else None,
        schedule=p.pipeline_schedule,
        virtual_stages=p.pipeline_virtual_stages,
        router_losses=(
            RouterLosses() if moe.interval > 0 and (moe.aux_loss_coef or moe.z_loss_coef) else None
        ),
    )
    if reader is not None:  # this stage's parameters only
        load_shards(pipe, names, topology, reader)
    return BuiltModel(pipe, model, tp_rng, names)


def _context(
    model: Transformer, topology: Optional[Topology], mode: str
) -> Optional[ContextParallel]:
    """Context parallelism around the model's attention cores (None without it)."""
    return apply_context(model, topology, mode) if topology is not None else None


def _stage_parts(
    cfg: Config, topology: Topology, padded: Optional[int], model: Transformer
) -> list[int]:
    """The pipeline's stage boundaries. Only ``parameters`` needs the split layout's parameter
    counts: from a second model of shapes only, laid out as this one."""
    p = cfg.parallel
    stages = pipeline_stage_count(cfg)
    if p.pipeline_partition != "parameters":  # block counts: the unsplit model's blocks suffice
        return stage_parts(model, stages, p.pipeline_partition)
    with torch.device("meta"):
        probe = Transformer(cfg.model, padded_vocab_size=padded)
    parallelize(probe, topology, p.sequence_parallel, None)
    distribute_experts(probe, topology)
    return stage_parts(probe, stages, p.pipeline_partition)


class Materializer:
    """Gives the parts of a meta-built model this rank keeps their values, one module at a time.

    Called on each block, the embedding and the output layer just before the tensor-parallel plan
    splits them (:func:`megaformer.parallel.plan.parallelize`): the module is allocated on
    ``device`` whole and initialised parameter by parameter (:meth:`Transformer.init_parameter`:
    the same values as a one-process build), an MoE block keeps this rank's experts at once
    (:func:`~megaformer.parallel.experts.distribute_experts`), and the plan then keeps this rank's
    shards. Modules of other pipeline stages stay on the meta device. With ``init=False`` (a
    checkpoint's shards follow) the values are left for the loader, or copied from ``reader``
    when given. ``partition(module)`` (ZeRO-3) then keeps this rank's partition of the module.
    The small rest of the model (final norm, positions, buffers, and on the last stage the
    multi-token prediction modules) is materialised at once."""

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        pieces: Optional[StagePieces],
        init: bool,
        topology: Optional[Topology] = None,
        reader: object = None,
        partition: Optional[Callable[[nn.Module], None]] = None,
    ) -> None:
        self.model, self.device, self.pieces, self.init = model, device, pieces, init
        self.topology, self.reader, self.partition = topology, reader, partition
        self.names = {id(mod): name for name, mod in model.named_modules()}
        self.blocks = {id(b): i for i, b in enumerate(model.layers)}
        for name, buf in list(model.named_buffers(recurse=False)):
            model.register_buffer(name, torch.empty_like(buf, device=device), persistent=False)
        # the multi-token prediction modules run on the last pipeline stage only
        mtp = model.mtp if pieces is None or pieces.head else ()
        for mod in (model.final_norm, model.pos_embeddings, *mtp):
            if mod is not None:
                self._fill(mod)
        model.reset_buffers()  # the sinusoidal table (meta blocks' buffers stay meta)

    def wanted(self, module: nn.Module) -> bool:
        pieces = self.pieces
        if pieces is None:
            return True
        if id(module) in self.blocks:
            return self.blocks[id(module)] in pieces.blocks
        if module is self.model.tok_embeddings:
            return pieces.embedding
        return pieces.head  # the output layer

    @torch.no_grad()
    def __call__(self, module: nn.Module) -> None:
        if not self.wanted(module) or not any(p.is_meta for p in module.parameters()):
            return  # another stage's, or done (the tied output layer is the embedding)
        self._fill(module)
        self.model.reset_buffers(module)

    def _fill(self, module: nn.Module) -> None:
        module.to_empty(device=self.device)
        self.model.tie_weights()
        prefix = self.names[id(module)]
        if self.init:
            for name, p in module.named_parameters():
                self.model.init_parameter(f"{prefix}.{name}", p)
        if self.topology is not None and id(module) in self.blocks:
            distribute_experts(module, self.topology)  # this block's experts only, from here on
        if self.reader is not None:
            load_shards(module, None, self.topology, self.reader, prefix=f"{prefix}.")
        if self.partition is not None:
            self.partition(module)


@torch.no_grad()
def load_shards(
    module: nn.Module,
    names: Optional[dict[int, str]],
    topology: Optional[Topology],
    reader: object,
    prefix: str = "",
) -> None:
    """Copy each parameter's tensor-parallel shard (vocabulary padding rows zero; an expert
    parameter's rows of this rank's experts) from ``reader`` into ``module`` (``names``:
    id(parameter) -> its plain-model name, under PP; else ``prefix`` + its name in ``module``)."""
    tp = topology.tp if topology is not None else 1
    rank = topology.tp_rank if topology is not None else 0
    for name, p in module.named_parameters():
        name = names[id(p)] if names is not None else prefix + name
        split = getattr(p, "tensor_model_parallel", False) and tp > 1
        dim = p.partition_dim if split else None
        shard = reader.shard(
            name,
            tuple(p.shape),
            dim,  # type: ignore[attr-defined]
            rank * p.shape[dim] if split else 0,
            ep_offset=expert_offset(p, topology),
        )
        p.copy_(shard.to(p.dtype))
