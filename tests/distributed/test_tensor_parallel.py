"""Tensor and sequence parallelism equal one process: losses and every gradient, over 3 steps.

Each rank builds the whole model from the seed (the reference, run in-process on every rank) and a
tensor-parallel copy; both take 3 AdamW steps with global-norm clipping on the same batches. The
TP copy's gradients are gathered to full shape and compared with the reference's, relative to the
reference's norm (1e-5, fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.helpers import (
    cli_main,
    full_gradients,
    reference_and_tensor_parallel,
    run_cli,
    run_torchrun,
    tiny_overrides,
)

pytestmark = pytest.mark.multiprocess

VARIANTS = {
    "mha-swiglu-tied": dict(n_heads=4, n_kv_heads=None, activation="swiglu", tie_embeddings=True),
    "gqa-gelu-untied-bias": dict(
        n_heads=8,
        n_kv_heads=4,
        d_model=64,
        activation="gelu",
        tie_embeddings=False,
        bias=True,
        norm="layernorm",
        position="learned",
    ),
    "gqa-parallel-residual": dict(n_heads=8, n_kv_heads=4, residual="parallel", d_model=64),
    # the output projection fused with a chunked vocab-parallel CE (chunks of 5 of the 32 tokens);
    # its TP=1 form equals the plain loss in tests/unit/test_fast_paths.py
    "chunked-ce-tied": dict(
        n_heads=4, activation="swiglu", tie_embeddings=True, loss_chunk_tokens=5
    ),
    "chunked-ce-untied-gelu": dict(
        n_heads=4,
        activation="gelu",
        tie_embeddings=False,
        bias=True,
        norm="layernorm",
        loss_chunk_tokens=5,
    ),
    # Qwen3/Qwen2/Mistral switches: heads wider than d_model / h, replicated q/k norms (their
    # gradients summed over TP), q/k/v biases split with their columns, a sliding window, YaRN
    "qk-norm-qkv-bias-window": dict(
        n_heads=8,
        n_kv_heads=4,
        head_dim=8,
        qk_norm=True,
        qkv_bias=True,
        sliding_window=5,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8},
    ),
    # multi-head latent attention: the up-projections split by heads, the latents, the shared
    # rotary key and their norms replicated (gradients summed over TP); YaRN with DeepSeek's scale
    "mla-q-latent-yarn": dict(
        n_heads=4,
        attention="mla",
        mla={
            "q_lora_rank": 12,
            "kv_lora_rank": 10,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4,
            "v_head_dim": 6,
        },
        rope_scaling={
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 8,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    "mla-direct-queries": dict(
        n_heads=4,
        attention="mla",
        mla={"q_lora_rank": None, "kv_lora_rank": 10, "qk_nope_head_dim": 8, "v_head_dim": 6},
    ),
    # DeepSeek-V3: latent attention, group-limited sigmoid MoE with a shared expert after a dense
    # block, two multi-token prediction modules (MoE blocks too); no sequence parallelism
    "deepseek-mtp": dict(
        n_heads=4,
        n_layers=2,
        attention="mla",
        mla={"q_lora_rank": 12, "kv_lora_rank": 10, "qk_nope_head_dim": 8, "v_head_dim": 6},
        moe={
            "interval": 1,
            "first_dense": 1,
            "num_experts": 8,
            "top_k": 3,
            "score": "sigmoid",
            "d_expert": 16,
            "num_shared_experts": 1,
            "num_groups": 4,
            "top_groups": 2,
            "routed_scaling_factor": 2.5,
            "aux_loss_coef": 0.0,
        },
        mtp_depth=2,
        mtp_loss_coef=0.3,
    ),
}


def _model_cfg(**kw):
    from megaformer.config import MLAConfig, ModelConfig, MoEConfig

    base = dict(vocab_size=257, d_model=32, n_layers=2, max_seq_len=16, d_ffn=64)
    base.update(kw)
    if isinstance(base.get("mla"), dict):
        base["mla"] = MLAConfig(**base["mla"])
    if isinstance(base.get("moe"), dict):
        base["moe"] = MoEConfig(**base["moe"])
    return ModelConfig(**base)


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """||a - b|| / max(||b||, floor). The floor (a small fraction of the whole gradient's norm)
    matters only for gradients that are zero in exact arithmetic, e.g. a key bias, which softmax
    ignores: there both sides hold round-off noise, and it is the absolute agreement that counts."""
    return float((a - b).norm() / max(float(b.norm()), floor, 1e-30))


def _tp_vs_reference(rank: int, world: int, variant: str, sp: bool) -> dict:
    from megaformer.parallel.grad_norm import global_grad_norm

    cfg = _model_cfg(**VARIANTS[variant])
    ref, tp, topo, full0 = reference_and_tensor_parallel(cfg, world, rank, sp)
    init_err = max(
        _rel(full0[n], p.detach()[:257] if "emb" in n or "lm_head" in n else p.detach())
        for n, p in ref.named_parameters()
    )
    # a small lr: AdamW divides by sqrt(v), which amplifies fp32 round-off in near-zero gradients
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1) for m in (ref, tp)]
    gen = torch.Generator().manual_seed(1)
    losses, grad_errs, norms = [], [], []
    for step in range(3):
        x = torch.randint(0, 257, (2, 16), generator=gen)
        y = torch.randint(0, 257, (2, 16), generator=gen)
        y[0, :3] = -100  # ignored positions
        pair = []
        for model, opt in zip((ref, tp), opts):
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            pair.append(loss.item())
        # gradients, gathered to full shape (vocab padding dropped)
        ref_grads = {
            n: p.grad[:257] if ("emb" in n or "lm_head" in n) else p.grad
            for n, p in ref.named_parameters()
        }
        tp_grads = {
            n: g[:257] if ("emb" in n or "lm_head" in n) else g
            for n, g in full_gradients(tp, world, topo.group("tp")).items()
        }
        assert tp_grads.keys() == ref_grads.keys()
        total = float(torch.stack([g.norm() for g in ref_grads.values()]).norm())
        errs = {n: _rel(tp_grads[n], ref_grads[n], 1e-3 * total) for n in ref_grads}
        grad_errs.append(max(errs.values()))
        worst = max(errs, key=errs.get)
        n_ref = global_grad_norm(ref.parameters(), None)
        n_tp = global_grad_norm(tp.parameters(), topo.group("tp"))
        norms.append((n_ref, n_tp))
        for model, n in ((ref, n_ref), (tp, n_tp)):
            coef = min(1.0, 0.5 / (n + 1e-6))  # clip to 0.5 so clipping is active
            for p in model.parameters():
                p.grad.mul_(coef)
        for opt in opts:
            opt.step()
        losses.append(pair)
    return {
        "worst": worst,
        "losses": losses,
        "grad_errs": grad_errs,
        "norms": norms,
        "init_err": init_err,
        "n_sharded": sum(getattr(p, "tensor_model_parallel", False) for p in tp.parameters()),
    }


def _tp_suite(rank: int, world: int) -> dict:
    return {
        f"{variant}/{'sp' if sp else 'nosp'}": _tp_vs_reference(rank, world, variant, sp)
        for variant in VARIANTS
        for sp in (False, True)
        # MoE multi-token prediction blocks are refused under sequence parallelism
        if not (sp and VARIANTS[variant].get("mtp_depth"))
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_one_process(tp):
    """Every variant x {with, without sequence parallelism}, vocabulary 257 (not divisible)."""
    results = run_ranks(tp, _tp_suite)
    for case in results[0]:
        for r in (res[case] for res in results):
            assert r["init_err"] == 0.0, case  # TP=N starts from TP=1's weights
            assert r["n_sharded"] > 0
            for ref_loss, tp_loss in r["losses"]:
                assert abs(tp_loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, r["losses"])
            assert max(r["grad_errs"]) < 1e-5, (case, r["grad_errs"], r["worst"])
            for n_ref, n_tp in r["norms"]:
                assert abs(n_tp - n_ref) <= 1e-5 * n_ref, case
        assert results[0][case]["losses"] == results[-1][case]["losses"]


def _vocab_parallel_ce(rank: int, world: int) -> dict:
    import torch.nn.functional as F

    from megaformer.parallel.layers import vocab_parallel_cross_entropy
    from megaformer.parallel.topology import build_topology

    topo = build_topology(world, rank, tp=world)
    gen = torch.Generator().manual_seed(0)
    V, Vp = 10, 12  # padded to 12: the last 2 columns must never count
    full = torch.randn(3, 5, Vp, generator=gen)
    labels = torch.randint(0, V, (3, 5), generator=gen)
    labels[1, 2] = -100
    shard = full.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(
        shard, labels, rank * Vp // world, topo.group("tp"), vocab_size=V
    )
    loss.backward()
    ref_in = full.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_in[..., :V].flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref.backward()
    ref_grad = ref_in.grad.chunk(world, dim=-1)[rank]
    return {
        "loss": (loss.item(), ref.item()),
        "grad_err": float((shard.grad - ref_grad).abs().max()),
        "pad_grad": float(ref_in.grad[..., V:].abs().max()),
    }


def test_vocab_parallel_cross_entropy_never_sees_padding():
    for r in run_ranks(2, _vocab_parallel_ce):
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-6)
        assert r["grad_err"] < 1e-6 and r["pad_grad"] == 0.0


def _rng_streams(rank: int, world: int) -> dict:
    from megaformer.config import ModelConfig
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.plan import ForkedAttentionCore, ForkedDropout, parallelize
    from megaformer.parallel.random import TensorParallelRNG
    from megaformer.parallel.topology import build_topology

    torch.manual_seed(7)
    rng = TensorParallelRNG(seed=7, tp_rank=rank)
    with rng.fork():
        sharded = torch.rand(4)
    replicated = torch.rand(4)
    torch.manual_seed(7)
    untouched = torch.rand(4)  # the default stream does not notice the fork
    topo = build_topology(world, rank, tp=world)
    cfg = ModelConfig(
        vocab_size=50,
        d_model=32,
        n_layers=1,
        n_heads=4,
        max_seq_len=8,
        dropout=0.5,
        attention_dropout=0.5,
    )
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        m = parallelize(Transformer(cfg), topo, sp, TensorParallelRNG(0, rank))
        out[sp] = (
            isinstance(m.layers[0].drop, ForkedDropout),
            isinstance(m.layers[0].attn.core, ForkedAttentionCore),
        )
    return {
        "sharded": sharded.tolist(),
        "replicated": replicated.tolist(),
        "untouched": untouched.tolist(),
        "wiring": out,
    }


def test_dropout_rng_differs_where_sharded_matches_where_replicated():
    a, b = run_ranks(2, _rng_streams)
    assert a["sharded"] != b["sharded"]
    assert a["replicated"] == b["replicated"] == a["untouched"]
    assert a["wiring"][False] == (False, True)  # residual dropout on replicated activations
    assert a["wiring"][True] == (True, True)  # under SP the residual stream is sharded


# ----------------------------------------------------------------------------- through DeepSpeed


def _records(run_dir: Path) -> dict[int, dict]:
    return {
        r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


TP_COMMON = tiny_overrides(
    "stdlib",
    **{
        "train.steps": 3,
        "eval.interval": 3,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 8,
        "model.d_ffn": 64,
        "log.sample_tokens": 10,
    },
)


@pytest.fixture(scope="module")
def tp_reference(tmp_path_factory) -> Path:
    """One process, TP_COMMON: the run every tensor-parallel layout must match."""
    run = tmp_path_factory.mktemp("tp") / "ref"
    ref = run_cli("train", "configs/quickstart.yaml", *TP_COMMON, "--run-dir", str(run))
    assert ref.returncode == 0, ref.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,stage,sp", [(2, 2, 1, True), (4, 2, 1, False), (4, 2, 2, True)])
def test_training_with_tp_and_zero_equals_one_process(tp_reference, tmp_path, world, tp, stage, sp):
    run = run_torchrun(
        world,
        "train",
        "configs/quickstart.yaml",
        *TP_COMMON,
        f"parallel.tensor={tp}",
        f"parallel.zero_stage={stage}",
        f"parallel.sequence_parallel={str(sp).lower()}",
        "--run-dir",
        str(tmp_path / "tp"),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"TP {tp}" in run.stdout and "tensor-parallel groups:   [0,1]" in run.stdout
    a, b = _records(tp_reference), _records(tmp_path / "tp")
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
    assert b[3]["val_loss"] == pytest.approx(a[3]["val_loss"], rel=1e-5)
    # the weights read back from the shards are full and unpadded, like a TP=1 checkpoint's
    from megaformer.checkpoint.weights import load_weights

    wa = load_weights(tp_reference / "checkpoints/step_0000003")
    wb = load_weights(tmp_path / "tp/checkpoints/step_0000003")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].shape == wb[k].shape
        assert float((wa[k] - wb[k]).norm() / wa[k].norm()) < 1e-5, k
    gen = cli_main("generate", str(tmp_path / "tp"), "--prompt", "def", "--max-new-tokens", "5")
    assert gen.returncode == 0 and gen.stdout.startswith("def")


@pytest.mark.slow
def test_resume_under_tensor_and_sequence_parallelism_is_exact(tmp_path):
    """TP=2 with SP and dropout (both RNG streams in use): stop at step 2, resume, same losses."""
    args = tiny_overrides(
        "stdlib",
        **{
            "train.steps": 4,
            "eval.interval": 0,
            "checkpoint.interval": 2,
            "model.dropout": 0.1,
            "model.attention_dropout": 0.1,
            "parallel.tensor": 2,
            "parallel.sequence_parallel": "true",
        },
    )
    full = tmp_path / "full"
    assert (
        run_torchrun(
            2, "train", "configs/quickstart.yaml", *args, "--run-dir", str(full)
        ).returncode
        == 0
    )
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000004")
    (resumed / "checkpoints" / "latest").write_text("step_0000002\n")
    proc = run_torchrun(2, "train", "configs/quickstart.yaml", *args, "--run-dir", str(resumed))
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    a, b = _records(full), _records(resumed)
    assert [b[s]["loss"] for s in (3, 4)] == [a[s]["loss"] for s in (3, 4)]
