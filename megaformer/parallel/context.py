"""Context parallelism: every sequence split over the CP group, attention exact over all of it.

Only attention mixes positions, so every other layer runs on this rank's tokens unchanged; the
attention core sees the whole sequence in one of two ways (``parallel.context_mode``).

Layout of a sequence of T tokens over N context ranks (the data loader hands each rank its part):

    ring:        2N chunks of C = T / 2N tokens; rank r holds chunks r and 2N-1-r
    all_to_all:  N contiguous parts; rank r holds tokens [r T/N, (r+1) T/N)

**Ring attention** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the key/value
blocks travel around the group (N-1 point-to-point passes per forward); each rank attends its
queries to every block it receives and merges the partial results by their log-sum-exp:

    S_j = Q K_j^T * scale + M_j,  l_j = logsumexp_rows(S_j),  O_j = exp(S_j - l_j) V_j
    l'  = log(e^l + e^{l_j}),     O' = e^{l - l'} O + e^{l_j - l'} O_j

so after N blocks O = softmax(Q K^T * scale + M) V and l = logsumexp of the whole row, exactly.
Each block pair is one call of a fused attention kernel that returns l_j
(:mod:`megaformer.kernels.attention_block`: aten's FlashAttention kernels on CPU and CUDA, the
memory-efficient one on CUDA where a pair needs an explicit mask), in the training dtype; only the
merge above is fp32. M_j is built from the *global* positions (and document ids) of the query and
key tokens: a pair wholly below the diagonal needs none, a pair on the diagonal is the kernel's
causal mask, a pair cut by the sliding window or holding document boundaries an explicit mask. The
backward pass is the ring's own: the kernel's backward op, given the *final* O and l of the rows
(FlashAttention-2's backward needs nothing else), returns each pair's exact share

    dV_j = P_j^T dO,   dS_j = P_j o (dO V_j^T - D),   dQ += dS_j K_j scale,   dK_j = dS_j^T Q scale,

with P_j = exp(S_j - l), D = rowsum(dO o O); the blocks travel around the ring again, each carrying
its fp32 dK_j, dV_j accumulators home (N-1 passes of K, V, dK, dV and a last one of dK, dV). Under a
causal mask a contiguous split would leave rank 0 one block of work and rank N-1 N blocks; with
chunks r and 2N-1-r every rank runs 2N+1 chunk pairs (chunk pairs wholly above the diagonal are
skipped). v's head dimension may differ from q's and k's (one block [k | v] travels).

**All-to-all** (DeepSpeed-Ulysses, Jacobs et al. 2023): q, k, v go from sequence-sharded
[B, h, T/N, d] to head-sharded [B, h/N, T, d] with one all-to-all each, the usual attention core
(any backend, document masks included) runs on whole sequences of h/N heads, and one all-to-all
brings the output back. Key/value heads fewer than (or not a multiple of) N are repeated first
(grouped-query attention: every rank gets the key/value heads its query heads read).

Applied around the model (:func:`apply_context`): every attention core ``Attention.core`` becomes a
:class:`ContextParallelAttention` around the core it had, a forward pre-hook hands the model this
rank's global ``positions`` and the documents of the whole sequences, and the train step weights
the loss (:func:`loss_weighting`; the pipeline's loss function: :func:`weighted_loss_fn`).

Communication per layer per step, per rank (b bytes per element, h_kv key/value heads, local
sequence T/N): ring forward (N-1) * 2 B h_kv (T/N) d b, backward twice that plus one more pass of
dK, dV; all-to-all: each of q, k, v, o (and their gradients) sends (N-1)/N of its local tensor.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megaformer import comm
from megaformer.kernels.attention import DocumentMask, document_ids, document_mask
from megaformer.kernels.attention_block import block_backward, block_forward
from megaformer.model.mtp import ShiftedTokens, shifted_sequences

MODES = ("ring", "all_to_all")


# ----------------------------------------------------------------------------- layout


def chunk_starts(rank: int, size: int, mode: str, t_local: int) -> list[tuple[int, int]]:
    """(global start position, length) of each contiguous piece of the sequence this rank holds
    (``t_local`` tokens in all), in local order."""
    if mode == "ring":
        c = t_local // 2
        return [(rank * c, c), ((2 * size - 1 - rank) * c, c)]
    return [(rank * t_local, t_local)]


def local_positions(
    rank: int, size: int, mode: str, t_local: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions of this rank's ``t_local`` tokens, in local order (int64 [t_local])."""
    return torch.cat(
        [torch.arange(s, s + n, device=device) for s, n in chunk_starts(rank, size, mode, t_local)]
    )


def split_sequence(t: torch.Tensor, rank: int, size: int, mode: str, dim: int = 1) -> torch.Tensor:
    """This rank's part of a whole sequence ``t`` (length divisible by 2N for ring, N else)."""
    if size == 1:
        return t
    T = t.shape[dim]
    parts = 2 * size if mode == "ring" else size
    if T % parts:
        raise ValueError(f"sequence of {T} tokens cannot be split into {parts} equal chunks")
    idx = local_positions(rank, size, mode, T // size, t.device)
    return t.index_select(dim, idx).contiguous()


#: chunk-pair products of the ring's forward pass, per process (a benchmark/test reads and resets it)
RING_WORK: Counter = Counter()

#: every ContextParallel of this process, by its ``key``
_GROUPS: list = []


@dataclass
class ContextParallel:
    """This rank's place in its context-parallel group and how attention spans the group.

    ``active`` is False inside :meth:`disabled`: the model then runs on whole sequences on every
    rank (diagnostics, which are exact that way)."""

    group: Any
    size: int
    rank: int
    mode: str
    ranks: list[int] = field(default_factory=list)
    active: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"context mode {self.mode!r}: choose from {MODES}")
        if not self.ranks:
            self.ranks = (
                dist.get_process_group_ranks(self.group)
                if self.group is not None
                else list(range(self.size))
            )
        # the operators below take the group by this number (a graph holds no Python object)
        self.key = len(_GROUPS)
        _GROUPS.append(self)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        saved, self.active = self.active, False
        try:
            yield
        finally:
            self.active = saved

    # ------------------------------------------------------------ sequences

    def positions(self, t_local: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's ``t_local`` tokens."""
        return local_positions(self.rank, self.size, self.mode, t_local, device)

    def split(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return split_sequence(t, self.rank, self.size, self.mode, dim)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The whole sequences [B, T] from every rank's part [B, T/N] (no gradient)."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        B, tl = t.shape[:2]
        full = t.new_empty((B, tl * self.size, *t.shape[2:]))
        for r, part in enumerate(parts):
            full[:, local_positions(r, self.size, self.mode, tl, t.device)] = part
        return full

    def documents(
        self,
        input_ids: torch.Tensor,
        eod_id: int,
        *,
        backend: str,
        head_dim: int,
        dtype: torch.dtype,
        window: Optional[int],
    ) -> DocumentMask:
        """The document boundaries of the whole sequences (ids gathered over the group): the
        ring reads the document ids; all-to-all the mask of its attention backend."""
        full = self.gather(input_ids)
        if self.mode == "ring":
            return DocumentMask(document_ids(full, eod_id))
        return document_mask(
            full, eod_id, backend=backend, head_dim=head_dim, dtype=dtype, window=window
        )

    def scale_loss(
        self, loss: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """loss (the mean over this rank's n_r counted labels) * N n_r / sum_r n_r: the gradients
        averaged over the group (DeepSpeed averages over data x context ranks) are those of the
        mean over the whole sequences, and so is the loss averaged over the group."""
        n_local = (labels != ignore_index).sum().to(torch.float32)
        n = n_local.detach().clone()
        dist.all_reduce(n, group=self.group)
        return loss * (n_local * self.size / n).to(loss.dtype)

    def shifted_tokens(
        self, input_ids: torch.Tensor, labels: torch.Tensor, depth: int, ignore_index: int = -100
    ) -> ShiftedTokens:
        """The multi-token prediction inputs of this rank's parts ``input_ids``, ``labels``
        [B, T/N]: the whole sequences (gathered) shifted by k = 1..depth, then split. With n_k
        the counted labels of depth k (n_0: the main loss's), here and over the group, the scale
        of depth k is N n_k,r / n_k and its weight that over the main loss's scale
        (:meth:`scale_loss`, which the train step applies to the whole loss)."""
        full_ids, full_labels = self.gather(input_ids), self.gather(labels)
        parts = [
            (self.split(i), self.split(lab))
            for i, lab in shifted_sequences(full_ids, full_labels, depth)
        ]
        local = torch.stack(
            [(lab != ignore_index).sum() for lab in [labels, *(lab for _, lab in parts)]]
        ).to(torch.float64)
        total = local.clone()
        dist.all_reduce(total, group=self.group)
        scales = local * self.size / total.clamp_min(1)
        weights = scales[1:] / scales[0].clamp_min(1e-30)
        return ShiftedTokens(
            ids=[i for i, _ in parts],
            labels=[lab for _, lab in parts],
            scales=[s.float() for s in scales[1:]],
            weights=[w.float() for w in weights],
        )

    # ------------------------------------------------------------ attention

    def attention(
        self,
        core: Callable[..., torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        dropout_p: float,
        backend: str,
        doc_ids: Optional[DocumentMask],
        window: Optional[int],
    ) -> torch.Tensor:
        """softmax(Q K^T / sqrt(d) + M) V over the whole sequence for this rank's queries:
        q [B, h, T/N, d], k [B, h_kv, T/N, d], v [B, h_kv, T/N, d_v] -> [B, h, T/N, d_v] (the
        ring takes d_v != d; all-to-all as its inner core does)."""
        if self.mode == "ring":
            if dropout_p > 0:
                raise ValueError("ring attention has no attention dropout")
            docs = doc_ids.doc_ids if doc_ids is not None else None
            return ring_attention(q, k, v, self, causal=causal, doc_ids=docs, window=window)
        return ulysses_attention(
            core,
            q,
            k,
            v,
            self,
            causal=causal,
            dropout_p=dropout_p,
            backend=backend,
            doc_ids=doc_ids,
            window=window,
        )


class ContextParallelAttention(nn.Module):
    """The attention core over the whole sequence of the context group (``Attention.core`` under
    context parallelism): ring attention (its own blockwise kernel), or all-to-all around
    ``inner`` (the core it replaced, which also runs alone while the group is disabled)."""

    def __init__(self, cp: ContextParallel, inner: nn.Module) -> None:
        super().__init__()
        self.cp = cp
        self.inner = inner

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        dropout_p: float = 0.0,
        backend: str = "auto",
        doc_ids: Optional[DocumentMask] = None,
        window: Optional[int] = None,
    ) -> torch.Tensor:
        if not self.cp.active:
            return self.inner(
                q,
                k,
                v,
                causal=causal,
                dropout_p=dropout_p,
                backend=backend,
                doc_ids=doc_ids,
                window=window,
            )
        return self.cp.attention(
            self.inner,
            q,
            k,
            v,
            causal=causal,
            dropout_p=dropout_p,
            backend=backend,
            doc_ids=doc_ids,
            window=window,
        )

    def extra_repr(self) -> str:
        how = (
            "ring attention; inner only while disabled"
            if self.cp.mode == "ring"
            else "inner between all-to-alls"
        )
        return f"mode={self.cp.mode}, size={self.cp.size}, rank={self.cp.rank} ({how})"


def _groups(model: nn.Module) -> list[ContextParallel]:
    """The context-parallel groups of ``model``'s attention cores."""
    found = {id(m.cp): m.cp for m in model.modules() if isinstance(m, ContextParallelAttention)}
    return list(found.values())


def context_disabled(model: nn.Module) -> contextlib.AbstractContextManager:
    """Run ``model`` on whole sequences on every rank for the duration (a no-op without CP)."""
    stack = contextlib.ExitStack()
    for cp in _groups(model):
        stack.enter_context(cp.disabled())
    return stack


def _inputs_hook(cp: ContextParallel, documents: bool) -> Callable:
    """A forward pre-hook handing a module taking token ids or activations [B, T_local, ...]
    first the ``positions`` of this rank's tokens (and, with ``documents``, the model's
    ``doc_ids`` of the whole sequences), unless the caller passed them or the group is disabled."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        if not cp.active or kwargs.get("positions") is not None:
            return None
        first = args[0] if args else kwargs["input_ids"]
        kwargs = dict(kwargs, positions=cp.positions(first.shape[1], first.device))
        if documents and module.cfg.document_mask and kwargs.get("doc_ids") is None:
            kwargs["doc_ids"] = module.document_mask(first, build=cp.documents)
        labels = args[1] if len(args) > 1 else kwargs.get("labels")
        depth = len(getattr(module, "mtp", ()))
        if documents and depth and module.training and labels is not None:
            kwargs["mtp_shifted"] = cp.shifted_tokens(first, labels.to(first.device), depth)
        return args, kwargs

    return hook


def attach_inputs(cp: ContextParallel, module: nn.Module) -> None:
    """Make ``module`` (a pipeline stage: the embedding, a block's attention) read this rank's
    global positions (its forward takes ``positions``)."""
    module.register_forward_pre_hook(_inputs_hook(cp, False), with_kwargs=True)


def apply_context(model: nn.Module, topo: Any, mode: str) -> Optional[ContextParallel]:
    """Split ``model``'s sequences over the context-parallel group: every attention core becomes
    a :class:`ContextParallelAttention` around the core it had (the multi-token prediction
    modules' too), and the model's forward gets this rank's global ``positions``, the documents
    of the whole sequences and the multi-token prediction inputs (a pre-hook). The loss
    is weighted by the train step (:func:`loss_weighting`)."""
    if topo.cp == 1:
        return None
    cp = ContextParallel(topo.groups.cp, topo.cp, topo.cp_rank, mode)
    for block in [*model.layers, *(m.block for m in getattr(model, "mtp", ()))]:
        block.attn.core = ContextParallelAttention(cp, block.attn.core)
    model.register_forward_pre_hook(_inputs_hook(cp, True), with_kwargs=True)
    return cp


def _unweighted(loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return loss


def loss_weighting(
    cp: Optional[ContextParallel],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``weigh(loss, labels)``: the train step's loss of this rank as the group needs it
    (:meth:`ContextParallel.scale_loss`; the loss unchanged without context parallelism)."""
    if cp is None:
        return _unweighted

    def weigh(loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cp.scale_loss(loss, labels.to(loss.device))

    return weigh


def weighted_loss_fn(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], cp: Optional[ContextParallel]
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn(logits, labels)`` followed by the context-parallel weighting (pipeline loss)."""
    if cp is None:
        return loss_fn
    weigh = loss_weighting(cp)

    def fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return weigh(loss_fn(logits, labels), labels)

    return fn


# ----------------------------------------------------------------------------- ring attention


def _pair_mask(
    qpos: torch.Tensor,
    kpos: torch.Tensor,
    causal: bool,
    window: Optional[int],
    qdoc: Optional[torch.Tensor],
    kdoc: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """Boolean [B|1, 1, Tq, Tk], True where a query may see a key; None: it sees all."""
    diff = qpos[:, None] - kpos[None, :]
    mask = None
    if causal:
        mask = diff >= 0
        if window is not None:
            mask = mask & (diff < window)
    if qdoc is not None:
        same = qdoc[:, :, None] == kdoc[:, None, :]
        return (same if mask is None else same & mask).unsqueeze(1)
    return None if mask is None else mask[None, None]


def _visible(q0: int, qn: int, k0: int, kn: int, causal: bool, window: Optional[int]) -> bool:
    """Whether any query of [q0, q0+qn) may see a key of [k0, k0+kn) (else the pair is skipped)."""
    if not causal:
        return True
    if q0 + qn - 1 < k0:
        return False
    return window is None or q0 - (k0 + kn - 1) < window


def _pairs(cp: ContextParallel, src: int, tl: int, causal: bool, window: Optional[int]):
    """The (query slice, key slice, query start, key start) chunk pairs to compute between this
    rank's queries and the keys/values of rank ``src`` (pairs nobody sees skipped)."""
    mine = chunk_starts(cp.rank, cp.size, cp.mode, tl)
    theirs = chunk_starts(src, cp.size, cp.mode, tl)
    qoff = koff = 0
    out = []
    for q0, qn in mine:
        koff = 0
        for k0, kn in theirs:
            if _visible(q0, qn, k0, kn, causal, window):
                out.append((slice(qoff, qoff + qn), slice(koff, koff + kn), q0, k0))
            koff += kn
        qoff += qn
    return out


@dataclass
class _Block:
    """One chunk pair as the kernel takes it: the query and key slices, and the mask -- none
    (every query sees every key), ``causal`` (a chunk on the diagonal) or an explicit one."""

    qs: slice
    ks: slice
    causal: bool
    mask: Optional[torch.Tensor]


def _pair_kind(
    q0: int, qn: int, k0: int, kn: int, causal: bool, window: Optional[int], documents: bool
) -> str:
    """How the kernel masks a visible chunk pair: ``full`` (wholly below the diagonal and inside
    the window: no mask), ``causal`` (on the diagonal: the kernel's own causal mask) or
    ``masked`` (cut by the window, or holding document boundaries: an explicit mask)."""
    in_window = window is None or q0 + qn - 1 - k0 < window
    if not documents and (not causal or (q0 >= k0 + kn - 1 and in_window)):
        return "full"
    if not documents and q0 == k0 and qn == kn and in_window:
        return "causal"
    return "masked"


#: the kernel work of a chunk pair in C x C score blocks: the causal kernel skips the upper half
PAIR_WORK = {"full": 1.0, "causal": 0.5, "masked": 1.0}


def ring_step_work(
    rank: int, size: int, t_local: int, window: Optional[int] = None, documents: bool = False
) -> list[float]:
    """The kernel work of each of ``rank``'s ring steps (causal attention), in C x C score blocks
    (C = t_local / 2): the chunk pairs it runs against the block of each step, weighted by
    :data:`PAIR_WORK`. Without a window every step of every rank is 2 (balanced)."""
    mine = chunk_starts(rank, size, "ring", t_local)
    out = []
    for step in range(size):
        theirs = chunk_starts((rank - step) % size, size, "ring", t_local)
        out.append(
            sum(
                PAIR_WORK[_pair_kind(q0, qn, k0, kn, True, window, documents)]
                for q0, qn in mine
                for k0, kn in theirs
                if _visible(q0, qn, k0, kn, True, window)
            )
        )
    return out


def _blocks(
    cp: ContextParallel,
    src: int,
    tl: int,
    causal: bool,
    window: Optional[int],
    doc_ids: Optional[torch.Tensor],
    device: torch.device,
    count: bool = False,
) -> list[_Block]:
    """The chunk pairs of :func:`_pairs` with their masks (:func:`_pair_kind`); ``count``: add
    them to :data:`RING_WORK`."""
    out = []
    for qs, ks, q0, k0 in _pairs(cp, src, tl, causal, window):
        RING_WORK["pairs"] += count
        qn, kn = qs.stop - qs.start, ks.stop - ks.start
        kind = _pair_kind(q0, qn, k0, kn, causal, window, doc_ids is not None)
        if kind != "masked":
            out.append(_Block(qs, ks, kind == "causal", None))
            continue
        qpos = torch.arange(q0, q0 + qn, device=device)
        kpos = torch.arange(k0, k0 + kn, device=device)
        qdoc = doc_ids[:, q0 : q0 + qn] if doc_ids is not None else None
        kdoc = doc_ids[:, k0 : k0 + kn] if doc_ids is not None else None
        out.append(_Block(qs, ks, False, _pair_mask(qpos, kpos, causal, window, qdoc, kdoc)))
    return out


class _RingPass(comm.RingPass):
    """One asynchronous pass: send ``t`` to the next rank of the ring, receive the previous one's."""

    def __init__(self, t: torch.Tensor, cp: ContextParallel, kind: str) -> None:
        super().__init__(t, cp.group, cp.ranks, cp.rank, kind)


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallel,
    causal: bool,
    doc_ids: Optional[torch.Tensor],
    window: Optional[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O in q's dtype, lse fp32) of this rank's queries over the whole sequence (module docstring)."""
    B, H, tl, _ = q.shape
    dk = k.shape[-1]
    o = torch.zeros(B, H, tl, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, tl), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.cat((k, v), dim=-1)  # one block travels; v's head dim may differ from k's
    src = cp.rank
    for step in range(cp.size):
        pending = _RingPass(kv, cp, "cp_ring_kv") if step < cp.size - 1 else None
        for b in _blocks(cp, src, tl, causal, window, doc_ids, q.device, True):
            o_b, l_b = block_forward(
                q[:, :, b.qs],
                kv[:, :, b.ks, :dk],
                kv[:, :, b.ks, dk:],
                causal=b.causal,
                mask=b.mask,
                scale=scale,
            )
            l_old = lse[:, :, b.qs]
            l_new = torch.logaddexp(l_old, l_b)
            safe = torch.where(torch.isinf(l_new), 0.0, l_new)
            o[:, :, b.qs] = o[:, :, b.qs] * torch.exp(l_old - safe).unsqueeze(-1) + o_b * (
                torch.exp(l_b - safe).unsqueeze(-1)
            )
            lse[:, :, b.qs] = l_new
        if pending is not None:
            kv = pending.wait()
        src = (src - 1) % cp.size
    return o.to(q.dtype), lse


def _ring_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cp: ContextParallel,
    causal: bool,
    doc_ids: Optional[torch.Tensor],
    window: Optional[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV): each chunk pair's share from the kernel's backward op given the final O and
    lse; the fp32 dK/dV accumulators travel with their block and are home after N passes."""
    tl, dk = q.shape[2], k.shape[-1]
    do = do.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.cat((k, v), dim=-1)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)
    src = cp.rank
    for step in range(cp.size):
        pending = _RingPass(kv, cp, "cp_ring_kv") if step < cp.size - 1 else None
        for b in _blocks(cp, src, tl, causal, window, doc_ids, q.device):
            dq_b, dk_b, dv_b = block_backward(
                do[:, :, b.qs],
                q[:, :, b.qs],
                kv[:, :, b.ks, :dk],
                kv[:, :, b.ks, dk:],
                o[:, :, b.qs],
                lse[:, :, b.qs],
                causal=b.causal,
                mask=b.mask,
                scale=scale,
            )
            dq[:, :, b.qs] += dq_b
            dkv[:, :, b.ks, :dk] += dk_b
            dkv[:, :, b.ks, dk:] += dv_b
        dkv = _RingPass(dkv, cp, "cp_ring_dkv").wait()
        if pending is not None:
            kv = pending.wait()
        src = (src - 1) % cp.size
    return (
        dq.to(q.dtype),
        torch.empty_like(k).copy_(dkv[..., :dk]),
        torch.empty_like(v).copy_(dkv[..., dk:]),
    )


# The ring as operators (torch.library): under torch.compile a block traces through them in one
# graph (their communication is opaque to the compiler), and autograd uses the ring's backward.


@torch.library.custom_op("megaformer::ring_attention", mutates_args=())
def _ring_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[torch.Tensor],
    group: int,
    causal: bool,
    window: Optional[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_forward(q, k, v, _GROUPS[group], causal, doc_ids, window, scale)


@_ring_op.register_fake
def _(q, k, v, doc_ids, group, causal, window, scale):
    B, H, T, _ = q.shape
    return q.new_empty(B, H, T, v.shape[-1]), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("megaformer::ring_attention_backward", mutates_args=())
def _ring_backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    doc_ids: Optional[torch.Tensor],
    group: int,
    causal: bool,
    window: Optional[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ring_backward(do, q, k, v, o, lse, _GROUPS[group], causal, doc_ids, window, scale)


@_ring_backward_op.register_fake
def _(do, q, k, v, o, lse, doc_ids, group, causal, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _ring_setup(ctx, inputs, output) -> None:
    q, k, v, doc_ids, group, causal, window, scale = inputs
    docs = () if doc_ids is None else (doc_ids,)
    ctx.save_for_backward(q, k, v, *output, *docs)
    ctx.args = (group, causal, window, scale)


def _ring_grad(ctx, do: torch.Tensor, _dlse: Optional[torch.Tensor]):
    q, k, v, o, lse, *docs = ctx.saved_tensors
    doc_ids = docs[0] if docs else None
    dq, dk, dv = _ring_backward_op(do, q, k, v, o, lse, doc_ids, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


_ring_op.register_autograd(_ring_grad, setup_context=_ring_setup)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallel,
    *,
    causal: bool = True,
    doc_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """softmax(Q K^T * scale + M) V over the whole sequence, q [B, H, T/N, d] and k, v
    [B, Hkv, T/N, d] this rank's tokens in the ring layout; ``doc_ids`` [B, T]: the document id
    of every position of the *whole* sequences (None: no document mask)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"ring attention: {q.shape[1]} query heads not a multiple of {k.shape[1]} "
            "key/value heads"
        )
    T = q.shape[2] * cp.size
    if window is not None and window >= T:
        window = None
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _ring_op(q, k, v, doc_ids, cp.key, causal, window, scale)[0]


# ----------------------------------------------------------------------------- all-to-all


@torch.library.custom_op("megaformer::cp_all_to_all", mutates_args=())
def _all_to_all_op(x: torch.Tensor, group: int) -> torch.Tensor:
    """all_to_all_single over dim 0 (N equal blocks): block j goes to rank j."""
    return comm.all_to_all(x, None, None, _GROUPS[group].group, kind="cp_all_to_all")


@_all_to_all_op.register_fake
def _(x, group):
    return torch.empty_like(x)


def _all_to_all_setup(ctx, inputs, output) -> None:
    ctx.group = inputs[1]


def _all_to_all_grad(ctx, g: torch.Tensor):
    return _all_to_all_op(g.contiguous(), ctx.group), None  # the exchange is its own transpose


_all_to_all_op.register_autograd(_all_to_all_grad, setup_context=_all_to_all_setup)


def _seq_to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[B, H, T/N, d] (this rank's positions, all heads) -> [B, H/N, T, d] (all positions)."""
    B, H, tl, D = x.shape
    n = cp.size
    blocks = x.reshape(B, n, H // n, tl, D).transpose(0, 1).contiguous()  # [N, B, H/N, T/N, d]
    got = _all_to_all_op(blocks, cp.key)  # got[j]: rank j's positions of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * tl, D)


def _heads_to_seq(y: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[B, H/N, T, d] -> [B, H, T/N, d]: the inverse of :func:`_seq_to_heads`."""
    B, hl, T, D = y.shape
    n = cp.size
    blocks = (
        y.reshape(B, hl, n, T // n, D).permute(2, 0, 1, 3, 4).contiguous()
    )  # [N, B, H/N, T/N, d]
    got = _all_to_all_op(blocks, cp.key)  # got[j]: this rank's positions of rank j's heads
    return got.transpose(0, 1).reshape(B, n * hl, T // n, D)


def ulysses_attention(
    core: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallel,
    *,
    causal: bool,
    dropout_p: float,
    backend: str,
    doc_ids: Optional[DocumentMask],
    window: Optional[int],
) -> torch.Tensor:
    """``core`` (the attention core) on whole sequences of H/N heads, between two all-to-alls.

    Key/value heads are repeated to a multiple of N first when there are fewer (or not a
    multiple): query head i still reads key/value head i // (H / Hkv)."""
    n, hkv = cp.size, k.shape[1]
    if q.shape[1] % n:
        raise ValueError(
            f"all-to-all context parallelism: {q.shape[1]} local heads not divisible "
            f"by the context degree {n}"
        )
    if hkv % n:
        reps = (hkv * n // math.gcd(hkv, n)) // hkv
        k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    qh, kh, vh = (_seq_to_heads(t, cp) for t in (q, k, v))
    y = core(
        qh,
        kh,
        vh,
        causal=causal,
        dropout_p=dropout_p,
        backend=backend,
        doc_ids=doc_ids,
        window=window,
    )
    return _heads_to_seq(y, cp)
