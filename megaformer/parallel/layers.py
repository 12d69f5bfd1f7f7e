"""Tensor-parallel layers (Megatron-LM's math, plain tensors so DeepSpeed ZeRO can partition them).

Weights are stored as in ``nn.Linear`` ([out, in]); a sharded parameter carries
``tensor_model_parallel = True`` and ``partition_dim`` (the dimension split across the TP group), which
DeepSpeed reads to count each shard once in the global gradient norm.

* Column parallel:  Y = X A + b,  A = [A_1, ..., A_p] split by output columns; rank i computes
  Y_i = f(X) A_i + b_i. f is the identity forward / all-reduce backward (with sequence parallelism:
  all-gather of the sequence forward / reduce-scatter backward).
* Row parallel:     Y = X A + b,  A = [A_1; ...; A_p] split by input rows, X = [X_1, ..., X_p] already
  split; Y = g(sum_i X_i A_i) + b, g the all-reduce forward / identity backward (with sequence
  parallelism: reduce-scatter of the sequence forward / all-gather backward).
* Vocab-parallel embedding: rank i holds rows [i V/p, (i+1) V/p); tokens outside its range look up
  zeros, and the partial embeddings are summed with g.
* Vocab-parallel cross-entropy: the loss -log softmax(z)_y computed from vocab-sharded logits with
  three all-reduces of [batch, seq] tensors (max, sum of exponentials, target logit), never the
  full logits.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megaformer.comm import (
    ProcessGroup,
    all_reduce,
    copy_to_tp,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_to_seq,
)
from megaformer.kernels.gemm import linear


def mark_sharded(param: nn.Parameter, dim: int) -> nn.Parameter:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    return param


def shard(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous 1/world slice of ``full`` along ``dim`` (a copy)."""
    size = full.shape[dim]
    if size % world:
        raise ValueError(f"dimension {dim} of size {size} does not split over {world} ranks")
    return full.narrow(dim, rank * (size // world), size // world).clone()


def _rank(group: ProcessGroup) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class ColumnParallelLinear(nn.Module):
    """Y_i = f(X) A_i + b_i: the output features are split across the TP group.

    ``input_comm=False`` leaves f to the caller: projections that share one input (q, k, v; the
    SwiGLU gate and up) apply it once to that input instead of once per projection.
    """

    def __init__(
        self, full: nn.Linear, group: ProcessGroup, sequence_parallel: bool, input_comm: bool = True
    ) -> None:
        super().__init__()
        rank, world = _rank(group)
        self.group, self.sequence_parallel, self.input_comm = group, sequence_parallel, input_comm
        self.weight = mark_sharded(nn.Parameter(shard(full.weight.data, 0, rank, world)), 0)
        self.bias = (
            mark_sharded(nn.Parameter(shard(full.bias.data, 0, rank, world)), 0)
            if full.bias is not None
            else None
        )

    fp8: Optional[Callable[..., torch.Tensor]] = None  # FP8 GEMMs (megaformer.parallel.fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_comm:
            x = tp_region_input(x, self.group, self.sequence_parallel)
        return (self.fp8 or linear)(x, self.weight, self.bias)


def tp_region_input(x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """Enter a column-parallel region: f (copy / all-reduce grads) or, with SP, gather the sequence."""
    return gather_seq(x, group) if sequence_parallel else copy_to_tp(x, group)


class RowParallelLinear(nn.Module):
    """Y = g(sum_i X_i A_i) + b: the input features are split; the bias is replicated."""

    def __init__(self, full: nn.Linear, group: ProcessGroup, sequence_parallel: bool) -> None:
        super().__init__()
        rank, world = _rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = mark_sharded(nn.Parameter(shard(full.weight.data, 1, rank, world)), 1)
        self.bias = nn.Parameter(full.bias.data.clone()) if full.bias is not None else None

    fp8: Optional[Callable[..., torch.Tensor]] = None  # FP8 GEMMs (megaformer.parallel.fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (self.fp8 or linear)(x, self.weight, None)
        y = (
            reduce_scatter_to_seq(y, self.group)
            if self.sequence_parallel
            else reduce_from_tp(y, self.group)
        )
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """E[ids] with the rows of E split across the TP group; partial lookups summed by g."""

    def __init__(self, full: nn.Embedding, group: ProcessGroup) -> None:
        super().__init__()
        rank, world = _rank(group)
        self.group = group
        vocab = full.weight.shape[0]
        self.per_rank = vocab // world
        self.start = rank * self.per_rank
        self.weight = mark_sharded(nn.Parameter(shard(full.weight.data, 0, rank, world)), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss_t = log sum_v exp(z_tv) - z_t,y_t over vocab shards (Megatron's formulation)."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):  # type: ignore[override]
        z = logits.float()
        z_max = all_reduce(z.max(dim=-1).values, group, op=dist.ReduceOp.MAX)
        z = z - z_max.unsqueeze(-1)
        local = labels - vocab_start
        outside = (local < 0) | (local >= z.shape[-1])
        local = local.masked_fill(outside, 0)
        target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target = all_reduce(target, group)
        exp = z.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        loss = sum_exp.log() - target
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        hit = (~outside).to(g.dtype)
        g.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    group: ProcessGroup,
    ignore_index: int = -100,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Mean cross-entropy over labels != ignore_index from this rank's logits [B, T, V/p].

    Columns at global ids >= ``vocab_size`` (vocabulary padding) are excluded from the softmax.
    """
    if vocab_size is not None and vocab_start + logits.shape[-1] > vocab_size:  # padding here
        ids = torch.arange(vocab_start, vocab_start + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    keep = labels != ignore_index
    safe = labels.masked_fill(~keep, 0)
    per_token = _VocabParallelCrossEntropy.apply(logits, safe, vocab_start, group)
    per_token = per_token * keep
    return per_token.sum() / keep.sum().clamp(min=1)


def gather_vocab(logits: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Full logits [.., V] from vocab shards (for evaluation without labels and for tests)."""
    rank, world = _rank(group)
    if world == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _SumGradOverTP:
    """Tensor hook: a replicated parameter used on sequence-sharded activations gets the sum of
    every TP rank's partial gradient (what one process would compute over the whole sequence)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return all_reduce(grad.clone(), self.group)


def sum_grad_over_tp(param: nn.Parameter, group: ProcessGroup) -> None:
    param.sequence_parallel = True
    param.register_hook(_SumGradOverTP(group))
