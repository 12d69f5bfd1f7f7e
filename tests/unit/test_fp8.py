"""FP8 training (train.fp8, emulated on CPU): the FP8 linear equals a hand-written
quantise -> matmul -> dequantise reference (tensorwise and rowwise, forward and backward), TP=2
equals TP=1, a tiny model trains as well as in fp32, and a device without FP8 GEMMs is refused.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.distributed as dist

from megaformer.errors import ConfigError
from tests.dist_harness import run_ranks
from tests.helpers import assert_one_line_error, cli_main, tiny_model, tiny_overrides

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _qdq(t: torch.Tensor, dtype: torch.dtype, dim=None, pow2: bool = False) -> torch.Tensor:
    """deq(q(t)): scale s = fp8_max / amax (over ``dim``, keeping it, or the whole tensor),
    optionally rounded down to a power of two; saturate, round to ``dtype``, divide by s."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    s = (fmax / amax.double().clamp(min=1e-12)).float()
    if pow2:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return (t.float() * s).clamp(-fmax, fmax).to(dtype).float() / s


def _reference(x, w, dy, recipe):
    """(y, dx, dw) of y = x w^T with every GEMM operand quantised as the recipe says."""
    if recipe == "tensorwise":
        y = _qdq(x, E4M3) @ _qdq(w, E4M3).t()
        dx = _qdq(dy, E5M2) @ _qdq(w, E4M3)
        dw = _qdq(dy, E5M2).t() @ _qdq(x, E4M3)
    else:  # one scale per row of the contraction: X, W over K; dY, W over N; dY, X over M
        y = _qdq(x, E4M3, 1, True) @ _qdq(w, E4M3, 1, True).t()
        dx = _qdq(dy, E4M3, 1, True) @ _qdq(w, E4M3, 0, True)
        dw = _qdq(dy, E4M3, 0, True).t() @ _qdq(x, E4M3, 0, True)
    return y, dx, dw


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_equals_quantise_matmul_dequantise(recipe):
    from megaformer.parallel.fp8 import Fp8Matmul

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 32, generator=g) * torch.linspace(0.1, 3, 24)[:, None]  # rows differ
    w = torch.randn(48, 32, generator=g) * 0.2
    b = torch.randn(48, generator=g)
    dy = torch.randn(24, 48, generator=g) * 1e-3
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = Fp8Matmul(recipe, emulate=True)(xr.view(2, 12, 32), wr, br)
    y.backward(dy.view(2, 12, 48))
    ry, rdx, rdw = _reference(x, w, dy, recipe)
    torch.testing.assert_close(y.view(24, 48), ry + b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xr.grad, rdx, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(wr.grad, rdw, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(br.grad, dy.sum(0))
    # and it is a quantisation: not the high-precision product, but close to it
    err = float((y.detach().view(24, 48) - b - x @ w.t()).norm() / (x @ w.t()).norm())
    assert 1e-4 < err < 0.1


def _tp_fp8(rank: int, world: int, recipe: str, sp: bool) -> dict:
    from megaformer.parallel.fp8 import apply_fp8
    from tests.helpers import reference_and_tensor_parallel

    cfg = tiny_model(vocab_size=64, n_heads=4, n_kv_heads=2, d_model=32, d_ffn=64, max_seq_len=16)
    ref, tp, topo, _ = reference_and_tensor_parallel(cfg, world, rank, sp)
    assert apply_fp8(ref, recipe, True) == 2 * 7
    apply_fp8(tp, recipe, True, topo.group("tp"))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (2, 16), generator=gen)
    y = torch.randint(0, 64, (2, 16), generator=gen)
    losses = []
    for m in (ref, tp):
        loss = m(x, y)
        loss.backward()
        losses.append(loss.item())
    errs = {}
    for (name, p_ref), (_, p_tp) in zip(ref.named_parameters(), tp.named_parameters()):
        g = p_tp.grad
        if getattr(p_tp, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g.contiguous(), group=topo.group("tp"))
            g = torch.cat(parts, dim=p_tp.partition_dim)
        r = p_ref.grad
        if "emb" in name or "lm_head" in name:
            g, r = g[:64], r[:64]
        errs[name] = float((g - r).norm() / r.norm().clamp(min=1e-30))
    return {"losses": losses, "errs": errs}


def _tp_layers(rank: int, world: int, recipe: str) -> float:
    """Column- and row-parallel FP8 layers against one process's FP8 layer: the worst relative
    error of y, dx and dw over both layers. The split dimension's halves differ 4096x in size in
    X and dY, and inversely in W, so both halves contribute alike to every product: a scale taken
    from one shard alone would quantise the small half differently (rowwise scales are powers of
    two, so only through e4m3's subnormal range, which 4096x reaches)."""
    import torch.nn as nn

    from megaformer.parallel.fp8 import Fp8Matmul
    from megaformer.parallel.layers import ColumnParallelLinear, RowParallelLinear

    g = torch.Generator().manual_seed(2)
    big = torch.ones(32)
    big[:16] = 4096.0
    x = torch.randn(8, 32, generator=g) * big  # over K
    w = torch.randn(32, 32, generator=g) / big[:, None] / big  # over N and K
    dy = torch.randn(8, 32, generator=g) * big  # over N
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = Fp8Matmul(recipe, True)(xr, wr)
    y.backward(dy)
    full = nn.Linear(32, 32, bias=False)
    full.weight.data.copy_(w)
    part = slice(rank * 32 // world, (rank + 1) * 32 // world)
    group = dist.group.WORLD
    errs = []
    for layer, split in (
        (ColumnParallelLinear(full, group, False), "N"),
        (RowParallelLinear(full, group, False), "K"),
    ):
        layer.fp8 = Fp8Matmul(recipe, True, split, group)
        xi = (x if split == "N" else x[:, part]).clone().requires_grad_()
        yi = layer(xi)
        yi.backward(dy[:, part] if split == "N" else dy)
        pairs = [
            (yi, y[:, part] if split == "N" else y),
            (xi.grad, xr.grad if split == "N" else xr.grad[:, part]),
            (layer.weight.grad, wr.grad[part] if split == "N" else wr.grad[:, part]),
        ]
        errs += [float((a - b).norm() / b.norm()) for a, b in pairs]
    return max(errs)


def _tp_fp8_cases(rank: int, world: int, cases: list) -> list[dict]:
    out = [_tp_fp8(rank, world, recipe, sp) for recipe, sp in cases]
    return out + [{recipe: _tp_layers(rank, world, recipe) for recipe in ("tensorwise", "rowwise")}]


@pytest.mark.multiprocess
def test_tensor_parallel_fp8_equals_one_process():
    """Shards quantised with the scales one process uses (amax all-reduced where a scale spans
    a split dimension): losses and every gradient agree within 1e-5, with and without SP."""
    cases = [(recipe, sp) for recipe in ("tensorwise", "rowwise") for sp in (False, True)]
    results = run_ranks(2, _tp_fp8_cases, cases)
    for case, (recipe, sp) in enumerate(cases):
        for r in (rank[case] for rank in results):
            ref_loss, tp_loss = r["losses"]
            assert abs(tp_loss - ref_loss) <= 1e-5 * abs(ref_loss), (recipe, sp, r["losses"])
            worst = max(r["errs"], key=r["errs"].get)
            assert r["errs"][worst] < 1e-5, (recipe, sp, worst, r["errs"][worst])
    for r in results:
        assert max(r[-1].values()) < 1e-6, r[-1]


def _train_losses(fp8: str, steps: int = 50) -> list[float]:
    """A tiny model (d 64, 2 layers) trained from the same seed on the same byte batches."""
    from megaformer.config import load_config
    from megaformer.parallel.build import build_model

    cfg = load_config(
        "configs/quickstart.yaml",
        [
            "model.d_model=64",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.max_seq_len=64",
            "model.vocab_size=257",
            f"train.fp8={fp8}",
            "train.fp8_emulate=true",
        ],
    )
    model = build_model(cfg, device="cpu").model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    with open(os.__file__, "rb") as f:  # the standard library's os.py: some real text
        text = f.read()
    data = torch.tensor(list(text[:200_000]), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (8,), generator=gen)
        batch = torch.stack([data[s : s + 65] for s in starts])
        opt.zero_grad()
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_tiny_model_trains_in_fp8_as_in_fp32():
    """50 steps, fp32 master weights and non-FP8 ops: the final loss (mean of the last 5 steps)
    of each FP8 recipe is within 2% of the fp32 run's, and FP8 did change the numbers."""
    base = _train_losses("off")
    assert base[-1] < 0.8 * base[0]  # it learns
    for recipe in ("tensorwise", "rowwise"):
        fp8 = _train_losses(recipe)
        assert fp8 != base
        final, ref = sum(fp8[-5:]) / 5, sum(base[-5:]) / 5
        assert abs(final - ref) <= 0.02 * ref, (recipe, final, ref)


def test_fp8_refused_without_fp8_gemms(tmp_path):
    from megaformer.config import load_config
    from megaformer.config.preflight import preflight
    from megaformer.parallel.fp8 import check_fp8_device, fp8_gemm_support

    assert fp8_gemm_support("cpu")[0] is False
    cfg = load_config("configs/quickstart.yaml", ["train.fp8=rowwise"])
    with pytest.raises(ConfigError, match="train.fp8=rowwise: the CPU has no FP8 GEMMs"):
        preflight(cfg, 1, "cpu")
    check_fp8_device(load_config("configs/quickstart.yaml", ["train.fp8=off"]).train, "cpu")
    check_fp8_device(
        load_config(
            "configs/quickstart.yaml", ["train.fp8=rowwise", "train.fp8_emulate=true"]
        ).train,
        "cpu",
    )
    assert_one_line_error(
        cli_main(
            "train",
            "configs/quickstart.yaml",
            *tiny_overrides(),
            "train.fp8=tensorwise",
            "train.device=cpu",
            "--run-dir",
            str(tmp_path / "run"),
        ),
        "train.fp8=tensorwise",
        "no FP8 GEMMs",
        "fp8_emulate",
    )
    assert not (tmp_path / "run").exists()  # refused before anything was built or written


def test_fp8_shapes_need_multiples_of_16_without_emulation():
    from megaformer.config import load_config

    odd = ["model.d_model=200", "model.n_heads=10", "model.n_kv_heads=5"]  # d_k 20: width 200
    with pytest.raises(ConfigError, match="d_model = 200 is not a multiple of 16"):
        load_config("configs/quickstart.yaml", ["train.fp8=tensorwise", *odd])
    with pytest.raises(ConfigError, match="key/value width kv_heads.head_dim / TP = 72 is not"):
        load_config("configs/quickstart.yaml", ["train.fp8=rowwise", "model.head_dim=18"])
    load_config("configs/quickstart.yaml", ["train.fp8=tensorwise", "train.fp8_emulate=true", *odd])
    load_config("configs/quickstart.yaml", ["train.fp8=off", *odd])


def test_fp8_tokens_per_micro_batch_and_context_rank_need_multiples_of_16():
    """The weight gradient dW = dY^T X contracts over micro_batch_size * seq_len / CP tokens."""
    from megaformer.config import load_config

    base = ["train.fp8=tensorwise", "model.max_seq_len=64", "train.global_batch_size=24"]
    with pytest.raises(
        ConfigError,
        match=r"micro_batch_size \* seq_len / parallel.context = "
        r"3 \* 40 / 1 = 120, are not a multiple of 16",
    ):
        load_config(
            "configs/quickstart.yaml", [*base, "train.micro_batch_size=3", "data.seq_len=40"]
        )
    load_config("configs/quickstart.yaml", [*base, "train.micro_batch_size=2", "data.seq_len=40"])
    load_config(
        "configs/quickstart.yaml",
        [*base, "train.micro_batch_size=3", "data.seq_len=40", "train.fp8_emulate=true"],
    )
    # context parallelism splits the tokens the activations' scales are taken over: refused
    with pytest.raises(ConfigError, match=r"train.fp8=tensorwise with parallel.context=2"):
        load_config(
            "configs/quickstart.yaml",
            [*base, "parallel.context=2", "train.micro_batch_size=1", "data.seq_len=64"],
        )


def test_eager_fp8_accepted_on_cuda(tmp_path, monkeypatch):
    """Real FP8 GEMMs on CUDA run without train.compile (each cast is a compiled function of its
    own): a stand-in CUDA device with FP8 GEMMs passes the device check, and `--dry-run` with
    train.device=cuda accepts eager FP8."""
    from megaformer.config import load_config
    from megaformer.parallel import fp8

    monkeypatch.setattr(fp8, "fp8_gemm_support", lambda device: (True, ""))
    for over in (["train.fp8=rowwise"], ["train.fp8=tensorwise", "train.compile=true"]):
        fp8.check_fp8_device(load_config("configs/quickstart.yaml", over).train, "cuda")
    args = [
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        "train.device=cuda",
        "train.fp8=tensorwise",
        "--dry-run",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    assert cli_main(*args).returncode == 0


def _aten_ops(fn) -> collections.Counter:
    """aten ops that ``fn()`` dispatches from Python, autograd or a compiled graph (not the ones
    an aten op calls itself), by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(
        e.name
        for e in prof.events()
        if e.name.startswith("aten::")
        and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
    )


def _fp8_operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(48, 64, generator=gen).bfloat16().requires_grad_()
    return x, w, torch.randn(64, 48, generator=gen).bfloat16()


@pytest.mark.parametrize("recipe,casts", [("tensorwise", 4), ("rowwise", 6)])
def test_fp8_linear_dispatches_three_gemms_and_one_function_per_cast(recipe, casts):
    """One FP8 linear layer's forward and backward, counted at the aten dispatcher: outside its
    casts, only the 3 GEMMs, views and the gradient accumulation; each cast (amax -> scale ->
    cast, 12+ aten ops when run eagerly) is one call of a compiled function. Tensorwise casts 4
    times (X and dY once each, serving two GEMMs; W twice), rowwise 6. The result is bitwise what
    the eager casts give."""
    from megaformer.kernels import fp8 as kernels
    from megaformer.parallel.fp8 import Fp8Matmul

    mm = Fp8Matmul(recipe, emulate=True)
    x, w, dy = _fp8_operands()
    mm(x, w).backward(dy)
    with kernels.counting() as count:
        mm(x, w).backward(dy)
    assert count.ops == {"view": 4, "t": 4, "scaled_mm": 3, "add_": 2}, count.ops
    assert len(count.casts) == casts and sum(count.every_op.values()) > 70, count


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_casts_equal_eager_casts(recipe, monkeypatch):
    """The casts compiled on their own (as on CUDA; here aot_eager, one graph each: fullgraph)
    compute the bits the eager casts compute, forward and backward."""
    from megaformer.kernels import fp8 as kernels
    from megaformer.parallel.fp8 import Fp8Matmul

    got = []
    for compiled in (False, True):
        monkeypatch.setattr(kernels, "COMPILE_CASTS", compiled)
        monkeypatch.setattr(kernels, "CAST_BACKEND", "aot_eager")
        x, w, dy = _fp8_operands()
        y = Fp8Matmul(recipe, emulate=True)(x, w)
        y.backward(dy)
        got.append((y, x.grad, w.grad))
    for a, b in zip(*got):
        assert torch.equal(a, b)
    assert kernels._compiled.cache_info().currsize >= 2


def _block_input_casts(recipe: str, shared: bool, monkeypatch) -> tuple[int, int, list]:
    """(casts of the normed attention and FFN inputs in forward, in backward, [loss, weight
    grads]) of one FP8 block; ``shared=False``: every projection casts its input itself."""
    from megaformer.kernels import fp8 as kernels
    from megaformer.model import linear
    from megaformer.model.block import Block
    from megaformer.parallel.fp8 import apply_fp8

    if not shared:
        monkeypatch.setattr(linear, "shared_fp8_projections", lambda x, projections: None)
    torch.manual_seed(0)
    cfg = tiny_model(n_kv_heads=2, activation="swiglu", n_layers=1)
    block = Block(cfg)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([block])
    apply_fp8(holder, recipe, True)
    normed: list[torch.Tensor] = []  # (held: no other tensor can take their memory)
    for norm in (block.attn_norm, block.mlp_norm):
        norm.register_forward_hook(lambda m, i, out: normed.append(out))
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    with kernels.counting() as count:
        y = block(x)
        n_forward = len(count.casts)
        (y.square().mean()).backward()
    inputs = [t.data_ptr() for t in normed]
    ptrs = [c[2] for c in count.casts]
    fwd = sum(p in inputs for p in ptrs[:n_forward])
    bwd = sum(p in inputs for p in ptrs[n_forward:])
    monkeypatch.undo()
    return fwd, bwd, {"y": y.detach(), **{n: p.grad for n, p in block.named_parameters()}}


@pytest.mark.parametrize("recipe,backward", [("tensorwise", (0, 0)), ("rowwise", (5, 2))])
def test_block_casts_each_normed_input_once(recipe, backward, monkeypatch):
    """A block's normed attention input is cast once for q, k and v and the FFN input once for
    gate and up (5 -> 2 casts in forward; rowwise backward casts X over M for the dW GEMMs:
    5 -> 2; tensorwise backward reuses the forward's casts). The output and the projections'
    weight gradients equal those of every projection casting for itself bit for bit; the
    gradients upstream of a shared input sum its dX terms in another order (1e-6)."""
    fwd, bwd, ref = _block_input_casts(recipe, False, monkeypatch)
    assert (fwd, bwd) == (5, backward[0])
    fwd, bwd, got = _block_input_casts(recipe, True, monkeypatch)
    assert (fwd, bwd) == (2, backward[1])
    for name, r in ref.items():
        if name == "y" or name.endswith((".wq.weight", ".wk.weight", ".wv.weight", "w1.weight")):
            assert torch.equal(got[name], r), name
        else:
            torch.testing.assert_close(got[name], r, rtol=1e-5, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_blocks_compile_without_graph_breaks(recipe):
    """train.compile with FP8 (emulated, bf16 autocast): the blocks trace as one graph reused by
    every block, with no graph break (aot_eager: the trace, without inductor's C++ build)."""
    from torch._dynamo.utils import counters

    from megaformer.model.block import compile_blocks
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.fp8 import apply_fp8

    counters.clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(tiny_model(n_kv_heads=2, max_seq_len=32), padded_vocab_size=40)
    apply_fp8(model, recipe, True)
    compile_blocks(model.layers, backend="aot_eager")
    x = torch.randint(0, 37, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, x).backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)
    assert all(p.grad is not None for p in model.layers.parameters())


@pytest.mark.skipif(
    os.environ.get("MEGAFORMER_TEST_INDUCTOR") != "1",
    reason="inductor's first CPU compile takes ~1-2 min (C++ build); "
    "set MEGAFORMER_TEST_INDUCTOR=1 to run it",
)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_fp8_linear_leaves_only_the_gemms_outside_inductor_kernels(recipe):
    """train.compile's path for the same layer: inductor fuses the casts into its generated
    kernels; the aten ops left are the three GEMMs and the gradient accumulation."""
    from megaformer.parallel.fp8 import Fp8Matmul

    mm = Fp8Matmul(recipe, emulate=True)
    x, w, dy = _fp8_operands()
    forward = torch.compile(lambda x_, w_: mm(x_, w_), backend="inductor", fullgraph=True)
    forward(x, w).backward(dy)  # the compilation
    compiled = _aten_ops(lambda: forward(x, w).backward(dy))
    assert compiled["aten::mm"] == 3, compiled
    others = {
        k: v
        for k, v in compiled.items()
        if k not in ("aten::mm", "aten::add_", "aten::resolve_conj", "aten::empty_strided")
    }
    assert not others, (recipe, compiled)


def test_fp8_converts_only_the_block_linears():
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.fp8 import apply_fp8

    torch.manual_seed(0)
    model = Transformer(tiny_model(), padded_vocab_size=40)
    assert apply_fp8(model, "tensorwise", True) == 2 * 7  # q k v o, w1 w3 w2 per block
    converted = {n for n, m in model.named_modules() if getattr(m, "fp8", None) is not None}
    assert converted == {
        f"layers.{i}.{n}"
        for i in range(2)
        for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w3", "mlp.w2")
    }
    assert apply_fp8(Transformer(tiny_model(), padded_vocab_size=40), "off", True) == 0


@pytest.mark.slow
def test_fp8_training_run_logs_dtype_split_and_compares_with_fp32(tmp_path):
    """`megaformer train` with train.fp8 (emulated): MFU against the bf16 peak, TFLOP/s split by
    the FP8 share of the FLOPs; `megaformer report FP32_RUN FP8_RUN` names the divergence."""
    import json

    from megaformer.analysis.flops import fp8_share
    from megaformer.analysis.summary import resolve_vocab
    from megaformer.config import load_config
    from tests.helpers import run_cli

    runs = {}
    for name, fp8 in (("fp32", "off"), ("fp8", "tensorwise")):
        overrides = tiny_overrides(
            **{
                "train.steps": 4,
                "eval.interval": 0,
                "eval.at_end": "false",
                "log.peak_tflops": 0.5,
                "log.diagnostics": "true",
                "log.diagnostics_interval": 2,
                "train.fp8": fp8,
                "train.fp8_emulate": "true",
                "checkpoint.save_at_end": "false",
            }
        )
        runs[name] = tmp_path / name
        r = run_cli("train", "configs/quickstart.yaml", *overrides, "--run-dir", str(runs[name]))
        assert r.returncode == 0, r.stderr[-3000:]
        recs = [json.loads(x) for x in (runs[name] / "metrics.jsonl").read_text().splitlines()]
        train = [x for x in recs if "tflops_per_gpu" in x]
        assert train
        if fp8 == "off":
            assert "MFU vs bf16 peak" not in r.stdout and "fp8_tflops_per_gpu" not in train[0]
            continue
        assert "MFU vs bf16 peak" in r.stdout and "FP8:" in r.stdout
        cfg = resolve_vocab(load_config("configs/quickstart.yaml", overrides))
        share = fp8_share(cfg.model, 32)
        assert 0.3 < share < 1
        for x in train:
            assert x["fp8_tflops_per_gpu"] == pytest.approx(share * x["tflops_per_gpu"])
            assert x["hp_tflops_per_gpu"] == pytest.approx((1 - share) * x["tflops_per_gpu"])
            assert x["mfu"] == pytest.approx(x["tflops_per_gpu"] / 0.5)
    out = cli_main("report", str(runs["fp32"]), str(runs["fp8"]), "--threshold", "1e-9")
    assert out.returncode == 0, out.stderr
    assert "train loss: first diverges at step 1" in out.stdout  # FP8 rounding from the start
    assert "residual RMS: first diverges at step 2, " in out.stdout
    assert (runs["fp32"] / "compare_fp8" / "compare_diag_resid_rms.png").is_file()


def test_fp8_share_of_the_flops_and_mixed_peak():
    """The FP8 layers' FLOPs by hand for a GQA SwiGLU model; the peak of the mix; `megaformer
    flops` under train.fp8 reports MFU against the bf16 peak and the FP8/mixed peaks."""
    from megaformer.accelerators import find_accelerator
    from megaformer.analysis.flops import forward_flops, fp8_forward_flops, fp8_share, mixed_peak
    from megaformer.analysis.summary import flops_summary
    from megaformer.config import ModelConfig, load_config

    m = ModelConfig(
        vocab_size=1000,
        d_model=64,
        n_layers=3,
        n_heads=8,
        n_kv_heads=2,
        d_ffn=160,
        activation="swiglu",
        max_seq_len=128,
    )
    s = 128  # d_k 8: q 64, k and v 16 each
    by_hand = 3 * (2 * s * 64 * (64 + 16 + 16) + 2 * s * 64 * 64 + 3 * 2 * s * 64 * 160)
    assert fp8_forward_flops(m, s) == by_hand
    total = forward_flops(m, s)
    assert by_hand == total.qkv + total.attn_out + total.mlp
    assert fp8_share(m, s) == pytest.approx(by_hand / total.total)
    h100 = find_accelerator("H100-SXM")
    assert mixed_peak(1.0, h100.peak("fp8"), h100.peak("bf16")) == pytest.approx(1979)
    assert mixed_peak(0.5, 2000, 1000) == pytest.approx(1000 / 0.75)

    cfg = load_config("configs/quickstart.yaml", ["train.fp8=tensorwise", "model.vocab_size=257"])
    d = flops_summary(cfg, gpu="H100-SXM", step_time_s=0.01)
    assert d["gpu"]["dtype"] == "bf16" and d["gpu"]["peak_tflops"] == 989.5
    f = d["fp8"]
    assert f["fp8_peak_tflops"] == 1979 and f["share"] == pytest.approx(fp8_share(cfg.model, 256))
    assert f["mixed_peak_tflops"] == pytest.approx(mixed_peak(f["share"], 1979, 989.5))
    assert d["measured"]["mfu"] == pytest.approx(d["measured"]["tflops_per_gpu"] / 989.5)
    out = cli_main(
        "flops",
        "configs/quickstart.yaml",
        "train.fp8=rowwise",
        "--gpu",
        "H200",
        "--step-time",
        "0.01",
    )
    assert out.returncode == 0 and "MFU vs bf16 peak" in out.stdout and "mixed peak" in out.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fp8_with_bf16_through_zero1_and_zero3_equals_one_process(tmp_path):
    """FP8 (emulated) beside bf16 master weights, under ZeRO-1 and ZeRO-3 on two data-parallel
    ranks: losses and gradient norms are one process's (the same weights and micro-batches), and
    not plain bf16's (the FP8 casts are on: the first gradient norm moves by ~2e-3)."""
    from tests.helpers import run_cli, run_torchrun, step_records

    common = tiny_overrides(
        **{
            "train.steps": 3,
            "eval.interval": 0,
            "eval.at_end": "false",
            "train.precision": "bf16",
            "train.fp8_emulate": "true",
            "checkpoint.save_at_end": "false",
            "log.peak_tflops": 0.5,
        }
    )
    ref = {}
    for fp8 in ("off", "tensorwise"):
        one = run_cli(
            "train",
            "configs/quickstart.yaml",
            *common,
            f"train.fp8={fp8}",
            "parallel.zero_stage=1",
            "--run-dir",
            str(tmp_path / fp8),
        )
        assert one.returncode == 0, one.stderr[-3000:]
        ref[fp8] = step_records(tmp_path / fp8)
    a, plain = ref["tensorwise"], ref["off"]
    assert abs(plain[1]["grad_norm"] / a[1]["grad_norm"] - 1) > 1e-3
    for zero in (1, 3):
        run = tmp_path / f"zero{zero}"
        proc = run_torchrun(
            2,
            "train",
            "configs/quickstart.yaml",
            *common,
            "train.fp8=tensorwise",
            f"parallel.zero_stage={zero}",
            "--run-dir",
            str(run),
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "FP8:" in proc.stdout and f"ZeRO {zero}" in proc.stdout, proc.stdout[-2000:]
        b = step_records(run)
        assert sorted(b) == sorted(a) == [1, 2, 3]
        for step in (1, 2, 3):
            for key in ("loss", "grad_norm"):
                assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (zero, step, key)
