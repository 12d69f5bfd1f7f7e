"""How this rank runs the model for evaluation: scores of given next tokens, and greedy decoding.

For a batch of token ids x [B, T] and targets y [B, T] (y_t = the token after x_t), the scores are

    logp[b, t]   = log softmax(logits[b, t])[y[b, t]]       (fp32, over the real vocabulary)
    greedy[b, t] = argmax_v logits[b, t, v] == y[b, t]

Two runners, one interface:

* :class:`PlainRunner`: a model that holds every layer (one process, or this rank's tensor-parallel
  shards: the vocab-parallel head gathers the logits, so every TP rank computes the same scores).
  Greedy decoding reuses the model's KV cache (:func:`megaformer.generation.greedy_tokens`); under
  sequence parallelism (the sequence is split over the TP ranks, so one new token cannot be fed
  alone) each step recomputes the whole sequence instead.
* :class:`PipelineRunner`: this rank's pipeline stages (``deepspeed.pipe.PipelineModule``, whose
  ``forward`` runs the exposed stage's layers), under any schedule: the stages run in order
  (:class:`~megaformer.parallel.stage_walk.StageWalk`), each on the rank that holds it, the
  activations going from the holder of one stage to the next by point-to-point sends over the
  pipeline group (shape first, so any batch shape works; none where one rank holds both). The
  last stage's rank computes the scores and broadcasts them to the other ranks. Greedy decoding
  recomputes the sequence each step (no cache across stages).

Every rank of a tensor- or pipeline-parallel group must call the same methods with the same
inputs in the same order (the calls are collective over those groups).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megaformer.comm import recv_with_shape, send_with_shape
from megaformer.model.decoding import decode
from megaformer.parallel.stage_walk import StageWalk, chunks_of


def token_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [B, T] fp32, greedy [B, T] bool) of ``targets`` under ``logits`` [B, T, V], row by row
    (one [T, V] fp32 log-softmax at a time)."""
    logp = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
    greedy = torch.empty(targets.shape, dtype=torch.bool, device=logits.device)
    for b in range(logits.shape[0]):
        row = torch.log_softmax(logits[b].float(), dim=-1)
        logp[b] = row.gather(-1, targets[b].unsqueeze(-1)).squeeze(-1)
        greedy[b] = row.argmax(dim=-1) == targets[b]
    return logp, greedy


def _pad_to(ids: torch.Tensor, multiple: int) -> torch.Tensor:
    """Right-pad [B, T] with token 0 to a multiple of ``multiple`` positions (causal attention: the
    padding never changes the scores of the real positions before it)."""
    extra = -ids.shape[1] % multiple
    return torch.nn.functional.pad(ids, (0, extra)) if extra else ids


class PlainRunner:
    """A model holding all layers: ``forward(ids)`` -> logits [B, T, V] (the callable that runs it,
    e.g. a DeepSpeed engine), ``model`` the Transformer itself (for the KV cache)."""

    def __init__(
        self,
        model: Any,
        forward: Optional[Callable] = None,
        seq_multiple: int = 1,
        device: Optional[torch.device] = None,
    ) -> None:
        self.model = model
        self.forward = forward or model
        self.seq_multiple = seq_multiple  # TP degree under sequence parallelism, else 1
        self.device = device or next(model.parameters()).device
        self.max_length = model.cfg.max_seq_len

    @torch.no_grad()
    def scores(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = ids.shape[1]
        logits = self.forward(_pad_to(ids.to(self.device), self.seq_multiple))[:, :T]
        return token_scores(logits, targets.to(self.device))

    @torch.no_grad()
    def greedy(
        self,
        prefix: list[int],
        max_new_tokens: int,
        stop: Optional[Callable[[list[int]], bool]] = None,
    ) -> list[int]:
        from megaformer.generation import greedy_tokens

        if self.seq_multiple == 1:
            return greedy_tokens(self.model, prefix, max_new_tokens, stop=stop, device=self.device)
        return _greedy_recompute(
            self._last_logits, prefix, max_new_tokens, stop, self.max_length, self.device
        )

    def _last_logits(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.forward(_pad_to(x, self.seq_multiple))[0, len(ids) - 1]


def _greedy_recompute(
    last_logits: Callable[[list[int]], torch.Tensor],
    prefix: list[int],
    max_new_tokens: int,
    stop: Optional[Callable[[list[int]], bool]],
    max_length: int,
    device: torch.device,
) -> list[int]:
    """Greedy decoding without a cache (:func:`megaformer.model.decoding.decode`): each step runs
    the last ``max_length`` tokens through ``last_logits`` (token ids -> logits [V] of the last)."""
    ids = torch.tensor([list(prefix)], dtype=torch.long, device=device)
    out = decode(
        lambda window, start: last_logits(window[0].tolist()).unsqueeze(0),
        ids,
        max_new_tokens,
        max_length,
        cached=False,
        stop=stop,
    )
    return out[0, ids.shape[1] :].tolist()


class PipelineRunner:
    """This rank's pipeline stages ``pipe`` (a ``PipelineModule`` of one chunk, or one of several
    exposed by ``activate_phase``) of ``plain`` (the Transformer whose ``output_logits`` drops the
    vocabulary padding and gathers a vocab-parallel head), with the pipeline group of ``topo``,
    walked in stage order by ``walk`` (:class:`~megaformer.parallel.stage_walk.StageWalk` of the
    schedule ``pipe`` was built for; default 1F1B)."""

    def __init__(
        self,
        pipe: Any,
        plain: Any,
        topo: Any,
        device: torch.device,
        seq_multiple: int = 1,
        walk: Optional[StageWalk] = None,
    ) -> None:
        self.pipe, self.plain, self.device = pipe, plain, device
        self.seq_multiple = seq_multiple
        self.max_length = plain.cfg.max_seq_len
        self.group = topo.groups.pp
        self.walk = walk or StageWalk.of("1f1b", topo.pp, topo.pp_rank)
        self.walk.check_module(pipe)
        self.last = dist.get_global_rank(self.group, self.walk.last)
        cfg = plain.cfg
        self.with_ids = cfg.document_mask or cfg.mtp_depth > 0  # the ids travel with x

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def _send(self, x: Any, rank: int) -> None:
        for t in x if isinstance(x, tuple) else (x,):  # (hidden, ids) when the ids travel
            send_with_shape(t, self._peer(rank), self.group)

    def _recv(self, rank: int) -> Any:
        dtype = next(self.pipe.parameters()).dtype
        x = recv_with_shape(self._peer(rank), self.group, dtype, self.device)
        if not self.with_ids:
            return x
        return x, recv_with_shape(self._peer(rank), self.group, torch.long, self.device)

    def _run_stages(self, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """The last stage's logits over the real vocabulary (None on the other ranks)."""
        ids = _pad_to(ids.to(self.device), self.seq_multiple)
        with chunks_of(self.pipe) as activate:

            def run(stage: int, chunk: int, x: Any) -> Any:
                activate(chunk)
                return self.pipe(x)

            x = self.walk.walk(run, ids, self._send, self._recv)
        if x is None:
            return None
        if isinstance(x, tuple):  # multi-token prediction: (head output, x_L, ids)
            x = x[0]
        if self.plain.cfg.loss_chunk_tokens > 0:  # the last layer passed the hidden states on
            x = self.plain.lm_head(x)
        return self.plain.output_logits(x)

    @torch.no_grad()
    def scores(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = ids.shape[1]
        logits = self._run_stages(ids)
        if logits is not None:
            logp, greedy = token_scores(logits[:, :T], targets.to(self.device))
            packed = torch.stack((logp, greedy.float()))
        else:
            packed = torch.empty((2, *targets.shape), dtype=torch.float32, device=self.device)
        dist.broadcast(packed, self.last, group=self.group)
        return packed[0], packed[1].bool()

    @torch.no_grad()
    def greedy(
        self,
        prefix: list[int],
        max_new_tokens: int,
        stop: Optional[Callable[[list[int]], bool]] = None,
    ) -> list[int]:
        return _greedy_recompute(
            self._last_logits, prefix, max_new_tokens, stop, self.max_length, self.device
        )

    def _last_logits(self, ids: list[int]) -> torch.Tensor:
        """One-hot of the greedy next token (only its argmax is used), the same on every stage."""
        logits = self._run_stages(torch.tensor([ids], dtype=torch.long))
        token = torch.zeros(1, dtype=torch.long, device=self.device)
        if logits is not None:
            token[0] = logits[0, len(ids) - 1].argmax()
        dist.broadcast(token, self.last, group=self.group)
        return torch.nn.functional.one_hot(token[0], num_classes=self.plain.vocab_size)
