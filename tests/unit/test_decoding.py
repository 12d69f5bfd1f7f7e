"""One decoding loop (megaformer.model.decoding.decode) behind Transformer.generate, the evaluation's
greedy decoding with the KV cache, and its cache-free recompute (sequence / pipeline parallelism):
all three make the same tokens as a naive argmax loop over full forwards."""

from __future__ import annotations

import torch

from megaformer.evaluation.forward import PlainRunner
from megaformer.generation import greedy_tokens
from megaformer.model import Transformer
from megaformer.model.decoding import decode, kv_cached
from tests.helpers import tiny_model


def model() -> Transformer:
    """A tiny model with weights large enough that greedy tokens vary from step to step."""
    torch.manual_seed(0)
    m = Transformer(tiny_model(vocab_size=37, max_seq_len=16)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
    return m


def naive(m: Transformer, prefix: list[int], n: int) -> list[int]:
    """argmax of a full forward over the last max_seq_len tokens, n times."""
    seq = list(prefix)
    L = m.cfg.max_seq_len
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(m(torch.tensor([seq[-L:]]))[0, -1].argmax()))
    return seq[len(prefix) :]


def test_cached_and_recomputed_decoding_equal_a_naive_loop_past_the_full_context():
    m = model()
    prefix = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    n = 14  # 11 + 14 > 16: crosses the full context
    want = naive(m, prefix, n)
    assert greedy_tokens(m, prefix, n) == want
    assert m.generate(torch.tensor([prefix]), n, temperature=0)[0, len(prefix) :].tolist() == want

    def full(window: torch.Tensor, start: int) -> torch.Tensor:
        return m(window)[:, -1]

    ids = torch.tensor([prefix])
    assert decode(full, ids, n, 16, cached=False)[0, len(prefix) :].tolist() == want
    assert decode(kv_cached(m), ids, n, 16)[0, len(prefix) :].tolist() == want
    assert len(set(want)) > 3  # not a constant continuation
    # sequence parallelism's runner (padded to a multiple, no cache) and the cached one
    assert PlainRunner(m, seq_multiple=4).greedy(prefix, n) == want
    assert PlainRunner(m).greedy(prefix, n) == want


def test_stop_and_eos_end_decoding():
    m = model()
    prefix = [7, 8, 9]
    want = naive(m, prefix, 10)
    seen: list[list[int]] = []

    def stop(new: list[int]) -> bool:
        seen.append(list(new))
        return len(new) == 4

    assert greedy_tokens(m, prefix, 10, stop=stop) == want[:4]
    assert seen == [want[:k] for k in range(1, 5)]
    assert greedy_tokens(m, prefix, 0) == []
    eos = want[2]
    out = m.generate(torch.tensor([prefix, prefix]), 10, temperature=0, eos_id=eos)
    first = want.index(eos) + 1
    assert out[:, 3:].tolist() == [want[:first]] * 2  # both rows stop at their first eos


def test_sampling_is_reproducible_with_a_seeded_generator():
    m = model()
    x = torch.tensor([[1, 2, 3]])
    a = m.generate(x, 8, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(3))
    b = decode(
        kv_cached(m), x, 8, 16, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(a, b) and a.shape == (1, 11)
