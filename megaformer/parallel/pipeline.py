"""Pipeline parallelism through DeepSpeed's pipeline engine.

The (already tensor-parallelised) model is cut into a flat sequence of layers that
``deepspeed.pipe.PipelineModule`` partitions into stages::

    [embedding] [block 0] ... [block L-1] [final norm] [output head]   -> loss_fn(logits, labels)

The embedding lives on the first stage and the output head on the last; with tied embeddings both
are one ``TiedLayerSpec`` ("embed"), so DeepSpeed keeps the two copies equal (it broadcasts the
weight at start and all-reduces its gradient between the two stages every step). Micro-batches are
the gradient-accumulation steps and run on DeepSpeed's 1F1B schedule.

Partitioning (``parallel.pipeline_partition``): ``layers`` (the same number of blocks per stage),
``parameters`` (balanced parameter counts), or an explicit list of blocks per stage such as
``"3,3,2"``. The embedding and head always go with the first and last stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn


class EmbeddingStage(nn.Module):
    """x_0 = the model's own embedding (:meth:`Transformer.embed`, token and absolute position
    tables, dropout); with tied embeddings it also computes the logits x E^T. ``positions``: the
    tokens' absolute positions (context parallelism hands them in; default 0..T-1)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        # the tables and dropout are registered here (this stage owns them); the computation
        # is the model's
        self.tok_embeddings = model.tok_embeddings
        self.pos_embeddings = model.pos_embeddings
        if model.pos_table is not None:
            self.register_buffer("pos_table", model.pos_table, persistent=False)
        else:
            self.pos_table = None
        self.drop = model.drop
        self.lm_head = model.lm_head if model.cfg.tie_embeddings else None
        self._embed: Callable = model.embed

    def forward(self, ids: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._embed(ids, positions=positions)[0]


def _tied_head(stage: EmbeddingStage, x: torch.Tensor) -> torch.Tensor:
    return stage.lm_head(x)


class TiedEmbedding(nn.Module):
    """A LayerSpec "class" that hands back an already built module: DeepSpeed's specs build
    modules from classes, while megaformer builds the model's layers itself (each stage
    materialises only its own, :func:`megaformer.parallel.build.build_model`)."""

    def __new__(cls, module: nn.Module) -> nn.Module:  # type: ignore[misc]
        return module


def _explicit_parts(spec: str, n_blocks: int, stages: int) -> Optional[list[int]]:
    """'3,3,2' -> DeepSpeed part boundaries over [embed, blocks..., norm, head]."""
    counts = [int(c) for c in spec.split(",")]
    if len(counts) != stages or sum(counts) != n_blocks or min(counts) < 1:
        raise ValueError(f"{spec!r}: need {stages} positive block counts summing to {n_blocks}")
    parts = [0]
    for i, c in enumerate(counts):
        parts.append(parts[-1] + c + (1 if i == 0 else 0))
    parts[-1] += 2  # final norm and head on the last stage
    return parts


def _param_count(*modules: Optional[nn.Module]) -> int:
    """Trainable parameters of ``modules`` (a shared Parameter once), as DeepSpeed counts a layer."""
    params = {id(p): p for m in modules if m is not None for p in m.parameters() if p.requires_grad}
    return sum(p.numel() for p in params.values())


def stage_parts(model: nn.Module, stages: int, partition: str) -> list[int]:
    """Stage boundaries over the layer list [embedding, block 0..L-1, final norm, head]: stage s
    runs layers parts[s] <= i < parts[s+1]. Shapes only (works on a model on the meta device):
    ``layers`` balances block counts, ``parameters`` parameter counts (DeepSpeed's
    ``partition_balanced``), or an explicit 'n1,n2,...' of blocks per stage."""
    from deepspeed.runtime import utils as ds_utils

    n_blocks = len(model.layers)
    if "," in partition or partition.isdigit():
        return _explicit_parts(partition, n_blocks, stages)
    if partition == "layers":
        weights = [0] + [1] * n_blocks + [0, 0]
    elif partition == "parameters":
        tied = model.cfg.tie_embeddings
        emb = _param_count(
            model.tok_embeddings, model.pos_embeddings, model.lm_head if tied else None
        )
        weights = (
            [emb]
            + [_param_count(b) for b in model.layers]
            + [_param_count(model.final_norm), emb if tied else _param_count(model.lm_head)]
        )
    else:
        raise ValueError(
            f"pipeline partition {partition!r}: expected 'layers', 'parameters' or block counts"
        )
    return ds_utils.partition_balanced(weights=weights, num_parts=stages)


@dataclass(frozen=True)
class StagePieces:
    """What pipeline stage ``stage`` holds of the plain model: its blocks, and whether the
    embedding (first stage, and the last with tied embeddings) and the final norm and output head
    (last stage) are there."""

    blocks: frozenset
    embedding: bool
    head: bool


def stage_pieces(parts: list[int], stage: int, n_blocks: int, tied: bool) -> StagePieces:
    lo, hi = parts[stage], parts[stage + 1]
    head = hi == n_blocks + 3  # the last stage: final norm and head
    return StagePieces(
        frozenset(i for i in range(n_blocks) if lo <= i + 1 < hi), lo == 0 or (tied and head), head
    )


def build_pipeline(
    model: nn.Module,
    topo: Any,
    partition: str,
    loss_fn: Callable,
    inputs_hook: Optional[Callable[[nn.Module], None]] = None,
) -> nn.Module:
    """A ``PipelineModule`` over ``model``'s layers for the grid in ``topo``. ``inputs_hook``
    (context parallelism) is applied to the embedding stage and to every block's attention, so
    that they read this rank's global positions."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    emb = EmbeddingStage(model)
    if inputs_hook is not None:
        for m in (emb, *(block.attn for block in model.layers)):
            inputs_hook(m)
    tied = model.cfg.tie_embeddings
    layers: list = []
    if tied:
        layers.append(
            TiedLayerSpec("embed", TiedEmbedding, emb, tied_weight_attr=["tok_embeddings.weight"])
        )
    else:
        layers.append(emb)
    layers.extend(model.layers)
    layers.append(model.final_norm)
    if tied:
        layers.append(
            TiedLayerSpec(
                "embed",
                TiedEmbedding,
                emb,
                forward_fn=_tied_head,
                tied_weight_attr=["tok_embeddings.weight"],
            )
        )
    else:
        layers.append(model.lm_head)
    # DeepSpeed's data axis is the replica group (DP x CP): the same rank order as the topology
    grid = PipeModelDataParallelTopology(num_pp=topo.pp, num_mp=topo.tp, num_dp=topo.replicas)
    parts = stage_parts(model, topo.pp, partition)

    class MegaformerPipeline(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = parts  # the boundaries the build materialised this stage's layers for
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return MegaformerPipeline(
        layers=layers,
        topology=grid,
        loss_fn=loss_fn,
        partition_method=partition,
        activation_checkpoint_interval=0,
    )


def original_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the plain model (before the pipeline renamed it)."""
    return {id(p): n for n, p in model.named_parameters()}


@torch.no_grad()
def pipeline_state_dict(
    pipe: nn.Module, names: dict[int, str], topo: Any, vocab_size: int
) -> dict[str, torch.Tensor]:
    """Unsharded, unpadded weights under the plain model's names, from every stage.

    Collective over the TP and PP groups: each stage gathers its tensor-parallel shards, then the
    stages' pieces are gathered (as objects) over the pipeline group. Every rank gets the result.
    """
    from megaformer.comm import all_gather_objects
    from megaformer.parallel.plan import gather_experts, gather_tensor_parallel

    local: dict[str, torch.Tensor] = {}
    for p in dict.fromkeys(pipe.parameters()):  # unique, in order
        t = gather_tensor_parallel(p, p.detach(), topo)
        t = gather_experts(p, t, topo)  # expert parallelism: every rank's experts
        name = names[id(p)]
        if name in ("tok_embeddings.weight", "lm_head.weight"):
            t = t[:vocab_size]
        local[name] = t.cpu().clone()
    merged: dict[str, torch.Tensor] = {}
    for piece in all_gather_objects(local, topo.groups.pp):
        merged.update(piece)
    order = {n: i for i, n in enumerate(names.values())}
    return dict(sorted(merged.items(), key=lambda kv: order[kv[0]]))
