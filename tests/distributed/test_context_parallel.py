"""Context parallelism equals one process: the attention function, the model, and training.

* the ring and all-to-all attention (forward and backward) against the full attention of one
  process, for MHA, GQA (key/value heads fewer than the context degree too), document masks and a
  sliding window, on 2 and 4 gloo ranks; the ring's work per rank (chunk-pair products) is the
  same on every rank, and its bytes are the analytical volume;
* the model, context-parallel (CP 2 and 4, and CP 2 x TP 2 with and without sequence
  parallelism) against one process: the loss averaged over the context group and every
  gradient, averaged over it as DeepSpeed does and gathered over TP, within 1e-5 over 3 AdamW
  steps;
* training through DeepSpeed: CP 2 (ring) x DP 2 with ZeRO-2 and document masks (then its
  sample and ``megaformer generate``), CP 2 (all-to-all) x PP 2 with the residual-stream
  diagnostics, equal to one process (losses, gradient norms, validation loss, diagnostics); a
  CP 2 checkpoint resumed by one process continues exactly;
* the one-line refusals of what context parallelism does not support.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megaformer.config import MLAConfig
from tests.dist_harness import run_ranks
from tests.helpers import (
    cli_main,
    full_gradients,
    run_cli,
    run_torchrun,
    step_records,
    tiny_overrides,
)

EOD = 7
VOCAB = 257


# ----------------------------------------------------------------------------- attention function


def _attention_case(rank: int, world: int, mode: str, hkv: int, docs: bool, window) -> dict:
    from megaformer.comm import CommCounter
    from megaformer.kernels.attention import attention, document_mask
    from megaformer.parallel.context import RING_WORK, ContextParallel

    cp = ContextParallel(dist.group.WORLD, world, rank, mode)
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 4, 16, 8
    q, do = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, hkv, T, D, generator=g), torch.randn(B, hkv, T, D, generator=g)
    ids = torch.randint(0, 5, (B, T), generator=g)  # token 0 ends a document
    full_docs = (
        document_mask(ids, 0, backend="reference", head_dim=D, dtype=torch.float32, window=window)
        if docs
        else None
    )
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*ref, causal=True, backend="reference", doc_ids=full_docs, window=window)
    out.backward(do)
    local_docs = (
        cp.documents(
            cp.split(ids), 0, backend="reference", head_dim=D, dtype=torch.float32, window=window
        )
        if docs
        else None
    )
    mine = [cp.split(t, dim=2).requires_grad_() for t in (q, k, v)]
    RING_WORK.clear()
    with CommCounter() as counter:
        y = cp.attention(
            attention,
            *mine,
            causal=True,
            dropout_p=0.0,
            backend="reference",
            doc_ids=local_docs,
            window=window,
        )
        y.backward(cp.split(do, dim=2))
    errs = [float((y.detach() - cp.split(out.detach(), dim=2)).abs().max())]
    errs += [float((a.grad - cp.split(b.grad, dim=2)).abs().max()) for a, b in zip(mine, ref)]
    return {
        "err": max(errs),
        "pairs": RING_WORK["pairs"],
        "bytes": dict(counter.bytes),
    }


def _attention_suite(rank: int, world: int) -> dict:
    """Every mode x key/value heads (MHA, GQA, fewer than the ranks) x document mask x window."""
    return {
        (mode, hkv, docs, window): _attention_case(rank, world, mode, hkv, docs, window)
        for mode in ("ring", "all_to_all")
        for hkv in (4, 2, 1)
        for docs in (False, True)
        for window in (None, 5)
    }


def _check_attention(results: list[dict], world: int) -> None:
    B, H, T, D, f32 = 2, 4, 16, 8, 4
    for case in results[0]:
        mode, hkv, docs, window = case
        for r in results:
            assert r[case]["err"] < 1e-5, (case, r[case]["err"])
        if mode == "ring":
            if window is None:  # balanced: every rank 2N + 1 chunk pairs (of the 2N x 2N)
                assert [r[case]["pairs"] for r in results] == [2 * world + 1] * world, case
            block = 2 * B * hkv * (T // world) * D * f32  # one K/V block, bytes
            for r in results:  # forward N-1 passes, backward N-1 (K, V) + N (dK, dV)
                assert r[case]["bytes"] == {
                    "cp_ring_kv": 2 * (world - 1) * block,
                    "cp_ring_dkv": world * block,
                }, case
        else:
            reps = 1 if hkv % world == 0 else world // math.gcd(hkv, world)
            local = B * (T // world) * D * f32 * (2 * H + 2 * hkv * reps)  # q, o; k, v; fwd
            for r in results:  # 4 tensors forward, 4 gradients backward, (N-1)/N of each sent
                assert r[case]["bytes"] == {"cp_all_to_all": 2 * local * (world - 1) // world}, case


# ----------------------------------------------------------------------------- the model

MODELS = {
    "mha-rope": dict(n_heads=4, n_kv_heads=None),
    "gqa-learned-untied": dict(
        n_heads=8,
        n_kv_heads=2,
        d_model=64,
        position="learned",
        tie_embeddings=False,
        bias=True,
        norm="layernorm",
        activation="gelu",
    ),
    "gqa-window-qknorm": dict(n_heads=8, n_kv_heads=4, d_model=64, sliding_window=5, qk_norm=True),
    # multi-head latent attention: value heads (6) narrower than query/key heads (8 + 4)
    "mla": dict(
        n_heads=4,
        attention="mla",
        mla=MLAConfig(
            q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
        ),
    ),
}


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return float((a - b).norm() / max(float(b.norm()), floor, 1e-30))


def _model_case(rank: int, topo, mode: str, sp: bool, variant: str, docs: bool) -> dict:
    from megaformer.config import ModelConfig
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.context import apply_context
    from megaformer.parallel.plan import padded_vocab_size, parallelize

    cfg = ModelConfig(
        **{
            **dict(
                vocab_size=VOCAB,
                d_model=32,
                n_layers=2,
                max_seq_len=16,
                d_ffn=64,
                document_mask=docs,
            ),
            **MODELS[variant],
        }
    )
    torch.manual_seed(0)
    ref = Transformer(cfg, padded_vocab_size=padded_vocab_size(VOCAB, 1, 8))
    torch.manual_seed(0)
    model = Transformer(cfg, padded_vocab_size=padded_vocab_size(VOCAB, topo.tp, 8))
    parallelize(model, topo, sp, None)
    cp = apply_context(model, topo, mode)
    ref.eod_id = model.eod_id = EOD
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1) for m in (ref, model)]
    gen = torch.Generator().manual_seed(1)
    losses, errs = [], []
    for step in range(3):
        x = torch.randint(0, VOCAB, (2, 16), generator=gen)
        y = torch.randint(0, VOCAB, (2, 16), generator=gen)
        x[0, [3, 10]] = EOD
        x[1, 6] = EOD
        y[0, :3] = -100  # ignored labels, all on one context rank: counted globally
        for opt in opts:
            opt.zero_grad()
        ref_loss = ref(x, y)
        ref_loss.backward()
        loss = cp.scale_loss(model(cp.split(x), cp.split(y)), cp.split(y))  # as the train step
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=topo.group("cp"))
        losses.append((ref_loss.item(), mean_loss.item() / topo.cp))
        ref_grads = {
            n: p.grad[:VOCAB] if ("emb" in n or "lm_head" in n) else p.grad
            for n, p in ref.named_parameters()
        }
        full = full_gradients(model, topo.tp, topo.group("tp"), topo.cp, topo.group("cp"))
        grads = {n: g[:VOCAB] if ("emb" in n or "lm_head" in n) else g for n, g in full.items()}
        assert grads.keys() == ref_grads.keys()
        total = float(torch.stack([g.norm() for g in ref_grads.values()]).norm())
        errs.append(max(_rel(grads[n], ref_grads[n], 1e-3 * total) for n in ref_grads))
        for opt in opts:
            opt.step()
    return {"losses": losses, "errs": errs}


def _suite(rank: int, world: int, model_cases: list[tuple]) -> dict:
    from megaformer.parallel.topology import build_topology

    out = {"attention": _attention_suite(rank, world)}
    topos: dict = {}
    for tp, cp, mode, sp, variant, docs in model_cases:
        if (tp, cp) not in topos:
            topos[tp, cp] = build_topology(world, rank, tp=tp, cp=cp)
        out[(tp, cp, mode, sp, variant, docs)] = _model_case(
            rank, topos[tp, cp], mode, sp, variant, docs
        )
    return out


CASES = {
    2: [
        (1, 2, mode, False, variant, docs)
        for mode in ("ring", "all_to_all")
        for variant in ("mha-rope", "gqa-learned-untied")
        for docs in (False, True)
    ]
    + [(1, 2, mode, False, "gqa-window-qknorm", True) for mode in ("ring", "all_to_all")]
    + [
        (1, 2, mode, False, "mla", docs)
        for mode in ("ring", "all_to_all")
        for docs in (False, True)
    ],
    4: [
        (1, 4, mode, False, variant, docs)
        for mode in ("ring", "all_to_all")
        for variant, docs in (("mha-rope", True), ("gqa-learned-untied", False))
    ]
    + [
        (2, 2, "ring", True, "gqa-window-qknorm", True),
        (2, 2, "all_to_all", True, "gqa-window-qknorm", True),
        (2, 2, "ring", False, "gqa-learned-untied", True),
        (2, 2, "all_to_all", False, "mha-rope", False),
        (2, 2, "all_to_all", True, "mla", True),
        (2, 2, "ring", True, "mla", True),
    ],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_and_model_equal_one_process(world):
    results = run_ranks(world, _suite, CASES[world])
    _check_attention([r["attention"] for r in results], world)
    for case in CASES[world]:
        for r in results:
            for ref_loss, cp_loss in r[case]["losses"]:
                assert abs(cp_loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, r[case]["losses"])
            assert max(r[case]["errs"]) < 1e-5, (case, r[case]["errs"])


def test_split_layouts_and_positions():
    from megaformer.parallel.context import local_positions, split_sequence

    t = torch.arange(16).view(1, 16)
    assert split_sequence(t, 1, 4, "ring").tolist() == [[2, 3, 12, 13]]  # chunks 1 and 6 of 8
    assert split_sequence(t, 0, 4, "ring").tolist() == [[0, 1, 14, 15]]
    assert split_sequence(t, 2, 4, "all_to_all").tolist() == [[8, 9, 10, 11]]
    parts = torch.cat([local_positions(r, 4, "ring", 4) for r in range(4)])
    assert sorted(parts.tolist()) == list(range(16))  # the parts cover the sequence once
    with pytest.raises(ValueError, match="8 equal chunks"):
        split_sequence(torch.zeros(1, 12), 0, 4, "ring")


# ----------------------------------------------------------------------------- config refusals


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["parallel.context=2", "data.seq_len=30", "model.max_seq_len=32"],
            "divisible by 2 * context = 4",
        ),
        (
            [
                "parallel.context=3",
                "parallel.context_mode=all_to_all",
                "data.seq_len=30",
                "model.max_seq_len=32",
            ],
            "heads per tensor-parallel rank must be divisible",
        ),
        (["parallel.context=2", "model.attention_backend=sdpa"], "attention_backend=sdpa"),
        (["parallel.context=2", "model.attention_dropout=0.1"], "no attention dropout"),
        (
            [
                "parallel.context=2",
                "model.moe.interval=1",
                "model.moe.num_experts=4",
                "model.moe.dropless=false",
                "model.moe.capacity_factor=1.25",
            ],
            "model.moe.dropless=false",
        ),
    ],
)
def test_unsupported_context_parallel_configs_are_refused(overrides, needle):
    from megaformer.config import load_config
    from megaformer.errors import ConfigError

    with pytest.raises(ConfigError, match=needle.replace("*", r"\*")) as e:
        load_config("configs/quickstart.yaml", overrides)
    assert "\n" not in str(e.value)


def test_all_to_all_accepts_any_backend_and_dropout():
    from megaformer.config import load_config

    cfg = load_config(
        "configs/quickstart.yaml",
        [
            "parallel.context=2",
            "parallel.context_mode=all_to_all",
            "model.attention_backend=sdpa",
            "model.attention_dropout=0.1",
        ],
    )
    assert cfg.parallel.context == 2


# ----------------------------------------------------------------------------- training

COMMON = tiny_overrides(
    "stdlib",
    **{
        "train.steps": 3,
        "eval.interval": 3,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 8,
        "model.d_ffn": 64,
        "checkpoint.interval": 2,
    },
)


def _same(ref: Path, run: Path, steps=(1, 2, 3)) -> None:
    """Losses, gradient norms, validation loss and diagnostics (where logged) within 1e-5."""
    a, b = step_records(ref), step_records(run)
    for step in steps:
        keys = ["loss", "grad_norm"] + [k for k in a[step] if "/" in k and k != "diag_time_s"]
        for key in keys:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-6), (step, key)
    assert b[3]["val_loss"] == pytest.approx(a[3]["val_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[bool, Path]:
    """One process, with document masks, and without them but with the residual-stream
    diagnostics (every step): the runs every CP layout must match."""
    out = {}
    for docs in (True, False):
        run = tmp_path_factory.mktemp("cp") / f"ref-{docs}"
        proc = run_cli(
            "train",
            "configs/quickstart.yaml",
            *COMMON,
            f"model.document_mask={str(docs).lower()}",
            f"log.diagnostics={str(not docs).lower()}",
            "log.diagnostics_interval=1",
            "--run-dir",
            str(run),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[docs] = run
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ring_cp2_dp2_zero2_with_documents_equals_one_process_and_resumes_at_cp1(
    references, tmp_path
):
    run = tmp_path / "cp"
    proc = run_torchrun(
        4,
        "train",
        "configs/quickstart.yaml",
        *COMMON,
        "model.document_mask=true",
        "parallel.context=2",
        "parallel.zero_stage=2",
        "log.sample_tokens=5",
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CP 2 (ring)" in proc.stdout and "context-parallel groups:  [0,1] [2,3]" in proc.stdout
    _same(references[True], run)
    gen = cli_main("generate", str(run), "--prompt", "def", "--max-new-tokens", "5")
    assert gen.returncode == 0 and gen.stdout.startswith("def"), gen.stderr[-2000:]
    # the checkpoint of step 2 resumed by one process (CP 1) continues as the reference does
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000003")
    (resumed / "checkpoints" / "latest").write_text("step_0000002\n")
    proc = run_cli(
        "train",
        "configs/quickstart.yaml",
        *COMMON,
        "model.document_mask=true",
        "parallel.zero_stage=2",
        "--run-dir",
        str(resumed),
    )
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    _same(references[True], resumed, steps=(3,))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_all_to_all_cp2_pp2_equals_one_process(references, tmp_path):
    run = tmp_path / "cp-pp"
    proc = run_torchrun(
        4,
        "train",
        "configs/quickstart.yaml",
        *COMMON,
        "parallel.context=2",
        "parallel.context_mode=all_to_all",
        "parallel.pipeline=2",
        "log.diagnostics=true",
        "log.diagnostics_interval=1",
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CP 2 (all_to_all)" in proc.stdout
    _same(references[False], run)  # diagnostics included: each context rank ran whole sequences
    assert any("/" in k for k in step_records(run)[1])


def test_print_model_names_the_swapped_attention_cores():
    """Context parallelism and recomputation swap ``Attention.core`` (a child module), so the
    model's printout says which core runs; the parameter names do not change."""
    from types import SimpleNamespace

    from megaformer.config import ModelConfig
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.context import ContextParallelAttention, apply_context
    from megaformer.parallel.recompute import CheckpointedAttentionCore, apply_recompute

    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    plain = Transformer(cfg)
    assert "(core): AttentionCore()" in str(plain)
    topo = SimpleNamespace(
        cp=2, cp_rank=1, groups=SimpleNamespace(cp=None)
    )  # a group of two, unused
    for recompute in ("selective", "full"):
        model = Transformer(cfg)
        apply_recompute(model.layers, recompute)
        cp = apply_context(model, topo, "ring")
        text = str(model)
        core = model.layers[1].attn.core
        assert isinstance(core, ContextParallelAttention) and core.cp is cp
        assert "(core): ContextParallelAttention(" in text
        assert "mode=ring, size=2, rank=1 (ring attention; inner only while disabled)" in text
        if recompute == "selective":
            assert isinstance(core.inner, CheckpointedAttentionCore)
            assert "(inner): CheckpointedAttentionCore(\n" in text
            assert "recomputes inner in backward\n" in text
        else:
            assert "CheckpointedBlock(\n      recomputes Block in backward" in text
            assert "(inner): AttentionCore()" in text
        assert str(model.layers[0]) == str(model.layers[1])  # (printed once: "2 x Block")
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ring_cp2_dp2_with_zero1_and_zero3_equals_one_process(references, tmp_path):
    """The ZeRO stages the docs claim beside context parallelism (partitions over DP x CP)."""
    for zero in (1, 3):
        run = tmp_path / f"cp-zero{zero}"
        proc = run_torchrun(
            4,
            "train",
            "configs/quickstart.yaml",
            *COMMON,
            "model.document_mask=true",
            "parallel.context=2",
            f"parallel.zero_stage={zero}",
            "--run-dir",
            str(run),
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "CP 2 (ring)" in proc.stdout, proc.stdout[-2000:]
        _same(references[True], run)
