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

from typing import Any, Callable, Optional

import torch
import torch.nn as nn


class EmbeddingStage(nn.Module):
    """x_0 = Dropout(E[ids] + PE[pos]); with tied embeddings it also computes the logits x E^T."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings
        self.pos_embeddings = model.pos_embeddings
        if model.pos_table is not None:
            self.register_buffer("pos_table", model.pos_table, persistent=False)
        else:
            self.pos_table = None
        self.drop = model.drop
        self.lm_head = model.lm_head if model.cfg.tie_embeddings else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(positions)
        elif self.pos_table is not None:
            x = x + self.pos_table[:ids.shape[1]].to(x.dtype)
        return self.drop(x)


def _tied_head(stage: EmbeddingStage, x: torch.Tensor) -> torch.Tensor:
    return stage.lm_head(x)


class TiedEmbedding(nn.Module):
    """A LayerSpec "class" that hands back an already built module: DeepSpeed's specs build
    modules from classes, while megaformer builds the whole model first (so every layout starts
    from the same weights) and then distributes it."""

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


def build_pipeline(model: nn.Module, topo: Any, partition: str, loss_fn: Callable) -> nn.Module:
    """A ``PipelineModule`` over ``model``'s layers for the grid in ``topo``."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    emb = EmbeddingStage(model)
    tied = model.cfg.tie_embeddings
    layers: list = []
    if tied:
        layers.append(TiedLayerSpec("embed", TiedEmbedding, emb,
                                    tied_weight_attr=["tok_embeddings.weight"]))
    else:
        layers.append(emb)
    layers.extend(model.layers)
    layers.append(model.final_norm)
    if tied:
        layers.append(TiedLayerSpec("embed", TiedEmbedding, emb, forward_fn=_tied_head,
                                    tied_weight_attr=["tok_embeddings.weight"]))
    else:
        layers.append(model.lm_head)
    grid = PipeModelDataParallelTopology(num_pp=topo.pp, num_mp=topo.tp, num_dp=topo.dp)
    n_blocks = len(model.layers)

    class MegaformerPipeline(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            if "," in method or method.isdigit():
                self.parts = _explicit_parts(method, n_blocks, self.num_stages)
                stage = self._topo.get_coord(self.global_rank).pipe
                self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
                return
            if method == "layers":
                method = "type:Block"
            super()._partition_layers(method)

    return MegaformerPipeline(layers=layers, topology=grid, loss_fn=loss_fn,
                              partition_method=partition, activation_checkpoint_interval=0)


def original_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the plain model (before the pipeline renamed it)."""
    return {id(p): n for n, p in model.named_parameters()}


@torch.no_grad()
def pipeline_state_dict(pipe: nn.Module, names: dict[int, str], topo: Any,
                        vocab_size: int) -> dict[str, torch.Tensor]:
    """Unsharded, unpadded weights under the plain model's names, from every stage.

    Collective over the TP and PP groups: each stage gathers its tensor-parallel shards, then the
    stages' pieces are gathered (as objects) over the pipeline group. Every rank gets the result.
    """
    import torch.distributed as dist

    local: dict[str, torch.Tensor] = {}
    for p in dict.fromkeys(pipe.parameters()):  # unique, in order
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False) and topo.tp > 1:
            parts = [torch.empty_like(t) for _ in range(topo.tp)]
            dist.all_gather(parts, t.contiguous(), group=topo.group("tp"))
            t = torch.cat(parts, dim=p.partition_dim)
        name = names[id(p)]
        if name in ("tok_embeddings.weight", "lm_head.weight"):
            t = t[:vocab_size]
        local[name] = t.cpu().clone()
    pieces: list = [None] * topo.pp
    dist.all_gather_object(pieces, local, group=topo.group("pp"))
    merged: dict[str, torch.Tensor] = {}
    for piece in pieces:
        merged.update(piece)
    order = {n: i for i, n in enumerate(names.values())}
    return dict(sorted(merged.items(), key=lambda kv: order[kv[0]]))
