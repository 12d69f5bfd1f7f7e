"""Static checks of the ``parallel`` section: each parallelism against the model it splits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaformer.config.checks.common import positive, require

if TYPE_CHECKING:
    from megaformer.config.root import Config


def check_parallel(cfg: Config) -> None:
    """Degrees, and what each of tensor, pipeline, context and expert parallelism (and FP8
    GEMM shapes) needs of the model."""
    p = cfg.parallel
    positive("parallel.tensor", p.tensor)
    positive("parallel.pipeline", p.pipeline)
    positive("parallel.vocab_multiple", p.vocab_multiple)
    positive("parallel.context", p.context)
    positive("parallel.expert", p.expert)
    check_tensor_parallel(cfg)
    check_pipeline(cfg)
    check_context(cfg)
    check_expert(cfg)
    check_fp8(cfg)
    positive("parallel.collective_timeout_minutes", p.collective_timeout_minutes)


def check_tensor_parallel(cfg: Config) -> None:
    m, tp = cfg.model, cfg.parallel.tensor
    if tp == 1:
        return
    require(m.n_heads % tp == 0, f"parallel.tensor={tp}: must divide model.n_heads={m.n_heads}")
    require(
        m.kv_heads % tp == 0,
        f"parallel.tensor={tp}: must divide the key/value heads (model.n_kv_heads="
        f"{m.kv_heads}); replicating KV heads across TP ranks is not supported",
    )
    require(m.ffn_dim % tp == 0, f"parallel.tensor={tp}: must divide the FFN width {m.ffn_dim}")
    if cfg.parallel.sequence_parallel:
        require(
            cfg.seq_len % tp == 0,
            f"parallel.sequence_parallel=true: sequence length "
            f"{cfg.seq_len} must be divisible by parallel.tensor={tp}",
        )
    require(
        cfg.parallel.zero_stage < 3,
        f"parallel.zero_stage=3 with parallel.tensor={tp}: ZeRO-3 does not partition "
        "tensor-parallel shards here; use zero_stage 0, 1 or 2",
    )


def pipeline_stage_count(cfg: Config) -> int:
    """The stages the blocks are cut into: PP under 1F1B, v * PP under the interleaved schedule
    (each rank holds v), 2 * PP under DualPipeV (each rank holds two)."""
    p = cfg.parallel
    return p.pipeline * stages_per_rank(p.pipeline_schedule, p.pipeline_virtual_stages)


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """How many stages each pipeline rank holds under ``schedule``."""
    return {"dualpipev": 2, "interleaved": virtual_stages}.get(schedule, 1)


def check_pipeline(cfg: Config) -> None:
    p, n = cfg.parallel, cfg.model.n_layers
    check_pipeline_schedule(cfg)
    stages = pipeline_stage_count(cfg)
    spec = p.pipeline_partition
    if spec not in ("layers", "parameters"):
        try:
            counts = [int(c) for c in spec.split(",")]
        except ValueError:
            counts = []
        require(
            len(counts) == stages and all(c >= 1 for c in counts) and sum(counts) == n,
            f"parallel.pipeline_partition={spec!r}: expected 'layers', 'parameters' or "
            f"{stages} positive block counts summing to model.n_layers={n}",
        )
    if p.pipeline == 1:
        return
    require(
        n >= stages,
        f"parallel.pipeline={p.pipeline}: more stages than model.n_layers={n}"
        + (
            f" ({p.pipeline_schedule} cuts the blocks into {stages // p.pipeline} * pipeline "
            f"= {stages} stages)"
            if stages > p.pipeline
            else ""
        ),
    )
    require(
        p.zero_stage <= 1,
        f"parallel.zero_stage={p.zero_stage} with parallel.pipeline={p.pipeline}: DeepSpeed's "
        "pipeline engine does not support ZeRO-2/3; use parallel.zero_stage=1 (or 0)",
    )
    require(
        not (cfg.train.precision == "bf16" and p.zero_stage == 0),
        f"train.precision=bf16 with parallel.pipeline={p.pipeline} needs parallel.zero_stage=1: "
        "DeepSpeed accumulates bf16 micro-batch gradients in fp32 only in its ZeRO-1 optimizer",
    )


def check_pipeline_schedule(cfg: Config) -> None:
    """What each schedule needs beyond the pipeline itself (the micro-batch count needs the world
    size: :func:`check_pipeline_micro_batches`)."""
    p = cfg.parallel
    if p.pipeline_schedule == "1f1b":
        return
    require(
        p.pipeline > 1,
        f"parallel.pipeline_schedule={p.pipeline_schedule}: needs a pipeline "
        "(parallel.pipeline > 1)",
    )
    name = p.pipeline_schedule
    if name == "interleaved":
        require(
            p.pipeline_virtual_stages >= 2,
            f"parallel.pipeline_virtual_stages={p.pipeline_virtual_stages}: the interleaved "
            "schedule needs at least 2 stages per rank (with 1 it is parallel.pipeline_schedule="
            "1f1b)",
        )
        stages, n = p.pipeline * p.pipeline_virtual_stages, cfg.model.n_layers
        require(
            p.pipeline_partition != "layers" or n % stages == 0 or n < stages,
            f"parallel.pipeline_virtual_stages={p.pipeline_virtual_stages}: the interleaved "
            f"schedule cuts model.n_layers={n} into pipeline * virtual stages = {stages} stages "
            "of equal work (every rank waits on the slowest chunk each round); choose a v with "
            "v * pipeline dividing the blocks, or give parallel.pipeline_partition explicitly",
        )
    ds_pipe = (cfg.deepspeed or {}).get("pipeline", {})
    require(
        not any(ds_pipe.get(k) for k in ("pipe_partitioned", "grad_partitioned")),
        f"parallel.pipeline_schedule={name} with deepspeed.pipeline.pipe_partitioned/"
        "grad_partitioned: this schedule sends whole activations; set both to false",
    )


def check_pipeline_micro_batches(cfg: Config, grad_accum: int) -> None:
    """The micro-batches per optimizer step (``grad_accum``) the schedule needs."""
    p = cfg.parallel
    per_step = (
        "micro-batches per step, got {} (train.global_batch_size / (train.micro_batch_size * "
        "data-parallel size)); raise the global batch or lower the micro-batch"
    ).format(grad_accum)
    if p.pipeline > 1 and p.pipeline_schedule == "dualpipev":
        require(
            grad_accum >= 2 * p.pipeline,
            f"parallel.pipeline_schedule=dualpipev: needs at least 2 * pipeline = "
            f"{2 * p.pipeline} {per_step}",
        )
    if p.pipeline > 1 and p.pipeline_schedule == "interleaved":
        require(
            grad_accum % p.pipeline == 0,
            f"parallel.pipeline_schedule=interleaved: needs a multiple of pipeline = "
            f"{p.pipeline} {per_step}",
        )


def check_context(cfg: Config) -> None:
    p, m = cfg.parallel, cfg.model
    cp = p.context
    if cp == 1:
        return
    if p.context_mode == "ring":
        require(
            cfg.seq_len % (2 * cp) == 0,
            f"parallel.context={cp} (ring): sequence length {cfg.seq_len} must be divisible by "
            f"2 * context = {2 * cp} (each rank holds two opposite chunks)",
        )
    else:
        require(
            cfg.seq_len % cp == 0,
            f"parallel.context={cp}: sequence length {cfg.seq_len} must "
            f"be divisible by the context degree",
        )
        local_heads = m.n_heads // p.tensor
        require(
            local_heads % cp == 0,
            f"parallel.context={cp} (all_to_all): the {local_heads} attention heads per "
            "tensor-parallel rank must be divisible by the context degree; use "
            "parallel.context_mode=ring",
        )
    require(
        m.moe.interval == 0 or m.moe.dropless,
        f"parallel.context={cp} with model.moe.dropless=false: a capacity keeps each expert's "
        "first assignments in the micro-batch's token order, which no context rank sees whole; "
        "use model.moe.dropless=true",
    )
    if p.context_mode == "ring":
        require(
            m.attention_backend in ("auto", "reference"),
            f"parallel.context={cp} (ring) with model.attention_backend="
            f"{m.attention_backend}: ring attention runs the block kernels that return a "
            "log-sum-exp (chosen by their own rule, not this setting); set attention_backend=auto "
            "or use parallel.context_mode=all_to_all (any backend)",
        )
        require(
            m.attention_dropout == 0,
            f"parallel.context={cp} (ring) with model.attention_dropout="
            f"{m.attention_dropout}: ring attention has no attention dropout; use "
            "parallel.context_mode=all_to_all or attention_dropout=0",
        )
    if p.sequence_parallel and p.tensor > 1:
        require(
            cfg.seq_len % (cp * p.tensor) == 0,
            f"parallel.sequence_parallel=true: sequence length {cfg.seq_len} must be divisible "
            f"by context * tensor = {cp * p.tensor}",
        )


def check_expert(cfg: Config) -> None:
    ep, moe = cfg.parallel.expert, cfg.model.moe
    if ep == 1:
        return
    require(
        moe.interval > 0,
        f"parallel.expert={ep}: needs a mixture-of-experts model (model.moe.interval > 0)",
    )
    require(
        moe.num_experts % ep == 0,
        f"parallel.expert={ep}: must divide model.moe.num_experts={moe.num_experts}",
    )
    p = cfg.parallel
    if p.tensor > 1 and not p.sequence_parallel:  # (sequence parallelism checks its own)
        local = cfg.seq_len // p.context
        require(
            local % p.tensor == 0,
            f"parallel.expert={ep} with parallel.tensor={p.tensor}: each tensor-parallel rank "
            f"dispatches its share of the sequence, so the {local} positions per context rank "
            "must be divisible by the tensor degree",
        )
    if p.expert_dispatch == "padded":
        width = cfg.model.expert_dim // p.tensor
        require(
            cfg.model.d_model % 8 == 0 and width % 8 == 0,
            f"parallel.expert_dispatch=padded: the experts run as grouped GEMMs, whose rows "
            f"must be multiples of 8 (16 bytes); d_model={cfg.model.d_model} and the expert "
            f"width per tensor-parallel rank {width} are not; use expert_dispatch=splits",
        )
    require(
        cfg.train.precision != "fp16",
        f"parallel.expert={ep} with train.precision=fp16: the fp16 optimizer's checkpoints "
        "cannot hold split experts; use train.precision=bf16",
    )


def check_fp8_demotion(cfg: Config) -> None:
    """Per-layer FP8 demotion compares FP8 with high precision in the diagnostics pass."""
    t = cfg.train
    positive("train.fp8_demote_threshold", t.fp8_demote_threshold, allow_zero=True)
    positive("train.fp8_demote_intervals", t.fp8_demote_intervals)
    if not t.fp8_demote_threshold:
        return
    key = f"train.fp8_demote_threshold={t.fp8_demote_threshold}"
    require(t.fp8 != "off", f"{key} with train.fp8=off: there is no FP8 to demote")
    require(
        cfg.log.diagnostics,
        f"{key} needs log.diagnostics=true (the diagnostics pass measures the gaps)",
    )
    require(
        cfg.parallel.pipeline == 1,
        f"{key} with parallel.pipeline={cfg.parallel.pipeline}: demotion measures every block "
        "from one stream, which pipeline stages split; use parallel.pipeline=1",
    )


def check_fp8(cfg: Config) -> None:
    """FP8 GEMMs (torch._scaled_mm) need both matrix dimensions of every converted linear layer's
    tensor-parallel shard, and the tokens each GEMM contracts over in the weight gradient, to be
    multiples of 16 (emulation has no such constraint)."""
    t, m, tp = cfg.train, cfg.model, cfg.parallel.tensor
    check_fp8_demotion(cfg)
    cp = cfg.parallel.context
    require(
        t.fp8 == "off" or cp == 1,
        f"train.fp8={t.fp8} with parallel.context={cp}: FP8 GEMMs scale the activations by "
        "their amax over the tokens, which context parallelism splits over ranks and the "
        "scales are not reduced over; use one of them",
    )
    if t.fp8 == "off" or t.fp8_emulate:
        return
    dims = {
        "model.d_model": m.d_model,
        "query width n_heads*head_dim / TP": m.n_heads * m.head_dim // tp,
        "key/value width kv_heads*head_dim / TP": m.kv_heads * m.head_dim // tp,
        "FFN width / TP": m.ffn_dim // tp,
    }
    if m.moe_layers and m.shared_dim:
        dims["shared-expert width / TP"] = m.shared_dim // tp
    if m.moe_layers and tp == 1:  # (split by TP, the routed experts stay in high precision)
        dims["routed-expert width"] = m.expert_dim
    for what, n in dims.items():
        require(
            n % 16 == 0,
            f"train.fp8={t.fp8}: the {what} = {n} is not a multiple of 16, which "
            "FP8 GEMMs need; change the model's widths or use train.fp8=off",
        )
    # the weight gradient dW = dY^T X contracts over the micro-batch's tokens on this CP rank
    if t.micro_batch_size is not None:  # null: resolved per world size, at launch
        tokens = t.micro_batch_size * cfg.seq_len // cp
        require(
            tokens % 16 == 0,
            f"train.fp8={t.fp8}: the tokens per micro-batch and context rank, micro_batch_size "
            f"* seq_len / parallel.context = {t.micro_batch_size} * {cfg.seq_len} / {cp} = "
            f"{tokens}, are not a multiple of 16, which the weight-gradient FP8 GEMM needs; "
            "change train.micro_batch_size or the sequence length",
        )
