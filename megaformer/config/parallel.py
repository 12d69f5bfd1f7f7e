"""The ``parallel`` section: how the world is split (TP x CP x DP x PP, plus EP inside DP)."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from megaformer.config.fields import option

PipelineSchedule = Literal["1f1b", "interleaved", "dualpipev"]
PIPELINE_SCHEDULES: tuple[str, ...] = typing.get_args(PipelineSchedule)


@dataclass
class ParallelConfig:
    """How the world is split. Data parallelism is world_size / (tensor * context * pipeline)."""

    tensor: int = option(
        1,
        "Tensor-parallel degree: each layer's matrices split over this many "
        "adjacent ranks (Megatron-style); must divide heads, KV heads, d_ffn.",
    )
    pipeline: int = option(
        1,
        "Pipeline-parallel degree: stages of consecutive blocks, run by "
        "DeepSpeed's pipeline engine on the schedule parallel.pipeline_schedule.",
    )
    pipeline_schedule: PipelineSchedule = option(
        "1f1b",
        "Order of the micro-batches' forward and backward passes over the stages: '1f1b' "
        "(one forward, one backward; idle fraction (p-1)/(m+p-1) for p stages and m "
        "micro-batches), 'interleaved' (interleaved 1F1B: the blocks are cut into v*p stages, "
        "v = parallel.pipeline_virtual_stages, rank r runs stages r, r+p, ...; idle fraction "
        "(p-1)/(v*m+p-1) for 2(vp-1) point-to-point sends per micro-batch instead of "
        "2(p-1); needs a multiple of p micro-batches per step and model.n_layers divisible by "
        "v*p) or 'dualpipev' (DeepSeek-V3's DualPipeV, "
        "DeepSpeed's engine: the blocks are cut into 2p stages, rank r runs stages r and 2p-1-r "
        "so micro-batches go out and come back, the embedding and the head both on the first "
        "rank; needs at least 2p micro-batches per step and 2p blocks).",
    )
    pipeline_virtual_stages: int = option(
        2,
        "Stages per pipeline rank (v) under parallel.pipeline_schedule=interleaved: the blocks "
        "are cut into v * parallel.pipeline stages. Ignored by the other schedules.",
    )
    pipeline_partition: str = option(
        "layers",
        "How blocks are split over stages: 'layers' (equal block counts), 'parameters' "
        "(balanced parameter counts) or an explicit list of blocks per stage, e.g. '3,3,2'. "
        "The embedding goes with the first stage, the final norm and head with the last.",
    )
    context: int = option(
        1,
        "Context-parallel degree: each sequence split into this many parts over adjacent ranks "
        "(after the tensor-parallel ranks); attention exchanges keys/values or heads between "
        "them (parallel.context_mode). Gradients are averaged over data x context ranks.",
    )
    context_mode: Literal["ring", "all_to_all"] = option(
        "ring",
        "How attention sees the whole sequence under context parallelism: 'ring' (K/V "
        "blocks passed around the context group, online softmax, two opposite chunks per "
        "rank so causal work is balanced; sequence divisible by 2 * context) or "
        "'all_to_all' (DeepSpeed-Ulysses: sequence-sharded to head-sharded around the "
        "attention core and back; heads per tensor-parallel rank divisible by context).",
    )
    expert: int = option(
        1,
        "Expert-parallel degree (model.moe): the routed experts split over this many "
        "data-parallel ranks, tokens sent to their experts' ranks and back with all-to-all; "
        "expert gradients are averaged over the remaining data-parallel ranks. Must divide "
        "model.moe.num_experts and the data-parallel size.",
    )
    expert_dispatch: Literal["auto", "splits", "padded"] = option(
        "auto",
        "How expert parallelism exchanges tokens: 'splits' (exactly the routed rows; their "
        "counts read on the host once per MoE block, a stream synchronisation on CUDA), "
        "'padded' (a fixed-size exchange of the most rows a rank could route to each rank, "
        "counts kept on the device: no host read; dropless it sends up to "
        "expert * min(top_k, experts per rank) / top_k times the rows, with a capacity factor "
        "about capacity_factor times) or 'auto' (padded on CUDA when the experts run as grouped "
        "GEMMs and the padding costs at most twice the rows, else splits).",
    )
    zero_stage: Literal[0, 1, 2, 3] = option(
        0, "DeepSpeed ZeRO stage: 0 (off), 1 (optimizer states), 2 (+gradients), 3 (+parameters)."
    )
    sequence_parallel: bool = option(
        False,
        "Split the residual stream along the sequence across the tensor-parallel group "
        "(all-gather / reduce-scatter instead of all-reduce); no effect when tensor = 1.",
    )
    vocab_multiple: int = option(
        128,
        "Pad the vocabulary to a multiple of vocab_multiple * tensor rows; the padding never "
        "reaches the loss, generation or exported weights.",
    )
    collective_timeout_minutes: float = option(
        30.0,
        "Timeout of the process group's collectives (init_process_group(timeout=...)): a rank "
        "waiting longer than this for the others fails instead of hanging.",
    )
