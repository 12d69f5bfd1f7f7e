"""Ring attention on the fused attention kernels (:mod:`megaformer.kernels.attention_block`).

* fp32: the ring at CP 2 equals the attention of one process (the written-out reference) within
  1e-5, forward and backward, for MHA, GQA, document masks, a sliding window (both, and a value
  head dimension different from the query/key one);
* bf16: the ring's error against the fp32 reference is within twice that of one process running
  torch's SDPA in bf16 (bf16 tolerance), forward and backward;
* the work it runs, counted by a dispatch mode: no fp32 matrix product in a bf16 ring (forward and
  backward), every kernel call in bf16; the rule picks ``cpu-flash`` on CPU.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist_harness import run_ranks

B, H, T, D = 2, 4, 16, 8
_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "addbmm", "dot", "mv"}
_KERNELS = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
}


class WorkByDtype(TorchDispatchMode):
    """Counts matrix-product FLOPs (2 m n k) per input dtype, and attention-kernel calls per dtype;
    megaformer's own operators (the ring) are run with the mode still on, so their inside counts."""

    def __init__(self) -> None:
        super().__init__()
        self.matmul_flops: Counter = Counter()
        self.kernel_calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "megaformer":
            from torch._library.custom_ops import OPDEFS

            with self:
                return OPDEFS[func.name().split(".")[0]]._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _MATMULS:
            a, b = args[-2], args[-1]
            m = math.prod(a.shape[:-1])
            self.matmul_flops[a.dtype] += 2 * m * a.shape[-1] * b.shape[-1]
        elif name in _KERNELS:
            self.kernel_calls[args[0].dtype] += 1
        return out


def _reference(q, k, v, mask) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + M) V written out in fp32 (one process, the whole sequence)."""
    g = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
    s = q.float() @ kf.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ vf


def _full_mask(ids, docs: bool, window) -> torch.Tensor:
    from megaformer.kernels.attention import causal_mask, document_causal_mask, document_ids

    if docs:
        return document_causal_mask(document_ids(ids, 0), window)
    return causal_mask(T, T, None, window)[None, None]


def _case(rank, world, dtype, hkv, docs, window, dv) -> dict:
    from megaformer.kernels.attention import attention as plain_attention
    from megaformer.kernels.attention import document_ids
    from megaformer.kernels.selection import track
    from megaformer.parallel.context import ContextParallel, ring_attention

    cp = ContextParallel(dist.group.WORLD, world, rank, "ring")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, hkv, T, D, generator=g)
    v = torch.randn(B, hkv, T, dv, generator=g)
    do = torch.randn(B, H, T, dv, generator=g)
    ids = torch.randint(0, 5, (B, T), generator=g)  # token 0 ends a document
    mask = _full_mask(ids, docs, window)

    def grads(fn, inputs, grad):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward(grad)
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    ref = grads(lambda *t: _reference(*t, mask), (q, k, v), do)
    doc_ids = document_ids(ids, 0) if docs else None
    mine = [cp.split(t.to(dtype), dim=2) for t in (q, k, v)]
    counter = WorkByDtype()
    with track() as ran, counter:
        got = grads(
            lambda *t: ring_attention(*t, cp, causal=True, doc_ids=doc_ids, window=window),
            mine,
            cp.split(do.to(dtype), dim=2),
        )
    want = [cp.split(t, dim=2) for t in ref]
    out = {
        "errs": [float((a - b).abs().max()) for a, b in zip(got, want)],
        "scale": [float(b.abs().max()) for b in want],
        "fp32_matmul_flops": counter.matmul_flops[torch.float32],
        "kernel_calls": dict(counter.kernel_calls),
        "ran": sorted(ran.get("attention_block", ())),
    }
    if dtype != torch.float32 and dv == D:  # one process, torch SDPA in the same dtype
        one = grads(
            lambda *t: plain_attention(
                *t, causal=True, backend="sdpa", doc_ids=doc_ids, window=window
            ),
            [t.to(dtype) for t in (q, k, v)],
            do.to(dtype),
        )
        out["one_process_errs"] = [float((a - b).abs().max()) for a, b in zip(one, ref)]
    return out


CASES = [
    (dtype, hkv, docs, window, dv)
    for dtype in (torch.float32, torch.bfloat16)
    for hkv in (4, 2)
    for docs, window in ((False, None), (True, None), (False, 5), (True, 5))
    for dv in (D,)
] + [(torch.float32, 2, True, 5, 16), (torch.float32, 4, False, None, 4)]


def _suite(rank: int, world: int) -> dict:
    return {case: _case(rank, world, *case) for case in CASES}


@pytest.mark.multiprocess
def test_ring_on_fused_kernels_equals_one_process_and_runs_no_fp32_tiles():
    results = run_ranks(2, _suite)
    for case in CASES:
        dtype = case[0]
        for r in results:
            res = r[case]
            assert res["ran"] == ["cpu-flash"], (case, res["ran"])
            assert set(res["kernel_calls"]) == {dtype} and sum(res["kernel_calls"].values()) > 0
            if dtype == torch.float32:
                assert max(res["errs"]) < 1e-5, (case, res["errs"])
                continue
            assert res["fp32_matmul_flops"] == 0, (case, res["fp32_matmul_flops"])
            for err, one, scale in zip(res["errs"], res["one_process_errs"], res["scale"]):
                assert err <= 2 * one + 1e-2 * scale, (case, res["errs"], res["one_process_errs"])
