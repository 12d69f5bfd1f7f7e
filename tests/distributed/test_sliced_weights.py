"""Whole-tensor weight files (a weights-only checkpoint, a Hugging Face folder) read shard by shard.

A Llama-style proxy (d_model 256, 4 blocks, vocabulary 8192, untied: 7.1M parameters, 29 MB
fp32) saved by transformers and converted: built at TP2 x PP2 on 4 gloo ranks, each rank reads at
most 1 / (TP * PP) + 10% of the weight bytes and its build grows its resident memory by less than
the whole fp32 model, with the scores of the one-process model (1e-5). ``model.init_from``
trains from the folder itself with the first loss of training from its conversion.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.helpers import run_cli, tiny_overrides

TP, PP = 2, 2
SEQ = 64


@pytest.fixture(scope="module")
def proxy(tmp_path_factory) -> tuple[Path, Path]:
    """(a random LlamaForCausalLM saved by transformers, its ``convert --to megaformer`` run)."""
    transformers = pytest.importorskip("transformers")
    from megaformer.checkpoint import layout as ckpt_layout
    from megaformer.checkpoint.hf.convert import import_from_hf
    from megaformer.data.tokenizer import ByteTokenizer

    base = tmp_path_factory.mktemp("sliced")
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(base / "hf", safe_serialization=True)
    run = import_from_hf(base / "hf", base / "run")
    ByteTokenizer().save(ckpt_layout.resolve_checkpoint(run) / "tokenizer.json")
    return base / "hf", run


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8192, (2, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _count_reads(counter: dict) -> None:
    """Every byte a ``safe_open`` handle or ``load_file`` hands out is added to ``counter``."""
    import safetensors
    import safetensors.torch

    real_open, real_load = safetensors.safe_open, safetensors.torch.load_file

    class Counted:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            t = self.f.get_tensor(name)
            counter["bytes"] += t.numel() * t.element_size()
            return t

        def get_slice(self, name):
            s = self.f.get_slice(name)

            class Sliced:
                def __getitem__(_, box):
                    t = s[box]
                    counter["bytes"] += t.numel() * t.element_size()
                    return t

                def __getattr__(_, attr):
                    return getattr(s, attr)

            return Sliced()

    def load_file(*a, **kw):
        out = real_load(*a, **kw)
        counter["bytes"] += sum(t.numel() * t.element_size() for t in out.values())
        return out

    safetensors.safe_open = Counted
    safetensors.torch.load_file = load_file


class PeakGrowth:
    """The growth of this process's resident memory at its highest inside the block over its
    size on entry (``/proc/self/statm``, sampled every 0.2 ms by a thread; mapped file pages
    count too, so a memory-mapped read is charged to the reader)."""

    def __enter__(self) -> "PeakGrowth":
        self.base = self.peak = _resident()
        self.done = False
        self.switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self) -> None:
        while not self.done:
            self.peak = max(self.peak, _resident())
            time.sleep(2e-4)

    def __exit__(self, *exc) -> None:
        self.done = True
        self.thread.join()
        sys.setswitchinterval(self.switch)
        self.peak = max(self.peak, _resident())
        self.growth = self.peak - self.base


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reader(how: str, hf: Path, run: Path, cfg) -> object:
    from megaformer.checkpoint import layout as ckpt_layout
    from megaformer.checkpoint import weights as ckpt_weights
    from megaformer.checkpoint.hf.init_from import hf_weights
    from megaformer.checkpoint.sliced import SlicedWeights

    ckpt = ckpt_layout.resolve_checkpoint(run)
    if how == "whole":  # what every rank read before: the whole file, then the whole model built
        return ckpt_weights.load_weights(ckpt)
    if how == "checkpoint":
        return SlicedWeights.checkpoint(ckpt, cfg.model)
    return hf_weights(dataclasses.replace(cfg.model, init_from=str(hf)))[0]


def _build(rank: int, world: int, how: str, hf: str, run: str) -> dict:
    """This rank's build at TP2 x PP2 from ``how``: weight bytes read, growth of the peak resident
    memory (:class:`PeakGrowth`), the scores of one batch; then ``generate`` and its bytes read."""
    from megaformer.checkpoint import layout as ckpt_layout
    from megaformer.evaluation.checkpoint import eval_layout, generate_from_checkpoint
    from megaformer.evaluation.forward import PipelineRunner
    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import build_topology
    from megaformer.training.distributed import detect_process, init_distributed

    init_distributed(detect_process("cpu"))  # DeepSpeed's comm layer adopts the gloo group
    topo = build_topology(world, rank, tp=TP, pp=PP)
    counter = {"bytes": 0}
    _count_reads(counter)
    cfg = eval_layout(ckpt_layout.read_config(ckpt_layout.resolve_checkpoint(Path(run))), topo)
    # the modules a build imports, imported before measuring: a tiny model built the same way
    tiny = dataclasses.replace(cfg.model, d_model=32, d_ffn=64, vocab_size=64)
    build_model(dataclasses.replace(cfg, model=tiny), topo)
    if how == "hf":
        _reader(how, Path(hf), Path(run), cfg)  # (transformers reads config.json)
    gc.collect()
    torch.distributed.barrier()
    with PeakGrowth() as mem:
        weights = _reader(how, Path(hf), Path(run), cfg)
        built = build_model(cfg, topo, weights=weights, weights_source=run)
        del weights
    peak, read = mem.growth, counter["bytes"]
    ids, targets = _batch()
    logp, _ = PipelineRunner(built.model, built.plain, topo, torch.device("cpu")).scores(
        ids, targets
    )
    counter["bytes"] = 0
    text = generate_from_checkpoint(run, "def ", 6, topo=topo)
    return {
        "read": read,
        "peak": peak,
        "logp": logp,
        "text": text,
        "generate_read": counter["bytes"],
    }


def _one_process(run: Path) -> tuple[torch.Tensor, str, int]:
    """(scores of the batch, generated text, the fp32 model's bytes) on one process."""
    from megaformer.evaluation.checkpoint import generate_from_checkpoint
    from megaformer.evaluation.forward import PlainRunner
    from megaformer.generation import load_checkpoint_model

    model, _, _, _ = load_checkpoint_model(run)
    ids, targets = _batch()
    logp, _ = PlainRunner(model).scores(ids, targets)
    size = sum(p.numel() * 4 for p in model.parameters())
    return logp, generate_from_checkpoint(run, "def ", 6), size


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["checkpoint", "hf"])
def test_each_rank_reads_and_builds_its_share(proxy, how):
    hf, run = proxy
    logp, text, model_bytes = _one_process(run)
    file_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    share = 1 / (TP * PP) + 0.10
    results = run_ranks(TP * PP, _build, how, str(hf), str(run), timeout=900)
    for rank, r in enumerate(results):
        print(
            f"{how} rank {rank}: read {r['read'] / file_bytes:.3f} of the weights, build peak "
            f"{r['peak'] / model_bytes:.2f} x the fp32 model, generate read "
            f"{r['generate_read'] / file_bytes:.3f}"
        )
        assert r["read"] <= share * file_bytes, rank
        assert r["generate_read"] <= share * file_bytes, rank
        assert r["peak"] < model_bytes, rank
        assert (r["logp"] - logp).abs().max().item() <= 1e-5, rank
        assert r["text"] == text, rank
    # every weight byte is read by some rank (the stages' shards cover the model)
    assert sum(r["read"] for r in results) >= 0.99 * model_bytes


@pytest.mark.slow
@pytest.mark.multiprocess
def test_whole_weights_before(proxy):
    """The layout-independent path the readers replaced: every rank reads every byte and builds
    the whole fp32 model first (kept as the baseline the shares above are measured against)."""
    hf, run = proxy
    _, _, model_bytes = _one_process(run)
    results = run_ranks(TP * PP, _build, "whole", str(hf), str(run), timeout=900)
    for rank, r in enumerate(results):
        print(
            f"whole rank {rank}: read {r['read'] / model_bytes:.3f}, build peak "
            f"{r['peak'] / model_bytes:.2f} x the fp32 model"
        )
        assert r["read"] >= model_bytes


def _first_loss(run: Path) -> float:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in lines if "loss" in r)


@pytest.mark.slow
def test_init_from_a_hugging_face_folder_equals_converting_first(proxy, tmp_path):
    hf, run = proxy
    steps = ["train.steps=1", "eval.interval=0", "eval.at_end=false", "model.max_seq_len=64"]
    direct = tmp_path / "direct"
    proc = run_cli(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        *steps,
        "--init-from",
        str(hf),
        "--run-dir",
        str(direct),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (direct / "checkpoints").exists() or not any(
        (p / "model.safetensors").exists() for p in (direct / "checkpoints").iterdir()
    )
    # converting first: the converted run's weights-only checkpoint in a fresh run directory
    converted = tmp_path / "converted"
    shutil.copytree(run / "checkpoints", converted / "checkpoints")
    proc = run_cli(
        "train", str(direct / "config.yaml"), "model.init_from=null", "--run-dir", str(converted)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _first_loss(direct), _first_loss(converted)
    assert math.isfinite(a) and abs(a - b) <= 1e-5, (a, b)


def test_init_from_refuses_a_missing_folder(tmp_path):
    from tests.helpers import assert_one_line_error, cli_main

    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        "--init-from",
        str(tmp_path / "nowhere"),
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert_one_line_error(proc, "no such Hugging Face model folder")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_generate_under_torchrun_prints_the_one_process_text(proxy):
    from tests.helpers import run_torchrun

    _, run = proxy
    args = ("generate", str(run), "--prompt", "def ", "--max-new-tokens", "6")
    one = run_cli(*args)
    two = run_torchrun(2, *args, "--tp", "2")
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.strip().endswith(one.stdout.strip()) and one.stdout.strip().startswith("def")


def test_experts_are_read_one_rank_share_at_a_time(tmp_path):
    """A Mixtral folder's per-expert tensors, stacked on the fly: a rank's box (its experts, its
    tensor-parallel rows) reads only those bytes and equals that box of the converted tensor."""
    transformers = pytest.importorskip("transformers")
    from megaformer.checkpoint import layout as ckpt_layout
    from megaformer.checkpoint import weights as ckpt_weights
    from megaformer.checkpoint.hf.convert import import_from_hf
    from megaformer.checkpoint.hf.init_from import hf_weights

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    run = import_from_hf(tmp_path / "hf", tmp_path / "run")
    ckpt = ckpt_layout.resolve_checkpoint(run)
    whole = ckpt_weights.load_weights(ckpt)["layers.1.mlp.experts.w1"]  # [E, f, d]
    model = dataclasses.replace(ckpt_layout.read_config(ckpt).model, init_from=str(tmp_path / "hf"))
    reader, _ = hf_weights(model)
    got = reader.shard("layers.1.mlp.experts.w1", (2, 24, 32), 1, 24, ep_offset=2)
    assert torch.equal(got, whole[2:4, 24:48])
    assert reader.bytes_read == 2 * 24 * 32 * 4  # a quarter of the tensor: nothing else read
