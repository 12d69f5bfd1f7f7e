"""The tensor-parallel plan: which layer of the plain model becomes which parallel layer.

TorchTitan keeps tensor parallelism as a short mapping from layer names to styles; so does
megaformer. The model in ``megaformer/model`` is built whole (identical on every rank, from the same
seed, so TP=N starts from exactly the weights of TP=1) and :func:`parallelize` then replaces:

    tok_embeddings           -> vocab-parallel embedding   (rows split; padded vocab)
    layers.*.attn.wq/wk/wv   -> column parallel             (heads split; KV heads split; biases
                                                             split with their columns)
    layers.*.attn.q/k_norm   -> replicated                  (one gain over d_k; every rank's heads
                                                             add to its gradient: summed over TP)
    layers.*.attn.wo         -> row parallel
    multi-head latent attention (model.attention: mla):
    layers.*.attn.wq / wq_b  -> column parallel             (heads split)
    layers.*.attn.wkv_b      -> column parallel             (heads split: keys and values of each)
    layers.*.attn.wq_a/wkv_a -> replicated                  (the latents and the shared rotary key:
    layers.*.attn.q/kv_norm                                  every rank's heads add to their
                                                             gradients: summed over TP)
    layers.*.mlp.w1 (/w3)    -> column parallel             (SwiGLU gate and up split alike)
    layers.*.mlp.w2          -> row parallel
    MoE blocks:
    layers.*.mlp.experts.w1/w3 -> every expert column parallel [E, f/p, d]
    layers.*.mlp.experts.w2  -> every expert row parallel [E, d, f/p]; one reduction of the
                                combined routed output (not one per expert)
    layers.*.mlp.router      -> replicated (gradient summed over TP: see megaformer.model.moe)
    layers.*.mlp.shared.*    -> as the dense mlp
    layers.*.mlp.shared_gate -> replicated (as the router)
    lm_head                  -> vocab-parallel output head (column parallel over the vocabulary,
                                vocab-parallel cross-entropy, gathered logits)
    norms                    -> replicated

With sequence parallelism the residual stream inside the blocks is split along the sequence: the
first block's input is scattered, the last block's output gathered; column-parallel inputs are
all-gathered and row-parallel outputs reduce-scattered instead of all-reduced; replicated
parameters that see only this rank's positions (norms, row-parallel biases) have their gradients
summed over the TP group. Dropout on sharded activations draws from the per-rank RNG stream.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from megaformer.comm import ProcessGroup, all_gather_cat, gather_seq_split_bwd, scatter_seq
from megaformer.kernels.cross_entropy import chunked_cross_entropy
from megaformer.kernels.dropout import Dropout
from megaformer.model.mla import LatentAttention
from megaformer.model.moe import MoE
from megaformer.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_vocab,
    mark_sharded,
    shard,
    sum_grad_over_tp,
    tp_region_input,
    vocab_parallel_cross_entropy,
)
from megaformer.parallel.random import TensorParallelRNG
from megaformer.parallel.topology import Topology

BLOCK_PLAN: dict[str, type] = {
    "attn.wq": ColumnParallelLinear,
    "attn.wk": ColumnParallelLinear,
    "attn.wv": ColumnParallelLinear,
    "attn.wo": RowParallelLinear,
    "attn.wq_b": ColumnParallelLinear,  # multi-head latent attention's up-projections
    "attn.wkv_b": ColumnParallelLinear,
    "mlp.w1": ColumnParallelLinear,
    "mlp.w3": ColumnParallelLinear,
    "mlp.w2": RowParallelLinear,
}
# An MoE block's shared experts are a dense FFN, split alike (the routed experts: shard_experts).
MOE_PLAN: dict[str, type] = {
    "mlp.shared.w1": ColumnParallelLinear,
    "mlp.shared.w3": ColumnParallelLinear,
    "mlp.shared.w2": RowParallelLinear,
}
# Multi-head latent attention's projections to its latents: replicated under TP (not in the plan)
MLA_DOWN_PROJECTIONS = ("attn.wq_a", "attn.wkv_a")
# What expert parallelism marks on an expert parameter (megaformer.parallel.experts), kept when it
# is split.
EXPERT_MARKS = ("allreduce", "group_name", "expert_parallel")
# Modules whose input enters the column-parallel region once, for all their projections.
REGION_INPUTS = ("attn", "mlp")


def shard_experts(moe: MoE, group: ProcessGroup, sequence_parallel: bool) -> None:
    """Split every routed expert of ``moe`` like the dense FFN: w1 and w3 [E, f, d] by their f
    rows, w2 [E, d, f] by its f columns. The router stays replicated: its gradient through the
    combine is this rank's share (summed over the group), that of the router losses is scaled
    by 1/tp inside the block. The block all-reduces (with SP reduce-scatters) its routed output."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ex = moe.experts
    for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        full = getattr(ex, name)
        if full is not None:
            part = mark_sharded(nn.Parameter(shard(full.data, dim, rank, world)), dim)
            for key in EXPERT_MARKS:  # this rank's experts already (expert parallelism)
                if hasattr(full, key):
                    setattr(part, key, getattr(full, key))
            setattr(ex, name, part)
    sum_grad_over_tp(moe.router.weight, group)
    if moe.shared_gate is not None:  # replicated too, its gradient share scaled inside the block
        sum_grad_over_tp(moe.shared_gate.weight, group)
    moe.tp_group, moe.tp_size, moe.sequence_parallel = group, world, sequence_parallel


def replicated_attention_parameters(attn: nn.Module) -> list[nn.Parameter]:
    """The parameters of an attention layer every TP rank holds whole while its gradient sees only
    this rank's heads: the q/k norms' gains; under multi-head latent attention the down-projections
    to the latents (and the shared rotary key) and the latents' norms."""
    if isinstance(attn, LatentAttention):
        parts = (attn.wq_a, attn.q_norm, attn.wkv_a, attn.kv_norm)
    else:
        parts = (attn.q_norm, attn.k_norm)
    return [p for m in parts if m is not None for p in m.parameters()]


def padded_vocab_size(vocab: int, tensor: int, multiple: int) -> int:
    """Smallest multiple of ``multiple * tensor`` >= vocab (Megatron's make-vocab-size-divisible-by)."""
    unit = multiple * tensor
    return -(-vocab // unit) * unit


class ForkedDropout(Dropout):
    """Dropout whose mask comes from the tensor-parallel RNG stream (sharded activations)."""

    def __init__(self, p: float, rng: TensorParallelRNG) -> None:
        super().__init__(p)
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.rng.fork():
            return super().forward(x)


class ForkedAttentionCore(nn.Module):
    """The attention core ``inner`` with its attention-probability dropout drawn from the
    tensor-parallel RNG stream (each rank holds other heads: independent masks)."""

    def __init__(self, inner: nn.Module, rng: TensorParallelRNG) -> None:
        super().__init__()
        self.inner = inner
        self.rng = rng

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.rng.fork():
            return self.inner(*args, **kwargs)

    def extra_repr(self) -> str:
        return "dropout from the tensor-parallel RNG stream"


class VocabParallelOutputHead(ColumnParallelLinear):
    """The output head with its vocabulary rows split over the TP group (the same methods as
    :class:`megaformer.model.transformer.OutputHead`): this rank's logits [.., Vp/p], the
    vocab-parallel cross-entropy on them (or chunked on the hidden states), and the gathered
    logits over the real vocabulary for evaluation without labels."""

    def __init__(
        self,
        full: nn.Linear,
        group: ProcessGroup,
        vocab_start: int,
        vocab_size: int,
        chunk_tokens: int,
    ) -> None:
        super().__init__(full, group, sequence_parallel=False)
        self.vocab_start, self.vocab_size, self.chunk_tokens = vocab_start, vocab_size, chunk_tokens

    def output_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_vocab(logits, self.group)[..., : self.vocab_size]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits, labels, self.vocab_start, self.group, vocab_size=self.vocab_size
        )

    def hidden_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the hidden states enter the column-parallel region (identity forward, all-reduce of dH
        # backward) as they would entering the head
        hidden = tp_region_input(hidden, self.group, sequence_parallel=False)
        return chunked_cross_entropy(
            hidden,
            self.weight,
            labels,
            self.chunk_tokens,
            vocab_start=self.vocab_start,
            vocab_size=self.vocab_size,
            group=self.group,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.weight.shape[1]}, {self.weight.shape[0]} (vocabulary rows "
            f"{self.vocab_start}..{self.vocab_start + self.weight.shape[0] - 1})"
        )


def submodule(root: nn.Module, dotted: str) -> tuple[Optional[nn.Module], str]:
    *path, leaf = dotted.split(".")
    parent = root
    for p in path:
        parent = getattr(parent, p, None)
        if parent is None:  # e.g. a block without shared experts
            return None, leaf
    return (parent if getattr(parent, leaf, None) is not None else None), leaf


def _region_input(group: ProcessGroup, sp: bool) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        return (tp_region_input(args[0], group, sp), *args[1:]), kwargs

    return hook


def _scatter_input(group: ProcessGroup) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        return (scatter_seq(args[0], group), *args[1:]), kwargs

    return hook


class _PaddedSequenceSplit:
    """A block on whole sequences [B, S, d] under sequence parallelism (a multi-token prediction
    module's, S = T - k need not divide by the TP degree p): x is padded with zero rows to
    S' = p ceil(S / p), split over the group, run, gathered and cut back to S. Causal attention
    keeps the padding out of rows < S; their gradients come back as the whole block's would."""

    def __init__(self, group: ProcessGroup, size: int) -> None:
        self.group, self.size = group, size
        self.length: list[int] = []  # S of each call in flight (recomputation runs it again)

    def attach(self, block: nn.Module) -> None:
        block.register_forward_pre_hook(self.before, with_kwargs=True)
        block.register_forward_hook(self.after)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        x = args[0]
        S = x.shape[1]
        self.length.append(S)
        pad = -S % self.size
        if pad:
            x = torch.cat((x, x.new_zeros(x.shape[0], pad, *x.shape[2:])), dim=1)
        return (scatter_seq(x, self.group), *args[1:]), kwargs

    def after(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return gather_seq_split_bwd(output, self.group)[:, : self.length.pop()]


def _gather_output(group: ProcessGroup) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return gather_seq_split_bwd(output, group)

    return hook


def parallelize(
    model: nn.Module,
    topo: Topology,
    sequence_parallel: bool,
    rng: Optional[TensorParallelRNG],
    materialize: Optional[Callable[[nn.Module], None]] = None,
) -> nn.Module:
    """Apply the tensor-parallel plan to ``model`` in place (a no-op for TP = 1).

    ``materialize(module)``, when given, is called on each block and on the embedding and output
    layer just before they are split: a model built on the meta device gets its values one block
    at a time, so no rank holds more than one unsplit block (:func:`megaformer.parallel.build
    .build_model`)."""
    if topo.tp == 1:
        if materialize is not None:
            for module in (*model.layers, model.tok_embeddings, model.lm_head):
                materialize(module)
        return model
    group = topo.groups.tp
    sp = sequence_parallel
    # the multi-token prediction modules' blocks are split as the model's; under sequence
    # parallelism each splits its own (shorter) sequences (:class:`_PaddedSequenceSplit`)
    extra = [m.block for m in getattr(model, "mtp", ())]
    for block in (*model.layers, *extra):
        if materialize is not None:
            materialize(block)
        if isinstance(block.mlp, MoE):
            shard_experts(block.mlp, group, sp)
        for name, style in {**BLOCK_PLAN, **MOE_PLAN}.items():
            parent, leaf = submodule(block, name)
            if parent is not None:
                kwargs = {"input_comm": False} if style is ColumnParallelLinear else {}
                setattr(parent, leaf, style(getattr(parent, leaf), group, sp, **kwargs))
        for name in REGION_INPUTS:
            getattr(block, name).register_forward_pre_hook(
                _region_input(group, sp), with_kwargs=True
            )
        for p in replicated_attention_parameters(block.attn):  # they feed this rank's heads
            sum_grad_over_tp(p, group)
        if rng is not None:
            block.attn.core = ForkedAttentionCore(block.attn.core, rng)  # local heads
            if sp and block.drop.p > 0:
                block.drop = ForkedDropout(block.drop.p, rng)  # local positions
        if sp:
            for norm in (block.attn_norm, block.mlp_norm):
                for p in norm.parameters():
                    sum_grad_over_tp(p, group)
            for row in (block.attn.wo, getattr(block.mlp, "w2", None)):
                if row is not None and row.bias is not None:
                    sum_grad_over_tp(row.bias, group)
    if sp:
        model.layers[0].register_forward_pre_hook(_scatter_input(group), with_kwargs=True)
        model.layers[-1].register_forward_hook(_gather_output(group))
        for block in extra:
            _PaddedSequenceSplit(group, topo.tp).attach(block)

    if materialize is not None:
        materialize(model.tok_embeddings)
        materialize(model.lm_head)
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group)
    vocab_start = topo.tp_rank * (model.padded_vocab_size // topo.tp)
    head = VocabParallelOutputHead(
        model.lm_head, group, vocab_start, model.vocab_size, model.cfg.loss_chunk_tokens
    )
    if model.cfg.tie_embeddings:
        head.weight = model.tok_embeddings.weight  # both split by vocabulary rows, alike
    model.lm_head = head
    return model


@torch.no_grad()
def full_state_dict(model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
    """Unsharded, unpadded weights (collective over the TP group, and the EP group for
    experts; every rank gets them).

    Tied output weights appear once, as ``tok_embeddings.weight``.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = gather_tensor_parallel(p, p.detach(), topo)
        t = gather_experts(p, t, topo)
        if name in ("tok_embeddings.weight", "lm_head.weight"):
            t = t[: model.vocab_size]
        out[name] = t.clone()
    return out


def gather_tensor_parallel(p: nn.Parameter, t: torch.Tensor, topo: Topology) -> torch.Tensor:
    """``t`` (``p``'s value on this rank) whole: the TP shards of a tensor-parallel parameter
    all-gathered along its partition dimension (collective over the TP group); else ``t``."""
    if not getattr(p, "tensor_model_parallel", False) or topo.tp == 1:
        return t
    return all_gather_cat(t, topo.groups.tp, p.partition_dim)


def gather_experts(p: nn.Parameter, t: torch.Tensor, topo: Topology) -> torch.Tensor:
    """``t`` (``p``'s value, TP-gathered) with every rank's experts of ``p`` under expert
    parallelism: all-gathered over the EP group along dim 0 (collective there); else ``t``."""
    if getattr(p, "allreduce", True) is not False or topo.ep == 1:
        return t
    return all_gather_cat(t, topo.groups.ep, 0)


@torch.no_grad()
def load_full_weights(model: nn.Module, weights: dict[str, torch.Tensor], source: Any) -> None:
    """Copy unsharded, unpadded weights (the inverse of :func:`full_state_dict`) into a whole,
    not yet parallelised model: vocabulary padding rows stay zero, a tied output layer follows
    the embedding. Call before :func:`parallelize`, which then keeps this rank's shards.

    A name missing or extra, or a shape that differs, raises CheckpointError naming ``source``."""
    from megaformer.errors import CheckpointError

    expected = dict(model.named_parameters())
    if getattr(model.cfg, "tie_embeddings", False):
        expected.pop("lm_head.weight", None)
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{source}: weights do not fit the configured model (missing "
            f"{missing[:3]}, unexpected {extra[:3]})"
        )
    for name, p in expected.items():
        w = weights[name]
        rows = (
            model.vocab_size if name in ("tok_embeddings.weight", "lm_head.weight") else p.shape[0]
        )
        if tuple(w.shape) != (rows, *p.shape[1:]):
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(w.shape)}, the configured "
                f"model needs {(rows, *p.shape[1:])}"
            )
        p[rows:].zero_()
        p[:rows].copy_(w.to(p.dtype))
