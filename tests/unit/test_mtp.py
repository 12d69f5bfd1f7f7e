"""Multi-token prediction (DeepSeek-V3 section 2.2) against its equations computed by hand from
the modules' weights; training only (evaluation and generation are the main model's); its
parameters and FLOPs equal the module's and FlopCounterMode's; the loss is logged apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaformer.config import MLAConfig, ModelConfig, MoEConfig
from megaformer.model.transformer import Transformer
from tests.helpers import ROOT, cli_main, step_records


def _cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=50,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=32,
        mtp_depth=2,
        mtp_loss_coef=0.3,
        attention_backend="reference",
    )
    return ModelConfig(**{**base, **kw})


def _deepseek(first_dense: int) -> dict:
    """Multi-head latent attention and sigmoid MoE blocks after the first ``first_dense``."""
    return dict(
        attention="mla",
        mla=MLAConfig(
            q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
        ),
        moe=MoEConfig(
            interval=1,
            first_dense=first_dense,
            num_experts=4,
            top_k=2,
            score="sigmoid",
            d_expert=16,
            num_shared_experts=1,
            aux_loss_coef=0.0,
        ),
    )


def _rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def _perturbed(cfg: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("mla", [False, True])
def test_loss_equals_the_equations_and_is_training_only(mla):
    extra = _deepseek(first_dense=2) if mla else {}
    cfg = _cfg(**extra)
    model = _perturbed(cfg).train()
    x = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    y[0, :3] = -100
    T = x.shape[1]
    with torch.no_grad():
        loss = model(x, y)
        # by hand: h^0 the last block's output, module k on the tokens k ahead
        h = model.tok_embeddings(x)
        for block in model.layers:
            h = block(h)
        main = F.cross_entropy(model.lm_head(model.final_norm(h)).flatten(0, 1), y.flatten())
        mtp = []
        for k, mod in enumerate(model.mtp, start=1):
            eps = cfg.norm_eps
            joined = torch.cat(
                (
                    _rms(h[:, : T - k], mod.hidden_norm.weight, eps),
                    _rms(model.tok_embeddings(x[:, k:]), mod.embed_norm.weight, eps),
                ),
                dim=-1,
            )
            h = mod.block(joined @ mod.proj.weight.T)
            logits = model.lm_head(mod.norm(h))
            mtp.append(F.cross_entropy(logits.flatten(0, 1), y[:, k:].flatten()))
        want = main + 0.3 / 2 * (mtp[0] + mtp[1])
    assert abs(loss.item() - want.item()) < 1e-5, (loss.item(), want.item())
    assert (mtp[0] - main).abs() > 1e-3  # a different loss, not the main one again
    metrics = model.mtp_metrics.take()
    assert abs(metrics["mtp/loss"] - (mtp[0] + mtp[1]).item() / 2) < 1e-5
    # evaluation and generation: the main model alone, equal to one built without the modules
    plain_cfg = _cfg(**extra)
    plain_cfg.mtp_depth = 0
    plain = Transformer(plain_cfg).eval()
    missing = plain.load_state_dict(
        {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    )
    assert not missing.missing_keys
    model.eval()
    with torch.no_grad():
        assert model(x, y).item() == pytest.approx(main.item(), abs=1e-6)
        assert torch.equal(model(x), plain(x))
        assert torch.equal(
            model.generate(x[:1, :4], 6, temperature=0), plain.generate(x[:1, :4], 6, temperature=0)
        )
    assert model.mtp_metrics.take() == {}  # nothing recorded out of training


@pytest.mark.parametrize("mla", [False, True])
def test_parameter_and_flop_counts_equal_the_module_and_the_flop_counter(mla):
    from torch.utils.flop_counter import FlopCounterMode

    from megaformer.analysis.flops import step_flops
    from megaformer.analysis.params import count_parameters

    extra = dict(tie_embeddings=False)
    if mla:
        extra.update(_deepseek(first_dense=1))
    cfg = _cfg(**extra)
    model = _perturbed(cfg).train()
    counts = count_parameters(cfg)
    assert counts["total"] == model.num_parameters()
    if mla:  # the modules' block is MoE (block 2 and 3 of a model whose block 0 is dense)
        assert counts["total"] - counts["active"] == 3 * 2 * (3 * 32 * 16)
    x = torch.randint(0, 50, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    assert counter.get_total_flops() == step_flops(cfg, 16, 2, causal=False).hardware


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["parallel.pipeline=2"], None),  # the last stage runs them (MoE blocks, untied)
        (
            [
                "parallel.pipeline=2",
                "model.tie_embeddings=true",
                "parallel.pipeline_schedule=dualpipev",
            ],
            "model.mtp_depth=1 with parallel.pipeline=2: not supported (the modules run on",
        ),
        (
            ["parallel.tensor=2", "parallel.sequence_parallel=true"],
            "model.mtp_depth=1 with parallel.sequence_parallel=true: not supported (its MoE",
        ),
        (
            ["parallel.tensor=2", "parallel.sequence_parallel=true", "model.moe.interval=0"],
            None,  # dense modules split their own sequences
        ),
        (
            ["parallel.context=2", "parallel.context_mode=all_to_all"],
            "model.mtp_depth=1 with parallel.context=2: not supported (its MoE blocks",
        ),
        (["parallel.context=2", "model.moe.interval=0"], None),  # dense modules split
        (["model.mtp_depth=-1"], "model.mtp_depth=-1: must be >= 0"),
        (["parallel.tensor=2"], None),  # tensor parallelism without sequence parallelism runs
    ],
)
def test_refusals_are_one_line(overrides, needle):
    from megaformer.config import ConfigError, load_config, validate

    def check() -> None:
        path = ROOT / "configs" / "deepseek-tiny.yaml"
        validate(load_config(path, ["model.mtp_depth=1", *overrides]))

    if needle is None:
        check()
        return
    with pytest.raises(ConfigError) as e:
        check()
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_training_logs_the_mtp_loss_apart(tmp_path):
    proc = cli_main(
        "train",
        str(ROOT / "configs" / "deepseek-tiny.yaml"),
        "--run-dir",
        str(tmp_path / "run"),
        "model.mtp_depth=1",
        "train.steps=8",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "model.max_seq_len=64",
        "data.max_bytes=400000",
        "eval.interval=4",
        "checkpoint.interval=0",
        "log.interval=1",
        "log.sample_tokens=0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = step_records(tmp_path / "run")
    mtp = [records[s]["mtp/loss"] for s in sorted(records)]
    losses = [records[s]["loss"] for s in sorted(records)]
    assert len(mtp) == 8 and mtp[-1] < mtp[0]
    # the logged loss is the objective: main + 0.3 * mtp, so above the mtp share alone
    assert all(loss > 0.3 * m for loss, m in zip(losses, mtp))
    # export: the main model as DeepseekV3ForCausalLM, equal logits, without the modules
    proc = cli_main(
        "convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf", "--verify"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verify: max |logit difference|" in proc.stdout
    config = (tmp_path / "hf" / "config.json").read_text()
    assert '"DeepseekV3ForCausalLM"' in config and '"num_nextn_predict_layers": 0' in config
