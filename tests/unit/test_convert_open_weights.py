"""Open-weight model classes in and out: Llama 3.x (llama3-scaled RoPE), Qwen2 (q/k/v biases,
sliding window, YaRN), Qwen3 (q/k norms, head_dim != d_model / h), Mistral (sliding window).

Tiny models made by ``transformers`` itself, every norm gain and bias perturbed, on sequences
longer than the sliding window and than the original RoPE context: megaformer's logits equal
transformers' within 1e-5 (fp32), exporting back gives identical tensors, greedy generation
(KV cache) gives the same tokens. Plus the tokenizer cases (weights only, SentencePiece,
configured eos), a minimal config.json, refusals, --verify, and the RoPE/attention switches
against transformers' own formulas.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import weights as ckpt_weights
from megaformer.checkpoint.hf.convert import export_to_hf, import_from_hf
from megaformer.checkpoint.hf.tokenizer_files import byte_tokenizer_as_hf
from megaformer.generation import load_checkpoint_model
from tests.helpers import assert_one_line_error, cli_main, run_torchrun, tiny_overrides

transformers = pytest.importorskip("transformers")

VOCAB, T = 300, 40  # T > the windows (8) and the original RoPE contexts (16) below
COMMON = dict(
    vocab_size=VOCAB,
    bos_token_id=256,
    eos_token_id=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}
KINDS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3)),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
            rope_parameters=YARN,
        ),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=8)),
}


def _hf_model(kind: str):
    config_cls, model_cls, extra = KINDS[kind]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm gains 1 and biases 0 would hide a wrong mapping
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def save_folders(base: Path, kinds: Any, make: Any) -> dict[str, Path]:
    """Each ``make(kind)`` saved with the byte tokenizer as a Hugging Face folder under ``base``."""
    out = {}
    for kind in kinds:
        make(kind).save_pretrained(base / kind)
        byte_tokenizer_as_hf().save(str(base / kind / "tokenizer.json"))
        out[kind] = base / kind
    return out


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    return save_folders(tmp_path_factory.mktemp("hf"), KINDS, _hf_model)


def _ids(n: int = T) -> torch.Tensor:
    return torch.randint(0, 257, (2, n), generator=torch.Generator().manual_seed(1))


def _hf(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32
    ).eval()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_import_equals_transformers_export_is_identical_generation_equal(
    hf_folders, tmp_path, kind
):
    src = hf_folders[kind]
    run = import_from_hf(src, tmp_path / "run")
    ours, _, cfg, _ = load_checkpoint_model(run)
    m = cfg.model
    theirs_model = _hf(src)
    with torch.no_grad():
        ours_logits, theirs = ours(_ids()), theirs_model(_ids()).logits
    diff = (ours_logits - theirs).abs().max().item()
    assert diff <= 1e-5 and theirs.std().item() > 0.1, diff
    # the switches the class needs were taken, not defaulted
    expected = {
        "llama": ("rope_scaling", "llama3"),
        "qwen2": ("sliding_window", 8),
        "qwen3": ("head_dim", 32),
        "mistral": ("sliding_window", 8),
    }[kind]
    got = getattr(m, expected[0])
    assert (got["rope_type"] if isinstance(got, dict) else got) == expected[1]
    assert m.qk_norm == (kind == "qwen3") and m.attn_bias == (kind == "qwen2")

    back = export_to_hf(run, tmp_path / "back")  # the class chosen for the model by itself
    a, b = _tensors(src), _tensors(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    again = _hf(back)
    assert type(again).__name__ == KINDS[kind][1]
    with torch.no_grad():
        assert (again(_ids()).logits - theirs).abs().max().item() == 0.0

    prompt = _ids(6)[:1]  # 6 + 20 tokens: past the window and the original RoPE context
    hf_out = theirs_model.generate(prompt, max_new_tokens=20, do_sample=False)
    ours_out = ours.generate(prompt, 20, temperature=0, eos_id=256)
    assert hf_out.tolist() == ours_out.tolist()


def test_the_window_and_the_scaling_change_the_function(hf_folders, tmp_path):
    """The parity above is not vacuous: without the window / the scaling the logits differ."""
    from megaformer.model.transformer import Transformer

    for kind, key, off in (("mistral", "sliding_window", None), ("llama", "rope_scaling", None)):
        run = import_from_hf(hf_folders[kind], tmp_path / kind)
        model, _, cfg, _ = load_checkpoint_model(run)
        setattr(cfg.model, key, off)
        plain = Transformer(cfg.model).eval()
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (plain(_ids()) - model(_ids())).abs().max().item() > 1e-3, kind


@pytest.mark.slow
@pytest.mark.multiprocess
def test_qwen3_trains_at_tp2_and_its_export_equals(hf_folders, tmp_path):
    run = tmp_path / "run"
    proc = cli_main(
        "convert", str(hf_folders["qwen3"]), str(run), "--to", "megaformer", "--tp", "2"
    )
    assert proc.returncode == 0, proc.stderr
    before = ckpt_weights.load_weights(ckpt_layout.resolve_checkpoint(run))
    args = [a for a in tiny_overrides() if not a.startswith("model.")]
    lr = 1e-3
    proc = run_torchrun(
        2,
        "train",
        str(run / "config.yaml"),
        *args,
        "train.steps=3",
        f"train.lr={lr}",
        "train.warmup_steps=0",
        "eval.interval=0",
        "data.seq_len=40",
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = ckpt_weights.load_weights(ckpt_layout.resolve_checkpoint(run))
    for k in ("layers.0.attn.q_norm.weight", "layers.1.attn.k_norm.weight"):
        delta = (after[k] - before[k]).abs().max().item()  # replicated, gradient summed over TP
        assert 0.5 * lr < delta <= 3.5 * lr, (k, delta)
    dst = tmp_path / "hf"
    proc = cli_main(
        "convert",
        str(run),
        str(dst),
        "--to",
        "hf",
        "--arch",
        "qwen3",
        "--verify",
        "--verify-tolerance",
        "1e-5",
    )
    assert proc.returncode == 0, proc.stderr
    assert "verify: max |logit difference|" in proc.stdout
    ours, _, _, _ = load_checkpoint_model(run)
    with torch.no_grad():
        assert (ours(_ids()) - _hf(dst)(_ids()).logits).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------- tokenizers


def test_weights_only_folder_converts_with_a_warning_and_training_asks_for_a_tokenizer(
    hf_folders, tmp_path, caplog
):
    src = tmp_path / "weights"
    shutil.copytree(hf_folders["mistral"], src)
    (src / "tokenizer.json").unlink()
    run = import_from_hf(src, tmp_path / "run")
    assert "converting the weights only" in caplog.text
    assert not (ckpt_layout.resolve_checkpoint(run) / "tokenizer.json").exists()
    args = [a for a in tiny_overrides() if not a.startswith(("model.", "data.tokenizer"))]
    proc = cli_main("train", str(run / "config.yaml"), *args, "--run-dir", str(run))
    assert_one_line_error(proc, "data.tokenizer=none", "converted without a tokenizer")
    with_tok = import_from_hf(
        src, tmp_path / "run2", tokenizer=hf_folders["mistral"] / "tokenizer.json"
    )
    _, tok, _, _ = load_checkpoint_model(with_tok)
    assert tok.eod_id == 256


def _sentencepiece_model(folder: Path) -> Path:
    spm = pytest.importorskip("sentencepiece")
    text = folder / "corpus.txt"
    text.write_text(
        "\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(200))
    )
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(folder / "sp"),
        vocab_size=60,
        model_type="bpe",
        minloglevel=2,
    )
    return folder / "sp.model"


def test_sentencepiece_tokenizer_model_and_configured_eos(hf_folders, tmp_path):
    import sentencepiece  # noqa: F401  (skipped by _sentencepiece_model when absent)

    model_file = _sentencepiece_model(tmp_path)
    src = tmp_path / "sp-folder"
    shutil.copytree(hf_folders["qwen3"], src)
    (src / "tokenizer.json").unlink()
    shutil.copy(model_file, src / "tokenizer.model")
    run = import_from_hf(src, tmp_path / "run")
    _, tok, _, _ = load_checkpoint_model(run)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    text = "the lazy fox jumps"
    assert tok.encode(text) == sp.encode(text) and tok.decode(tok.encode(text)) == text
    assert tok.eod_id == sp.eos_id() == 2
    # eos_token of tokenizer_config.json comes before the fallback list
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    _, tok2, _, _ = load_checkpoint_model(import_from_hf(src, tmp_path / "run2"))
    assert tok2.eod_id == sp.unk_id() == 0
    back = export_to_hf(run, tmp_path / "back")
    assert (back / "tokenizer.model").read_bytes() == model_file.read_bytes()


def test_configured_eos_of_a_tokenizer_json_is_kept_through_the_checkpoint(hf_folders, tmp_path):
    src = tmp_path / "eos"
    shutil.copytree(hf_folders["qwen2"], src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 65}))  # 'A'
    run = import_from_hf(src, tmp_path / "run")
    _, tok, _, _ = load_checkpoint_model(run)
    assert tok.eod_id == 65


# ----------------------------------------------------------------------------- configs and refusals


def test_minimal_config_json_takes_transformers_defaults(hf_folders, tmp_path):
    src = tmp_path / "minimal"
    shutil.copytree(hf_folders["qwen3"], src)
    (src / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "vocab_size": VOCAB,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
            }
        )
    )
    run = import_from_hf(src, tmp_path / "run")
    cfg = ckpt_layout.read_config(ckpt_layout.resolve_checkpoint(run))
    defaults = transformers.Qwen3Config()
    assert cfg.model.max_seq_len == defaults.max_position_embeddings
    assert cfg.model.norm_eps == defaults.rms_norm_eps
    assert cfg.model.rope_theta == defaults.rope_parameters["rope_theta"]


def test_options_megaformer_cannot_express_are_refused_in_one_line(hf_folders, tmp_path):
    src = tmp_path / "mixed"
    shutil.copytree(hf_folders["qwen2"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(max_window_layers=1, layer_types=None)
    (src / "config.json").write_text(json.dumps(cfg))
    proc = cli_main("convert", str(src), str(tmp_path / "out"), "--to", "megaformer")
    assert_one_line_error(
        proc,
        "Qwen2ForCausalLM option layer_types mixing sliding_attention",
        "applies to every layer",
    )
    cfg.update(
        max_window_layers=0,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    (src / "config.json").write_text(json.dumps(cfg))
    proc = cli_main("convert", str(src), str(tmp_path / "out"), "--to", "megaformer")
    assert_one_line_error(proc, "option rope_type=dynamic cannot be expressed", "llama3, yarn")
    assert not (tmp_path / "out").exists()


def test_export_refuses_what_the_class_lacks(hf_folders, tmp_path):
    run = import_from_hf(hf_folders["qwen3"], tmp_path / "run")
    proc = cli_main("convert", str(run), str(tmp_path / "a"), "--to", "hf", "--arch", "llama")
    assert_one_line_error(proc, "model.qk_norm=true cannot be expressed by LlamaForCausalLM")
    run = import_from_hf(hf_folders["qwen2"], tmp_path / "run2")
    proc = cli_main("convert", str(run), str(tmp_path / "b"), "--to", "hf", "--arch", "mistral")
    assert_one_line_error(proc, "model.qkv_bias=true cannot be expressed by MistralForCausalLM")


def test_verify_fails_above_tolerance_and_leaves_nothing(hf_folders, tmp_path):
    proc = cli_main(
        "convert",
        str(hf_folders["mistral"]),
        str(tmp_path / "ok"),
        "--to",
        "megaformer",
        "--verify",
    )
    assert proc.returncode == 0, proc.stderr
    diff = float(proc.stdout.split("max |logit difference| = ")[1].split()[0])
    assert diff <= 1e-5
    src = tmp_path / "broken"  # a config that disagrees with the weights' function
    shutil.copytree(hf_folders["mistral"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5
    (src / "config.json").write_text(json.dumps(cfg))
    from megaformer.checkpoint.hf import verify

    real = verify.hf_logits
    try:  # transformers runs the original (eps 1e-6), megaformer the edited config
        verify.hf_logits = lambda folder, ids: real(hf_folders["mistral"], ids)
        with pytest.raises(Exception, match="exceeds the tolerance"):
            import_from_hf(src, tmp_path / "out", verify=True)
    finally:
        verify.hf_logits = real
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


# ----------------------------------------------------------------------------- the switches themselves


@pytest.mark.parametrize(
    "scaling",
    [
        LLAMA3,
        YARN,
        {**YARN, "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16, "truncate": False},
        {**YARN, "attention_factor": 1.3},
    ],
)
def test_rope_scaling_matches_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megaformer.model.positions import RotaryEmbedding

    hf_cfg = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=256,
        rope_parameters=dict(scaling),
    )
    inv, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    ours = RotaryEmbedding(
        64, 1.0, scaling["rope_theta"], {k: v for k, v in scaling.items() if k != "rope_theta"}
    )
    assert torch.equal(ours.inv_freq(), inv.float())
    assert ours.attention_factor == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_sliding_window_on_every_path_equals_the_banded_reference(backend):
    from megaformer.kernels.attention import attention, causal_mask, share_kv_heads
    from megaformer.kernels.selection import choose_for

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=g) for h in (4, 2, 2))
    W = 5
    mask = causal_mask(24, 24, window=W)
    assert mask[10, 6] and not mask[10, 5] and mask.sum(-1).max() == W
    scores = (q @ share_kv_heads(k, 4).transpose(-2, -1)) / 4.0
    want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ share_kv_heads(v, 4)
    got = attention(q, k, v, causal=True, backend=backend, window=W)
    assert (got - want).abs().max().item() < 1e-5
    last = attention(q[:, :, -3:], k, v, causal=True, backend=backend, window=W)  # KV-cache shape
    assert (last - want[:, :, -3:]).abs().max().item() < 1e-5
    assert (
        choose_for(
            "attention", q, backend="auto", head_dim=16, dropout=False, doc_mask=False, window=True
        ).impl
        != "native"
    )


def test_rms_norm_gradient_of_a_strided_view_of_rows():
    """k_norm on one key/value head (a TP shard): k.view(B, T, 1, d_k) of the fused [q | k | v]
    product is rows with a stride; the native backward reads them as the forward does."""
    from megaformer.kernels.norm import rms_norm, rms_norm_reference

    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 16, 24, generator=g, requires_grad=True)
    w = torch.randn(8, generator=g, requires_grad=True)
    k = qkv[..., 8:16].view(2, 16, 1, 8)
    dy = torch.randn(2, 16, 1, 8, generator=g)
    grads = torch.autograd.grad(rms_norm(k, w, 1e-6), (qkv, w), dy)
    want = torch.autograd.grad(rms_norm_reference(k, w, 1e-6), (qkv, w), dy)
    for a, b in zip(grads, want):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "model,needle",
    [
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "model.rope_scaling: rope_type llama3 needs high_freq_factor, low_freq_factor, "
            "original_max_position_embeddings",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            "model.rope_scaling.rope_type='linear'",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "original_max_position_embeddings": 8,
                    "beta": 3,
                }
            },
            "model.rope_scaling.beta: unknown for rope_type yarn",
        ),
        ({"head_dim": 0}, "model.head_dim=0: must be > 0"),
        ({"sliding_window": 0}, "model.sliding_window=0: must be > 0"),
        (
            {"d_model": 30, "n_heads": 4},
            "must be divisible by model.n_heads=4 (or set model.head_dim)",
        ),
    ],
)
def test_new_model_keys_are_validated_in_one_line(model, needle):
    from megaformer.config import ConfigError, config_from_dict, validate

    with pytest.raises(ConfigError) as e:
        validate(config_from_dict({"model": model}))
    assert needle in str(e.value) and "\n" not in str(e.value)
    ok = config_from_dict({"model": {"d_model": 30, "n_heads": 4, "head_dim": 8}})
    validate(ok)
    assert ok.model.head_dim == 8 and ok.to_dict()["model"]["head_dim"] == 8
    assert config_from_dict({}).to_dict()["model"]["head_dim"] is None  # saved as configured


def test_counts_follow_the_switches():
    from megaformer.analysis.flops import attention_pairs, forward_flops
    from megaformer.analysis.params import count_parameters
    from megaformer.config import ModelConfig
    from megaformer.model.transformer import Transformer

    for kw in (
        dict(head_dim=24, qk_norm=True, qkv_bias=True),
        dict(bias=True, qkv_bias=False),
        dict(n_kv_heads=2, head_dim=4, qk_norm=True, sliding_window=3),
    ):
        cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, **kw)
        with torch.device("meta"):
            assert count_parameters(cfg)["total"] == Transformer(cfg).num_parameters(), kw
    # query i of 10 sees min(i + 1, 4) keys: 1 + 2 + 3 + 4 * 7
    assert attention_pairs(10, True, 4) == 34 and attention_pairs(10, True, 10) == 55
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, sliding_window=4)
    assert forward_flops(cfg, 10).attn_scores == 2 * 2 * 34 * 32
