"""``megaformer convert``: Hugging Face parity (logits, tensors, generation), streaming shards, and
refusals.

Tiny models made by ``transformers`` itself (random init, every 1-D parameter perturbed so that a
norm gain or bias mapped to the wrong place changes the logits) are imported; megaformer's logits
must equal transformers' within 1e-5 (fp32) and exporting back must give identical tensors. A model
trained at TP=2 x PP=2 exports to HF with equal logits and equal greedy generation, and an imported
model continues pretraining at TP=2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import weights as ckpt_weights
from megaformer.checkpoint.hf.convert import export_to_hf, import_from_hf
from megaformer.checkpoint.hf.tokenizer_files import byte_tokenizer_as_hf
from megaformer.generation import load_checkpoint_model
from tests.helpers import assert_one_line_error, cli_main, run_torchrun, tiny_overrides

transformers = pytest.importorskip("transformers")

VOCAB = 300  # > the 257 tokens of the tokenizer: the HF embedding has unused rows


def _hf_model(kind: str):
    t = transformers
    common = dict(vocab_size=VOCAB, bos_token_id=256, eos_token_id=256)
    if kind == "llama":
        cfg = t.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
            **common,
        )
        cls = t.LlamaForCausalLM
    elif kind == "gpt2":
        cfg = t.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
            **common,
        )
        cls = t.GPT2LMHeadModel
    else:
        cfg = t.GPTNeoXConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            rotary_pct=0.25,
            use_parallel_residual=True,
            **common,
        )
        cls = t.GPTNeoXForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm gains 1 and biases 0 would hide a wrong mapping
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("llama", "gpt2", "gpt-neox"):
        folder = base / kind
        _hf_model(kind).save_pretrained(folder)
        byte_tokenizer_as_hf().save(str(folder / "tokenizer.json"))
        out[kind] = folder
    return out


def _ids(n: int = 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 257, (2, n), generator=g)


def _hf_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return model(_ids()).logits


def _our_logits(run: Path) -> torch.Tensor:
    model, _, _, _ = load_checkpoint_model(run)
    with torch.no_grad():
        return model(_ids())


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt-neox"])
def test_import_matches_transformers_and_export_gives_identical_tensors(hf_folders, tmp_path, kind):
    src = hf_folders[kind]
    run = import_from_hf(src, tmp_path / "run")
    ours, theirs = _our_logits(run), _hf_logits(src)
    assert ours.shape == theirs.shape == (2, 20, VOCAB)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert theirs.std().item() > 0.1  # a real function, not near-constant logits

    back = export_to_hf(run, tmp_path / "back", arch=kind)
    a, b = _tensors(src), _tensors(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    model = transformers.AutoModelForCausalLM.from_pretrained(back, local_files_only=True)
    assert (
        type(model).__name__
        == {
            "llama": "LlamaForCausalLM",
            "gpt2": "GPT2LMHeadModel",
            "gpt-neox": "GPTNeoXForCausalLM",
        }[kind]
    )
    assert (_hf_logits(back) - theirs).abs().max().item() == 0.0


NATIVE = {  # megaformer-made models, exercising the other branches of each mapping
    "llama": {"tie_embeddings": True, "bias": True, "rope_theta": 500.0},
    "gpt2": {
        "position": "learned",
        "norm": "layernorm",
        "activation": "gelu",
        "bias": False,
        "tie_embeddings": False,
        "n_kv_heads": None,
        "norm_eps": 1e-6,
    },
    "gpt-neox": {
        "norm": "layernorm",
        "activation": "gelu_tanh",
        "residual": "sequential",
        "rotary_fraction": 0.5,
        "bias": False,
        "tie_embeddings": True,
        "n_kv_heads": None,
    },
}


@pytest.mark.parametrize("kind", list(NATIVE))
def test_megaformer_models_export_with_equal_logits(tmp_path, kind):
    from megaformer.config import config_from_dict
    from megaformer.data.tokenizer import ByteTokenizer
    from megaformer.model.transformer import Transformer

    model_cfg = {
        "vocab_size": 257,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": 32,
        **NATIVE[kind],
    }
    cfg = config_from_dict({"model": model_cfg})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p) if p.dim() == 1 else 0.05 * torch.randn_like(p))
    weights = {
        k: v
        for k, v in model.state_dict().items()
        if not (cfg.model.tie_embeddings and k == "lm_head.weight")
    }
    run = tmp_path / "run"
    ckpt_weights.save_weights_checkpoint(run, 0, weights, cfg.to_yaml(), ByteTokenizer(), {})
    dst = export_to_hf(run, tmp_path / "hf", arch=kind)
    ours, theirs = _our_logits(run), _hf_logits(dst)
    assert (ours - theirs).abs().max().item() <= 1e-5 and theirs.std().item() > 0.1


def test_sharded_bf16_export_through_the_cli(hf_folders, tmp_path):
    run = import_from_hf(hf_folders["gpt-neox"], tmp_path / "run")
    dst = tmp_path / "hf"
    proc = cli_main(
        "convert", str(run), str(dst), "--to", "hf", "--dtype", "bf16", "--max-shard-size", "40KB"
    )
    assert proc.returncode == 0, proc.stderr
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and sorted(p.name for p in dst.glob("*.safetensors")) == shards
    for shard in shards:  # no shard above the limit unless it holds a single larger tensor
        size = (dst / shard).stat().st_size
        tensors = [k for k, v in index["weight_map"].items() if v == shard]
        assert size <= 40_000 + 2_000 or len(tensors) == 1, (shard, size)
    ref = _tensors(hf_folders["gpt-neox"])
    got = _tensors(dst)
    assert sorted(got) == sorted(ref) and index["metadata"]["total_size"] == sum(
        t.numel() * 2 for t in got.values()
    )
    for k in ref:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], ref[k].to(torch.bfloat16)), k
    back = import_from_hf(dst, tmp_path / "back", dtype="fp32")  # reads the sharded folder
    w0, w1 = (
        ckpt_weights.load_weights(ckpt_layout.resolve_checkpoint(run)),
        ckpt_weights.load_weights(ckpt_layout.resolve_checkpoint(back)),
    )
    assert sorted(w0) == sorted(w1)
    for k in w0:
        assert w1[k].dtype == torch.float32 and torch.equal(w1[k], w0[k].bfloat16().float()), k
    tok = transformers.AutoTokenizer.from_pretrained(dst, local_files_only=True)
    assert tok.encode("def é\n") == list("def é\n".encode()) and tok.eos_token_id == 256
    assert tok.decode(list("añb".encode())) == "añb"


# ----------------------------------------------------------------------------- trained at TP2 x PP2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_imported_model_trains_at_tp2_pp2_and_exports_with_equal_logits_and_generation(
    hf_folders, tmp_path
):
    """HF GPT-NeoX (biases, partial rotary, parallel residual) -> megaformer for TP=2 x PP=2 ->
    3 steps of `megaformer train` on 4 ranks -> HF again.

    The weights move from the imported ones by at most what 3 AdamW steps of lr allow (a
    re-initialised model would be ~0.1 away); transformers' logits on the export equal
    megaformer's, and transformers' greedy generate gives the tokens of `megaformer generate`."""
    run = tmp_path / "run"
    proc = cli_main(
        "convert",
        str(hf_folders["gpt-neox"]),
        str(run),
        "--to",
        "megaformer",
        "--tp",
        "2",
        "--pp",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    before = ckpt_weights.load_weights(ckpt_layout.resolve_checkpoint(run))
    args = [a for a in tiny_overrides() if not a.startswith("model.")]
    lr = 1e-3
    proc = run_torchrun(
        4,
        "train",
        str(run / "config.yaml"),
        *args,
        "train.steps=3",
        f"train.lr={lr}",
        "train.warmup_steps=0",
        "eval.interval=0",
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "starting from the weights of" in proc.stdout + proc.stderr
    after_ckpt = ckpt_layout.resolve_checkpoint(run)
    assert after_ckpt.name == "step_0000003"
    assert json.loads((after_ckpt / "meta.json").read_text())["parallel"]["pipeline"] == 2
    after = ckpt_weights.load_weights(after_ckpt)
    assert sorted(after) == sorted(before)
    moved = 0.0
    for k in before:
        delta = (after[k] - before[k]).abs().max().item()
        assert delta <= 3.5 * lr, (k, delta)
        moved = max(moved, delta)
    assert moved > 0.5 * lr

    dst = tmp_path / "hf"
    proc = cli_main("convert", str(run), str(dst), "--to", "hf", "--arch", "gpt-neox")
    assert proc.returncode == 0, proc.stderr
    assert (_our_logits(run) - _hf_logits(dst)).abs().max().item() <= 1e-5

    prompt, n = "def main(", 12
    gen = cli_main(
        "generate", str(run), "--prompt", prompt, "--max-new-tokens", str(n), "--temperature", "0"
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(dst, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(dst, local_files_only=True)
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(prompt.encode())
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    ours_model, _, _, _ = load_checkpoint_model(run)
    expected = ours_model.generate(ids, n, temperature=0, eos_id=256)
    assert out[0].tolist() == expected[0].tolist()
    new = out[0, ids.shape[1] :].tolist()
    assert gen.stdout.rstrip("\n") == prompt + tok.decode(new, skip_special_tokens=True)


# ----------------------------------------------------------------------------- refusals and errors


@pytest.fixture(scope="module")
def megaformer_run(hf_folders, tmp_path_factory) -> Path:
    return import_from_hf(hf_folders["llama"], tmp_path_factory.mktemp("mf") / "run")


def test_features_a_class_cannot_express_are_refused_by_name(megaformer_run, tmp_path):
    proc = cli_main(
        "convert", str(megaformer_run), str(tmp_path / "a"), "--to", "hf", "--arch", "gpt2"
    )
    assert_one_line_error(
        proc,
        "model.position=rope cannot be expressed by GPT2LMHeadModel",
        "model.norm=rmsnorm",
        "model.activation=swiglu",
        "model.n_kv_heads=2",
    )
    proc = cli_main(
        "convert", str(megaformer_run), str(tmp_path / "b"), "--to", "hf", "--arch", "gpt-neox"
    )
    assert_one_line_error(proc, "GPTNeoXForCausalLM", "model.n_kv_heads=2")
    # a sinusoidal model fits no class
    ckpt = ckpt_layout.resolve_checkpoint(megaformer_run)
    import yaml

    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg["model"]["position"] = "sinusoidal"
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    try:
        proc = cli_main("convert", str(megaformer_run), str(tmp_path / "c"), "--to", "hf")
        assert_one_line_error(
            proc,
            "no Hugging Face class can express this model",
            "model.position=sinusoidal cannot be expressed by LlamaForCausalLM",
            "model.position=sinusoidal cannot be expressed by GPT2LMHeadModel",
        )
    finally:
        cfg["model"]["position"] = "rope"
        (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_hf_options_megaformer_cannot_express_are_refused(hf_folders, tmp_path):
    import shutil

    src = tmp_path / "llama"
    shutil.copytree(hf_folders["llama"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    (src / "config.json").write_text(json.dumps(cfg))
    proc = cli_main("convert", str(src), str(tmp_path / "out"), "--to", "megaformer")
    assert_one_line_error(proc, "LlamaForCausalLM option rope_type=linear cannot be expressed")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    cfg["model_type"] = "gemma"
    (src / "config.json").write_text(json.dumps(cfg))
    proc = cli_main("convert", str(src), str(tmp_path / "out"), "--to", "megaformer")
    assert_one_line_error(proc, "model_type='gemma' is not supported")


def test_conversion_errors_are_one_line(hf_folders, megaformer_run, tmp_path):
    proc = cli_main("convert", str(tmp_path / "missing"), str(tmp_path / "x"), "--to", "hf")
    assert_one_line_error(proc, "missing: no such file or directory")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("keep me")
    proc = cli_main("convert", str(megaformer_run), str(taken), "--to", "hf")
    assert_one_line_error(proc, "already exists and is not empty")
    assert (taken / "file").read_text() == "keep me"
    proc = cli_main(
        "convert", str(hf_folders["llama"]), str(tmp_path / "y"), "--to", "megaformer", "--tp", "3"
    )
    assert_one_line_error(proc, "--tp 3", "must divide model.n_heads=4")
    proc = cli_main(
        "convert", str(hf_folders["llama"]), str(tmp_path / "y"), "--to", "megaformer", "--pp", "3"
    )
    assert_one_line_error(proc, "--pp 3", "more stages than model.n_layers=2")
    assert not (tmp_path / "y").exists()


def test_truncated_or_tampered_safetensors_name_the_file(hf_folders, megaformer_run, tmp_path):
    import shutil

    src = tmp_path / "gpt2"
    shutil.copytree(hf_folders["gpt2"], src)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])  # truncated
    proc = cli_main("convert", str(src), str(tmp_path / "out"), "--to", "megaformer")
    assert_one_line_error(proc, str(weights), "corrupt safetensors file")
    weights.write_bytes(b"\xff" * 8 + data[8:])  # tampered header length
    proc = cli_main("convert", str(src), str(tmp_path / "out"), "--to", "megaformer")
    assert_one_line_error(proc, str(weights), "corrupt safetensors file")
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"pickle")
    proc = cli_main("convert", str(src), str(tmp_path / "out"), "--to", "megaformer")
    assert_one_line_error(proc, "pickled .bin files are refused")

    run = tmp_path / "run"
    shutil.copytree(megaformer_run, run)
    mf_weights = ckpt_layout.resolve_checkpoint(run) / "model.safetensors"
    mf_weights.write_bytes(mf_weights.read_bytes()[:-10])
    proc = cli_main("convert", str(run), str(tmp_path / "out2"), "--to", "hf")
    assert_one_line_error(proc, str(mf_weights), "corrupt safetensors file")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_megaformer_to_megaformer_reshards(megaformer_run, tmp_path):
    """``convert CKPT DST --to megaformer --tp/--pp``: a new run directory whose checkpoint has the
    same tensors and a config for the new layout (the resumed training is tested in
    tests/distributed/test_relayout.py)."""
    import yaml
    from safetensors.torch import load_file

    dst = tmp_path / "r"
    proc = cli_main(
        "convert", str(megaformer_run), str(dst), "--to", "megaformer", "--tp", "2", "--pp", "2"
    )
    assert proc.returncode == 0, proc.stderr
    src_ckpt, out = (
        ckpt_layout.resolve_checkpoint(megaformer_run),
        ckpt_layout.resolve_checkpoint(dst),
    )
    parallel = yaml.safe_load((out / "config.yaml").read_text())["parallel"]
    assert (parallel["tensor"], parallel["pipeline"]) == (2, 2)
    a, b = load_file(str(src_ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)
    proc = cli_main(
        "convert", str(megaformer_run), str(tmp_path / "r3"), "--to", "megaformer", "--tp", "3"
    )
    assert_one_line_error(proc, "--tp 3")
    assert not (tmp_path / "r3").exists()
    proc = cli_main(
        "convert", str(megaformer_run), str(tmp_path / "r2"), "--to", "megaformer", "--arch", "gpt2"
    )
    assert_one_line_error(proc, "--arch gpt2", "drop --arch")


def test_tokenizer_without_endoftext_uses_its_own_end_of_document_token():
    """A Llama-style tokenizer ends documents with </s>: it is the EOD (no token added)."""
    from tokenizers import Tokenizer, models

    from megaformer.data.tokenizer import HFTokenizer

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}, unk_token="<unk>"))
    wrapped = HFTokenizer(tok)
    assert (wrapped.eod_id, wrapped.vocab_size) == (2, 4)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    wrapped = HFTokenizer(tok)
    assert (wrapped.eod_id, wrapped.vocab_size) == (2, 3)  # <|endoftext|> added, as before


def test_a_tensor_without_counterpart_is_refused_not_dropped(hf_folders, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "llama"
    shutil.copytree(hf_folders["llama"], src)
    w = load_file(str(src / "model.safetensors"))
    w["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a Qwen3-style extra norm
    save_file(w, str(src / "model.safetensors"))
    proc = cli_main("convert", str(src), str(tmp_path / "out"), "--to", "megaformer")
    assert_one_line_error(
        proc, "model.layers.0.self_attn.q_norm.weight has no counterpart", "refusing to drop it"
    )
