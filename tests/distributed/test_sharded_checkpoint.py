"""Sharded checkpoints: every rank writes its own share, any layout resumes from the shards.

Three 4-rank layouts: A = TP2 x DP2 (ZeRO-1), B = DP4 (ZeRO-3), C = PP2 x DP2 (ZeRO-1). A trains
steps 1-8 with a checkpoint every 2 steps: the reference. Then a chain of resumes goes round the
three layouts (A -> B -> C -> A): each run resumes from the checkpoint the previous one wrote (at
its own layout), trains two steps and saves, so every layout reads shards written by another and
writes shards another reads; its two losses equal A's within 1e-5 (a constant LR
after warmup: the schedule does not depend on how many steps a run was told to take). A resume of A
at A's own layout is bitwise; one process (DP 1, ZeRO-0) reads the 4-rank shards too.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from megaformer.checkpoint import sharded
from megaformer.checkpoint.sharded import Owned, ShardedState, flat_boxes
from megaformer.errors import CheckpointError
from tests.helpers import (
    assert_one_line_error,
    cli_main,
    keep_only,
    run_torchrun,
    tiny_overrides,
)

LAYOUTS = {
    "A": ("parallel.tensor=2", "parallel.zero_stage=1"),
    "B": ("parallel.zero_stage=3",),
    "C": ("parallel.pipeline=2", "parallel.zero_stage=1", "parallel.pipeline_partition=parameters"),
    "D": ("parallel.zero_stage=0",),  # DP4 without ZeRO: megaformer's own optimizer state split
}
COMMON = (
    "checkpoint.interval=2",
    "eval.interval=0",
    "eval.at_end=false",
    "model.dropout=0.0",
    "model.attention_dropout=0.0",
    "train.micro_batch_size=2",
    "parallel.vocab_multiple=1",
    "checkpoint.keep_last=null",
    "train.lr_schedule=constant",
)
CHAIN = ["A", "B", "C", "A"]


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def train4(run: Path, layout: str, steps: int) -> str:
    proc = run_torchrun(
        4,
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        *COMMON,
        *LAYOUTS[layout],
        f"train.steps={steps}",
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def largest_read_share(out: str) -> tuple[float, float]:
    """The largest share of the saved state one rank read while resuming, and the largest ratio of
    a rank's read to its shards' state over its replica group (the resume's log)."""
    m = re.search(r"sharded state read per rank: at most ([0-9.]+)%.*at most ([0-9.]+)x", out)
    return float(m.group(1)) / 100, float(m.group(2))


# ----------------------------------------------------------------------------- geometry (fast)


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5)])
def test_flat_ranges_are_unions_of_boxes(shape):
    n = math.prod(shape)
    a = torch.arange(n).view(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            boxes = flat_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            pieces = []
            for off, size, flat in boxes:
                vals = a[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
                assert torch.equal(vals, torch.arange(flat, flat + vals.numel()))  # contiguous
                pieces.append(vals)
            got = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
            assert torch.equal(got, torch.arange(start, stop))


def test_vocabulary_padding_is_cut_from_the_boxes():
    # a TP rank's half of a 10-row table padded to 12: rows 6..11, of which 6..9 are real
    o = Owned("tok_embeddings.weight", None, (6, 4), 3, 24, 0, 6, 10)
    boxes = o.boxes()
    assert [b[0] for b in boxes] == [((6, 3), (1, 1)), ((7, 0), (3, 4))]
    assert sum(math.prod(b[0][1]) for b in boxes) == (10 - 6) * 4 - 3


def zero3_pieces(world: int, shapes: dict[str, list[int]]) -> list[dict]:
    """Every rank's piece description under ZeRO-3 at DP ``world`` (no TP): rank r owns
    [r p, min((r + 1) p, n)) of each flattened parameter, p = ceil(n / world)."""
    out = []
    for r in range(world):
        ranges = {}
        for name, shape in shapes.items():
            n = math.prod(shape)
            p = -(-n // world)
            if min((r + 1) * p, n) > r * p:
                ranges[name] = [0, 0, r * p, min((r + 1) * p, n)]
        out.append(
            {
                "rank": r,
                "file": sharded.rank_file(r),
                "bytes": 1 << 30,
                "ranges": ranges,
                "shapes": shapes,
                "shards": {n: [s, None, None] for n, s in shapes.items()},
            }
        )
    return out


PROXY = {
    "tok_embeddings.weight": [32000, 512],
    "final_norm.weight": [512],
    **{
        f"layers.{i}.{n}": s
        for i in range(12)
        for n, s in (
            ("attention_norm.weight", [512]),
            ("attention.wqkv.weight", [1536, 512]),
            ("attention.wo.weight", [512, 512]),
            ("ffn_norm.weight", [512]),
            ("feed_forward.w13.weight", [4096, 512]),
            ("feed_forward.w2.weight", [512, 2048]),
        )
    },
}


def test_zero3_index_at_dp512_is_bounded_per_rank(tmp_path):
    """A 67M-parameter proxy's index at a simulated DP512 ZeRO-3: the partition of each parameter
    is one rule, so the index is params + ranks (30 KB; listing every box took 16 MB, 32 KB per
    rank, growing with params x ranks). Bound: under 100 bytes per rank plus 400 per parameter."""
    sizes = {}
    for world in (64, 512):
        text = sharded.build_index(zero3_pieces(world, PROXY), {"step": 1})
        sizes[world] = len(text)
        assert len(text) <= 100 * world + 400 * len(PROXY), (world, len(text))
    assert sizes[512] - sizes[64] <= 40 * (512 - 64)  # grows with ranks only by their file sizes
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "index.json").write_text(text)
    state = ShardedState(tmp_path)
    listed = json.dumps({"boxes": state.listed()}, indent=1)
    assert len(listed) > 500 * len(text)  # what format 1 would have held
    boxes = state.boxes_of("layers.3.attention.wo.weight", "exp_avg")  # the rule, expanded
    assert boxes[1] == [
        "rank_00001.safetensors",
        "layers.3.attention.wo.weight/exp_avg/0",
        [1, 0],
        [1, 512],
    ]  # rank r: row r (512 elements each)
    assert sum(math.prod(b[3]) for b in boxes) == 512 * 512


def test_index_runs_round_trip_every_partition():
    """Equal parts (ZeRO-3), even splits (ZeRO-0), irregular fragments (ZeRO 1/2) and TP shards:
    the runs expand to exactly the saved entries."""
    cases = [
        [(r, 0, 0, r * 7, min((r + 1) * 7, 30)) for r in range(5)],  # equal parts
        [(r, 0, 0, r * 30 // 4, (r + 1) * 30 // 4) for r in range(4)],  # even split
        [(0, 0, 0, 0, 3), (1, 0, 0, 3, 11), (2, 0, 0, 11, 12), (3, 0, 0, 12, 30)],  # ZeRO 1/2
        [(2 * r + t, 16 * t, 0, 8 * r, 8 * r + 8) for t in range(2) for r in range(2)],
    ]
    for entries in cases:
        runs = sharded.compress_ranges(entries)
        got = sorted(e for run in runs for e in sharded.expand_run(run))
        assert got == sorted(entries), (entries, runs)
    assert (
        len(sharded.compress_ranges(cases[0])) == 1 and len(sharded.compress_ranges(cases[1])) == 1
    )
    assert len(sharded.compress_ranges(cases[3])) == 2  # one run per TP shard


def test_small_index_claiming_a_huge_tensor_is_refused_before_reading(tmp_path):
    shapes = {"w": [64, 32]}
    text = sharded.build_index(zero3_pieces(4, shapes), {"step": 1})
    index = json.loads(text)
    index["files"] = {f: 100 for f in index["files"]}  # tiny shard files
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="the index places 24576 bytes of tensors in 400"):
        ShardedState(tmp_path)
    index["shapes"]["w"] = [1 << 25, 32]  # the shards do not hold the claimed tensor
    (tmp_path / "state" / "index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match="the boxes of w hold 2048 elements, the tensor 1073741824"
    ):
        ShardedState(tmp_path)
    index = json.loads(text)
    index["ranges"]["w"][0][7] -= 1  # the last element of w saved nowhere
    (tmp_path / "state" / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="corrupt .the ranges or shards of a parameter"):
        ShardedState(tmp_path)


def test_a_read_looks_up_only_the_ranks_whose_ranges_meet_it(tmp_path):
    """At a simulated DP512 ZeRO-3 a rank's read of its own partition finds the one or two saved
    boxes that meet it, and a whole-tensor read finds every rank's, from one run each."""
    (tmp_path / "state").mkdir()
    text = sharded.build_index(zero3_pieces(512, PROXY), {"step": 1})
    (tmp_path / "state" / "index.json").write_text(text)
    state = ShardedState(tmp_path)
    name, shape = "layers.5.feed_forward.w2.weight", (512, 2048)  # 2,048 elements per rank
    mine = state._boxes_in(name, "master", ((7, 0), (1, 2048)))  # row 7: rank 7's partition
    assert [b[:2] for b in mine] == [["rank_00007.safetensors", f"{name}/master/0"]]
    everything = state._boxes_in(name, "master", ((0, 0), shape))
    assert len(everything) == 512 and sum(math.prod(b[3]) for b in everything) == 512 * 2048


# ----------------------------------------------------------------------------- 4 ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sharded") / "A"
    train4(run, "A", 2 * len(CHAIN))
    return run


@pytest.fixture(scope="module")
def chain(reference, tmp_path_factory) -> list[tuple[str, Path, str]]:
    """The resumes round the layouts: (layout, run, stdout) of each link of :data:`CHAIN` after
    the reference. Link i copies the previous run, keeps only its checkpoint of step 2i, trains
    to step 2i + 2 at its own layout and saves: B's step 4 and C's step 6 are written at B and C."""
    links = []
    prev = reference
    for i, layout in enumerate(CHAIN[1:], start=1):
        run = tmp_path_factory.mktemp("chain") / f"{i}-{layout}"
        shutil.copytree(prev, run)
        keep_only(run, 2 * i)
        links.append((layout, run, train4(run, layout, 2 * i + 2)))
        prev = run
    return links


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_rank_writes_its_own_share(reference):
    _each_rank_writes_its_share(reference / "checkpoints" / "step_0000002")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_layout_writes_each_element_once_and_a_quarter_per_rank(chain, tmp_path):
    """The per-rank write bound of the reference's layout (A) holds for B (ZeRO-3) and C (PP2),
    read from the checkpoints their links of the chain wrote, and for D (ZeRO-0), trained here."""
    written = {layout: run for layout, run, _ in chain}
    _each_rank_writes_its_share(written["B"] / "checkpoints" / "step_0000004")
    _each_rank_writes_its_share(written["C"] / "checkpoints" / "step_0000006")
    run = tmp_path / "D"
    train4(run, "D", 2)
    _each_rank_writes_its_share(run / "checkpoints" / "step_0000002")


def _each_rank_writes_its_share(ckpt: Path) -> None:
    """Each of the 4 ranks wrote its own file; the files hold every element of the state (weights
    and two AdamW moments, fp32) exactly once, and no rank more than 1/4 + 10% of it."""
    index = json.loads((ckpt / "state" / "index.json").read_text())
    assert sorted(index["files"]) == [sharded.rank_file(r) for r in range(4)]
    assert not list(ckpt.glob("*.pt")) and not (ckpt / "model.safetensors").exists()
    per_rank = {f: 0 for f in index["files"]}
    for boxes in ShardedState(ckpt).listed().values():
        for file, _, _, size in boxes:
            per_rank[file] += 4 * math.prod(size)
    total = sum(per_rank.values())
    state_bytes = 3 * 4 * sum(math.prod(s) for s in index["shapes"].values())
    assert total == state_bytes  # every element of every tensor exactly once
    for file, n in per_rank.items():
        assert 0 < n <= (1 / 4 + 0.10) * total, (file, n / total)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_round_the_layouts_from_the_shards(reference, chain):
    ref = losses(reference)
    for i, (layout, run, out) in enumerate(chain, start=1):
        assert "at a new layout" in out
        # each byte read once per replica group: 1/world of the state per rank, not the masters
        # of the whole TP x PP shard on top (41.7% from PP2 x DP2 at TP2 x DP2 before). Under
        # PP the stages differ in size and both hold the tied embedding: the bound is then what
        # the rank's shards hold over its replica group
        share, ratio = largest_read_share(out)
        assert ratio <= 1.10 and (layout == "C" or share <= 1.10 / 4), (layout, share, ratio)
        got = losses(run)
        for step in (2 * i + 1, 2 * i + 2):
            assert abs(got[step] - ref[step]) <= 1e-5 * abs(ref[step]), (
                CHAIN[i - 1],
                layout,
                step,
                got[step],
                ref[step],
            )
    assert ref[2 * len(CHAIN)] < ref[2]  # it trains: the comparison is not between constants


@pytest.mark.slow
@pytest.mark.multiprocess
def test_same_layout_resume_is_bitwise(reference, tmp_path):
    run = tmp_path / "again"
    shutil.copytree(reference, run)
    keep_only(run, 4)
    out = train4(run, "A", 6)
    assert "at a new layout" not in out and "resumed from" in out
    assert largest_read_share(out)[0] <= 1.10 / 4  # 41.7% when every replica read its masters
    a, b = losses(reference), losses(run)
    assert [b[s] for s in (5, 6)] == [a[s] for s in (5, 6)]
    for key in sharded.KEYS:  # the state it wrote equals the uninterrupted run's, bit for bit
        x = ShardedState(run / "checkpoints" / "step_0000006")
        y = ShardedState(reference / "checkpoints" / "step_0000006")
        for name in y.names():
            assert torch.equal(x.whole(name, key), y.whole(name, key)), (name, key)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_process_reads_four_ranks_shards_and_generates(reference, tmp_path):
    run = tmp_path / "one"
    shutil.copytree(reference, run)
    keep_only(run, 2)
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        *COMMON,
        "parallel.zero_stage=0",
        "train.steps=4",
        "train.micro_batch_size=4",
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = losses(reference), losses(run)
    for step in (3, 4):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])
    gen = cli_main(
        "generate",
        str(reference / "checkpoints" / "step_0000002"),
        "--prompt",
        "def ",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert gen.returncode == 0 and gen.stdout.startswith("def "), gen.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_truncated_or_missing_shard_is_one_line(reference, tmp_path):
    for damage in ("truncate", "delete"):
        run = tmp_path / damage
        shutil.copytree(reference, run)
        keep_only(run, 2)
        shard = run / "checkpoints" / "step_0000002" / "state" / "rank_00002.safetensors"
        if damage == "truncate":
            shard.write_bytes(shard.read_bytes()[:-100])
        else:
            shard.unlink()
        before = sorted(p.name for p in (run / "checkpoints").iterdir())
        proc = cli_main(
            "train",
            "configs/quickstart.yaml",
            *tiny_overrides(),
            *COMMON,
            "parallel.zero_stage=0",
            "train.steps=4",
            "train.micro_batch_size=4",
            "--run-dir",
            str(run),
        )
        assert_one_line_error(
            proc, "rank_00002.safetensors", "truncated" if damage == "truncate" else "missing"
        )
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


# ----------------------------------------------------------------------------- previous release

PREVIOUS = Path(__file__).resolve().parents[1] / "data" / "previous_release_run"
PREVIOUS_MODEL = (
    "model.d_model=16",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.max_seq_len=16",
    "data.max_bytes=20000",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr=3e-3",
    "train.warmup_steps=1",
    "eval.interval=0",
    "eval.at_end=false",
    "checkpoint.interval=2",
    "log.interval=1",
    "log.progress_bar=false",
    "log.tensorboard=false",
    "log.sample_tokens=0",
    "model.dropout=0.0",
    "model.attention_dropout=0.0",
    "train.steps=4",
)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_previous_release_checkpoint_still_resumes(tmp_path, zero_stage):
    """A checkpoint of the first release (DeepSpeed's files, model.safetensors, optimizer/):
    resumed at its own layout through DeepSpeed's files, at another (ZeRO-1) through its
    layout-free state; either way steps 3-4 equal the losses that release logged, and the new
    checkpoint it writes is sharded."""
    run = tmp_path / "run"
    shutil.copytree(PREVIOUS, run)
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        "data.source=stdlib",
        *PREVIOUS_MODEL,
        f"parallel.zero_stage={zero_stage}",
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    old = {
        r["step"]: r["loss"]
        for r in map(json.loads, (PREVIOUS / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
    new = losses(run)
    for step in (3, 4):
        assert abs(old[step] - new[step]) <= 1e-5 * abs(old[step]), (step, old[step], new[step])
    assert sharded.has_sharded_state(run / "checkpoints" / "step_0000004")


@pytest.mark.slow
def test_bf16_resumes_at_another_zero_stage_and_in_fp32(tmp_path):
    """bf16 keeps fp32 masters in the shards: ZeRO-1 -> ZeRO-2 in bf16 continues the run; the
    same shards also start an fp32 run (whose losses then follow fp32 arithmetic)."""
    common = (*COMMON, "train.precision=bf16", "train.micro_batch_size=4")
    ref = tmp_path / "ref"
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        *common,
        "parallel.zero_stage=1",
        "train.steps=4",
        "--run-dir",
        str(ref),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    index = json.loads((ref / "checkpoints" / "step_0000002" / "state" / "index.json").read_text())
    assert index["precision"] == "bf16"
    for overrides in (
        ("train.precision=bf16", "parallel.zero_stage=2"),
        ("train.precision=fp32", "parallel.zero_stage=0"),
    ):
        run = tmp_path / overrides[0].split("=")[1]
        shutil.copytree(ref, run)
        keep_only(run, 2)
        proc = cli_main(
            "train",
            "configs/quickstart.yaml",
            *tiny_overrides(),
            *common,
            *overrides,
            "train.steps=4",
            "--run-dir",
            str(run),
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        a, b = losses(ref), losses(run)
        tol = 1e-5 if "bf16" in overrides[0] else 2e-2  # fp32 arithmetic vs bf16's
        for step in (3, 4):
            assert abs(a[step] - b[step]) <= tol * abs(a[step]), (overrides, step, a[step], b[step])
