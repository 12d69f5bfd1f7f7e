"""Pipeline parallelism through DeepSpeed's pipeline engine.

The (already tensor-parallelised) model is cut into a flat sequence of layers that
``deepspeed.pipe.PipelineModule`` partitions into stages::

    [embedding] [block 0] ... [block L-1] [final norm] [output head]   -> loss_fn(logits, labels)

The embedding lives on the first stage and the output head on the last; with tied embeddings both
are one ``TiedLayerSpec`` ("embed"), so DeepSpeed keeps the two copies equal (it broadcasts the
weight at start and all-reduces its gradient between the two stages every step). Micro-batches are
the gradient-accumulation steps and run on DeepSpeed's 1F1B schedule.

What crosses a stage boundary is the hidden state x [B, T, d], and with ``model.document_mask``
also the token ids (each stage rebuilds the documents' mask from them, once per micro-batch,
instead of sending the mask), and with ``model.mtp_depth`` the token ids too: the last stage holds
the multi-token prediction modules (in its final-norm layer), and its last layer hands the loss the
head's output, the last block's output x_L and the ids, from which the loss adds the modules' losses.
The embedding they share is on the last stage as a tied layer (the head itself with tied
embeddings; else a layer after the head that passes its inputs on), which DeepSpeed keeps equal to
the first stage's. With ``model.loss_chunk_tokens`` the last layer passes x on and the
loss reads x and the head's weight a chunk of tokens at a time (no [B, T, V] logits). The MoE
router losses r of a stage's blocks enter the backward where they are made: y = x forward, and
dL/dr = the micro-batch's loss scale backward (:class:`RouterLosses`), so a stage's routers get
the gradient of L = CE + sum_r r without r crossing the later stages.

Partitioning (``parallel.pipeline_partition``): ``layers`` (the same number of blocks per stage),
``parameters`` (balanced parameter counts), or an explicit list of blocks per stage such as
``"3,3,2"``. The embedding and head always go with the first and last stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn


class DocumentMasks:
    """The document mask of a micro-batch's ids, built once per stage: every block of the stage
    is handed the same ids tensor, so the last one built is reused while the ids are the same."""

    def __init__(self, build: Callable[[torch.Tensor], Any]) -> None:
        self.build = build
        self._ids: Optional[torch.Tensor] = None
        self._mask: Any = None

    def __call__(self, ids: torch.Tensor) -> Any:
        if ids is not self._ids:
            self._ids, self._mask = ids, self.build(ids)
        return self._mask


class _RouterLossInBackward(torch.autograd.Function):
    """y = x; backward: dL/dx = dL/dy and dL/dr = scale (the micro-batch loss's own scale)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, router: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(router)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (router,) = ctx.saved_tensors
        return grad, torch.full_like(router, ctx.scale), None


class RouterLosses:
    """The MoE router losses r of this stage's blocks: each joins the backward at its block
    (gradient ``scale``, set by the train step to the loss's 1 / micro-batches), and their sum
    over the step's micro-batches is kept for the logged loss (:meth:`take`)."""

    def __init__(self) -> None:
        self.scale = 1.0
        self._sum: Optional[torch.Tensor] = None

    def add(self, x: torch.Tensor, router: Optional[torch.Tensor]) -> torch.Tensor:
        if router is None:
            return x
        r = router.detach().float()
        self._sum = r if self._sum is None else self._sum + r
        return _RouterLossInBackward.apply(x, router, self.scale)

    def take(self, device: torch.device) -> torch.Tensor:
        """This stage's router losses summed over the micro-batches since the last take."""
        total = self._sum if self._sum is not None else torch.zeros((), device=device)
        self._sum = None
        return total


class PipelineBlock(nn.Module):
    """A block as a pipeline layer: x -> block(x), or (x, ids) -> (block(x, mask(ids)), ids)
    when the ids travel (``pass_ids``; with document masks, the mask of the ids); its router
    losses (if any) join the backward here."""

    def __init__(
        self,
        block: nn.Module,
        masks: Optional[DocumentMasks],
        router: Optional[RouterLosses],
        pass_ids: bool = False,
    ) -> None:
        super().__init__()
        self.block, self.masks, self.router = block, masks, router
        self.pass_ids = pass_ids or masks is not None

    def forward(self, inputs: Any) -> Any:
        if not self.pass_ids:
            x = self.block(inputs)
        else:
            x, ids = inputs
            x = self.block(x, doc_ids=self.masks(ids)) if self.masks is not None else self.block(x)
        if self.router is not None and self.training and torch.is_grad_enabled():
            from megaformer.model.moe import take_router_losses

            x = self.router.add(x, take_router_losses(self.block))
        return (x, ids) if self.pass_ids else x


class FinalNorm(nn.Module):
    """The final norm as the pipeline layer after the last block: (x, ids) -> norm(x)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.norm(inputs[0])


class FinalNormMTP(nn.Module):
    """The final norm as the pipeline layer after the last block, holding the multi-token
    prediction modules (the loss runs them): (x_L, ids) -> (Norm(x_L), x_L, ids). With an untied
    ``head`` it also holds the output head and applies it (unless the loss is chunked):
    (x_L, ids) -> (head(Norm(x_L)), x_L, ids); the layer after it is then the embedding, tied to
    the first stage's, which passes the tuple on."""

    def __init__(
        self, norm: nn.Module, mtp: nn.ModuleList, head: Optional[nn.Module], logits: bool
    ) -> None:
        super().__init__()
        self.norm, self.mtp, self.head = norm, mtp, head
        self.logits = logits and head is not None

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        x, ids = inputs
        h = self.norm(x)
        return (self.head(h) if self.logits else h), x, ids


class MTPLoss:
    """The pipeline's loss with multi-token prediction: ``main(out, labels)`` of the head's
    output, plus the model's lambda / D sum_k L^k of (out, x_L, ids)."""

    def __init__(self, main: Callable, model: nn.Module) -> None:
        self.main, self.model = main, model

    def __call__(self, outputs: tuple, labels: torch.Tensor) -> torch.Tensor:
        out, residual, ids = outputs
        loss = self.main(out, labels)
        mtp = self.model.mtp_loss(residual, ids, labels.to(ids.device))
        return loss if mtp is None else loss + mtp


class HiddenToLoss(nn.Module):
    """The output layer as the last pipeline layer under the chunked loss: passes the hidden
    states on (the loss function applies the head a chunk of tokens at a time)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head  # the stage owns (and trains) the head's weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


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
        self.pass_ids = False  # document masks: the later stages rebuild them from the ids

    def forward(self, ids: torch.Tensor, positions: Optional[torch.Tensor] = None) -> Any:
        x = self._embed(ids, positions=positions)[0]
        return (x, ids) if self.pass_ids else x


def _tied_head(stage: EmbeddingStage, x: torch.Tensor) -> torch.Tensor:
    return stage.lm_head(x)


def _pass_hidden(stage: EmbeddingStage, x: torch.Tensor) -> torch.Tensor:
    return x


def _tied_head_keep(stage: EmbeddingStage, inputs: tuple) -> tuple:
    """(Norm(x_L), x_L, ids) -> (logits, x_L, ids): the multi-token prediction loss's inputs."""
    return (stage.lm_head(inputs[0]), *inputs[1:])


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
        mtp = list(getattr(model, "mtp", ()))
        emb = _param_count(
            model.tok_embeddings, model.pos_embeddings, model.lm_head if tied else None
        )
        if mtp and not tied:  # [final norm, modules, head] [the embedding, tied]
            last = [_param_count(model.final_norm, *mtp, model.lm_head), emb]
        else:
            last = [
                _param_count(model.final_norm, *mtp),
                emb if tied else _param_count(model.lm_head),
            ]
        weights = [emb] + [_param_count(b) for b in model.layers] + last
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
    """``tied``: the last stage holds the embedding too (tied to the head, or read by the
    multi-token prediction modules)."""
    lo, hi = parts[stage], parts[stage + 1]
    head = hi == n_blocks + 3  # the last stage: final norm and head
    return StagePieces(
        frozenset(i for i in range(n_blocks) if lo <= i + 1 < hi), lo == 0 or (tied and head), head
    )


def rank_stages(schedule: str, pp: int, pp_rank: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The stages pipeline rank ``pp_rank`` of ``pp`` holds: (r,) under 1F1B; (r, r+p, ...,
    r+(v-1)p) under the interleaved schedule (v = ``virtual_stages``), so a micro-batch visits the
    ranks v times; (r, 2p-1-r) under DualPipeV, whose micro-batches go out through ranks 0..p-1
    and come back through p-1..0, so rank 0 holds both the embedding (stage 0) and the head
    (stage 2p-1)."""
    if schedule == "dualpipev":
        return (pp_rank, 2 * pp - 1 - pp_rank)
    if schedule == "interleaved":
        return tuple(c * pp + pp_rank for c in range(virtual_stages))
    return (pp_rank,)


def rank_pieces(
    parts: list[int], stages: tuple[int, ...], n_blocks: int, tied: bool
) -> StagePieces:
    """What a rank holding ``stages`` holds of the plain model: the union of the stages' pieces."""
    each = [stage_pieces(parts, s, n_blocks, tied) for s in stages]
    return StagePieces(
        frozenset().union(*(e.blocks for e in each)),
        any(e.embedding for e in each),
        any(e.head for e in each),
    )


def build_pipeline(
    model: nn.Module,
    topo: Any,
    partition: str,
    loss_fn: Callable,
    inputs_hook: Optional[Callable[[nn.Module], None]] = None,
    schedule: str = "1f1b",
    router_losses: Optional[RouterLosses] = None,
    virtual_stages: int = 1,
) -> nn.Module:
    """A ``PipelineModule`` over ``model``'s layers for the grid in ``topo``. ``inputs_hook``
    (context parallelism) is applied to the embedding stage and to every block's attention, so
    that they read this rank's global positions. ``loss_fn(output, labels)`` reads the logits, or
    the hidden states under ``model.loss_chunk_tokens``. ``router_losses``: where MoE blocks put
    their router losses (None: they have none).

    ``schedule="dualpipev"``: a ``DualPipeVModule`` cut into 2p stages, rank r running stages r
    and 2p-1-r (DeepSpeed picks its DualPipeV engine for it). The embedding and the head are both
    on rank 0, so tied embeddings are one module there and need no gradient exchange.

    ``schedule="interleaved"``: an :class:`~megaformer.parallel.interleaved_engine.InterleavedModule`
    cut into v p stages (v = ``virtual_stages``), rank r running stages r, r+p, ..., r+(v-1)p; the
    embedding is on rank 0 and the head on rank p-1, as under 1F1B."""
    from deepspeed.pipe import DualPipeVModule, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megaformer.parallel.interleaved_engine import InterleavedModule

    emb = EmbeddingStage(model)
    if inputs_hook is not None:
        for m in (emb, *(block.attn for block in model.layers)):
            inputs_hook(m)
    cfg = model.cfg
    tied, chunked = cfg.tie_embeddings, cfg.loss_chunk_tokens > 0
    masks = DocumentMasks(model.document_mask) if cfg.document_mask else None
    mtp = len(model.mtp) > 0
    if mtp and masks is not None:
        raise ValueError("multi-token prediction under pipeline parallelism: no document masks")
    emb.pass_ids = masks is not None or mtp
    layers: list = []
    if tied or mtp:  # the last stage holds the embedding too (the head, or the modules' input)
        layers.append(
            TiedLayerSpec("embed", TiedEmbedding, emb, tied_weight_attr=["tok_embeddings.weight"])
        )
    else:
        layers.append(emb)
    if masks is not None or router_losses is not None or mtp:
        layers.extend(PipelineBlock(b, masks, router_losses, mtp) for b in model.layers)
    else:
        layers.extend(model.layers)
    if mtp:
        untied_head = None if tied else model.lm_head
        layers.append(FinalNormMTP(model.final_norm, model.mtp, untied_head, not chunked))
        loss_fn = MTPLoss(loss_fn, model)
    else:
        layers.append(FinalNorm(model.final_norm) if masks is not None else model.final_norm)
    if mtp and not tied:
        layers.append(
            TiedLayerSpec(
                "embed",
                TiedEmbedding,
                emb,
                forward_fn=_pass_hidden,
                tied_weight_attr=["tok_embeddings.weight"],
            )
        )
    elif tied:
        layers.append(
            TiedLayerSpec(
                "embed",
                TiedEmbedding,
                emb,
                forward_fn=_pass_hidden if chunked else (_tied_head_keep if mtp else _tied_head),
                tied_weight_attr=["tok_embeddings.weight"],
            )
        )
    else:
        layers.append(HiddenToLoss(model.lm_head) if chunked else model.lm_head)
    # DeepSpeed's data axis is the replica group (DP x CP): the same rank order as the topology
    grid = PipeModelDataParallelTopology(num_pp=topo.pp, num_mp=topo.tp, num_dp=topo.replicas)
    chunks = rank_stages(schedule, topo.pp, 0, virtual_stages)
    parts = stage_parts(model, len(chunks) * topo.pp, partition)

    class MegaformerPipeline(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = parts  # the boundaries the build materialised this stage's layers for
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    class MegaformerDualPipeV(DualPipeVModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            # DualPipeVModule's own split, over the boundaries the build materialised
            rank = self._topo.get_coord(self.global_rank).pipe
            self.num_stages = 2 * topo.pp
            self.parts = parts
            first, second = rank_stages(schedule, topo.pp, rank)
            self._set_bounds(start=parts[first], stop=parts[first + 1])
            self.phase_bounds = [
                (parts[first], parts[first + 1]),
                (parts[second], parts[second + 1]),
            ]

    class MegaformerInterleaved(InterleavedModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            rank = self._topo.get_coord(self.global_rank).pipe
            self.num_stages, self.parts = len(parts) - 1, parts
            mine = rank_stages(schedule, topo.pp, rank, virtual_stages)
            self.phase_bounds = [(parts[s], parts[s + 1]) for s in mine]
            self._set_bounds(*self.phase_bounds[0])

    cls = {"dualpipev": MegaformerDualPipeV, "interleaved": MegaformerInterleaved}
    pipe = cls.get(schedule, MegaformerPipeline)(
        layers=layers,
        topology=grid,
        loss_fn=loss_fn,
        partition_method=partition,
        activation_checkpoint_interval=0,
    )
    pipe.router_losses = router_losses  # read by the train step (scale, logged loss)
    pipe.mtp_metrics = model.mtp_metrics  # the multi-token prediction losses (the last stage's)
    return pipe


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
