"""The decoder-only Transformer language model.

    x_0     = E_tok[ids] (+ PE[pos])                     token embedding, absolute positions if any
    x_l     = Block_l(x_{l-1}),  l = 1..L                pre-norm blocks on the residual stream
    logits  = Norm(x_L) W_out                            W_out = E_tok^T when embeddings are tied
    loss    = mean over positions with label != -100 of -log softmax(logits)[label]
              (+ in training, the MoE blocks' router losses: megaformer.model.moe, and with
              ``model.mtp_depth`` the multi-token prediction loss: megaformer.model.mtp)

The embedding and output tables may hold more rows than the vocabulary (``padded_vocab_size``, so
that tensor parallelism splits them evenly); padding rows start at zero and are sliced off the
logits before any softmax, so they never reach the loss, generation or exported weights.
The output head ``lm_head`` (:class:`OutputHead`) computes the logits, drops the padding columns
and computes the loss; a tensor-parallel plan swaps it for a vocab-parallel head, as it swaps the
linears, without this file knowing the degree. With ``model.loss_chunk_tokens`` > 0 the loss is
the output projection fused with the cross-entropy over chunks of tokens (the full logits never
exist). With ``model.document_mask`` the training forward computes the documents' boundaries once
(``eod_id`` set by the trainer from the tokenizer) so packed documents do not attend to each other.
The forward takes the tokens' ``positions`` and the batch's document mask ``doc_ids`` as inputs
(defaults: 0..T-1, and the mask of ``input_ids`` under ``model.document_mask``): context
parallelism (:mod:`megaformer.parallel.context`) hands in this rank's part of each sequence with
its global positions and the documents of the whole sequences, and weights the loss in the train
step; the model itself names no parallelism.

Initialisation: every Linear/Embedding weight ~ N(0, init_std), biases 0, norm gains 1; the
residual-output projections (attn.wo, mlp.w2; every expert's w2) ~ N(0, init_std / sqrt(2 L))
(GPT-2 / Megatron); the aux-loss-free expert biases start at 0. Each weight has its own random
stream, seeded by the seed the model was built under and the parameter's name, so any rank can
draw any one parameter alone (:meth:`Transformer.init_parameter`): a tensor- or pipeline-parallel
build initialises one whole parameter at a time and keeps its shard, never the whole model.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from megaformer.config import ModelConfig
from megaformer.kernels.attention import DocumentMask, document_mask
from megaformer.kernels.cross_entropy import chunked_cross_entropy, cross_entropy
from megaformer.kernels.dropout import Dropout
from megaformer.model.attention import KVCache
from megaformer.model.block import Block
from megaformer.model.decoding import decode, kv_cached
from megaformer.model.linear import Linear
from megaformer.model.mla import LatentKVCache
from megaformer.model.moe import MoE, take_router_losses
from megaformer.model.mtp import MTPMetrics, MTPModule, ShiftedTokens, mtp_losses
from megaformer.model.norms import RMSNorm, build_norm
from megaformer.model.positions import RotaryEmbedding, sinusoidal_table

IGNORE_INDEX = -100


class OutputHead(Linear):
    """logits = h W_out^T over the padded vocabulary [.., Vp]; the real vocabulary is the first V
    columns. Also the loss on those logits (or on the hidden states, ``chunk_tokens`` at a time)."""

    def __init__(
        self, d_model: int, padded_vocab_size: int, vocab_size: int, chunk_tokens: int = 0
    ) -> None:
        super().__init__(d_model, padded_vocab_size, bias=False)
        self.vocab_size, self.chunk_tokens = vocab_size, chunk_tokens

    def output_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary [.., V] (padding columns dropped)."""
        return logits[..., : self.vocab_size]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (fp32) over labels != -100, over the real vocabulary."""
        return cross_entropy(logits, labels, self.vocab_size, IGNORE_INDEX)

    def hidden_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """loss(self(hidden), labels) without the full logits: ``chunk_tokens`` tokens at a time."""
        return chunked_cross_entropy(
            hidden,
            self.weight,
            labels,
            self.chunk_tokens,
            vocab_size=self.vocab_size,
            ignore_index=IGNORE_INDEX,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", vocab_size={self.vocab_size}"


class Transformer(nn.Module):
    """Decoder-only Transformer: tok_embeddings, [pos_embeddings], layers, final_norm, lm_head."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: Optional[int] = None) -> None:
        super().__init__()
        if (
            not isinstance(cfg.vocab_size, int)
            or isinstance(cfg.vocab_size, bool)
            or cfg.vocab_size <= 0
        ):
            raise ValueError(
                f"model.vocab_size must be a positive int when the model is built, "
                f"got {cfg.vocab_size!r} (resolve it from the tokenizer first)"
            )
        if cfg.position not in ("sinusoidal", "learned", "rope", "none"):
            raise ValueError(
                f"model.position={cfg.position!r}: must be sinusoidal, learned, rope or none"
            )
        self.cfg = cfg
        self.eod_id: Optional[int] = None  # end-of-document token, for model.document_mask
        self.vocab_size = cfg.vocab_size
        self.padded_vocab_size = padded_vocab_size or cfg.vocab_size
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size={padded_vocab_size} < vocab_size={cfg.vocab_size}")
        # Submodules are created on the meta device and initialised once by reset_parameters, so
        # the random draws depend only on the seed and the real shapes (not on vocabulary padding
        # or on PyTorch's per-layer default initialisers).
        self.init_seed = torch.initial_seed()  # the seed the weights are drawn from
        target = torch.get_default_device()
        with torch.device("meta"):
            self._build(cfg)
        if target.type != "meta":
            self.to_empty(device=target)
        self.reset_parameters()

    def _build(self, cfg: ModelConfig) -> None:
        self.tok_embeddings = nn.Embedding(self.padded_vocab_size, cfg.d_model)
        self.pos_embeddings = (
            nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        )
        if cfg.position == "sinusoidal":
            self.register_buffer(
                "pos_table", sinusoidal_table(cfg.max_seq_len, cfg.d_model), persistent=False
            )
        else:
            self.pos_table = None
        fraction = 1.0 if cfg.attention == "mla" else cfg.rotary_fraction
        self.rotary = (
            RotaryEmbedding(cfg.rope_dim, fraction, cfg.rope_theta, cfg.rope_scaling)
            if cfg.position == "rope"
            else None
        )
        self.drop = Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, layer=i) for i in range(cfg.n_layers))
        # multi-token prediction (model.mtp_depth): training only, after the blocks
        self.mtp = nn.ModuleList(MTPModule(cfg, cfg.n_layers + k) for k in range(cfg.mtp_depth))
        self.mtp_metrics = MTPMetrics()
        self.final_norm = build_norm(cfg)
        self.lm_head = OutputHead(
            cfg.d_model, self.padded_vocab_size, cfg.vocab_size, cfg.loss_chunk_tokens
        )
        self.tie_weights()

    def tie_weights(self) -> None:
        """W_out = E_tok (one Parameter) when tie_embeddings. ``Module.to_empty`` on a meta model
        breaks the sharing; :meth:`reset_parameters` calls this again."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    # ------------------------------------------------------------------ initialisation

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, init_std) weights, zero biases, unit norm gains; wo and w2 use init_std / sqrt(2 L).

        Each parameter is drawn from its own stream (:meth:`init_parameter`), so its values depend
        only on the default generator's seed (``torch.manual_seed``), its name and its shape. Also re-ties the embeddings and refills the
        buffers, so ``to_empty(device=...)`` after meta construction followed by
        ``reset_parameters()`` gives a complete model.
        """
        self.tie_weights()
        if self.tok_embeddings.weight.is_meta:
            return  # shapes only (e.g. counting a 70B model): there are no values to initialise
        self.init_seed = torch.initial_seed()  # the seed of the default generator, now
        self.reset_buffers()
        for name, p in self.named_parameters():
            self.init_parameter(name, p)

    @torch.no_grad()
    def reset_buffers(self, module: Optional[nn.Module] = None) -> None:
        """Fill the buffers of ``module`` (default: the whole model) that hold no values after
        meta construction: the sinusoidal table, the MoE blocks' bias and counters."""
        module = self if module is None else module
        if module is self and self.pos_table is not None:
            self.pos_table.copy_(sinusoidal_table(self.cfg.max_seq_len, self.cfg.d_model))
        for m in module.modules():
            if isinstance(m, MoE):
                m.reset_state()

    def init_std_of(self, name: str) -> Optional[float]:
        """The standard deviation parameter ``name`` is drawn with; None for biases (zeros) and
        norm gains (ones)."""
        leaf = name.rsplit(".", 1)[-1]
        owner = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
        if leaf == "bias" or isinstance(owner, (nn.LayerNorm, RMSNorm)):
            return None
        out = name.endswith(("attn.wo.weight", "mlp.w2.weight", "mlp.shared.w2.weight")) or (
            name.endswith("experts.w2")
        )
        return self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers) if out else self.cfg.init_std

    @torch.no_grad()
    def init_parameter(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Fill ``t``, the whole (unsharded) tensor of parameter ``name``, with its initial values.

        Weights ~ N(0, std) from a generator seeded by (seed, name), so every rank of every
        layout computes the same tensor for a parameter without drawing any other; a
        vocabulary table's padding rows are zero. Biases 0, norm gains 1."""
        std = self.init_std_of(name)
        if std is None:
            return t.fill_(0.0 if name.endswith("bias") else 1.0)
        g = torch.Generator(device=t.device)
        g.manual_seed((self.init_seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
        if name in ("tok_embeddings.weight", "lm_head.weight"):
            # real rows drawn exactly as without padding; padding rows zero
            t[: self.vocab_size].normal_(0.0, std, generator=g)
            t[self.vocab_size :].zero_()
            return t
        return t.normal_(0.0, std, generator=g)

    # ------------------------------------------------------------------ forward

    def embed(
        self, input_ids: torch.Tensor, start_pos: int = 0, positions: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]]:
        """x_0 [B, T, d] (the residual stream before the first block) for tokens at positions
        start_pos..start_pos+T-1 (or ``positions`` [T]), and the rotary (cos, sin) of those
        positions (None without RoPE)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        if start_pos + T > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {start_pos + T} tokens exceeds model.max_seq_len="
                f"{self.cfg.max_seq_len}"
            )
        if positions is None:
            positions = torch.arange(start_pos, start_pos + T, device=input_ids.device)
            table = (
                self.pos_table[start_pos : start_pos + T] if self.pos_table is not None else None
            )
            rope = (
                self.rotary.tables(start_pos, T, input_ids.device)
                if self.rotary is not None
                else None
            )
        else:
            table = self.pos_table[positions] if self.pos_table is not None else None
            with torch.no_grad():
                rope = self.rotary(positions) if self.rotary is not None else None
        x = self.tok_embeddings(input_ids)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(positions)
        elif table is not None:
            x = x + table.to(x.dtype)
        return self.drop(x), rope

    def _hidden(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Final-normed residual stream Norm(x_L) [B, T, d]; the arguments of :meth:`_residual`."""
        return self.final_norm(self._residual(*args, **kwargs))

    def _residual(
        self,
        input_ids: torch.Tensor,
        cache: Optional[KVCache],
        start_pos: int,
        positions: Optional[torch.Tensor] = None,
        doc_ids: Optional[DocumentMask] = None,
    ) -> torch.Tensor:
        """x_L [B, T, d], the last block's output (before the final norm), for tokens at positions
        start_pos..start_pos+T-1 (or ``positions``), with the document mask ``doc_ids`` (default:
        that of ``input_ids`` under ``model.document_mask``, without a cache)."""
        x, rope = self.embed(input_ids, start_pos, positions)
        if doc_ids is None and self.cfg.document_mask and cache is None:
            doc_ids = self.document_mask(input_ids)
        docs = {"doc_ids": doc_ids} if doc_ids is not None else {}
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                rope=rope,
                cache=cache.layers[i] if cache is not None else None,
                start_pos=start_pos,
                **docs,
            )
        return x

    def document_mask(
        self, input_ids: torch.Tensor, build: Callable[..., DocumentMask] = document_mask
    ) -> DocumentMask:
        """The batch's document boundaries, once per forward, in the form attention reads.

        ``build(ids, eod_id, backend=, head_dim=, dtype=, window=)`` makes it (default
        :func:`megaformer.kernels.attention.document_mask`; context parallelism passes one that
        reads the whole sequences)."""
        if self.eod_id is None:
            raise ValueError(
                "model.document_mask needs the end-of-document id: set the "
                "model's eod_id (the trainer sets it from the tokenizer)"
            )
        dev = input_ids.device.type
        dtype = (
            torch.get_autocast_dtype(dev)
            if torch.is_autocast_enabled(dev)
            else self.tok_embeddings.weight.dtype
        )  # that of the activations
        return build(
            input_ids,
            self.eod_id,
            backend=self.cfg.attention_backend,
            head_dim=self.cfg.qk_head_dim,
            dtype=dtype,
            window=self.cfg.sliding_window,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        doc_ids: Optional[DocumentMask] = None,
        mtp_shifted: Optional[ShiftedTokens] = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] when ``labels`` is None, else the mean cross-entropy over labels != -100.

        ``positions`` [T]: the tokens' absolute positions (default 0..T-1); ``doc_ids``: the
        document mask (default: that of ``input_ids`` under ``model.document_mask``);
        ``mtp_shifted``: the multi-token prediction inputs of split sequences (context
        parallelism passes them)."""
        residual = self._residual(input_ids, None, 0, positions, doc_ids)
        hidden = self.final_norm(residual)
        if labels is None:
            return self.lm_head.output_logits(self.lm_head(hidden))
        loss = self.head_loss(hidden, labels)
        if self.training:  # + lambda / D sum_k L^k_MTP
            mtp = self.mtp_loss(residual, input_ids, labels, mtp_shifted, positions)
            if mtp is not None:
                loss = loss + mtp
        if self.cfg.moe.interval > 0:  # + the MoE blocks' router losses, in training
            router = take_router_losses(self)
            if router is not None:
                loss = loss + router
        return loss

    def mtp_loss(
        self,
        residual: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        shifted: Optional[ShiftedTokens] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """lambda / D sum_k L^k_MTP of the last block's output ``residual`` [B, T, d] (None
        without the modules, out of training or when no depth fits), each L^k recorded for
        ``mtp/loss``; ``shifted``, ``positions``: split sequences (:func:`mtp_losses`)."""
        if len(self.mtp) == 0 or not self.mtp.training:
            return None
        losses = mtp_losses(
            self.mtp,
            residual,
            input_ids,
            labels,
            self._embed_tokens,
            self.head_loss,
            shifted,
            positions,
        )
        if not losses:
            return None
        if shifted is not None:  # each L^k weighed by its own label count
            self.mtp_metrics.add([x * s for x, s in zip(losses, shifted.scales)])
            losses = [x * w for x, w in zip(losses, shifted.weights)]
        else:
            self.mtp_metrics.add(losses)
        return self.cfg.mtp_loss_coef / len(self.mtp) * sum(losses)

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The output head's mean cross-entropy of final-normed hidden states [B, T, d] (chunked
        with ``model.loss_chunk_tokens``)."""
        if self.cfg.loss_chunk_tokens > 0:
            return self.lm_head.hidden_loss(hidden, labels)
        return self.lm_head.loss(self.lm_head(hidden), labels)

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Emb(ids) with the embedding dropout (the multi-token prediction modules' input)."""
        return self.drop(self.tok_embeddings(input_ids))

    def output_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """lm_head output -> logits over the real vocabulary [.., V] (padding columns dropped)."""
        return self.lm_head.output_logits(logits)

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (fp32) over labels != -100 of lm_head output, over the real vocabulary."""
        return self.lm_head.loss(logits, labels)

    def new_cache(self, max_len: Optional[int] = None) -> KVCache:
        """An empty KV cache for up to ``max_len`` (default max_seq_len) positions; storage is
        allocated at the first forward_cached call."""
        latent = LatentKVCache if self.cfg.attention == "mla" else None
        return KVCache(self.cfg.n_layers, max_len or self.cfg.max_seq_len, latent)

    def forward_cached(
        self,
        input_ids: torch.Tensor,
        cache: Optional[KVCache] = None,
        start_pos: int = 0,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, KVCache]:
        """Logits of tokens at positions start_pos.. given the cache of positions < start_pos.

        Returns (logits [B, T, V] or [B, 1, V] with ``last_only``, cache updated in place).
        """
        if cache is None:
            cache = self.new_cache()
        h = self._hidden(input_ids, cache, start_pos)
        if last_only:
            h = h[:, -1:]
        return self.lm_head.output_logits(self.lm_head(h)), cache

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        eos_id: Optional[int] = None,
    ) -> torch.Tensor:
        """Append up to ``max_new_tokens`` tokens to ``input_ids`` [B, T] -> [B, T + n], with a KV cache.

        Temperature 0 is greedy (:func:`megaformer.model.decoding.decode`). Generation stops once
        every row has produced ``eos_id`` (finished rows are padded with eos_id). The model sees
        at most max_seq_len tokens: a longer prompt is cropped from the left, and once the context
        is full each step recomputes over the last max_seq_len tokens (exactly what a cache-free
        sliding window computes). Runs in eval mode.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be a non-empty [batch, seq] tensor, got {tuple(input_ids.shape)}"
            )
        was_training = self.training
        self.eval()
        try:
            return decode(
                kv_cached(self),
                input_ids,
                max_new_tokens,
                self.cfg.max_seq_len,
                temperature=temperature,
                top_k=top_k,
                generator=generator,
                eos_id=eos_id,
            )
        finally:
            self.train(was_training)

    # ------------------------------------------------------------------ bookkeeping

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count of the real model: tied weights once, vocabulary padding rows excluded;
        without token/learned-position embeddings and an untied lm_head when ``exclude_embeddings``.
        (Of an unsharded model; a tensor-parallel shard is counted by the analytic formula.)"""
        total = sum(p.numel() for p in self.parameters())  # parameters() yields shared tensors once
        padding = (self.padded_vocab_size - self.vocab_size) * self.cfg.d_model
        total -= padding * (1 if self.cfg.tie_embeddings else 2)
        if exclude_embeddings:
            total -= self.vocab_size * self.cfg.d_model
            if self.pos_embeddings is not None:
                total -= self.pos_embeddings.weight.numel()
            if not self.cfg.tie_embeddings:
                total -= self.vocab_size * self.cfg.d_model
        return total
