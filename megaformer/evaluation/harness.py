"""megaformer's model as an lm-evaluation-harness ``LM``: the three request types, on any layout.

For a context c and continuation x = (x_1..x_n), tokenized together (lm-eval's ``TemplateLM``
moves trailing spaces of c into x; an empty c becomes the end-of-document token):

    loglikelihood(c, x)       = sum_i log p(x_i | c, x_<i),   is_greedy = every x_i is the argmax
    loglikelihood_rolling(s)  = sum over the disjoint windows of s (lm-eval's rolling windows of
                                the model's max_seq_len, the first one after the EOD token, each
                                later one with as much earlier context as fits): every token of s
                                is scored exactly once, as Hugging Face's HFLM does
    generate_until(c, kw)     = greedy tokens after c until one of kw["until"] appears, the
                                end-of-document token, or kw["max_gen_toks"] tokens (256)

A (context + continuation) longer than max_seq_len + 1 keeps its last max_seq_len + 1 tokens.

Every rank of the job runs lm-eval on all requests (task building is cheap and deterministic);
the model calls split the requests over the data-parallel ranks (longest first, dealt round-robin
so the ranks get similar work), each replica (its TP x PP ranks together) scores its share, and the
results are gathered over the data-parallel group, so every rank returns all of them. When the
data-parallel ranks must run their forwards together (ZeRO-3 gathers the weights in every
forward; expert parallelism exchanges tokens), each rank runs the same number of batches (padded
with repeats) and generation runs every request to max_gen_toks before cutting at the stop
strings.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from megaformer.errors import UserError

log = logging.getLogger("megaformer")

DEFAULT_MAX_GEN_TOKS = 256


def _lm_base() -> type:
    """lm-eval's ``TemplateLM`` (the tokenization boilerplate of its HF model), or a UserError
    that names the extra to install."""
    try:
        from lm_eval.api.model import TemplateLM
    except ImportError:
        raise UserError(
            "lm-evaluation-harness is not installed: pip install megaformer[eval]"
        ) from None
    return TemplateLM


def make_lm(
    runner: Any,
    tokenizer: Any,
    *,
    batch_size: int = 8,
    dp_group: Any = None,
    lockstep: bool = False,
) -> Any:
    """An ``lm_eval.api.model.LM`` over ``runner`` (:mod:`megaformer.evaluation.forward`) and the
    run's ``tokenizer``; ``dp_group``: the data-parallel group the requests are split over (None:
    this process does all of them)."""
    base = _lm_base()

    class MegaformerLM(base):  # type: ignore[misc, valid-type]
        backend = "causal"

        def __init__(self) -> None:
            super().__init__()
            self.runner, self.tok = runner, tokenizer
            self.batch_size = max(1, int(batch_size))
            self.group = dp_group
            self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
            self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
            self.lockstep = lockstep and self.dp > 1
            self.max_length = runner.max_length
            self.warned = False  # sampling options ignored: said once

        # ------------------------------------------------------------------ tokenizer
        @property
        def eot_token_id(self) -> int:
            return self.tok.eod_id

        @property
        def tokenizer_name(self) -> str:
            return str(getattr(self.tok, "name", "megaformer"))

        def tok_encode(
            self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any
        ) -> list[int]:
            return list(self.tok.encode(string))

        def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
            return self.tok.decode(tokens)

        # ------------------------------------------------------------------ requests
        def _loglikelihood_tokens(
            self, requests: list, disable_tqdm: bool = False, **kwargs: Any
        ) -> list[tuple[float, bool]]:
            """(sum of log p, all greedy) of each ((context, continuation), context tokens,
            continuation tokens); an empty continuation is (0.0, True)."""
            items = []
            for _, context, continuation in requests:
                whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
                n = len(continuation)
                if n > self.max_length:
                    raise UserError(
                        f"a continuation of {n} tokens cannot be scored by a model of "
                        f"max_seq_len {self.max_length}"
                    )
                items.append((whole[:-1], whole[1:], n))
            order = sorted(
                (i for i in range(len(items)) if items[i][2] > 0), key=lambda i: -len(items[i][0])
            )
            mine = order[self.dp_rank :: self.dp]
            batches = [mine[i : i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
            out: dict[int, tuple[float, bool]] = {}
            for batch, real in self._padded(batches, filler=order[:1]):
                T = max(len(items[i][0]) for i in batch)
                ids = torch.zeros(len(batch), T, dtype=torch.long)
                tgt = torch.zeros(len(batch), T, dtype=torch.long)
                for row, i in enumerate(batch):
                    inp, target, _ = items[i]
                    ids[row, : len(inp)] = torch.tensor(inp)
                    tgt[row, : len(target)] = torch.tensor(target)
                logp, greedy = self.runner.scores(ids, tgt)
                for row, i in enumerate(batch if real else []):
                    length, n = len(items[i][0]), items[i][2]
                    lp = logp[row, length - n : length].double().sum().item()
                    out[i] = (lp, bool(greedy[row, length - n : length].all()))
            done = self._gather(out)
            return [done.get(i, (0.0, True)) for i in range(len(items))]

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            from lm_eval import utils

            windows, owner = [], []
            for k, (string,) in enumerate(req.args for req in requests):
                for ctx, cont in map(
                    utils.make_disjoint_window,
                    utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    ),
                ):
                    windows.append(((None,), ctx, cont))
                    owner.append(k)
            totals = [0.0] * len(requests)
            for k, (lp, _) in zip(owner, self._loglikelihood_tokens(windows)):
                totals[k] += lp
            return totals

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            args = [req.args for req in requests]
            order = sorted(range(len(args)), key=lambda i: -len(args[i][0]))
            mine = order[self.dp_rank :: self.dp]
            # in lockstep every request runs the same number of steps: the most any asks for
            steps = (
                max(int((a[1] or {}).get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)) for a in args)
                if self.lockstep and args
                else None
            )
            out: dict[int, str] = {}
            for (i,), real in self._padded([[i] for i in mine], filler=order[:1]):
                text = self._generate_one(*args[i], steps=steps)
                if real:
                    out[i] = text
            return [r for _, r in sorted(self._gather(out).items())]

        def _generate_one(self, context: str, gen_kwargs: dict, steps: Optional[int] = None) -> str:
            """Greedy continuation of ``context`` cut at the first stop string (``steps``: run
            exactly that many tokens, for lockstep)."""
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eod_text = self.tok_decode([self.eot_token_id])
            if eod_text and eod_text not in until:
                until.append(eod_text)
            max_new = int(kw.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            sampling = kw.get("do_sample") or float(kw.get("temperature", 0.0) or 0.0) > 0
            if sampling and not self.warned:
                self.warned = True
                log.warning(
                    "generate_until: sampling options %s ignored; megaformer eval decodes greedily",
                    {k: kw[k] for k in ("do_sample", "temperature") if k in kw},
                )
            ctx = self.tok_encode(context) or [self.eot_token_id]
            room = self.max_length - max_new
            ctx = ctx[-room:] if room > 0 else ctx[-self.max_length :]
            eod = self.eot_token_id

            def stop(new: list[int]) -> bool:
                if self.lockstep:
                    return False  # every data-parallel rank runs the same number of steps
                if new[-1] == eod:
                    return True
                text = self.tok_decode(new)
                return any(s and s in text for s in until)

            new = self.runner.greedy(ctx, steps or max_new, stop=stop)[:max_new]
            if eod in new:
                new = new[: new.index(eod)]
            text = self.tok_decode(new)
            for s in until:
                if s:
                    text = text.split(s)[0]
            return text

        # ------------------------------------------------------------------ data parallelism
        def _padded(
            self, batches: list[list[int]], filler: list[int]
        ) -> list[tuple[list[int], bool]]:
            """(batch, is it real) for ``batches`` and, when the data-parallel ranks must run in
            lockstep, ``filler`` batches (run, results dropped) up to the largest count over the
            ranks."""
            out = [(b, True) for b in batches]
            if not self.lockstep:
                return out
            n = torch.tensor([len(batches)], dtype=torch.long, device=self.runner.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
            return out + [(filler, False)] * (int(n) - len(batches))

        def _gather(self, part: dict) -> dict:
            if self.dp == 1:
                return part
            parts: list = [None] * self.dp
            dist.all_gather_object(parts, part, group=self.group)
            merged: dict = {}
            for p in parts:
                merged.update(p)
            return merged

    return MegaformerLM()
