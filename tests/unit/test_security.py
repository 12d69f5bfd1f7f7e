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
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import save as ckpt_save
from megaformer.checkpoint import weights as ckpt_weights
from megaformer.checkpoint.legacy import engine_files
from megaformer.config import Config, load_config
from megaformer.errors import CheckpointError, ConfigError, DataError, UserError
from tests.helpers import (
    ROOT,
    assert_one_line_error,
    cli_main,
    run_module,
    subprocess_env,
    tiny_model,
    tiny_overrides,
)

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
    ckpt_weights.save_weights_checkpoint(root, 0, weights, cfg.to_yaml(), ByteTokenizer(), {})
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
    for section, needle in (
        ({"checkpoint": {"load_universal": True}}, "deepspeed.checkpoint:"),
        (
            {"flops_profiler": {"output_file": str(tmp_path / "x")}},
            "deepspeed.flops_profiler.output_file:",
        ),
        ({"torch_autocast": {"enabled": True}}, "deepspeed.torch_autocast:"),
        (
            {"zero_optimization": {"offload_param": {"device": "nvme"}}},
            "deepspeed.zero_optimization.offload_param.device='nvme'",
        ),
        ({"wandb": {"enabled": True}}, "deepspeed.wandb:"),
    ):
        cfg_file.write_text(json.dumps({"deepspeed": section}))
        with pytest.raises(
            ConfigError, match="^" + needle.replace(".", r"\.").replace("(", r"\(")
        ) as e:
            load_config(cfg_file)
        assert "\n" not in str(e.value)
    # reviewed keys pass, and the derived config never loads universal checkpoints
    cfg_file.write_text(
        json.dumps(
            {
                "deepspeed": {
                    "zero_optimization": {"overlap_comm": True},
                    "communication_data_type": "fp32",
                }
            }
        )
    )
    ds = build_deepspeed_config(load_config(cfg_file), grad_accum=1)
    assert ds["checkpoint"] == {"load_universal": False}
    assert ds["zero_optimization"] == {"stage": 0, "overlap_comm": True}


def test_deepspeed_loading_is_weights_only_for_the_whole_call(tmp_path):
    """A pickle payload that DeepSpeed would load with weights_only=False (as its universal
    checkpoint loader does) does not run inside load_engine_state: one-line CheckpointError."""
    marker = tmp_path / "pwned"
    payload = tmp_path / "run" / "checkpoints" / "step_0000001" / "universal.pt"
    payload.parent.mkdir(parents=True)
    (payload.parent / ckpt_layout.META).write_text("{}")
    with open(payload, "wb") as fh:
        pickle.dump({"state": Marker(marker)}, fh, protocol=2)

    class Engine:  # loads like deepspeed.checkpoint.universal_checkpoint does
        def load_checkpoint(self, root, tag, **kw):
            return torch.load(Path(root) / tag / "universal.pt", weights_only=False), {}

    with pytest.raises(CheckpointError, match="cannot restore the training state") as e:
        engine_files.load_engine_state(Engine(), payload.parent, rank=0)
    assert "\n" not in str(e.value) and not marker.exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # restored after the call


def test_yaml_alias_bomb_and_device_config_are_refused(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
        for i in range(8)
    ]
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


@pytest.mark.parametrize(
    "entry",
    [
        "metrics.jsonl",
        "checkpoints",
        "logs",
        "tokenizer.json",
        "data_cache",
        "report",
        "config.yaml",
    ],
)
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
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.5})
        + "\n"
        + json.dumps({"step": "ssh-ed25519 AAAA", "loss": 1})
        + "\n"
        + json.dumps({"step": 2, "loss": "ssh-ed25519 AAAA"})
        + "\n"
    )
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
    for name in (
        "../../someone_else/checkpoints/step_0000000",
        str(other / "checkpoints" / "step_0000000"),
    ):
        pointer.write_text(name + "\n")
        with pytest.raises(CheckpointError, match="expected step_<digits>"):
            ckpt_layout.resolve_checkpoint(run_dir)
        assert_one_line_error(
            cli_main("generate", str(run_dir), "--max-new-tokens", "1"),
            "latest",
            "expected step_<digits>",
        )
    pointer.write_text("step_0000000\n")
    assert ckpt_layout.resolve_checkpoint(run_dir) == run_dir / "checkpoints" / "step_0000000"


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
    (planted / ckpt_layout.META).write_text("{}")
    other = tmp_path / "other" / "step_0000001"
    other.mkdir(parents=True)
    (other / ckpt_layout.META).write_text("{}")
    victim(other)
    (run / "checkpoints" / "step_0000000").symlink_to(other, target_is_directory=True)
    saved = [
        ckpt_save.save_checkpoint(
            CopyingEngine(),
            run,
            step,
            rank=0,
            world_size=1,
            client_state={"step": step},
            snapshot=snapshot(step),
            keep_last=2,
            barrier=lambda: None,
        )
        for step in (1, 2, 3)
    ]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["latest", "step_0000000", "step_0000002", "step_0000003", "step_9999999"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000003"
    assert (other / "victim.txt").read_text() == VICTIM_TEXT and planted.is_dir()
    assert not (saved[-1] / "zero_to_fp32.py").exists()
    assert "megaformer convert" in (saved[-1] / ckpt_layout.README).read_text()


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
        return native.build_library(
            compiler, native.SOURCE, native.FLAGS, native.LIBRARY, "native"
        )[0]

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
    config.update(
        hidden_size=4194304, head_dim=4194304 // config["num_attention_heads"], attention_bias=True
    )
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
    with pytest.raises(CheckpointError, match="config.yaml: is a symbolic link"):
        load_checkpoint_model(run_dir)
    (ckpt / "config.yaml").unlink()
    os.mkfifo(ckpt / "config.yaml")  # opened non-blocking: refused, not read forever
    with pytest.raises(CheckpointError, match="config.yaml: not a regular file"):
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
    proc = cli_main(
        "prepare-data",
        "--input",
        "someone/dataset",
        "--tokenizer",
        "byte",
        "--output-prefix",
        str(tmp_path / "out"),
    )
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


# ----------------------------------------------------------------------------- code from a config


def plant_task_folder(tmp_path: Path, marker: Path) -> Path:
    """An lm-eval task folder whose `!function` tag imports a .py that creates ``marker``."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "evil.yaml").write_text(
        "task: evil_task\ncustom_dataset: !function payload.ds\noutput_type: loglikelihood_rolling\n"
        "test_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
    )
    (folder / "payload.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "def ds(**kw):\n    return {{}}\n"
    )
    return folder


def test_config_file_may_not_name_a_task_folder(tmp_path, monkeypatch):
    """eval.tasks_include_path in a downloaded config would import the folder's Python: refused
    before anything runs; accepted from the command line or when the environment trusts it."""
    marker = tmp_path / "pwned"
    folder = plant_task_folder(tmp_path, marker)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        json.dumps({"eval": {"tasks": ["evil_task"], "tasks_include_path": str(folder)}})
    )
    proc = cli_main("train", str(cfg), *tiny_overrides(), "--run-dir", str(tmp_path / "run"))
    assert_one_line_error(proc, "c.yaml: eval.tasks_include_path=", "MEGAFORMER_TRUST_TASKS_DIR")
    assert not marker.exists() and not (tmp_path / "run").exists()
    plain = tmp_path / "plain.yaml"
    plain.write_text(json.dumps({"eval": {"tasks": ["evil_task"]}}))
    assert load_config(plain, [f"eval.tasks_include_path={folder}"]).eval.tasks_include_path == str(
        folder
    )
    monkeypatch.setenv("MEGAFORMER_TRUST_TASKS_DIR", str(folder))
    assert load_config(cfg).eval.tasks_include_path == str(folder)
    monkeypatch.setenv("MEGAFORMER_TRUST_TASKS_DIR", str(tmp_path))  # another folder: refused
    with pytest.raises(ConfigError, match="tasks_include_path"):
        load_config(cfg)
    assert not marker.exists()


# ----------------------------------------------------------------------------- reads through links


def test_checkpoint_files_are_never_read_through_links(tmp_path, run_dir):
    """A linked tokenizer.json (a private-key stand-in), config.yaml, state/ folder or checkpoints/
    folder is refused by generate, convert and eval; nothing is copied into a published folder."""
    from megaformer.safe_files import open_inside, read_inside

    other = tiny_run(tmp_path / "other")
    ckpt = run_dir / "checkpoints" / "step_0000000"
    key = victim(tmp_path, "id_ed25519")
    tok = ckpt / "tokenizer.json"
    saved = tok.read_bytes()
    tok.unlink()
    tok.symlink_to(key)
    out = tmp_path / "out"
    line = assert_one_line_error(
        cli_main("convert", str(run_dir), str(out), "--to", "megaformer"),
        f"{tok}: is a symbolic link",
    )
    assert "victim" not in line and not out.exists()
    tok.unlink()
    tok.write_bytes(saved)
    (ckpt / "config.yaml").unlink()
    (ckpt / "config.yaml").symlink_to(other / "checkpoints" / "step_0000000" / "config.yaml")
    for args in (
        ("generate", str(run_dir), "--max-new-tokens", "1"),
        ("convert", str(run_dir), str(out), "--to", "hf"),
        ("eval", str(run_dir), "--tasks", "x"),
    ):
        assert_one_line_error(cli_main(*args), f"{ckpt / 'config.yaml'}: is a symbolic link")
    assert not out.exists()
    (ckpt / "config.yaml").unlink()
    shutil.copy(other / "checkpoints" / "step_0000000" / "config.yaml", ckpt / "config.yaml")
    (ckpt / "state").symlink_to(other / "checkpoints" / "step_0000000", target_is_directory=True)
    assert_one_line_error(
        cli_main("generate", str(run_dir), "--max-new-tokens", "1"),
        f"{ckpt / 'state'}: is a symbolic link",
    )
    (ckpt / "state").unlink()
    # the reading helper opens each component without following links, and a FIFO does not hang
    with pytest.raises(CheckpointError, match="linked: is a symbolic link"):
        (tmp_path / "linked").symlink_to(ckpt, target_is_directory=True)
        read_inside(tmp_path, "linked/config.yaml")
    os.mkfifo(ckpt / "fifo")
    with pytest.raises(CheckpointError, match="not a regular file"):
        open_inside(ckpt, "fifo")
    with pytest.raises(CheckpointError, match="not a plain path"):
        open_inside(ckpt, "../step_0000000/config.yaml")
    assert (
        read_inside(run_dir / "checkpoints", "step_0000000/config.yaml")
        == (ckpt / "config.yaml").read_bytes()
    )
    os.unlink(ckpt / "fifo")
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").symlink_to(other / "checkpoints", target_is_directory=True)
    assert_one_line_error(
        cli_main("generate", str(run_dir), "--max-new-tokens", "1"),
        f"{run_dir / 'checkpoints'}: is a symbolic link",
    )
    assert key.read_text() == VICTIM_TEXT


# ----------------------------------------------------------------------------- sharded state


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A run directory whose checkpoint is a sharded state (two tiny training steps)."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(**{"train.steps": 2, "eval.interval": 0, "eval.at_end": False}),
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run


def copy_run(run: Path, dst: Path) -> tuple[Path, Path, dict]:
    """A copy of ``run``: (run, its checkpoint, the parsed index in the format that lists every
    box, which checkpoints of the first sharded release have and crafted ones may have)."""
    from megaformer.checkpoint.sharded import ShardedState

    shutil.copytree(run, dst)
    ckpt = dst / "checkpoints" / "step_0000002"
    index = json.loads((ckpt / "state" / "index.json").read_text())
    listed = {k: v for k, v in index.items() if k not in ("shards", "ranges")}
    return dst, ckpt, {**listed, "format": 1, "boxes": ShardedState(ckpt).listed()}


def test_overlapping_boxes_do_not_pass_as_a_whole_tensor(tmp_path, sharded_run):
    """Half the embedding saved once and referenced twice (counted twice toward coverage, the
    other half left as uninitialised memory): refused on the index before anything is read or
    exported."""
    from safetensors.torch import load_file, save_file

    from megaformer.checkpoint.index_checks import check_exact_cover

    run, ckpt, index = copy_run(sharded_run, tmp_path / "run")
    shard = ckpt / "state" / "rank_00000.safetensors"
    tensors = load_file(str(shard))
    name, key = "tok_embeddings.weight", "tok_embeddings.weight/master/0"
    rows, cols = index["shapes"][name]
    half = rows // 2
    tensors[key + "x"] = tensors[key][rows - 1 :].contiguous()  # the odd last row
    tensors[key] = tensors[key][:half].contiguous()
    save_file(tensors, str(shard))
    index["files"][shard.name] = shard.stat().st_size
    index["boxes"][f"{name}/master"] = [
        [shard.name, key, [0, 0], [half, cols]],
        [shard.name, key, [0, 0], [half, cols]],
        [shard.name, key + "x", [rows - 1, 0], [1, cols]],
    ]
    assert 2 * half + 1 == rows  # the element count adds up
    (ckpt / "state" / "index.json").write_text(json.dumps(index))
    out = tmp_path / "hf"
    assert_one_line_error(
        cli_main("convert", str(run), str(out), "--to", "hf"),
        "two boxes of tok_embeddings.weight/master overlap",
    )
    assert not out.exists()
    index["boxes"][f"{name}/master"].pop(1)  # half missing: the volumes do not add up
    (ckpt / "state" / "index.json").write_text(json.dumps(index))
    assert_one_line_error(
        cli_main("generate", str(run), "--max-new-tokens", "1"),
        f"hold {(half + 1) * cols} elements, the tensor {rows * cols}",
    )
    # exact tilings of a 2-d tensor pass, partial rows included
    tiles = [["f", "k", [0, 0], [1, 3]], ["f", "k", [0, 3], [1, 2]], ["f", "k", [1, 0], [2, 5]]]
    check_exact_cover("w", (3, 5), tiles, Path("index.json"))
    crossing = [
        ["f", "k", [0, 0], [2, 3]],
        ["f", "k", [1, 2], [2, 3]],
        ["f", "k", [0, 3], [1, 2]],
        ["f", "k", [2, 0], [1, 1]],
    ]  # 15 elements, (1, 2) twice and (2, 1) never
    with pytest.raises(
        CheckpointError,
        match=r"two boxes of w overlap \(at offsets \[0, 0\] and "
        r"\[1, 2\]\)",
    ):
        check_exact_cover("w", (3, 5), crossing, Path("index.json"))


# ----------------------------------------------------------------------------- writes through links


def test_shared_cache_and_wandb_folder_are_not_written_through_links(tmp_path):
    """A link planted at the tokenizer scratch name of a shared data.cache_dir (a ~/.bashrc
    stand-in) is not written through; a linked RUN_DIR/wandb is refused before W&B starts; the
    folders megaformer creates in the cache are private."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(
            json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(300)
        )
    )
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    bashrc = victim(tmp_path, "bashrc")
    for rank in range(2):
        (cache / f".tokenizer-{rank}.json").symlink_to(bashrc)
    overrides = tiny_overrides(
        **{
            "train.steps": 1,
            "eval.interval": 0,
            "eval.at_end": False,
            "checkpoint.save_at_end": False,
        }
    )
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *overrides,
        f"data.paths=[{docs}]",
        f"data.cache_dir={cache}",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert bashrc.read_text() == VICTIM_TEXT
    assert oct((cache / "prepared").stat().st_mode & 0o777) == "0o700"
    assert [p.stat().st_mode & 0o777 for p in (cache / "prepared").iterdir()] == [0o700]
    run = tmp_path / "run2"
    run.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (run / "wandb").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *overrides,
        "log.wandb=true",
        "log.wandb_mode=offline",
        "--run-dir",
        str(run),
    )
    assert_one_line_error(proc, f"{run / 'wandb'}: is a symbolic link")
    assert list((tmp_path / "elsewhere").iterdir()) == []


# ----------------------------------------------------------------------------- allocation bombs

ADDRESS_LIMIT = 3 << 30  # each bomb below asks for more; the genuine work needs far less


def run_limited(*args: str) -> subprocess.CompletedProcess:
    """``megaformer ARGS`` in a process of its own (forked from the preloaded server) whose address
    space is capped at :data:`ADDRESS_LIMIT`: a file that sizes an allocation fails there, never
    on the machine."""
    return run_module(
        1,
        "tests.address_limited",
        [str(ADDRESS_LIMIT), *args],
        torchrun=False,
        env=subprocess_env(),
        cwd=ROOT,
        timeout=600,
    )


def test_no_allocation_is_sized_by_a_file_before_it_is_checked(tmp_path, sharded_run):
    """A 2^25-row vocabulary claimed by index.json and config.yaml beside tiny shards; a 1 KB
    metrics file read under the 8 GiB metrics bound; a token id of 2^31 - 1 beyond the first
    2^20 tokens; a meta.json data position of 10^12; 1,100 layers in metrics.jsonl."""
    run, ckpt, index = copy_run(sharded_run, tmp_path / "bomb")
    rows = 1 << 25
    for name in ("tok_embeddings.weight", "lm_head.weight"):
        if name in index["shapes"]:
            index["shapes"][name][0] = rows
            for key in ("master", "exp_avg", "exp_avg_sq"):
                for box in index["boxes"][f"{name}/{key}"]:
                    box[3][0] = rows
    (ckpt / "state" / "index.json").write_text(json.dumps(index))
    text = (ckpt / "config.yaml").read_text()
    (ckpt / "config.yaml").write_text(text.replace("vocab_size: 257", f"vocab_size: {rows}"))
    assert f"vocab_size: {rows}" in (ckpt / "config.yaml").read_text()
    assert_one_line_error(
        run_limited("generate", str(run), "--max-new-tokens", "1"),
        "rank_00000.safetensors: the index places",
        "bytes of tensors",
    )
    # report: a small metrics file is read in chunks, not into a buffer of the bound's size
    small = tmp_path / "small"
    small.mkdir()
    (small / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    proc = run_limited("report", str(small))
    assert proc.returncode == 0 and "1 records" in proc.stdout, proc.stderr[-2000:]
    # every token id is range-checked, the validation split's included
    from megaformer.data.indexed import IndexedWriter

    tokens = np.full(3 << 20, 65, dtype=np.int64)
    tokens[-5] = 2**31 - 1
    writer = IndexedWriter(tmp_path / "data", np.int32)
    writer.add(tokens, np.full(3 << 10, 1 << 10))
    writer.finish()
    overrides = tiny_overrides(**{"train.steps": 1, "eval.interval": 0})
    proc = run_limited(
        "train",
        "configs/quickstart.yaml",
        *overrides,
        f"data.paths=[{tmp_path / 'data'}]",
        "--run-dir",
        str(tmp_path / "r"),
    )
    assert_one_line_error(proc, "data.bin: token id 2147483647", "outside the vocabulary")
    # a data position no saved step could have reached
    run, ckpt, _ = copy_run(sharded_run, tmp_path / "position")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["consumed_samples"] = 10**12
    (ckpt / "meta.json").write_text(json.dumps(meta))
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(**{"train.steps": 3, "eval.interval": 0, "eval.at_end": False}),
        "--run-dir",
        str(run),
    )
    assert_one_line_error(proc, "consumed_samples 1000000000000 is not a count")
    # report draws a bounded number of panels, whatever the number of layers named
    from megaformer.diagnostics.plots import MAX_DRAWN, thinned

    layers = tmp_path / "layers"
    layers.mkdir()
    with open(layers / "metrics.jsonl", "w") as fh:
        for step in (1, 2):
            fh.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": 1.0,
                        **{f"attn/layer_{i}/entropy/head_0": 0.5 for i in range(1100)},
                    }
                )
                + "\n"
            )
    assert cli_main("report", str(layers)).returncode == 0
    assert thinned(list(range(1100))) == [
        round(i * 1099 / (MAX_DRAWN - 1)) for i in range(MAX_DRAWN)
    ]


# ----------------------------------------------------------------------------- one line

DEEP_JSON = "[" * 200_000 + "]" * 200_000  # deeper than Python's parsers recurse
LONG_INT = "7" * 5000  # longer than Python converts (4,300 digits)


def test_deep_nesting_and_long_integers_are_one_line(tmp_path, run_dir, sharded_run):
    """Deeply nested JSON/YAML and over-long integers in metrics.jsonl, meta.json, index.json,
    tokenizer.json, config.yaml and a safetensors header; a crafted RNG file; inspect --out on a
    dangling link: each a one-line error (or, in metrics.jsonl, a skipped line), no traceback."""
    from megaformer.checkpoint.safetensors_check import read_header

    metrics = tmp_path / "m"
    metrics.mkdir()
    (metrics / "metrics.jsonl").write_text(
        "\n".join([DEEP_JSON, '{"step": ' + LONG_INT + "}", json.dumps({"step": 3, "loss": 1.5})])
    )
    proc = cli_main("report", str(metrics))
    assert proc.returncode == 0 and "1 records" in proc.stdout, proc.stderr[-2000:]
    ckpt = run_dir / "checkpoints" / "step_0000000"
    generate = ("generate", str(run_dir), "--max-new-tokens", "1")
    convert = ("convert", str(run_dir), str(tmp_path / "out"), "--to", "megaformer")
    for name, text, needle, command in (
        ("meta.json", DEEP_JSON, "meta.json is missing or corrupt", convert),
        ("meta.json", '{"step": ' + LONG_INT + "}", "meta.json is missing or corrupt", convert),
        ("tokenizer.json", DEEP_JSON, "not a tokenizer.json file", generate),
        ("tokenizer.json", LONG_INT, "not a tokenizer.json file", generate),
        ("config.yaml", "a: " + DEEP_JSON, "nested too deeply", generate),
        ("config.yaml", "train: {steps: " + LONG_INT + "}", "an integer too long", generate),
    ):
        saved = (ckpt / name).read_bytes()
        (ckpt / name).write_text(text)
        line = assert_one_line_error(cli_main(*command), needle)
        assert len(line) < 1000
        (ckpt / name).write_bytes(saved)
    config = tmp_path / "deep.yaml"
    config.write_text("train:\n  steps: " + LONG_INT + "\n")
    assert_one_line_error(cli_main("train", str(config)), "deep.yaml: holds an integer too long")
    for header in (
        DEEP_JSON,
        '{"x": {"dtype": "F32", "shape": [' + LONG_INT + '], "data_offsets": [0, 4]}}',
    ):
        weights = tmp_path / "w.safetensors"
        raw = header.encode()
        weights.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 4)
        with pytest.raises(CheckpointError, match="header is not JSON"):
            read_header(weights)
    run, sharded_ckpt, _ = copy_run(sharded_run, tmp_path / "sharded")
    (sharded_ckpt / "state" / "index.json").write_text(DEEP_JSON)
    assert_one_line_error(
        cli_main("generate", str(run), "--max-new-tokens", "1"), "index.json: missing or corrupt"
    )
    # a crafted RNG file: plain data that unpickles weights-only, but is not an RNG state
    run, sharded_ckpt, _ = copy_run(sharded_run, tmp_path / "rng")
    torch.save(
        {
            "torch": torch.get_rng_state(),
            "python": [3, list(range(625)), None],
            "numpy": ["MT19937", [1, 2, 3], 0, 0, 0.0],
        },
        sharded_ckpt / "rng" / "rank_0.pt",
    )
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(**{"train.steps": 3, "eval.interval": 0, "eval.at_end": False}),
        "--run-dir",
        str(run),
    )
    assert_one_line_error(proc, "rank_0.pt: corrupt RNG state")
    dangling = tmp_path / "plots"
    dangling.symlink_to(tmp_path / "nowhere")
    assert_one_line_error(
        cli_main("inspect", str(run_dir), "--prompt", "def ", "--out", str(dangling)),
        "--out",
        "symbolic link",
    )
    assert not (tmp_path / "nowhere").exists()


# ----------------------------------------------------------------------------- run locks


def test_planted_lock_files_neither_hang_nor_refuse_others(tmp_path):
    """A FIFO named .owner in a shared (sticky) folder, a FIFO in a run directory, and a record
    whose heartbeat lies a year in the future: convert/prepare-data are neither hung nor refused,
    and a training run takes its own directory over."""
    import threading
    import time

    from megaformer.runtime.run_lock import OWNER_FILE, RunLock, check_not_owned

    shared = tmp_path / "scratch"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    os.mkfifo(shared / OWNER_FILE)
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / OWNER_FILE)
    future = tmp_path / "future"
    future.mkdir()
    (future / OWNER_FILE).write_text(
        json.dumps({"host": "elsewhere", "pid": 1, "started": time.time(), "token": "t"}) + "\n"
    )
    ahead = time.time() + 365 * 86400
    os.utime(future / OWNER_FILE, (ahead, ahead))
    done = []

    def check_all() -> None:
        for target in (shared / "me" / "out", run / "export", future / "export"):
            check_not_owned(target, "convert")
            done.append(target)

    worker = threading.Thread(target=check_all, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert len(done) == 3, "check_not_owned blocked on a planted .owner"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 50)
    (shared / "me").mkdir()
    proc = cli_main(
        "prepare-data",
        "--input",
        str(corpus),
        "--tokenizer",
        "byte",
        "--output-prefix",
        str(shared / "me" / "data"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for folder in (run, future):
        with RunLock(folder) as lock:
            assert lock.held
        assert not (folder / OWNER_FILE).exists()


# ----------------------------------------------------------------------------- smaller


def test_blend_cache_must_be_a_schedule_this_module_writes(tmp_path):
    """A cached blend index that favours one dataset, repeats a sample or skips one, consistent
    in shape and range, is ignored and rebuilt; the cache folder and its missing parents are
    created private."""
    from megaformer.data.blend import BlendedDataset, blend_index

    parts = [
        type(
            "Part",
            (),
            {"sample": lambda self, k: np.array([k]), "ensure": lambda *a, **k: None, "seq_len": i},
        )()
        for i in range(3)
    ]
    cache = tmp_path / "shared" / "cache"
    built = BlendedDataset(parts, [1, 2, 3], 5000, cache)
    assert [oct(p.stat().st_mode & 0o777) for p in (cache.parent, cache)] == ["0o700"] * 2
    reference = blend_index([1, 2, 3], 5000)
    paths = built._paths()
    which, offset = np.array(built.which), np.array(built.offset)
    favoured, repeated = which.copy(), offset.copy()
    favoured[:] = 2  # one dataset only; offsets rewritten to stay consistent with it
    repeated[100] = repeated[99] if which[99] == which[100] else 0
    for w, o in ((favoured, np.arange(len(which))), (which, repeated)):
        np.save(paths["which"], w)
        np.save(paths["offset"], o)
        again = BlendedDataset(parts, [1, 2, 3], 5000, cache, build=False)
        assert not isinstance(again.which, np.memmap)  # ignored, computed afresh
        assert np.array_equal(again.which, reference[0])
        assert np.array_equal(again.offset, reference[1])


def test_network_use_is_announced_and_fault_injection_warns(tmp_path, monkeypatch, caplog):
    """eval.tasks from lm-eval's registry and W&B online say at start that they reach the network
    (and HF_HUB_OFFLINE / WANDB_MODE are honoured); MEGAFORMER_FAULT warns loudly."""
    import logging

    from megaformer.evaluation.tasks import network_notice
    from megaformer.training import wandb_log
    from megaformer.training.faults import FaultPlan

    caplog.set_level(logging.INFO, logger="megaformer")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    network_notice(["hellaswag"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    network_notice(["arc_easy"])
    lines = [r.getMessage() for r in caplog.records]
    assert any("hellaswag" in m and "downloaded from the Hugging Face hub" in m for m in lines)
    assert any("arc_easy" in m and "offline (HF_HUB_OFFLINE)" in m for m in lines)
    inits = []

    class FakeWandb:
        @staticmethod
        def init(**kw):
            inits.append(kw["mode"])
            return type("Run", (), {"id": "abc"})()

    monkeypatch.setattr(wandb_log, "_import_wandb", lambda: FakeWandb)
    cfg = load_config("configs/quickstart.yaml", ["log.wandb=true"])
    monkeypatch.delenv("WANDB_MODE", raising=False)
    wandb_log.open_run(cfg, tmp_path / "run")
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb_log.open_run(cfg, tmp_path / "run")
    assert inits == ["online", "offline"]
    assert sum("W&B: online" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setenv("MEGAFORMER_FAULT", "nan@step=3")
    assert FaultPlan.from_env(0).faults
    assert any(
        "fail ON PURPOSE" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records
    )
