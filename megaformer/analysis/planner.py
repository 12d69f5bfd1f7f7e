"""``megaformer plan``: feasible (TP, PP, DP, CP, EP, ZeRO, micro-batch, recompute) layouts, best first.

Memory per GPU from :mod:`megaformer.analysis.memory`: the larger of a training step's and the
model's build (this rank's part plus one whole module; ZeRO-3 keeps only its partition as it
builds) (+ ``RESERVE_GB`` for the CUDA context,
NCCL buffers and allocator fragmentation). Step time from a compute + communication model with
stated bandwidths and nothing overlapped but the ring's K/V passes with its kernels (so it is a
pessimistic, comparable ranking, not a promise):

    compute   = hardware FLOPs / (GPUs * peak * efficiency) * k(schedule, PP, m)   m micro-batches;
                k = 1 + (PP-1)/m under 1F1B, 1 + (PP-1)/(v m) interleaved with v stages per
                rank, the DualPipeV timeline's step over its busy time
                (:mod:`megaformer.analysis.schedules`: a backward costing two forwards);
                the attention core (scores and values) at its fused kernel's rate on the blocks it
                runs (:mod:`megaformer.analysis.attention_time`: whole sequences for one process
                and all-to-all, chunks of s / 2CP for the ring, n / (n + 256) of the rate on n-token
                blocks), reported also on its own as ``attention``
    TP        = 4 (6 with full recompute) all-reduces of b*s*h*e bytes per layer per micro-batch,
                ring: 2 (t-1)/t * bytes / BW;  BW = intra-node if TP <= GPUs per node, else inter
    DP        = gradient all-reduce 2 (d-1)/d * P*e_g / BW (ZeRO 2: reduce-scatter + all-gather,
                same volume; ZeRO 3: x1.5 for the parameter all-gathers); BW = intra if TP*DP fits a
                node, else inter
    PP        = m * 2 (PP-1) point-to-point sends of b*s*h*e bytes (interleaved: 2 (v PP - 1),
                every stage boundary between ranks; DualPipeV: 4 (PP-1), out and back) over PP
                ranks at the inter/intra bandwidth
    CP        = per layer and micro-batch: the ring's passes its kernels do not hide (each step's K/V
                pass beyond that step's kernel time, every fp32 dK/dV pass), or the all-to-all's
                q/k/v/out exchange (:func:`megaformer.analysis.memory.context_comm_bytes`) / BW; intra
                if TP*CP fits a node. Dense gradients are averaged over DP x CP
    EP        = per MoE block and micro-batch four all-to-alls of the routed tokens
                (:func:`megaformer.analysis.memory.expert_comm_bytes`) / BW; intra if TP*CP*EP fits a
                node. Expert gradients are averaged over DP / EP

    MFU = model FLOPs / (step time * GPUs * peak)

With ``train.fp8`` the FP8 GEMMs' FLOPs (:func:`megaformer.analysis.flops.fp8_forward_flops`, x3,
and their share of the recomputed forward) run at the accelerator's FP8 peak and the rest at the
training precision's; MFU stays against the bf16 peak.

Checkpoints are sharded: the state is 12 bytes per parameter (fp32 master weight and Adam's two
moments), and every rank writes its own share in parallel: the busiest rank's TP x PP shard / DP
(its ZeRO partition; under ZeRO-0 the DP ranks split the replicated shard). On a GPU each rank
stages exactly that share in one pinned host arena (:mod:`megaformer.checkpoint.staging`),
allocated at the first save and reused by every later one; an asynchronous save writes from it.

Context parallelism is proposed for sequences of 8192 tokens and more (CP in 1, 2, 4, 8, 16; ring
and, where the heads allow, all-to-all); expert parallelism for MoE models (EP dividing the experts
and DP).

Rules that reject a layout: TP must divide heads, KV heads and the FFN width and stay within a node
(more is allowed but slow; it is not rejected); PP at most n_layers; the global batch
must split into micro-batches x DP; ZeRO-3 not with TP > 1 (megaformer), ZeRO 2/3 not with PP > 1
(DeepSpeed's pipeline engine); the interleaved schedule needs a multiple of PP micro-batches per
step and v PP layers; DualPipeV needs 2 PP micro-batches per step and 2 PP layers; a pipeline
layout the config's own checks refuse (bf16 without ZeRO-1, multi-token prediction under
DualPipeV, ...) is rejected with their one-line message; memory must fit.
Every PP > 1 layout is tried under each schedule (``1f1b``, ``interleaved`` with v = 2 ..
``MAX_VIRTUAL_STAGES`` stages per rank, ``dualpipev``): 1F1B holds PP micro-batches' activations
on the first stage; interleaved (2(PP-1) + (v-1) PP + 1)/v there (more than PP when m > PP), the
embedding on rank 0 and the head on rank PP-1 as 1F1B; DualPipeV PP + 1/2 on every rank and the
embedding and head both on rank 0. MoE models (``model.moe``): TP must also divide the
expert and shared-expert widths, no ZeRO-3 with EP > 1, no CP with a capacity factor; memory
and checkpoints
count every expert (total parameters), FLOPs and MFU the active ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import asdict, dataclass
from typing import Optional

from megaformer.accelerators import find_accelerator, peak_tflops
from megaformer.analysis.attention_time import attention_seconds, recomputed_share
from megaformer.analysis.flops import forward_flops, fp8_forward_flops, fp8_share, step_flops
from megaformer.analysis.memory import DTYPE_BYTES, Layout, estimate, pipeline_in_flight
from megaformer.analysis.schedules import (
    p2p_sends_per_micro_batch,
    schedule_label,
    simulate,
    step_factor,
)
from megaformer.analysis.summary import resolve_vocab
from megaformer.config import Config
from megaformer.errors import ConfigError, UserError
from megaformer.parallel.plan import padded_vocab_size

RESERVE_GB = 2.0
GB = 1e9
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 master weight + Adam's first and second moments
MUON_CHECKPOINT_BYTES_PER_PARAM = 8  # fp32 master weight + Muon's momentum
MAX_VIRTUAL_STAGES = 4  # the interleaved schedule is tried with v = 2 .. this stages per rank
# (schedule, v) tried for every PP > 1 layout
PIPELINE_SCHEDULES = (
    ("1f1b", 1),
    *(("interleaved", v) for v in range(2, MAX_VIRTUAL_STAGES + 1)),
    ("dualpipev", 1),
)


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpus_per_node: int
    memory_gb: float
    peak_tflops: float
    intra_gbps: float
    inter_gbps: float
    efficiency: float
    fp8_tflops: Optional[float] = None  # the FP8 peak, for train.fp8 (FP8 GEMMs at their own rate)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _allreduce_s(nbytes: float, group: int, gbps: float) -> float:
    return 0.0 if group <= 1 else 2 * (group - 1) / group * nbytes / (gbps * GB)


def evaluate(cfg: Config, hw: Hardware, lay: Layout) -> dict:
    """Estimated memory and step time of one layout (no feasibility checks)."""
    m, s = cfg.model, cfg.seq_len
    e = DTYPE_BYTES[lay.precision]
    padded = padded_vocab_size(m.vocab_size, lay.tp, cfg.parallel.vocab_multiple)
    mem = estimate(m, s, lay, padded)
    gbs = cfg.train.global_batch_size
    fl = step_flops(
        m, s, gbs, recompute=lay.recompute, recompute_every=lay.recompute_every, padded_vocab=padded
    )
    peak = hw.peak_tflops * 1e12
    micro = lay.grad_accum
    work = fl.hardware / peak  # GPU-seconds at full peak
    if cfg.train.fp8 != "off" and hw.fp8_tflops:
        # the FP8 GEMMs' share of the work (the recomputed forward included) at the FP8 peak
        share = fp8_share(m, s)
        f8 = 3 * fp8_forward_flops(m, s) * gbs + share * fl.recompute
        work = (fl.hardware - f8) / peak + f8 / (hw.fp8_tflops * 1e12)
    node = hw.gpus_per_node

    def bw(span: int) -> float:  # a group of `span` adjacent ranks: NVLink if it fits a node
        return hw.intra_gbps if span <= node else hw.inter_gbps

    layers = math.ceil(m.n_layers / lay.pp)
    # the pipeline's idle time: 1 + (PP-1)/m under 1F1B, the schedule's timeline otherwise
    v = lay.virtual_stages
    bubble = step_factor(lay.schedule, lay.pp, micro, v)
    # the attention core at its kernels' rate, by what the context mode runs (attention_time)
    fwd = forward_flops(m, s)
    core = (fwd.attn_scores + fwd.attn_values) * gbs
    core_hw = core * (3 + recomputed_share(m, lay))
    attn = attention_seconds(m, s, lay, peak * hw.efficiency, bw(lay.tp * lay.cp))
    attn_time = micro * layers * attn["compute"] * bubble
    compute = (work - core_hw / peak) / (hw.gpus * hw.efficiency) * bubble + attn_time
    act = lay.micro_batch * s // lay.cp * m.d_model * e  # one context rank's part
    n_ar = 6 if lay.recompute == "full" else 4
    tp_time = micro * layers * n_ar * _allreduce_s(act, lay.tp, bw(lay.tp))
    from megaformer.analysis.memory import (
        context_comm_bytes,
        expert_comm_bytes,
        expert_params_per_rank,
        muon_params_per_rank,
        params_per_rank,
    )

    P, X = params_per_rank(m, lay, padded), expert_params_per_rank(m, lay)
    dp_bw = bw(lay.tp * lay.cp * lay.dp)
    dp_time = (
        _allreduce_s((P - X) * e, lay.replicas, dp_bw)
        + _allreduce_s(X * e, lay.expert_replicas, dp_bw)
    ) * (1.5 if lay.zero == 3 else 1.0)
    pp_bw = hw.inter_gbps if lay.tp * lay.pp > node else hw.intra_gbps
    sends = p2p_sends_per_micro_batch(lay.schedule, lay.pp, v)  # over the pipeline
    pp_time = micro * sends * act / (pp_bw * GB) / lay.pp if lay.pp > 1 else 0.0
    if lay.cp_mode == "ring":  # the passes a ring step's kernels do not hide
        cp_time = micro * layers * attn["exposed"]
    else:
        cp_time = micro * layers * context_comm_bytes(m, s, lay) / (bw(lay.tp * lay.cp) * GB)
    moe_layers = min(layers, math.ceil(m.moe_layers / lay.pp)) if m.moe_layers else 0
    ep_time = (
        micro * moe_layers * expert_comm_bytes(m, s, lay) / (bw(lay.tp * lay.cp * lay.ep) * GB)
    )
    from megaformer.analysis.params import count_parameters

    opt_time, total = 0.0, count_parameters(m)["total"]
    per_rank = CHECKPOINT_BYTES_PER_PARAM * ((P - X) / lay.replicas + X / lay.expert_replicas)
    ckpt_total = CHECKPOINT_BYTES_PER_PARAM * total
    if lay.optimizer == "muon":
        U = muon_params_per_rank(m, lay)
        # each owned matrix gathered over TP for Newton-Schulz, each parameter broadcast by its
        # owner under ZeRO-1/2 (ring volumes, fp32)
        owned = U / lay.replicas if lay.zero >= 1 else U
        opt_time = (lay.tp - 1) / lay.tp * 4 * owned / (bw(lay.tp) * GB)
        if lay.zero >= 1:
            opt_time += _allreduce_s(4 * P, lay.replicas, dp_bw) / 2
        # Muon's matrices save one moment instead of two
        per_rank = CHECKPOINT_BYTES_PER_PARAM * (
            P - U
        ) / lay.replicas + MUON_CHECKPOINT_BYTES_PER_PARAM * (
            (U - X) / lay.replicas + X / lay.expert_replicas
        )
        whole = muon_params_per_rank(m, Layout())
        ckpt_total = (
            CHECKPOINT_BYTES_PER_PARAM * (total - whole) + MUON_CHECKPOINT_BYTES_PER_PARAM * whole
        )
    step = compute + tp_time + dp_time + pp_time + cp_time + ep_time + opt_time
    return {
        "layout": asdict(lay),
        "memory_gb": mem.total / GB,
        "memory": {k: float(v) / GB for k, v in mem.as_dict().items() if not isinstance(v, bool)},
        "step_time_s": step,
        "time": {
            "compute": compute,
            "attention": attn_time,
            "tp_comm": tp_time,
            "dp_comm": dp_time,
            "pp_comm": pp_time,
            "cp_comm": cp_time,
            "ep_comm": ep_time,
            "optimizer_comm": opt_time,
        },
        "mfu": fl.model / (step * hw.gpus * peak),
        "pipeline": {
            "bubble": simulate(lay.schedule, lay.pp, micro, v=v).bubble if lay.pp > 1 else 0.0,
            "in_flight": pipeline_in_flight(lay),
            "p2p_gb_per_rank": micro * sends * act / lay.pp / GB if lay.pp > 1 else 0.0,
        },
        "tokens_per_s": fl.tokens / step,
        "checkpoint": {
            "total_gb": ckpt_total / GB,
            "per_rank_gb": per_rank / GB,
            "async_staging_gb": per_rank / GB,
        },
    }


def _reject_reason(
    cfg: Config,
    tp: int,
    cp: int,
    dp: int,
    pp: int,
    ep: int,
    *,
    zero: int,
    mb: int,
    cp_mode: str = "ring",
    schedule: str = "1f1b",
    virtual_stages: int = 1,
) -> Optional[str]:
    m, gbs = cfg.model, cfg.train.global_batch_size
    micro = gbs // (mb * dp)  # micro-batches per step (when the batch splits)
    if cp > 1 and cp_mode == "ring" and cfg.seq_len % (2 * cp):
        return f"CP={cp} (ring) needs the sequence {cfg.seq_len} divisible by {2 * cp}"
    if cp > 1 and cp_mode == "all_to_all" and (m.n_heads // tp) % cp:
        return f"CP={cp} (all_to_all) does not divide the {m.n_heads // tp} heads per TP rank"
    if cp > 1 and m.moe_layers and not m.moe.dropless:
        return "CP with a capacity factor (model.moe.dropless=false) is not supported"
    if ep > 1 and (m.moe.num_experts % ep or dp % ep):
        return f"EP={ep} does not divide the experts {m.moe.num_experts} / DP {dp}"
    if m.n_heads % tp or m.kv_heads % tp or m.ffn_dim % tp:
        return (
            f"TP={tp} does not divide heads {m.n_heads} / KV heads {m.kv_heads} / FFN {m.ffn_dim}"
        )
    if m.moe_layers and (m.expert_dim % tp or m.shared_dim % tp):
        return f"TP={tp} does not divide the expert FFN {m.expert_dim} / shared FFN {m.shared_dim}"
    if m.moe_layers and zero == 3 and ep > 1:
        return "ZeRO-3 with EP > 1 is not supported by DeepSpeed (its own AutoEP layers only)"
    if pp > m.n_layers:
        return f"PP={pp} > {m.n_layers} layers"
    if gbs % (mb * dp):
        return f"global batch {gbs} not a multiple of micro-batch {mb} x DP {dp}"
    v = virtual_stages
    if schedule == "interleaved" and v * pp > m.n_layers:
        return f"interleaved with v = {v} cuts {v * pp} stages from {m.n_layers} layers"
    if schedule == "interleaved" and micro % pp:
        return (
            f"interleaved needs a multiple of PP = {pp} micro-batches per step, "
            f"this layout has {micro}"
        )
    if schedule == "dualpipev" and 2 * pp > m.n_layers:
        return f"DualPipeV cuts {2 * pp} stages from {m.n_layers} layers"
    if schedule == "dualpipev" and micro < 2 * pp:
        return f"DualPipeV needs 2 x PP = {2 * pp} micro-batches per step, this layout has {micro}"
    if zero == 3 and tp > 1:
        return "ZeRO-3 with TP > 1 is not supported by megaformer"
    if zero >= 2 and pp > 1:
        return f"ZeRO-{zero} with PP > 1 is not supported by DeepSpeed's pipeline engine"
    if zero == 3 and cfg.train.optimizer == "muon":
        return "ZeRO-3 with Muon: Newton-Schulz needs each whole matrix on one rank"
    return None


def _config_refusal(cfg: Config, lay: Layout) -> Optional[str]:
    """The config's own one-line refusal of its pipeline at layout ``lay``, by the checks that
    need no world size: the pipeline's (bf16 needs ZeRO-1, the stages, ...), its schedule's and
    multi-token prediction's (its modules run on one last stage, which DualPipeV does not have);
    None where they accept it."""
    from megaformer.config.checks.model import check_mtp
    from megaformer.config.checks.parallel import check_pipeline, check_pipeline_schedule

    parallel = dataclasses.replace(
        cfg.parallel,
        tensor=lay.tp,
        context=lay.cp,
        context_mode=lay.cp_mode,
        pipeline=lay.pp,
        expert=lay.ep,
        zero_stage=lay.zero,
        sequence_parallel=lay.sequence_parallel,
        pipeline_schedule=lay.schedule,
        pipeline_virtual_stages=lay.virtual_stages if lay.schedule == "interleaved" else 2,
    )
    try:
        for check in (check_pipeline, check_pipeline_schedule, check_mtp):
            check(dataclasses.replace(cfg, parallel=parallel))
    except ConfigError as e:
        return str(e)
    return None


def plan(cfg: Config, hw: Hardware, micro_batches: tuple = (1, 2, 4, 8, 16)) -> dict:
    """{'assumptions', 'feasible' (best first), 'rejected'} for ``cfg`` on ``hw``."""
    cfg = resolve_vocab(cfg)
    feasible, rejected = [], []
    refused: dict = {}  # pipeline layout and schedule -> the config's refusal of it, or None
    long = cfg.seq_len >= 8192
    contexts = [(1, "ring")] + [
        (c, mode)
        for c in (2, 4, 8, 16)
        if long and hw.gpus % c == 0
        for mode in ("ring", "all_to_all")
    ]
    for tp in _divisors(hw.gpus):
        for cp, cp_mode in contexts:
            if hw.gpus % (tp * cp):
                continue
            for pp in _divisors(hw.gpus // (tp * cp)):
                dp = hw.gpus // (tp * cp * pp)
                experts = _divisors(dp) if cfg.model.moe_layers else [1]
                schedules = PIPELINE_SCHEDULES if pp > 1 else (("1f1b", 1),)
                for ep, zero, mb, (sched, v) in (
                    (ep, z, mb, sc)
                    for ep in experts
                    for z in (0, 1, 2, 3)
                    for mb in micro_batches
                    for sc in schedules
                ):
                    why = _reject_reason(
                        cfg,
                        tp,
                        cp,
                        dp,
                        pp,
                        ep,
                        zero=zero,
                        mb=mb,
                        cp_mode=cp_mode,
                        schedule=sched,
                        virtual_stages=v,
                    )
                    base = Layout(
                        tp=tp,
                        cp=cp,
                        dp=dp,
                        pp=pp,
                        ep=ep,
                        zero=zero,
                        micro_batch=mb,
                        grad_accum=cfg.train.global_batch_size // (mb * dp),
                        sequence_parallel=tp > 1,
                        precision=cfg.train.precision,
                        device="cuda",
                        cp_mode=cp_mode,
                        schedule=sched,
                        virtual_stages=v,
                        optimizer=cfg.train.optimizer,
                    )
                    at = (tp, cp, cp_mode, pp, ep, zero, sched, v)
                    if not why and pp > 1 and at not in refused:
                        refused[at] = _config_refusal(cfg, base)
                    why = why or refused.get(at)
                    key = {"tp": tp, "pp": pp, "dp": dp, "zero": zero, "micro_batch": mb}
                    if pp > 1:
                        key["schedule"] = sched
                    if sched == "interleaved":
                        key["virtual_stages"] = v
                    if cp > 1:
                        key.update(cp=cp, cp_mode=cp_mode)
                    if ep > 1:
                        key["ep"] = ep
                    if why:
                        rejected.append({**key, "reason": why})
                        continue
                    for rc in ("none", "selective", "full"):
                        lay = dataclasses.replace(base, recompute=rc)
                        r = evaluate(cfg, hw, lay)
                        need = r["memory_gb"] + RESERVE_GB
                        if need > hw.memory_gb:
                            rejected.append(
                                {
                                    **key,
                                    "recompute": rc,
                                    "memory_gb": need,
                                    "reason": f"needs {need:.1f} GB > {hw.memory_gb:g} GB",
                                }
                            )
                        else:
                            feasible.append(r)
    feasible.sort(key=lambda r: (r["step_time_s"], r["memory_gb"]))
    return {
        "config": cfg.name,
        "assumptions": dict(
            asdict(hw),
            reserve_gb=RESERVE_GB,
            overlap="the ring's K/V passes with its kernels",
            seq_len=cfg.seq_len,
            global_batch=cfg.train.global_batch_size,
            precision=cfg.train.precision,
            fp8=cfg.train.fp8,
        ),
        "feasible": feasible,
        "rejected": rejected,
    }


def plan_from_args(cfg: Config, args: argparse.Namespace) -> dict:
    if args.gpus < 1:
        raise UserError(f"--gpus {args.gpus}: must be >= 1")
    acc = find_accelerator(args.gpu) if args.gpu else None
    peak = peak_tflops(args.gpu, cfg.train.precision, args.peak_tflops)
    if peak is None:
        raise UserError(
            "plan: give --gpu NAME (peak table) or --peak-tflops for the step-time model"
        )
    mem = args.gpu_mem or (acc.memory_gb if acc else None)
    if not mem or mem <= 0:
        raise UserError("plan: give --gpu-mem GB (or a --gpu from the table)")
    intra = args.intra_bw or (acc.intra_gbps if acc else None)
    inter = args.inter_bw or (acc.inter_gbps if acc else None)
    if not intra or not inter:
        raise UserError("plan: give --intra-bw and --inter-bw (GB/s per GPU) for an unlisted GPU")
    if not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency {args.efficiency}: must be in (0, 1]")
    fp8 = None
    if cfg.train.fp8 != "off":
        if acc is None or "fp8" not in acc.peaks:
            raise UserError(
                f"plan: train.fp8={cfg.train.fp8} needs a --gpu with an FP8 peak in the "
                "table (see megaformer/accelerators.py)"
            )
        fp8 = acc.peak("fp8")
    hw = Hardware(args.gpus, args.nodes_of, mem, peak, intra, inter, args.efficiency, fp8)
    return plan(cfg, hw)


def format_plan(r: dict, top: int = 10) -> str:
    a = r["assumptions"]
    lines = [
        f"plan {r['config']}: {a['gpus']} GPUs ({a['gpus_per_node']} per node), {a['memory_gb']:g} GB "
        f"each, peak {a['peak_tflops']:g} TFLOP/s x efficiency {a['efficiency']:g}; NVLink/intra "
        f"{a['intra_gbps']:g} GB/s, network {a['inter_gbps']:g} GB/s per GPU; "
        "no overlap but the ring's K/V passes; "
        f"{a['reserve_gb']:g} GB reserved; global batch {a['global_batch']} x {a['seq_len']}",
        f"{'TP':>3s} {'PP':>3s} {'schedule':>15s} {'bubble':>6s} {'DP':>4s} {'ZeRO':>4s} {'mb':>3s} "
        f"{'recompute':>9s} {'mem GB':>7s} {'step s':>8s} {'MFU':>6s} {'ckpt GB/rank':>12s}  "
        "time split (compute/TP/DP/PP)",
    ]
    if a.get("fp8", "off") != "off" and a.get("fp8_tflops"):
        lines.insert(
            1,
            f"train.fp8={a['fp8']}: the block GEMMs at the FP8 peak "
            f"{a['fp8_tflops']:g} TFLOP/s; MFU is against the {a['peak_tflops']:g} "
            "TFLOP/s peak (above 100% when FP8 pays)",
        )
    shown = r["feasible"][:top]
    cp_col = any(x["layout"]["cp"] > 1 for x in shown)
    ep_col = any(x["layout"]["ep"] > 1 for x in shown)
    opt_col = any(x["time"].get("optimizer_comm", 0) > 0 for x in shown)
    extra = ("/CP" if cp_col else "") + ("/EP" if ep_col else "") + ("/Muon" if opt_col else "")
    lines[-1] = (lines[-1][:-1] + extra + ")").replace(
        f"{'DP':>4s} ",
        f"{'DP':>4s} " + (f"{'CP':>13s} " if cp_col else "") + (f"{'EP':>3s} " if ep_col else ""),
        1,
    )
    for x in shown:
        L, t = x["layout"], x["time"]
        cp = f"{L['cp']} {L['cp_mode']}" if L["cp"] > 1 else "1"
        sched = schedule_label(L["schedule"], L["virtual_stages"]) if L["pp"] > 1 else "-"
        lines.append(
            f"{L['tp']:>3d} {L['pp']:>3d} {sched:>15s} {100 * x['pipeline']['bubble']:>5.1f}% "
            f"{L['dp']:>4d} "
            + (f"{cp:>13s} " if cp_col else "")
            + (f"{L['ep']:>3d} " if ep_col else "")
            + f"{L['zero']:>4d} {L['micro_batch']:>3d} "
            f"{L['recompute']:>9s} {x['memory_gb']:>7.1f} {x['step_time_s']:>8.3f} "
            f"{100 * x['mfu']:>5.1f}% {x['checkpoint']['per_rank_gb']:>12.2f}  "
            f"{t['compute']:.3f}/{t['tp_comm']:.3f}/"
            f"{t['dp_comm']:.3f}/{t['pp_comm']:.3f}"
            + (f"/{t['cp_comm']:.3f}" if cp_col else "")
            + (f"/{t['ep_comm']:.3f}" if ep_col else "")
            + (f"/{t['optimizer_comm']:.3f}" if opt_col else "")
        )
    if r["feasible"]:
        c = r["feasible"][0]["checkpoint"]
        muon = r["feasible"][0]["layout"]["optimizer"] == "muon"
        state = "Muon's momentum / AdamW's moments" if muon else "Adam moments"
        lines.append(
            f"checkpoint: {c['total_gb']:.1f} GB of training state (fp32 master + {state}), "
            f"written in parallel: {c['per_rank_gb']:.2f} GB per rank for the "
            f"first layout (= each rank's pinned host staging arena on a GPU, "
            f"held for the run)"
        )
    if not r["feasible"]:
        lines.append("no feasible layout")
    lines.append(f"{len(r['feasible'])} feasible, {len(r['rejected'])} rejected; e.g.:")
    seen = set()
    for x in r["rejected"]:
        kind = re.sub(r"[0-9.]+", "#", x["reason"])  # one example of each reason
        if kind in seen:
            continue
        seen.add(kind)
        lines.append(
            f"  TP {x['tp']} PP {x['pp']}"
            + (
                f" {schedule_label(x['schedule'], x.get('virtual_stages', 1))}"
                if "schedule" in x
                else ""
            )
            + f" DP {x['dp']}"
            + (f" CP {x['cp']} {x['cp_mode']}" if "cp" in x else "")
            + (f" EP {x['ep']}" if "ep" in x else "")
            + f" ZeRO {x['zero']} mb {x['micro_batch']}"
            f"{' ' + x['recompute'] if 'recompute' in x else ''}: {x['reason']}"
        )
    return "\n".join(lines)
