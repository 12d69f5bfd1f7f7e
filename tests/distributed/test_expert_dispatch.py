"""Expert dispatch by counting: the fixed-size exchange reads nothing on the host, and under
tensor parallelism each TP rank's all-to-all carries 1 / TP of the rows.

A TP 2 x EP 2 model (4 gloo ranks) runs a training forward and backward with ``Tensor.tolist``,
``.item()``, ``.cpu()`` (and the implicit reads ``int()``, ``float()``, ``bool()``) raising inside
every MoE block's forward and backward; the all-to-all bytes each rank sends are counted against
those of TP 1 x EP 2 on the same micro-batch (every TP rank used to send the whole micro-batch).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from tests.dist_harness import run_ranks

READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class HostRead(RuntimeError):
    pass


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Every way a tensor's values reach Python raises inside."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def trap(name: str):
        def read(self, *a, **k):
            raise HostRead(f"Tensor.{name} inside an MoE block")

        return read

    for name in READS:
        setattr(torch.Tensor, name, trap(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def trap_moe_blocks(model: torch.nn.Module) -> list[str]:
    """Arm :func:`no_host_reads` around every MoE block's forward and its backward (from the
    gradient reaching its output until the one leaving its input); returns the log of armed
    passes."""
    from megaformer.model.moe import moe_layers

    log: list[str] = []
    state: dict = {}

    def arm(what: str) -> None:
        state["ctx"] = no_host_reads()
        state["ctx"].__enter__()
        log.append(what)

    def disarm() -> None:
        state.pop("ctx").__exit__(None, None, None)

    for moe in moe_layers(model):

        def pre(module, args):
            arm("forward")
            x = args[0]
            if x.requires_grad:  # the gradient leaving the block: its backward is over
                x.register_hook(lambda g: disarm())

        def post(module, args, out):
            disarm()
            if out.requires_grad:
                out.register_hook(lambda g: arm("backward"))

        moe.register_forward_pre_hook(pre)
        moe.register_forward_hook(post)
    return log


def _config(tp: int, dispatch: str, sp: bool = False):
    from megaformer.config import load_config

    over = {
        "model.vocab_size": 64,
        "model.d_model": 32,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.n_kv_heads": 2,
        "model.max_seq_len": 16,
        "data.seq_len": 16,
        "model.moe.interval": 1,
        "model.moe.num_experts": 4,
        "model.moe.top_k": 2,
        "model.moe.d_expert": 32,
        "model.moe.num_shared_experts": 1,
        "model.moe.d_shared": 16,
        "model.moe.aux_loss_coef": 0.05,
        "model.moe.z_loss_coef": 0.01,
        "parallel.tensor": tp,
        "parallel.expert": 2,
        "parallel.sequence_parallel": sp,
        "parallel.expert_dispatch": dispatch,
        "parallel.vocab_multiple": 8,
    }
    return load_config("configs/quickstart.yaml", [f"{k}={v}" for k, v in over.items()])


def _measure(rank: int, world: int, tp: int, dispatch: str, trap: bool, sp: bool = False) -> dict:
    """One training forward and backward of layout TP ``tp`` x EP 2 (DP = world / tp): the
    all-to-all bytes this rank sent, the host reads seen, the passes the trap covered."""
    from megaformer.comm import CommCounter
    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import build_topology

    cfg = _config(tp, dispatch, sp)
    topo = build_topology(world, rank, tp=tp, ep=2)
    model = build_model(cfg, topo).model.train()
    log = trap_moe_blocks(model) if trap else []
    # the same micro-batch on every rank: TP 1 and TP 2 route the same tokens
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with CommCounter() as c:
        model(x, x).backward()
    return {"bytes": c.bytes["all_to_all"], "calls": c.calls["all_to_all"], "armed": log}


def _suite(rank: int, world: int) -> dict:
    out = {}
    for name, args in {
        "padded_tp2": (2, "padded", True),
        "padded_tp2_sp": (2, "padded", True, True),
        "padded_tp1": (1, "padded", False),
        "splits_tp2": (2, "splits", False),
        "splits_tp1": (1, "splits", False),
    }.items():
        out[name] = _measure(rank, world, *args)
    try:
        _measure(rank, world, 2, "splits", True)
        out["splits_trapped"] = None
    except HostRead as e:
        out["splits_trapped"] = str(e)
    return out


@pytest.mark.multiprocess
def test_padded_dispatch_reads_nothing_on_the_host_and_tp_splits_the_bytes():
    results = run_ranks(4, _suite, timeout=300)
    for r in results:
        # forward and backward of both MoE blocks ran trapped, and nothing was read
        for name in ("padded_tp2", "padded_tp2_sp"):
            assert r[name]["armed"] == ["forward"] * 2 + ["backward"] * 2, r[name]["armed"]
        # the uneven exchange does read its split sizes (the trap is live)
        assert r["splits_trapped"] and "tolist" in r["splits_trapped"]
        # padded: shapes alone fix the bytes; TP 2 sends exactly half of TP 1's
        assert r["padded_tp2"]["bytes"] * 2 == r["padded_tp1"]["bytes"] > 0
        assert r["padded_tp2_sp"]["bytes"] == r["padded_tp2"]["bytes"]
    # uneven: the two TP ranks (0, 1 and 2, 3) of EP rank e send between them exactly what a
    # TP 1 rank of EP rank e (rank e) sends for the same micro-batch, where each used to send it
    tp2 = [r["splits_tp2"]["bytes"] for r in results]
    tp1 = [r["splits_tp1"]["bytes"] for r in results]
    assert tp2[0] + tp2[1] == tp1[0] and tp2[2] + tp2[3] == tp1[1], (tp2, tp1)
    assert all(b > 0 for b in tp2)


def _odd_lengths(rank: int, world: int) -> dict:
    """Logits of TP 2 x EP 2 on 15 positions (not split over the TP ranks: each dispatches the
    whole sequence, the partial outputs reduced) and on one (a generation step) against one
    process."""
    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import build_topology

    worst = {}
    for mode in ("splits", "padded"):
        cfg = _config(2, mode)
        ref = build_model(cfg, None).model.eval()
        model = build_model(cfg, build_topology(world, rank, tp=2, ep=2)).model.eval()
        gen = torch.Generator().manual_seed(5)
        for T in (15, 1):
            x = torch.randint(0, 64, (2, T), generator=gen)
            with torch.no_grad():
                a, b = model(x), ref(x)
            worst[mode, T] = float((a - b).abs().max() / b.abs().max())
    return worst


@pytest.mark.multiprocess
def test_sequences_the_tp_ranks_cannot_split_are_dispatched_whole():
    for r in run_ranks(4, _odd_lengths, timeout=300):
        assert max(r.values()) < 1e-5, r


def test_padded_exchange_on_a_device_without_grouped_gemms_is_one_line(monkeypatch):
    from megaformer.config import load_config
    from megaformer.config import preflight as pf
    from megaformer.errors import ConfigError
    from megaformer.kernels.selection import Choice

    cfg = load_config(
        "configs/moe-tiny.yaml", ["parallel.expert=2", "parallel.expert_dispatch=padded"]
    )
    pf.check_device(cfg, torch.device("cpu"))  # torch's grouped GEMM runs on the CPU
    # a CUDA device whose experts rule falls back to the loop (fp32 here)
    monkeypatch.setattr(pf, "choose", lambda *a, **k: Choice("loop", "grouped GEMM needs bf16"))
    with pytest.raises(ConfigError) as e:
        pf.check_device(cfg, torch.device("cuda"))
    message = str(e.value)
    assert message.startswith("parallel.expert_dispatch=padded: the fixed-size exchange runs")
    assert "grouped GEMM needs bf16" in message and "\n" not in message
