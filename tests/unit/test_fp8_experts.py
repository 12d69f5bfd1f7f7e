"""FP8 on the routed experts (train.fp8, emulated on CPU): the grouped GEMMs equal a quantise ->
grouped matmul -> dequantise reference, forward and backward; an x shared by W1 and W3 is cast
once; EP=2 equals EP=1 in FP8; compiled FP8 blocks (dense and MoE) trace without graph breaks;
the padding of token groups for the CUDA kernel keeps every row where it belongs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks

E4M3 = torch.float8_e4m3fn


def _qdq(t: torch.Tensor, dim: int) -> torch.Tensor:
    """deq(q(t)) in e4m3 with one power-of-two scale per slice over ``dim`` (fp32)."""
    fmax = torch.finfo(E4M3).max
    amax = t.abs().amax(dim=dim, keepdim=True)
    s = (fmax / amax.double().clamp(min=1e-12)).float()
    s = torch.exp2(torch.floor(torch.log2(s)))
    return (t.float() * s).clamp(-fmax, fmax).to(E4M3).float() / s


def _operands(counts: list[int], d: int = 32, f: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    x = torch.randn(m, d, generator=g) * torch.linspace(0.1, 3, m)[:, None]  # rows differ
    w = torch.randn(len(counts), f, d, generator=g) * 0.2
    dy = torch.randn(m, f, generator=g) * torch.linspace(1e-3, 1, f)  # columns differ
    return x, w, dy, torch.tensor(counts)


def _reference(x, w, dy, counts):
    """Per expert e on its rows: Y_e = qdq(X_e, K) qdq(W_e, K)^T, dX_e = qdq(dY_e, N) qdq(W_e, N),
    dW_e = qdq(dY_e, M_e)^T qdq(X_e, M_e) (the scales of dW over the expert's own rows)."""
    ys, dxs, dws = [], [], []
    for e, (xe, dye) in enumerate(zip(x.split(counts.tolist()), dy.split(counts.tolist()))):
        ys.append(_qdq(xe, 1) @ _qdq(w[e], 1).t())
        dxs.append(_qdq(dye, 1) @ _qdq(w[e], 0))
        if len(xe):
            dws.append(_qdq(dye, 0).t() @ _qdq(xe, 0))
        else:
            dws.append(torch.zeros_like(w[e]))
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


def _experts_fp8(split: bool = False, group=None):
    from megaformer.parallel.fp8 import Fp8Experts, Fp8Matmul

    return Fp8Experts(
        Fp8Matmul("rowwise", True, "N" if split else None, group),
        Fp8Matmul("rowwise", True, "K" if split else None, group),
    )


def test_fp8_grouped_gemm_equals_quantise_grouped_matmul_dequantise():
    """Rowwise scales per row of X and per output row of W_e (Y), per row of dY and per column of
    W_e (dX), per column of each expert's rows of dY and X (dW); an expert with no rows too."""
    counts = [5, 0, 11, 8]
    x, w, dy, c = _operands(counts)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (y,) = _experts_fp8().grouped(xr, [wr], c)
    y.backward(dy)
    ry, rdx, rdw = _reference(x, w, dy, c)
    torch.testing.assert_close(y, ry, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xr.grad, rdx, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(wr.grad, rdw, rtol=1e-6, atol=1e-9)
    err = float((y.detach() - ry.new_tensor(0) - _hp(x, w, c)).norm() / _hp(x, w, c).norm())
    assert 1e-4 < err < 0.1  # a quantisation: close to the high-precision product, not it


def _hp(x, w, counts):
    return torch.cat([xe @ w[e].t() for e, xe in enumerate(x.split(counts.tolist()))])


def test_shared_input_is_cast_once_and_equals_separate_calls():
    """W1 and W3 read one cast of x: the same outputs and gradients as two separate calls (dX
    sums the two terms in one order: 1e-6), with one cast of x instead of two."""
    from megaformer.kernels import fp8 as kernels

    x, w1, dy, c = _operands([6, 3, 7], seed=1)
    _, w3, dy3, _ = _operands([6, 3, 7], seed=2)
    fp8 = _experts_fp8()
    xs, w1s, w3s = (t.clone().requires_grad_() for t in (x, w1, w3))
    with kernels.counting() as count:
        h1, h3 = fp8.grouped(xs, [w1s, w3s], c)
    assert [s for s in count.casts if s[2] == xs.data_ptr()].__len__() == 1
    torch.autograd.backward([h1, h3], [dy, dy3])
    xa, w1a, w3a = (t.clone().requires_grad_() for t in (x, w1, w3))
    (a1,) = fp8.grouped(xa, [w1a], c)
    (a3,) = fp8.grouped(xa, [w3a], c)
    torch.autograd.backward([a1, a3], [dy, dy3])
    assert torch.equal(h1, a1) and torch.equal(h3, a3)
    assert torch.equal(w1s.grad, w1a.grad) and torch.equal(w3s.grad, w3a.grad)
    torch.testing.assert_close(xs.grad, xa.grad, rtol=1e-6, atol=1e-9)


def test_padded_token_groups_keep_every_row_in_its_group():
    """The CUDA kernel needs groups of a multiple of 16 rows: each group is padded with zero rows
    on the device (a fixed shape, no host read); the rows come back from where they went."""
    from megaformer.parallel.fp8 import pad_groups

    x = torch.arange(23 * 2, dtype=torch.float32).view(23, 2)
    counts = torch.tensor([5, 0, 17, 1])
    padded, offs, dest = pad_groups(x, counts, 16)
    assert padded.shape[0] == 23 + 4 * 15 and offs.tolist() == [16, 16, 48, 64]
    assert torch.equal(padded[dest], x)
    starts = [0, 16, 16, 48]
    for e, (s, n) in enumerate(zip(starts, counts.tolist())):
        block = padded[s : offs[e]]
        assert torch.equal(block[:n], x[sum(counts[:e].tolist()) :][:n])
        assert not block[n:].any()


def _moe_cfg(moe: bool = True):
    from megaformer.config import MoEConfig
    from tests.helpers import tiny_model

    if not moe:
        return tiny_model(n_kv_heads=2, activation="swiglu")
    experts = MoEConfig(interval=1, num_experts=4, top_k=2, d_expert=32)
    return tiny_model(n_kv_heads=2, activation="swiglu", moe=experts)


def test_moe_model_converts_routed_experts_and_trains_near_bf16_free_reference():
    """apply_fp8 converts the routed experts (one per MoE block) besides the block linears; the
    FP8 loss is close to the high-precision one and not equal to it."""
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.fp8 import apply_fp8

    torch.manual_seed(0)
    ref = Transformer(_moe_cfg(), padded_vocab_size=40)
    torch.manual_seed(0)
    m = Transformer(_moe_cfg(), padded_vocab_size=40)
    assert apply_fp8(m, "tensorwise", True) == 2 * 4 + 2  # q k v o per block, routed experts
    assert all(layer.mlp.experts.fp8 is not None for layer in m.layers)
    x = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(3))
    a, b = ref(x, x), m(x, x)
    assert 0 < abs(a.item() - b.item()) < 0.02 * a.item()
    b.backward()
    assert all(p.grad is not None for p in m.layers.parameters())


@pytest.mark.parametrize("moe", [False, True])
def test_compiled_fp8_block_has_no_graph_break(moe):
    """torch._dynamo.explain on an FP8 block (emulated; the casts traced inline, not compiled
    again): one graph, no break, dense and MoE (whose experts run the FP8 grouped GEMMs)."""
    from megaformer.model.block import Block
    from megaformer.parallel.fp8 import apply_fp8

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = _moe_cfg(moe)
    block = Block(cfg, layer=0)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([block])
    assert apply_fp8(holder, "rowwise", True) == (5 if moe else 7)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def _ep_fp8(rank: int, world: int) -> dict:
    """One process (EP=1) and this rank's EP=2 model, both FP8 (emulated), from one seed: each
    rank's loss on its own micro-batch, and every gradient (the non-expert ones summed over the
    ranks, the experts' gathered) against the one-process gradient of both micro-batches."""
    from megaformer.config import load_config
    from megaformer.parallel.build import build_model
    from megaformer.parallel.plan import gather_experts
    from megaformer.parallel.topology import build_topology
    from tests.helpers import TINY

    over = {
        **{k: TINY[k] for k in ("model.d_model", "model.n_layers", "model.n_heads")},
        "model.n_kv_heads": 2,
        "model.vocab_size": 64,
        "model.max_seq_len": 16,
        "data.seq_len": 16,
        "model.moe.interval": 1,
        "model.moe.num_experts": 4,
        "model.moe.top_k": 2,
        "model.moe.d_expert": 32,
        "model.moe.aux_loss_coef": 0.05,
        "train.fp8": "rowwise",
        "train.fp8_emulate": True,
        "parallel.expert": 2,
        "parallel.vocab_multiple": 8,
    }
    cfg = load_config("configs/quickstart.yaml", [f"{k}={v}" for k, v in over.items()])
    topo = build_topology(world, rank, ep=2)
    ref = build_model(cfg, None).model
    ep = build_model(cfg, topo).model
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (2, 16), generator=gen) for _ in range(world)]
    ref_losses = [ref(x, x) for x in batches]
    sum(ref_losses).backward()
    loss = ep(batches[rank], batches[rank])
    loss.backward()
    errs = {}
    for (name, p), r in zip(ep.named_parameters(), ref.parameters()):
        g = p.grad.clone()
        if getattr(p, "allreduce", True) is not False:  # not an expert: summed over the ranks
            dist.all_reduce(g)
        g = gather_experts(p, g, topo)
        errs[name] = float((g - r.grad).norm() / r.grad.norm().clamp(min=1e-12))
    converted = sum(m.experts.fp8 is not None for m in (b.mlp for b in ep.layers))
    return {"loss": (float(loss), float(ref_losses[rank])), "errs": errs, "converted": converted}


@pytest.mark.multiprocess
def test_expert_parallel_fp8_equals_one_process():
    """EP=2 in FP8 equals EP=1 in FP8 within 1e-5: losses and every gradient (expert parallelism
    splits no GEMM dimension, so every scale is the one process's)."""
    for r in run_ranks(2, _ep_fp8, timeout=300):
        got, want = r["loss"]
        assert abs(got - want) <= 1e-5 * abs(want), r["loss"]
        worst = max(r["errs"], key=r["errs"].get)
        assert r["errs"][worst] < 1e-5, (worst, r["errs"][worst])
        assert r["converted"] == 2


@pytest.mark.parametrize("routed", [False, True])
def test_fp8_gemm_flops_of_a_step_are_the_analytic_fp8_share(routed):
    """The FP8 GEMMs of one training micro-batch (counted as they run, forward and backward) are
    3 x the forward FP8 FLOPs the throughput accounting uses (fp8_forward_flops), with the routed
    experts in FP8 or left in high precision."""
    from megaformer.analysis.flops import fp8_forward_flops
    from megaformer.kernels import fp8 as kernels
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.fp8 import apply_fp8

    torch.manual_seed(0)
    cfg = _moe_cfg()
    model = Transformer(cfg, padded_vocab_size=40)
    apply_fp8(model, "rowwise", True)
    if not routed:
        for block in model.layers:
            block.mlp.experts.fp8 = None
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(4))
    with kernels.counting() as count:
        model(ids, ids).backward()
    assert count.gemm_flops == 3 * 2 * fp8_forward_flops(cfg, 16, routed=routed)
    assert count.ops["scaled_grouped_mm"] == (2 * 3 * 3 if routed else 0)  # 2 blocks, 3 GEMMs x3


def _tp_moe_fp8(rank: int, world: int, sp: bool) -> dict:
    """One process and this rank's TP=2 shard of an MoE model, both FP8 (emulated): the loss and
    every gradient, gathered over TP (the routed experts split like the FFN: W1/W3 by rows, W2 by
    columns, their split amaxes all-reduced)."""
    from megaformer.parallel.fp8 import apply_fp8
    from tests.helpers import full_gradients, reference_and_tensor_parallel

    ref, tp, topo, _ = reference_and_tensor_parallel(_moe_cfg(), world, rank, sp)
    for model, group in ((ref, None), (tp, topo.group("tp"))):
        apply_fp8(model, "rowwise", True, group)
    assert tp.layers[0].mlp.experts.fp8.first.split == "N"
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(6))
    losses = []
    for m in (ref, tp):
        loss = m(ids, ids)
        loss.backward()
        losses.append(float(loss))
    errs = {}
    full = full_gradients(tp, world, topo.group("tp"))
    for (name, g), r in zip(full.items(), ref.parameters()):
        g, rg = g[: r.grad.shape[0]], r.grad
        errs[name] = float((g - rg).norm() / rg.norm().clamp(min=1e-12))
    return {"losses": losses, "errs": errs}


@pytest.mark.multiprocess
def test_tensor_parallel_fp8_experts_equal_one_process():
    """TP=2 with the routed experts in FP8 (emulated) equals one process within 1e-5, with and
    without sequence parallelism: every scale that spans a split dimension is all-reduced."""
    for sp in (False, True):
        for r in run_ranks(2, _tp_moe_fp8, sp, timeout=300):
            ref_loss, tp_loss = r["losses"]
            assert abs(tp_loss - ref_loss) <= 1e-5 * abs(ref_loss), (sp, r["losses"])
            worst = max(r["errs"], key=r["errs"].get)
            assert r["errs"][worst] < 1e-5, (sp, worst, r["errs"][worst])
