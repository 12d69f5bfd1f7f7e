"""lm-evaluation-harness on megaformer's own model (``megaformer eval``, ``eval.tasks``) and the
Weights & Biases sink.

The reference is ``transformers`` on the exported model (``megaformer convert --to hf``), scored
request by request with lm-eval's own rules (trailing context spaces move into the continuation,
(context + continuation) keeps its last max_seq_len + 1 tokens, rolling windows from
``lm_eval.utils``); megaformer's harness must give the same log-likelihood for every request
within 1e-5 (relative) at TP=1, TP=2, DP=2 and PP=2, and the same greedy tokens. The local tasks
live in tests/data/eval_tasks (JSONL read relative to the YAMLs); nothing reaches the network.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.helpers import assert_one_line_error, cli_main, tiny_overrides

pytest.importorskip("lm_eval")

TASKS_DIR = Path(__file__).resolve().parents[1] / "data" / "eval_tasks"
MC, PPL, GEN = "megaformer_code_mc", "megaformer_code_ppl", "megaformer_code_gen"
MAX_LEN = 32
OFFLINE = {
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # not in HOME or the cwd
        monkeypatch.setenv(k, str(tmp_path / "wandb_home"))


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS_DIR / name).read_text().splitlines()]


def _requests() -> tuple[list, list]:
    """The local tasks' requests as lm-eval Instances: (loglikelihood, loglikelihood_rolling)."""
    from lm_eval.api.instance import Instance

    ll = [
        Instance("loglikelihood", {}, (d["context"], c), i)
        for i, d in enumerate(_jsonl("code_mc.jsonl"))
        for c in d["choices"]
    ]
    roll = [
        Instance("loglikelihood_rolling", {}, (d["text"],), i)
        for i, d in enumerate(_jsonl("code_ppl.jsonl"))
    ]
    return ll, roll


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """(a megaformer run with random, perturbed weights: Llama-style, GQA, untied; its Hugging
    Face export)."""
    from megaformer.checkpoint import weights as ckpt_weights
    from megaformer.checkpoint.hf.convert import export_to_hf
    from megaformer.config import config_from_dict
    from megaformer.data.tokenizer import ByteTokenizer
    from megaformer.model.transformer import Transformer

    pytest.importorskip("transformers")
    base = tmp_path_factory.mktemp("eval")
    cfg = config_from_dict(
        {
            "model": {
                "vocab_size": 257,
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 2,
                "max_seq_len": MAX_LEN,
                "tie_embeddings": False,
            }
        }
    )
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p) if p.dim() == 1 else 0.05 * torch.randn_like(p))
    ckpt_weights.save_weights_checkpoint(
        base / "run", 0, model.state_dict(), cfg.to_yaml(), ByteTokenizer(), {}
    )
    return base / "run", export_to_hf(base / "run", base / "hf")


def _transformers_scores(hf: Path) -> tuple[list, list, list]:
    """transformers' (loglikelihoods, rolling loglikelihoods, greedy tokens) of the requests."""
    import transformers
    from lm_eval import utils

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf, local_files_only=True, dtype=torch.float32
    ).eval()

    def score(context: list[int], continuation: list[int]) -> tuple[float, bool]:
        whole = (context + continuation)[-(MAX_LEN + 1) :]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits[0].float(), -1)
        n = len(continuation)
        target = torch.tensor(whole[1:])[-n:]
        sel = logp[-n:]
        return float(sel.gather(-1, target[:, None]).sum()), bool((sel.argmax(-1) == target).all())

    ll_reqs, roll_reqs = _requests()
    ll = []
    for req in ll_reqs:
        c, x = req.args
        k = len(c) - len(c.rstrip())  # lm-eval moves trailing spaces into the continuation
        if k:
            c, x = c[:-k], c[-k:] + x
        ll.append(score(list(c.encode()), list(x.encode())))
    roll = []
    for req in roll_reqs:
        windows = utils.get_rolling_token_windows(list(req.args[0].encode()), 256, MAX_LEN, 1)
        roll.append(sum(score(c, x)[0] for c, x in map(utils.make_disjoint_window, windows)))
    prompt = torch.tensor([list(b"def main():\n")])
    gen = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1] :].tolist()
    return ll, roll, gen


def _megaformer_scores(ckpt: Path, topo=None, batch_size: int = 3) -> tuple[list, list, list, list]:
    """megaformer's (loglikelihoods, rolling, greedy tokens, generate_until texts) of the requests
    through the harness, laid out for ``topo`` (None: one process)."""
    from lm_eval.api.instance import Instance

    from megaformer.checkpoint.layout import resolve_checkpoint
    from megaformer.evaluation.checkpoint import load_runner
    from megaformer.evaluation.harness import make_lm

    runner, tok, _ = load_runner(resolve_checkpoint(ckpt), topo, torch.device("cpu"))
    dp = topo.group("dp") if topo is not None and topo.dp > 1 else None
    lm = make_lm(runner, tok, batch_size=batch_size, dp_group=dp)
    ll_reqs, roll_reqs = _requests()
    until = {"until": ["\n\n"], "max_gen_toks": 12}
    gen_reqs = [
        Instance("generate_until", {}, (d["context"], until), i)
        for i, d in enumerate(_jsonl("code_gen.jsonl"))
    ]
    return (
        lm.loglikelihood(ll_reqs),
        lm.loglikelihood_rolling(roll_reqs),
        runner.greedy(list(b"def main():\n"), 12),
        lm.generate_until(gen_reqs),
    )


def _assert_close(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        a_lp, b_lp = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
        assert abs(a_lp - b_lp) <= 1e-5 * max(1.0, abs(b_lp)), (a, b)
        if isinstance(a, tuple):
            assert a[1] == b[1], (a, b)


def test_loglikelihoods_equal_transformers_request_by_request(exported):
    run, hf = exported
    ll, roll, gen = _transformers_scores(hf)
    ours = _megaformer_scores(run)
    _assert_close(ours[0], ll)
    _assert_close(ours[1], roll)
    assert ours[2] == gen  # greedy tokens with the KV cache = transformers' greedy generate
    # a real function of the input: the requests' scores spread, the long texts span windows
    assert max(x[0] for x in ll) - min(x[0] for x in ll) > 5
    assert any(len(d["text"]) > 3 * MAX_LEN for d in _jsonl("code_ppl.jsonl"))


def test_generate_until_equals_transformers_generate_cut_at_the_stop_strings(exported):
    """generate_until against transformers' greedy ``generate`` on the exported weights, cut as
    lm-eval's HFLM cuts: the context keeps its last max_length - max_gen_toks tokens, the text
    ends before the end-of-document token and before the first occurrence of any stop string."""
    import transformers
    from lm_eval.api.instance import Instance

    from megaformer.checkpoint.layout import resolve_checkpoint
    from megaformer.evaluation.checkpoint import load_runner
    from megaformer.evaluation.harness import make_lm

    run, hf = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf, local_files_only=True, dtype=torch.float32
    ).eval()
    max_gen, eod = 12, 256
    contexts = [d["context"] for d in _jsonl("code_gen.jsonl")]
    contexts.append("def long_function_name(argument_one, argument_two):\n    return ")  # > 20 B

    def hf_text(context: str) -> str:
        ids = list(context.encode())[-(MAX_LEN - max_gen) :]
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_gen,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
        new = out[0, len(ids) :].tolist()
        new = new[: new.index(eod)] if eod in new else new
        return bytes(t for t in new if t < 256).decode("utf-8", errors="replace")

    full = [hf_text(c) for c in contexts]
    # a stop string from the middle of each continuation (the cut must happen), and one never met
    stops = [[t[4:6]] if len(t) >= 6 else ["\x00"] for t in full]
    stops[-1] = ["\x00never"]
    runner, tok, _ = load_runner(resolve_checkpoint(run), None, torch.device("cpu"))
    lm = make_lm(runner, tok, batch_size=2)
    reqs = [
        Instance("generate_until", {}, (c, {"until": u, "max_gen_toks": max_gen}), i)
        for i, (c, u) in enumerate(zip(contexts, stops))
    ]
    want = [t.split(u[0])[0] for t, u in zip(full, stops)]
    assert lm.generate_until(reqs) == want
    assert sum(w != t for w, t in zip(want, full)) >= 3  # the stop strings did cut
    assert len(want[-1]) >= 8 and len(contexts[-1]) > MAX_LEN - max_gen  # truncated context


def _layouts(rank: int, world: int, ckpt: str) -> dict:
    """TP=2, DP=2 and PP=2 on the same two gloo ranks."""
    from megaformer.parallel.topology import build_topology
    from megaformer.training.distributed import detect_process, init_distributed

    init_distributed(detect_process("cpu"))  # DeepSpeed's comm layer adopts the gloo group
    out = {}
    for name, (tp, pp) in {"tp2": (2, 1), "dp2": (1, 1), "pp2": (1, 2)}.items():
        topo = build_topology(world, rank, tp=tp, pp=pp)
        out[name] = _megaformer_scores(Path(ckpt), topo, batch_size=2)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp2_dp2_pp2_equal_transformers(exported):
    run, hf = exported
    ll, roll, gen = _transformers_scores(hf)
    one = _megaformer_scores(run)
    results = run_ranks(2, _layouts, str(run))
    for rank in range(2):
        for name, (r_ll, r_roll, r_gen, r_text) in results[rank].items():
            _assert_close(r_ll, ll)
            _assert_close(r_roll, roll)
            assert r_gen == gen, name
            assert r_text == one[3], name  # generate_until: the same texts on every layout


@pytest.mark.slow
def test_cli_eval_writes_results_and_refuses_bad_input(exported, tmp_path, monkeypatch):
    run, _ = exported
    out = tmp_path / "scores.json"
    proc = cli_main(
        "eval",
        str(run),
        "--tasks",
        f"{MC},{PPL},{GEN}",
        "--include-path",
        str(TASKS_DIR),
        "--limit",
        "3",
        "--output",
        str(out),
        "--batch-size",
        "2",
        env=OFFLINE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tasks"] == [MC, PPL, GEN] and res["limit"] == 3
    scores = res["scores"]
    assert set(scores) >= {
        f"eval/{MC}/acc",
        f"eval/{MC}/acc_norm",
        f"eval/{PPL}/bits_per_byte",
        f"eval/{PPL}/word_perplexity",
        f"eval/{GEN}/exact_match",
    }
    assert 0 <= scores[f"eval/{MC}/acc"] <= 1 and scores[f"eval/{PPL}/bits_per_byte"] > 0
    assert res["lm_eval"]["n-samples"][MC]["effective"] == 3
    assert f"{MC}" in proc.stdout and "bits_per_byte" in proc.stdout and str(out) in proc.stdout
    # the default results file: beside the checkpoint's weights, named after the tasks
    proc = cli_main(
        "eval",
        str(run),
        "--tasks",
        MC,
        "--include-path",
        str(TASKS_DIR),
        "--limit",
        "2",
        env=OFFLINE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "checkpoints" / "step_0000000" / "eval" / f"{MC}.json").is_file()

    assert_one_line_error(
        cli_main(
            "eval",
            str(run),
            "--tasks",
            "megaformer_code_mcq",
            "--include-path",
            str(TASKS_DIR),
            env=OFFLINE,
        ),
        "unknown task",
        "megaformer_code_mcq",
        MC,
    )
    assert_one_line_error(
        cli_main("eval", str(tmp_path / "nope"), "--tasks", MC, env=OFFLINE), "nope"
    )
    assert_one_line_error(
        cli_main(
            "eval",
            str(run),
            "--tasks",
            MC,
            "--include-path",
            str(tmp_path / "no_tasks"),
            env=OFFLINE,
        ),
        "--include-path",
    )
    assert_one_line_error(
        cli_main("eval", str(run), "--tasks", MC, "--tp", "2", env=OFFLINE), "--tp 2"
    )
    for mod in (
        "lm_eval",
        "lm_eval.api",
        "lm_eval.api.model",
        "lm_eval.tasks",
        "lm_eval.evaluator",
    ):
        monkeypatch.setitem(sys.modules, mod, None)  # as if lm-eval were not installed
    assert_one_line_error(
        cli_main("eval", str(run), "--tasks", MC, env=OFFLINE), "pip install megaformer[eval]"
    )


def _wandb_records(folder: Path) -> list:
    """The protobuf records of the offline W&B run under ``folder``: its ``run-ID.wandb`` file is a
    7-byte header (':W&B', magic, version) then LevelDB-log framing (32 KiB blocks; each chunk a
    7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST) around ``wandb_internal_pb2.Record``
    messages, parsed with wandb's own protobuf classes."""
    import struct

    from wandb.proto import wandb_internal_pb2

    files = sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    data = files[0].read_bytes()
    assert data[:4] == b":W&B"
    pos, records, pending, block = 7, [], b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a chunk header: block padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
            pending = b""
    return records


def _wandb_history(folder: Path) -> list[dict]:
    return [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in _wandb_records(folder)
        if r.WhichOneof("record_type") == "history"
    ]


def _wandb_config(folder: Path) -> dict:
    out: dict = {}
    for r in _wandb_records(folder):
        kind = r.WhichOneof("record_type")
        update = (
            r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        )
        out.update({i.key: json.loads(i.value_json) for i in update if i.key})
    return {k: v.get("value", v) if isinstance(v, dict) else v for k, v in out.items()}


@pytest.mark.slow
def test_eval_tasks_during_training_logged_to_metrics_tensorboard_and_wandb(tmp_path):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(
            **{"train.steps": 4, "eval.interval": 0, "log.interval": 2, "log.tensorboard": "true"}
        ),
        f"eval.tasks=[{MC},{PPL}]",
        "eval.tasks_interval=2",
        "eval.tasks_limit=3",
        f"eval.tasks_include_path={TASKS_DIR}",
        "log.wandb=true",
        "log.wandb_mode=offline",
        "--run-dir",
        str(run),
        env=OFFLINE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if f"eval/{MC}/acc" in r}
    assert sorted(evals) == [2, 4]
    for r in evals.values():
        assert 0 <= r[f"eval/{MC}/acc"] <= 1 and r[f"eval/{PPL}/bits_per_byte"] > 0
    assert evals[2][f"eval/{PPL}/bits_per_byte"] != evals[4][f"eval/{PPL}/bits_per_byte"]

    # the live model's scores at the last step = megaformer eval on the checkpoint saved there
    from megaformer.evaluation.checkpoint import evaluate_checkpoint

    out = evaluate_checkpoint(
        run, [MC, PPL], include_path=str(TASKS_DIR), limit=3, output=tmp_path / "ckpt.json"
    )
    for key, value in out.scores.items():
        assert evals[4][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars(f"eval/{MC}/acc")] == [2, 4]

    # W&B (offline): the same keys and values as metrics.jsonl, at the same steps
    history = _wandb_history(run)
    by_step: dict[int, dict] = {}
    for row in history:
        if "_step" in row:
            by_step.setdefault(int(row["_step"]), {}).update(row)
    for r in records:
        got = by_step[r["step"]]
        for key, value in r.items():
            if key != "step" and isinstance(value, (int, float)):
                assert got[key] == pytest.approx(value, rel=1e-9), (r["step"], key)
    config = _wandb_config(run)
    assert config["eval"]["tasks"] == [MC, PPL] and config["model"]["d_model"] == 32
    assert any(k.startswith("report/") for row in history for k in row)  # the report's plots


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [
        {"parallel.pipeline": 2},
        {"parallel.zero_stage": 3, "train.precision": "fp32"},
        {"parallel.context": 2, "parallel.zero_stage": 3, "train.precision": "fp32"},
    ],
    ids=["pp2", "dp2-zero3", "cp2-zero3"],
)
def test_eval_tasks_on_the_live_engine_of_two_ranks(tmp_path, layout):
    """Pipeline stages (activations sent stage to stage), ZeRO-3 data parallelism (the ranks
    run their forwards in lockstep) and context parallelism (whole sequences on each rank, the
    requests split over the context ranks, in lockstep under ZeRO-3): the scores at the last step
    equal megaformer eval of the checkpoint saved there, on one process."""
    from megaformer.evaluation.checkpoint import evaluate_checkpoint
    from tests.helpers import run_torchrun

    run = tmp_path / "run"
    proc = run_torchrun(
        2,
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(**{"train.steps": 2, "eval.interval": 0, **layout}),
        f"eval.tasks=[{MC},{PPL},{GEN}]",
        "eval.tasks_limit=3",
        f"eval.tasks_include_path={TASKS_DIR}",
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2
    out = evaluate_checkpoint(
        run, [MC, PPL, GEN], include_path=str(TASKS_DIR), limit=3, output=tmp_path / "one.json"
    )
    assert len(out.scores) == 6
    for key, value in out.scores.items():
        assert last[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
    if "parallel.pipeline" in layout:  # and megaformer eval on two ranks at TP=2 agrees
        proc = run_torchrun(
            2,
            "eval",
            str(run),
            "--tasks",
            f"{MC},{PPL},{GEN}",
            "--limit",
            "3",
            "--include-path",
            str(TASKS_DIR),
            "--tp",
            "2",
            "--device",
            "cpu",
            "--output",
            str(tmp_path / "tp2.json"),
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        res = json.loads((tmp_path / "tp2.json").read_text())
        assert res["layout"] == {"tensor": 2, "pipeline": 1, "data": 1, "expert": 1}
        for key, value in out.scores.items():
            assert res["scores"][key] == pytest.approx(value, rel=1e-5, abs=1e-9), key


def test_eval_task_keys_are_checked():
    from megaformer.config import config_from_dict
    from megaformer.errors import ConfigError

    cfg = config_from_dict({"eval": {"tasks": [MC], "tasks_interval": 5, "tasks_limit": 2}})
    assert cfg.eval.tasks == [MC] and cfg.log.wandb is False and cfg.log.wandb_mode == "online"
    for bad, needle in (
        ({"eval": {"tasks": []}}, "eval.tasks"),
        ({"eval": {"tasks": [" "]}}, "eval.tasks"),
        ({"eval": {"tasks_limit": 0}}, "eval.tasks_limit"),
        ({"eval": {"tasks_interval": -1}}, "eval.tasks_interval"),
        ({"log": {"wandb_mode": "cloud"}}, "log.wandb_mode"),
    ):
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            config_from_dict(bad)
    # task evaluation under context parallelism runs whole sequences on each rank
    assert config_from_dict({"eval": {"tasks": [MC]}, "parallel": {"context": 2}}).eval.tasks


def test_wandb_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        "log.wandb=true",
        "--run-dir",
        str(tmp_path / "run"),
        env=OFFLINE,
    )
    assert_one_line_error(proc, "pip install megaformer[wandb]")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _eval_ep2(rank: int, world: int, ckpt: str, out: str) -> dict:
    from megaformer.checkpoint.layout import resolve_checkpoint
    from megaformer.evaluation.checkpoint import evaluate_checkpoint, load_runner
    from megaformer.parallel import experts
    from megaformer.parallel.topology import build_topology
    from megaformer.training.distributed import detect_process, init_distributed

    init_distributed(detect_process("cpu"))
    topo = build_topology(world, rank, ep=2)
    runner, _, _ = load_runner(resolve_checkpoint(ckpt), topo, torch.device("cpu"))
    held = sorted({p.shape[0] for p in runner.model.parameters() if experts.is_expert_param(p)})
    res = evaluate_checkpoint(
        ckpt,
        [MC, PPL, GEN],
        include_path=str(TASKS_DIR),
        limit=3,
        topo=topo,
        is_main=rank == 0,
        output=out,
        batch_size=2,
    )
    return {"scores": res.scores, "held": held}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_eval_at_ep2_equals_ep1(tmp_path):
    """An MoE checkpoint scored with its experts split over two ranks (each builds and reads its
    own, the forward dispatches tokens to them) gives the scores of one process."""
    from megaformer.evaluation.checkpoint import evaluate_checkpoint
    from tests.helpers import run_torchrun

    run = tmp_path / "run"
    moe = {
        "model.moe.interval": 1,
        "model.moe.num_experts": 4,
        "model.moe.top_k": 2,
        "model.moe.d_expert": 32,
        "parallel.zero_stage": 1,
        "parallel.expert": 2,
        "train.steps": 2,
        "eval.interval": 0,
        "eval.at_end": "false",
        "data.max_bytes": 50000,
    }
    proc = run_torchrun(
        2, "train", "configs/quickstart.yaml", *tiny_overrides(**moe), "--run-dir", str(run)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = evaluate_checkpoint(
        run,
        [MC, PPL, GEN],
        include_path=str(TASKS_DIR),
        limit=3,
        output=tmp_path / "one.json",
        batch_size=2,
    )
    ranks = run_ranks(2, _eval_ep2, str(run), str(tmp_path / "ep2.json"), timeout=600)
    assert [r["held"] for r in ranks] == [[2], [2]]  # 4 experts, 2 on each rank
    written = json.loads((tmp_path / "ep2.json").read_text())
    assert written["layout"]["expert"] == 2 and len(one.scores) == 6
    for r in ranks:
        for key, value in one.scores.items():
            assert r["scores"][key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
