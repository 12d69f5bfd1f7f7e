"""Crafted downloads are refused with one line (or ignored), and the file they aim at is untouched.

One test per class of input a user may download: configs (DeepSpeed pass-through, YAML aliases,
device files), run directories (symlinked entries, ``latest``, planted checkpoints), the native
kernel cache, Hugging Face folders (weight_map, shape bombs), data specs and shared data caches.
Every test plants a harmless marker or victim file and checks it is neither run, read nor changed.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megaformer.checkpoint import io as ckpt_io
from megaformer.config import Config, load_config
from megaformer.errors import CheckpointError, ConfigError, DataError, UserError
from tests.helpers import assert_one_line_error, cli_main, tiny_model, tiny_overrides

VICTIM_TEXT = "victim: must stay exactly like this\n"


def victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    path = tmp_path / name
    path.write_text(VICTIM_TEXT)
    return path


class Marker:
    """Unpickling this creates the marker file: proof that a pickle's code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


# ----------------------------------------------------------------------------- tiny checkpoints

def tiny_run(root: Path) -> Path:
    """A run directory holding a weights-only checkpoint of a tiny untied model (no training)."""
    from megaformer.data.tokenizer import ByteTokenizer
    from megaformer.model.transformer import Transformer

    cfg = Config(model=tiny_model(vocab_size=257, tie_embeddings=False))
    torch.manual_seed(0)
    weights = Transformer(cfg.model).state_dict()
    ckpt_io.save_weights_checkpoint(root, 0, weights, cfg.to_yaml(), ByteTokenizer(), {})
    return root


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tiny_run(tmp_path / "run")


@pytest.fixture
def hf_folder(tmp_path: Path, run_dir: Path) -> Path:
    from megaformer.checkpoint.hf.convert import export_to_hf

    return export_to_hf(run_dir, tmp_path / "hf", arch="llama")


# ----------------------------------------------------------------------------- configs

def test_deepspeed_section_is_an_allowlist_and_universal_loading_is_off(tmp_path):
    from megaformer.training.deepspeed_config import build_deepspeed_config

    cfg_file = tmp_path / "c.yaml"
    for section, needle in (({"checkpoint": {"load_universal": True}}, "deepspeed.checkpoint:"),
                            ({"flops_profiler": {"output_file": str(tmp_path / "x")}},
                             "deepspeed.flops_profiler.output_file:"),
                            ({"torch_autocast": {"enabled": True}}, "deepspeed.torch_autocast:"),
                            ({"zero_optimization": {"offload_param": {"device": "nvme"}}},
                             "deepspeed.zero_optimization.offload_param.device='nvme'"),
                            ({"wandb": {"enabled": True}}, "deepspeed.wandb:")):
        cfg_file.write_text(json.dumps({"deepspeed": section}))
        with pytest.raises(ConfigError, match="^" + needle.replace(".", r"\.").replace("(", r"\(")
                           ) as e:
            load_config(cfg_file)
        assert "\n" not in str(e.value)
    # reviewed keys pass, and the derived config never loads universal checkpoints
    cfg_file.write_text(json.dumps({"deepspeed": {"zero_optimization": {"overlap_comm": True},
                                                  "communication_data_type": "fp32"}}))
    ds = build_deepspeed_config(load_config(cfg_file), grad_accum=1)
    assert ds["checkpoint"] == {"load_universal": False}
    assert ds["zero_optimization"] == {"stage": 0, "overlap_comm": True}


def test_deepspeed_loading_is_weights_only_for_the_whole_call(tmp_path):
    """A pickle payload that DeepSpeed would load with weights_only=False (as its universal
    checkpoint loader does) does not run inside load_engine_state: one-line CheckpointError."""
    marker = tmp_path / "pwned"
    payload = tmp_path / "run" / "checkpoints" / "step_0000001" / "universal.pt"
    payload.parent.mkdir(parents=True)
    (payload.parent / ckpt_io.META).write_text("{}")
    with open(payload, "wb") as fh:
        pickle.dump({"state": Marker(marker)}, fh, protocol=2)

    class Engine:  # loads like deepspeed.checkpoint.universal_checkpoint does
        def load_checkpoint(self, root, tag, **kw):
            return torch.load(Path(root) / tag / "universal.pt", weights_only=False), {}

    with pytest.raises(CheckpointError, match="cannot restore the training state") as e:
        ckpt_io.load_engine_state(Engine(), payload.parent, rank=0)
    assert "\n" not in str(e.value) and not marker.exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # restored after the call


def test_yaml_alias_bomb_and_device_config_are_refused(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
              f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
              for i in range(8)]
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="anchors and aliases.*line 1") as e:
        load_config(bomb)
    assert "\n" not in str(e.value)
    proc = cli_main("train", str(bomb))
    assert_one_line_error(proc, "bomb.yaml", "anchors and aliases")
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(zero)


# ----------------------------------------------------------------------------- run directories

@pytest.mark.parametrize("entry", ["metrics.jsonl", "checkpoints", "logs", "tokenizer.json",
                                   "data_cache", "report", "config.yaml"])
def test_symlinked_run_dir_entries_are_refused(tmp_path, entry):
    """`megaformer train` refuses a run directory whose entry is a link, before writing anything;
    the link's target is untouched."""
    run = tmp_path / "run"
    run.mkdir()
    target = victim(tmp_path) if "." in entry else tmp_path / "victim_dir"
    if target.suffix == "":
        target.mkdir()
        victim(target, "inside.txt")
    (run / entry).symlink_to(target)
    proc = cli_main("train", "configs/quickstart.yaml", *tiny_overrides(), "--run-dir", str(run))
    assert_one_line_error(proc, f"{run / entry}: is a symbolic link")
    if target.is_file():
        assert target.read_text() == VICTIM_TEXT
    else:
        assert [p.name for p in target.iterdir()] == ["inside.txt"]
        assert (target / "inside.txt").read_text() == VICTIM_TEXT


def test_metrics_report_and_prune_do_not_write_through_links(tmp_path):
    from megaformer.analysis.report import write_report
    from megaformer.training.metrics import MetricsWriter, truncate_metrics

    run = tmp_path / "run"
    run.mkdir()
    target = victim(tmp_path)
    (run / "metrics.jsonl").symlink_to(target)
    with pytest.raises(CheckpointError, match="symbolic link"):
        truncate_metrics(run / "metrics.jsonl", 0)
    with pytest.raises(CheckpointError, match="symbolic link"):
        MetricsWriter(run, enabled=True, tensorboard=False).write({"step": 1, "loss": 1.0})
    assert target.read_text() == VICTIM_TEXT
    # report: a planted summary.md link (an authorized_keys stand-in) is refused, not written
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n"
                                       + json.dumps({"step": "ssh-ed25519 AAAA", "loss": 1}) + "\n"
                                       + json.dumps({"step": 2, "loss": "ssh-ed25519 AAAA"}) + "\n")
    keys = victim(tmp_path, "authorized_keys")
    (run / "report").mkdir()
    (run / "report" / "summary.md").symlink_to(keys)
    with pytest.raises(UserError, match="summary.md: is a symbolic link"):
        write_report(run)
    assert keys.read_text() == VICTIM_TEXT
    (run / "report" / "summary.md").unlink()
    summary = Path(write_report(run)["summary"]).read_text()
    assert "ssh-ed25519" not in summary and "last step 2" in summary  # records are numbers only


def test_latest_may_only_name_a_checkpoint_inside_the_run(tmp_path, run_dir):
    other = tiny_run(tmp_path / "someone_else")
    pointer = run_dir / "checkpoints" / "latest"
    for name in ("../../someone_else/checkpoints/step_0000000",
                 str(other / "checkpoints" / "step_0000000")):
        pointer.write_text(name + "\n")
        with pytest.raises(CheckpointError, match="expected step_<digits>"):
            ckpt_io.resolve_checkpoint(run_dir)
        assert_one_line_error(cli_main("generate", str(run_dir), "--max-new-tokens", "1"),
                              "latest", "expected step_<digits>")
    pointer.write_text("step_0000000\n")
    assert ckpt_io.resolve_checkpoint(run_dir) == run_dir / "checkpoints" / "step_0000000"


def test_pruning_keeps_the_sealed_checkpoint_and_never_follows_planted_entries(tmp_path):
    """keep_last by step number: a planted step_9999999 neither evicts the new checkpoint nor is
    deleted, a planted link to another run's checkpoint is not deleted, and DeepSpeed's
    unpickling recovery scripts are not left in the folder (a README points at `convert`)."""
    from megaformer.checkpoint.safe_load import install_safe_checkpoint_engine

    class CopyingEngine:  # writes like DeepSpeed, which copies zero_to_fp32.py into ZeRO saves
        def __init__(self) -> None:
            install_safe_checkpoint_engine(self)

        def save_checkpoint(self, root, tag, client_state, save_latest):
            (Path(root) / tag).mkdir(parents=True, exist_ok=True)
            self.checkpoint_engine.save({"step": client_state}, str(Path(root) / tag / "states.pt"))
            (Path(root) / tag / "zero_to_fp32.py").write_text("import pickle\n")

    def snapshot(step: int):
        return lambda tmp, memo: {"meta.json": json.dumps({"step": step})}

    run = tmp_path / "run"
    planted = run / "checkpoints" / "step_9999999"
    planted.mkdir(parents=True)
    (planted / ckpt_io.META).write_text("{}")
    other = tmp_path / "other" / "step_0000001"
    other.mkdir(parents=True)
    (other / ckpt_io.META).write_text("{}")
    victim(other)
    (run / "checkpoints" / "step_0000000").symlink_to(other, target_is_directory=True)
    saved = [ckpt_io.save_checkpoint(CopyingEngine(), run, step, rank=0, world_size=1,
                                     client_state={"step": step}, snapshot=snapshot(step),
                                     keep_last=2, barrier=lambda: None) for step in (1, 2, 3)]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["latest", "step_0000000", "step_0000002", "step_0000003", "step_9999999"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000003"
    assert (other / "victim.txt").read_text() == VICTIM_TEXT and planted.is_dir()
    assert not (saved[-1] / "zero_to_fp32.py").exists()
    assert "megaformer convert" in (saved[-1] / ckpt_io.README).read_text()


# ----------------------------------------------------------------------------- native kernel cache

def test_planted_library_in_a_group_writable_cache_is_not_loaded(tmp_path, monkeypatch):
    from megaformer.kernels import native

    built = []

    def fake_compile(compiler: str, folder: Path, source, flags, library) -> Path:
        target = folder / library  # what _compile leaves, minus the cc run
        target.write_bytes(b"\x7fELF genuine")
        target.with_name(target.name + ".sha256").write_text(native._sha256(target) + "\n")
        built.append(folder)
        return target

    monkeypatch.setenv("MEGAFORMER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_compile", fake_compile)
    def build(compiler: str) -> Path:
        return native.build_library(compiler, native.SOURCE, native.FLAGS, native.LIBRARY, "native")[0]

    first = build("cc")
    assert oct((tmp_path / "cache" / "native").stat().st_mode & 0o777) == "0o700"
    assert build("cc") == first and len(built) == 1  # verified cache: no rebuild
    # an attacker's library (and a digest matching it) in a cache the group can write to
    first.write_bytes(b"\x7fELF planted: its constructor would run on load")
    first.with_name(first.name + ".sha256").write_text(native._sha256(first) + "\n")
    os.chmod(tmp_path / "cache" / "native", 0o770)
    again = build("cc")
    assert again != first and len(built) == 2 and not str(again).startswith(str(tmp_path / "cache"))
    assert oct(again.parent.stat().st_mode & 0o777) == "0o700"
    shutil.rmtree(again.parent)
    # private again, but the digest does not match: rebuilt in place, never loaded as is
    os.chmod(tmp_path / "cache" / "native", 0o700)
    first.write_bytes(b"\x7fELF swapped")
    assert build("cc") == first and len(built) == 3
    assert first.read_bytes() == b"\x7fELF genuine"


# ----------------------------------------------------------------------------- Hugging Face folders

@pytest.mark.parametrize("where", ["../secret.safetensors", "ABSOLUTE"])
def test_weight_map_pointing_outside_the_folder_is_refused(tmp_path, hf_folder, where):
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"SECRET-BYTES" * 4)
    name = str(secret) if where == "ABSOLUTE" else where
    shard = hf_folder / "model.safetensors"
    shard.rename(hf_folder / "model-00001-of-00001.safetensors")
    from safetensors import safe_open

    with safe_open(str(hf_folder / "model-00001-of-00001.safetensors"), "pt") as f:
        keys = list(f.keys())
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in keys}}
    index["weight_map"][keys[0]] = name
    (hf_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = cli_main("convert", str(hf_folder), str(tmp_path / "out"), "--to", "megaformer")
    line = assert_one_line_error(proc, "weight_map names", "plain *.safetensors file name")
    assert "SECRET" not in line and not (tmp_path / "out").exists()
    assert secret.read_bytes() == b"SECRET-BYTES" * 4


def test_hf_shape_bomb_is_refused_before_anything_is_allocated(tmp_path, hf_folder):
    """config.json claims hidden_size 4194304 (and biases the weights lack, which would be
    zero-filled at that width) beside the tiny tensors: refused on shapes, nothing written."""
    config = json.loads((hf_folder / "config.json").read_text())
    config.update(hidden_size=4194304, head_dim=4194304 // config["num_attention_heads"],
                  attention_bias=True)
    (hf_folder / "config.json").write_text(json.dumps(config))
    proc = cli_main("convert", str(hf_folder), str(tmp_path / "out"), "--to", "megaformer")
    assert_one_line_error(proc, "has shape", "the config describes")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_generate_checks_weight_shapes_before_building_the_model(run_dir):
    from megaformer.generation import load_checkpoint_model

    ckpt = run_dir / "checkpoints" / "step_0000000"
    text = (ckpt / "config.yaml").read_text().replace("d_model: 32", "d_model: 4194304")
    (ckpt / "config.yaml").write_text(text)
    with pytest.raises(CheckpointError, match="has shape .* the config describes"):
        load_checkpoint_model(run_dir)
    (ckpt / "config.yaml").unlink()
    (ckpt / "config.yaml").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_checkpoint_model(run_dir)


# ----------------------------------------------------------------------------- data

def test_missing_local_dataset_path_is_an_error_not_a_hub_lookup(tmp_path, monkeypatch):
    import datasets

    from megaformer.data.sources import open_source

    def no_network(*a, **kw):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    for spec in (str(tmp_path / "missing.jsonl"), "someone/dataset"):
        with pytest.raises(DataError, match="no such file.*needs the prefix hf:") as e:
            open_source(spec)
        assert str(e.value).startswith(spec)
    proc = cli_main("prepare-data", "--input", "someone/dataset", "--tokenizer", "byte",
                    "--output-prefix", str(tmp_path / "out"))
    assert_one_line_error(proc, "someone/dataset: no such file")
    assert open_source("hf:someone/dataset").hub == ("someone/dataset", None, "train")


def test_poisoned_shared_data_cache_is_ignored(tmp_path):
    from megaformer.data.gpt_dataset import GPTDataset
    from megaformer.data.indexed import IndexedDataset, IndexedWriter

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 40, size=50)
    writer = IndexedWriter(tmp_path / "d", np.uint16)
    writer.add(rng.integers(0, 200, size=int(lengths.sum())), lengths)
    writer.finish()
    data, cache = IndexedDataset(tmp_path / "d"), tmp_path / "cache"
    fresh = GPTDataset(data, "train", (0, 50), 16, 7, 100, None)
    built = GPTDataset(data, "train", (0, 50), 16, 7, 100, cache)
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    key = built.key()
    sample_file = cache / f"{key}-sample.npy"
    assert GPTDataset(data, "train", (0, 50), 16, 7, 100, cache)._load_cached(key, 1)
    poisoned = np.load(sample_file).copy()
    poisoned[5] = [0, 2**31 - 1]  # an offset far outside the data
    np.save(sample_file, poisoned)
    reread = GPTDataset(data, "train", (0, 50), 16, 7, 100, cache, build=False)  # reads only
    assert not reread._load_cached(key, 1)
    assert all(np.array_equal(reread.sample(g), fresh.sample(g)) for g in range(len(fresh)))
    # a shuffle that favours one sample, consistent in shape: refused too
    shuffle_file = cache / f"{key}-shuffle.npy"
    np.save(shuffle_file, np.zeros_like(np.load(shuffle_file)))
    np.save(sample_file, fresh.sample_idx)
    assert not reread._load_cached(key, 1)
    # someone else could have written it: a group-writable file is ignored even when valid
    np.save(shuffle_file, fresh.shuffle_idx)
    assert reread._load_cached(key, 1)
    os.chmod(shuffle_file, 0o664)
    assert not reread._load_cached(key, 1)
