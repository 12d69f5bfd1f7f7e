"""``megaformer plan``: feasible (TP, PP, DP, ZeRO, micro-batch, recompute) layouts, best first.

Memory per GPU from :mod:`megaformer.analysis.memory` (+ ``RESERVE_GB`` for the CUDA context,
NCCL buffers and allocator fragmentation). Step time from a compute + communication model with
stated bandwidths and nothing overlapped (so it is a pessimistic, comparable ranking, not a promise):

    compute   = hardware FLOPs / (GPUs * peak * efficiency) * (1 + (PP - 1) / m)      1F1B bubble, m micro-batches
    TP        = 4 (6 with full recompute) all-reduces of b*s*h*e bytes per layer per micro-batch,
                ring: 2 (t-1)/t * bytes / BW;  BW = intra-node if TP <= GPUs per node, else inter
    DP        = gradient all-reduce 2 (d-1)/d * P*e_g / BW (ZeRO 2: reduce-scatter + all-gather,
                same volume; ZeRO 3: x1.5 for the parameter all-gathers); BW = intra if TP*DP fits a
                node, else inter
    PP        = 2 m (PP-1) point-to-point sends of b*s*h*e bytes at the inter/intra bandwidth

    MFU = model FLOPs / (step time * GPUs * peak)

Checkpoints are sharded: the state is 12 bytes per parameter (fp32 master weight and Adam's two
moments), and every rank writes its own share in parallel: the busiest rank's TP x PP shard / DP
(its ZeRO partition; under ZeRO-0 the DP ranks split the replicated shard). An asynchronous save
stages exactly that share in host memory.

Rules that reject a layout: TP must divide heads, KV heads and the FFN width and stay within a node
(more is allowed but slow; it is not rejected); PP at most n_layers; the global batch
must split into micro-batches x DP; ZeRO-3 not with TP > 1 (megaformer), ZeRO 2/3 not with PP > 1
(DeepSpeed's pipeline engine); memory must fit. MoE models (``model.moe``): TP must also divide the
expert and shared-expert widths, no ZeRO-3, no PP > 1 with router losses; memory and checkpoints
count every expert (total parameters), FLOPs and MFU the active ones.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Optional

from megaformer.analysis.flops import step_flops
from megaformer.analysis.memory import DTYPE_BYTES, Layout, estimate
from megaformer.accelerators import find_accelerator, peak_tflops
from megaformer.analysis.summary import resolve_vocab
from megaformer.config import Config
from megaformer.errors import UserError
from megaformer.parallel.plan import padded_vocab_size

RESERVE_GB = 2.0
GB = 1e9
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 master weight + Adam's first and second moments


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpus_per_node: int
    memory_gb: float
    peak_tflops: float
    intra_gbps: float
    inter_gbps: float
    efficiency: float


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
    fl = step_flops(m, s, gbs, recompute=lay.recompute, recompute_every=lay.recompute_every,
                    padded_vocab=padded)
    peak = hw.peak_tflops * 1e12
    micro = lay.grad_accum
    compute = fl.hardware / (hw.gpus * peak * hw.efficiency) * (1 + (lay.pp - 1) / micro)
    act = lay.micro_batch * s * m.d_model * e
    tp_bw = hw.intra_gbps if lay.tp <= hw.gpus_per_node else hw.inter_gbps
    layers = math.ceil(m.n_layers / lay.pp)
    n_ar = 6 if lay.recompute == "full" else 4
    tp_time = micro * layers * n_ar * _allreduce_s(act, lay.tp, tp_bw)
    dp_bw = hw.intra_gbps if lay.tp * lay.dp <= hw.gpus_per_node else hw.inter_gbps
    from megaformer.analysis.memory import params_per_rank

    grad_bytes = params_per_rank(m, lay, padded) * e
    dp_time = _allreduce_s(grad_bytes, lay.dp, dp_bw) * (1.5 if lay.zero == 3 else 1.0)
    pp_bw = hw.inter_gbps if lay.tp * lay.pp > hw.gpus_per_node else hw.intra_gbps
    pp_time = 2 * micro * (lay.pp - 1) * act / (pp_bw * GB) / max(lay.pp, 1) if lay.pp > 1 else 0.0
    step = compute + tp_time + dp_time + pp_time
    from megaformer.analysis.params import count_parameters

    per_rank = CHECKPOINT_BYTES_PER_PARAM * params_per_rank(m, lay, padded) / lay.dp
    return {
        "layout": asdict(lay), "memory_gb": mem.total / GB,
        "memory": {k: v / GB for k, v in mem.as_dict().items() if isinstance(v, float)},
        "step_time_s": step,
        "time": {"compute": compute, "tp_comm": tp_time, "dp_comm": dp_time, "pp_comm": pp_time},
        "mfu": fl.model / (step * hw.gpus * peak), "tokens_per_s": fl.tokens / step,
        "checkpoint": {"total_gb": CHECKPOINT_BYTES_PER_PARAM * count_parameters(m)["total"] / GB,
                       "per_rank_gb": per_rank / GB, "async_staging_gb": per_rank / GB},
    }


def _reject_reason(cfg: Config, tp: int, pp: int, dp: int, zero: int, mb: int) -> Optional[str]:
    m, gbs = cfg.model, cfg.train.global_batch_size
    if m.n_heads % tp or m.kv_heads % tp or m.ffn_dim % tp:
        return f"TP={tp} does not divide heads {m.n_heads} / KV heads {m.kv_heads} / FFN {m.ffn_dim}"
    if m.moe_layers and (m.expert_dim % tp or m.shared_dim % tp):
        return f"TP={tp} does not divide the expert FFN {m.expert_dim} / shared FFN {m.shared_dim}"
    if m.moe_layers and zero == 3:
        return "ZeRO-3 with MoE blocks is not supported by megaformer"
    if m.moe_layers and pp > 1 and (m.moe.aux_loss_coef > 0 or m.moe.z_loss_coef > 0):
        return "MoE router losses (aux/z loss) with PP > 1 are not supported"
    if pp > m.n_layers:
        return f"PP={pp} > {m.n_layers} layers"
    if gbs % (mb * dp):
        return f"global batch {gbs} not a multiple of micro-batch {mb} x DP {dp}"
    if zero == 3 and tp > 1:
        return "ZeRO-3 with TP > 1 is not supported by megaformer"
    if zero >= 2 and pp > 1:
        return f"ZeRO-{zero} with PP > 1 is not supported by DeepSpeed's pipeline engine"
    return None


def plan(cfg: Config, hw: Hardware, micro_batches: tuple = (1, 2, 4, 8, 16)) -> dict:
    """{'assumptions', 'feasible' (best first), 'rejected'} for ``cfg`` on ``hw``."""
    cfg = resolve_vocab(cfg)
    feasible, rejected = [], []
    for tp in _divisors(hw.gpus):
        for pp in _divisors(hw.gpus // tp):
            dp = hw.gpus // (tp * pp)
            for zero in (0, 1, 2, 3):
                for mb in micro_batches:
                    why = _reject_reason(cfg, tp, pp, dp, zero, mb)
                    key = {"tp": tp, "pp": pp, "dp": dp, "zero": zero, "micro_batch": mb}
                    if why:
                        rejected.append({**key, "reason": why})
                        continue
                    accum = cfg.train.global_batch_size // (mb * dp)
                    for rc in ("none", "selective", "full"):
                        lay = Layout(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=mb, grad_accum=accum,
                                     recompute=rc, sequence_parallel=tp > 1,
                                     precision=cfg.train.precision, device="cuda")
                        r = evaluate(cfg, hw, lay)
                        need = r["memory_gb"] + RESERVE_GB
                        if need > hw.memory_gb:
                            rejected.append({**key, "recompute": rc, "memory_gb": need,
                                             "reason": f"needs {need:.1f} GB > {hw.memory_gb:g} GB"})
                        else:
                            feasible.append(r)
    feasible.sort(key=lambda r: (r["step_time_s"], r["memory_gb"]))
    return {"config": cfg.name, "assumptions": dict(asdict(hw), reserve_gb=RESERVE_GB,
                                                    overlap="none", seq_len=cfg.seq_len,
                                                    global_batch=cfg.train.global_batch_size,
                                                    precision=cfg.train.precision),
            "feasible": feasible, "rejected": rejected}


def plan_from_args(cfg: Config, args: argparse.Namespace) -> dict:
    if args.gpus < 1:
        raise UserError(f"--gpus {args.gpus}: must be >= 1")
    acc = find_accelerator(args.gpu) if args.gpu else None
    peak = peak_tflops(args.gpu, cfg.train.precision, args.peak_tflops)
    if peak is None:
        raise UserError("plan: give --gpu NAME (peak table) or --peak-tflops for the step-time model")
    mem = args.gpu_mem or (acc.memory_gb if acc else None)
    if not mem or mem <= 0:
        raise UserError("plan: give --gpu-mem GB (or a --gpu from the table)")
    intra = args.intra_bw or (acc.intra_gbps if acc else None)
    inter = args.inter_bw or (acc.inter_gbps if acc else None)
    if not intra or not inter:
        raise UserError("plan: give --intra-bw and --inter-bw (GB/s per GPU) for an unlisted GPU")
    if not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency {args.efficiency}: must be in (0, 1]")
    hw = Hardware(args.gpus, args.nodes_of, mem, peak, intra, inter, args.efficiency)
    return plan(cfg, hw)


def format_plan(r: dict, top: int = 10) -> str:
    a = r["assumptions"]
    lines = [f"plan {r['config']}: {a['gpus']} GPUs ({a['gpus_per_node']} per node), {a['memory_gb']:g} GB "
             f"each, peak {a['peak_tflops']:g} TFLOP/s x efficiency {a['efficiency']:g}; NVLink/intra "
             f"{a['intra_gbps']:g} GB/s, network {a['inter_gbps']:g} GB/s per GPU; no overlap; "
             f"{a['reserve_gb']:g} GB reserved; global batch {a['global_batch']} x {a['seq_len']}",
             f"{'TP':>3s} {'PP':>3s} {'DP':>4s} {'ZeRO':>4s} {'mb':>3s} {'recompute':>9s} "
             f"{'mem GB':>7s} {'step s':>8s} {'MFU':>6s} {'ckpt GB/rank':>12s}  "
             "time split (compute/TP/DP/PP)"]
    for x in r["feasible"][:top]:
        L, t = x["layout"], x["time"]
        lines.append(f"{L['tp']:>3d} {L['pp']:>3d} {L['dp']:>4d} {L['zero']:>4d} {L['micro_batch']:>3d} "
                     f"{L['recompute']:>9s} {x['memory_gb']:>7.1f} {x['step_time_s']:>8.3f} "
                     f"{100 * x['mfu']:>5.1f}% {x['checkpoint']['per_rank_gb']:>12.2f}  "
                     f"{t['compute']:.3f}/{t['tp_comm']:.3f}/"
                     f"{t['dp_comm']:.3f}/{t['pp_comm']:.3f}")
    if r["feasible"]:
        c = r["feasible"][0]["checkpoint"]
        lines.append(f"checkpoint: {c['total_gb']:.1f} GB of training state (fp32 master + Adam "
                     f"moments), written in parallel: {c['per_rank_gb']:.2f} GB per rank for the "
                     f"first layout (= its host staging with checkpoint.async_save)")
    if not r["feasible"]:
        lines.append("no feasible layout")
    lines.append(f"{len(r['feasible'])} feasible, {len(r['rejected'])} rejected; e.g.:")
    seen = set()
    for x in r["rejected"]:
        kind = x["reason"].split(" ")[0]
        if kind in seen:
            continue
        seen.add(kind)
        lines.append(f"  TP {x['tp']} PP {x['pp']} DP {x['dp']} ZeRO {x['zero']} mb {x['micro_batch']}"
                     f"{' ' + x['recompute'] if 'recompute' in x else ''}: {x['reason']}")
    return "\n".join(lines)
