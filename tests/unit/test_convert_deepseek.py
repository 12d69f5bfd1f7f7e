"""DeepseekV3ForCausalLM in and out: a tiny model made by ``transformers`` (multi-head latent
attention with and without the query latent, YaRN with DeepSeek's mscale, 8 experts in 4 groups
of which 2 are kept, the routed scale, a shared expert, the first block dense), every norm gain
and the expert biases perturbed: megaformer's logits equal transformers' within 1e-5 (fp32),
exporting back gives identical tensors, greedy generation through the latent KV cache gives the
same tokens, --verify passes; the multi-token prediction module is not imported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaformer.checkpoint.hf.convert import export_to_hf, import_from_hf
from megaformer.checkpoint.router_state import read_router_state
from megaformer.generation import load_checkpoint_model
from tests.helpers import assert_one_line_error, cli_main
from tests.unit.test_convert_open_weights import _hf, _ids, _tensors, save_folders

transformers = pytest.importorskip("transformers")

VOCAB = 300
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 0.8,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
    "rope_theta": 10000.0,
}
COMMON = dict(
    vocab_size=VOCAB,
    bos_token_id=256,
    eos_token_id=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    max_position_embeddings=64,
)
KINDS = {
    "q-latent-yarn": dict(q_lora_rank=24, rope_parameters=YARN),
    "direct-queries": dict(q_lora_rank=None),
}


def _hf_model(kind: str):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**COMMON, **KINDS[kind])
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm gains 1 would hide a wrong mapping
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)  # the router too (transformers starts it at zeros)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # changes which experts are chosen
                b.copy_(0.05 * torch.randn_like(b))
    return model.eval()


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    return save_folders(tmp_path_factory.mktemp("hf"), KINDS, _hf_model)


@pytest.mark.parametrize("kind", list(KINDS))
def test_import_equals_transformers_export_is_identical_generation_equal(
    hf_folders, tmp_path, kind
):
    src = hf_folders[kind]
    run = import_from_hf(src, tmp_path / "run")
    ours, _, cfg, ckpt = load_checkpoint_model(run)
    m = cfg.model
    assert m.attention == "mla" and m.moe.num_groups == 4 and m.moe.first_dense == 1
    assert (m.mla.q_lora_rank is None) == (kind == "direct-queries")
    biases = read_router_state(ckpt)  # the expert biases travel as the router state
    assert sorted(biases) == ["layers.1.mlp.expert_bias", "layers.2.mlp.expert_bias"]
    theirs_model = _hf(src)
    with torch.no_grad():
        ours_logits, theirs = ours(_ids()), theirs_model(_ids()).logits
    diff = (ours_logits - theirs).abs().max().item()
    print(f"{kind}: max |logit difference| against transformers = {diff:.3g}")
    assert diff <= 1e-5 and theirs.std().item() > 0.1, diff

    back = export_to_hf(run, tmp_path / "back")  # the class chosen for the model by itself
    a, b = _tensors(src), _tensors(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    again = _hf(back)
    assert type(again).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        assert (again(_ids()).logits - theirs).abs().max().item() == 0.0

    prompt = _ids(6)[:1]  # 6 + 20 tokens: past the original RoPE context
    hf_out = theirs_model.generate(prompt, max_new_tokens=20, do_sample=False)
    ours_out = ours.generate(prompt, 20, temperature=0, eos_id=256)
    assert hf_out.tolist() == ours_out.tolist()


def test_the_conversion_is_not_vacuous(hf_folders, tmp_path):
    """Without the expert biases, the groups or YaRN's attention scale
    the logits differ."""
    from megaformer.model.moe import MoE
    from megaformer.model.transformer import Transformer

    run = import_from_hf(hf_folders["q-latent-yarn"], tmp_path / "run")
    model, _, cfg, _ = load_checkpoint_model(run)
    with torch.no_grad():
        base = model(_ids())
        for change in ("bias", "groups", "mscale"):
            other = Transformer(cfg.model).eval()
            other.load_state_dict(model.state_dict())
            for a, b in zip(model.modules(), other.modules()):
                if isinstance(a, MoE):
                    b.expert_bias.copy_(a.expert_bias if change != "bias" else 0 * a.expert_bias)
                    if change == "groups":
                        b.top_groups = b.num_groups
                if change == "mscale" and hasattr(b, "softmax_scale"):
                    b.softmax_scale = 1.0
            assert (other(_ids()) - base).abs().max().item() > 1e-4, change


def test_verify_and_the_mtp_module_is_left_with_a_note(hf_folders, tmp_path, caplog):
    """The released checkpoints hold the multi-token prediction module as block L: not read."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "with_mtp"
    shutil.copytree(hf_folders["direct-queries"], src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    proc = cli_main("convert", str(src), str(tmp_path / "run"), "--to", "megaformer", "--verify")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verify: max |logit difference|" in proc.stdout
    assert "(multi-token prediction) are not imported" in caplog.text


def test_export_refuses_what_the_class_lacks(hf_folders, tmp_path):
    import yaml

    run = import_from_hf(hf_folders["direct-queries"], tmp_path / "run")
    ckpt = run / "checkpoints" / "step_0000000"
    raw = yaml.safe_load((ckpt / "config.yaml").read_text())
    raw["model"]["moe"]["score"] = "softmax"
    (ckpt / "config.yaml").write_text(yaml.safe_dump(raw))
    proc = cli_main(
        "convert", str(run), str(tmp_path / "out"), "--to", "hf", "--arch", "deepseek_v3"
    )
    assert_one_line_error(
        proc, "model.moe.score=softmax cannot be expressed by DeepseekV3ForCausalLM"
    )


def test_init_from_reads_the_weights_and_the_expert_biases(hf_folders, tmp_path):
    """``model.init_from`` with a DeepseekV3ForCausalLM folder: its shapes and routing keys, its
    expert biases (kept as they are with bias_update_rate 0: the checkpoint's router state after
    one step equals the folder's e_score_correction_bias)."""
    from safetensors.torch import load_file

    from tests.helpers import ROOT

    src = hf_folders["q-latent-yarn"]
    run = tmp_path / "run"
    proc = cli_main(
        "train",
        str(ROOT / "configs" / "deepseek-tiny.yaml"),
        "--run-dir",
        str(run),
        f"model.init_from={src}",
        f"data.tokenizer={src / 'tokenizer.json'}",
        "model.moe.bias_update_rate=0",
        "model.max_seq_len=32",
        "train.steps=1",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "data.max_bytes=200000",
        "eval.interval=0",
        "log.sample_tokens=0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = load_file(str(src / "model.safetensors"))
    saved = read_router_state(run / "checkpoints" / "step_0000001")
    assert sorted(saved) == ["layers.1.mlp.expert_bias", "layers.2.mlp.expert_bias"]
    for i in (1, 2):
        want = theirs[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        assert want.abs().max() > 0 and torch.equal(saved[f"layers.{i}.mlp.expert_bias"], want)
