"""Static checks of the ``model`` section: widths, positions, dropout, mixture-of-experts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megaformer.config.checks.common import positive, require
from megaformer.config.model import ROPE_SCALING_KEYS

if TYPE_CHECKING:
    from megaformer.config.root import Config


def check_model(cfg: Config) -> None:
    """The model's own keys, and the model features a pipeline cannot carry."""
    m = cfg.model
    for key in (
        "d_model",
        "n_layers",
        "n_heads",
        "max_seq_len",
        "vocab_size",
        "n_kv_heads",
        "d_ffn",
        "sliding_window",
    ):
        positive(f"model.{key}", getattr(m, key))
    positive("model.head_dim", m.configured_head_dim)
    require(
        m.configured_head_dim is not None or m.d_model % m.n_heads == 0,
        f"model.d_model={m.d_model}: must be divisible by model.n_heads={m.n_heads} "
        "(or set model.head_dim)",
    )
    require(
        m.n_heads % m.kv_heads == 0,
        f"model.n_heads={m.n_heads}: must be divisible by model.n_kv_heads={m.kv_heads}",
    )
    if m.position == "rope":
        rot = int(m.head_dim * m.rotary_fraction)
        require(
            0 < m.rotary_fraction <= 1,
            f"model.rotary_fraction={m.rotary_fraction}: must be in (0, 1]",
        )
        require(
            rot >= 2 and rot % 2 == 0,
            f"model.rotary_fraction={m.rotary_fraction}: rotary dims per head "
            f"({m.head_dim} * fraction = {rot}) must be even and >= 2",
        )
        positive("model.rope_theta", m.rope_theta)
        check_rope_scaling(m.rope_scaling)
    else:
        require(
            m.rope_scaling is None,
            f"model.rope_scaling: needs model.position=rope, not {m.position}",
        )
    if m.position == "sinusoidal":
        require(
            m.d_model % 2 == 0,
            f"model.d_model={m.d_model}: sinusoidal positions need an even width",
        )
    for key in ("dropout", "attention_dropout"):
        v = getattr(m, key)
        require(0 <= v < 1, f"model.{key}={v}: must be in [0, 1)")
    positive("model.norm_eps", m.norm_eps)
    positive("model.init_std", m.init_std)
    positive("model.loss_chunk_tokens", m.loss_chunk_tokens, allow_zero=True)
    p = cfg.parallel
    require(
        not (m.document_mask and p.pipeline > 1 and p.context > 1),
        f"model.document_mask with parallel.pipeline={p.pipeline} and parallel.context="
        f"{p.context}: the stages rebuild the mask from their context part of the ids, not the "
        "whole sequences; use one of pipeline or context parallelism",
    )
    check_mla(cfg)
    check_moe(cfg)
    check_mtp(cfg)


def check_mtp(cfg: Config) -> None:
    """Multi-token prediction: its depth and weight, and the layouts it runs under."""
    m, p = cfg.model, cfg.parallel
    positive("model.mtp_depth", m.mtp_depth, allow_zero=True)
    positive("model.mtp_loss_coef", m.mtp_loss_coef, allow_zero=True)
    if m.mtp_depth == 0:
        return
    require(
        m.mtp_depth < m.max_seq_len - 1,
        f"model.mtp_depth={m.mtp_depth}: must be below model.max_seq_len - 1",
    )
    moe_modules = any(m.is_moe_layer(m.n_layers + k) for k in range(m.mtp_depth))
    for key, value, why in (
        ("model.position", m.position != "rope", "the modules reuse the rotary positions"),
        ("model.document_mask", m.document_mask, "its shifted sequences cross documents"),
        (
            "parallel.pipeline",
            p.pipeline > 1 and p.pipeline_schedule == "dualpipev",
            "the modules run on the last stage of the last rank (1f1b or interleaved)",
        ),
        (
            "parallel.pipeline",
            p.pipeline > 1 and p.context > 1,
            "the last stage has no shifted sequences of the context ranks",
        ),
        (
            "parallel.sequence_parallel",
            p.tensor > 1 and p.sequence_parallel and moe_modules,
            "its MoE blocks would route the rows that pad its sequences",
        ),
        (
            "parallel.context",
            p.context > 1 and moe_modules,
            "its MoE blocks would route the padding past each sequence's end",
        ),
        ("parallel.expert", p.expert > 1, "its experts are not distributed yet"),
        ("parallel.zero_stage", p.zero_stage == 3, "its modules are not partitioned yet"),
    ):
        section, name = key.split(".")
        require(
            not value,
            f"model.mtp_depth={m.mtp_depth} with {key}="
            f"{str(getattr(m if section == 'model' else p, name)).lower()}: not supported "
            f"({why}); set model.mtp_depth=0",
        )


def check_mla(cfg: Config) -> None:
    """Multi-head latent attention's widths, and what it does not combine with."""
    m = cfg.model
    if m.attention != "mla":
        return
    mla = m.mla
    positive("model.mla.q_lora_rank", mla.q_lora_rank)
    for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        positive(f"model.mla.{key}", getattr(mla, key))
    require(
        mla.qk_rope_head_dim >= 2 and mla.qk_rope_head_dim % 2 == 0,
        f"model.mla.qk_rope_head_dim={mla.qk_rope_head_dim}: must be even and >= 2",
    )
    for key, on, why in (
        ("position", m.position != "rope", "its decoupled keys are rotary"),
        ("rotary_fraction", m.rotary_fraction != 1.0, "model.mla.qk_rope_head_dim sets it"),
        ("n_kv_heads", m.n_kv_heads not in (None, m.n_heads), "every head has its own key"),
        ("qk_norm", m.qk_norm, "its latents are normalised instead"),
        ("bias", m.bias or m.attn_bias, "its projections have no biases"),
        ("sliding_window", m.sliding_window is not None, "it attends to the whole context"),
        ("residual", m.residual != "sequential", "it is built for the sequential residual"),
    ):
        require(
            not on,
            f"model.{key}={getattr(m, key)}: not supported with model.attention=mla ({why})",
        )
    tp = cfg.parallel.tensor
    require(
        m.n_heads % tp == 0,
        f"parallel.tensor={tp}: must divide model.n_heads={m.n_heads} (MLA splits heads)",
    )


def check_rope_scaling(scaling: Optional[dict]) -> None:
    """One-line ConfigError unless ``model.rope_scaling`` is null or a complete llama3/yarn spec."""
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    require(
        kind in ROPE_SCALING_KEYS,
        f"model.rope_scaling.rope_type={kind!r}: must be one of "
        f"{', '.join(ROPE_SCALING_KEYS)} (or rope_scaling: null)",
    )
    required, optional = ROPE_SCALING_KEYS[kind]
    missing = sorted(required - set(scaling))
    require(not missing, f"model.rope_scaling: rope_type {kind} needs {', '.join(missing)}")
    unknown = sorted(set(scaling) - required - optional - {"rope_type"})
    require(
        not unknown,
        f"model.rope_scaling.{unknown[0] if unknown else ''}: unknown for "
        f"rope_type {kind} (known: {', '.join(sorted(required | optional))})",
    )
    for key in sorted((required | optional) & set(scaling)):
        value = scaling[key]
        if key == "truncate":
            require(
                isinstance(value, bool), f"model.rope_scaling.truncate={value!r}: expected bool"
            )
        elif value is not None or key in required:
            require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"model.rope_scaling.{key}={value!r}: expected a positive number",
            )
    if kind == "llama3":
        require(
            scaling["high_freq_factor"] > scaling["low_freq_factor"],
            "model.rope_scaling: high_freq_factor must exceed low_freq_factor",
        )


def check_moe(cfg: Config) -> None:
    m, moe = cfg.model, cfg.model.moe
    positive("model.moe.interval", moe.interval, allow_zero=True)
    if moe.interval == 0:
        return
    require(
        moe.interval <= m.n_layers,
        f"model.moe.interval={moe.interval}: no block would be "
        f"MoE with model.n_layers={m.n_layers}",
    )
    positive("model.moe.num_experts", moe.num_experts)
    require(1 <= moe.top_k <= 8, f"model.moe.top_k={moe.top_k}: must be in 1..8")
    require(
        moe.top_k <= moe.num_experts,
        f"model.moe.top_k={moe.top_k}: more than model.moe.num_experts={moe.num_experts}",
    )
    for key in ("d_expert", "d_shared"):
        positive(f"model.moe.{key}", getattr(moe, key))
    for key in (
        "num_shared_experts",
        "aux_loss_coef",
        "z_loss_coef",
        "bias_update_rate",
        "first_dense",
    ):
        positive(f"model.moe.{key}", getattr(moe, key), allow_zero=True)
    positive("model.moe.routed_scaling_factor", moe.routed_scaling_factor)
    positive("model.moe.num_groups", moe.num_groups)
    positive("model.moe.top_groups", moe.top_groups)
    groups = moe.num_groups
    require(
        moe.num_experts % groups == 0,
        f"model.moe.num_groups={groups}: must divide model.moe.num_experts={moe.num_experts}",
    )
    top_groups = groups if moe.top_groups is None else moe.top_groups
    require(
        top_groups <= groups,
        f"model.moe.top_groups={moe.top_groups}: more than model.moe.num_groups={groups}",
    )
    require(
        groups == 1 or moe.num_experts // groups >= 2,
        f"model.moe.num_groups={groups}: a group is ranked by its two best experts, so each "
        f"needs >= 2 of the {moe.num_experts}",
    )
    require(
        top_groups * (moe.num_experts // groups) >= moe.top_k,
        f"model.moe.top_groups={top_groups}: the groups kept hold fewer than "
        f"model.moe.top_k={moe.top_k} experts",
    )
    require(
        m.moe_layers > 0,
        f"model.moe.first_dense={moe.first_dense}: no block would be MoE with "
        f"model.n_layers={m.n_layers}",
    )
    require(
        not moe.shared_gate or moe.num_shared_experts > 0,
        "model.moe.shared_gate=true: gates the shared experts; set "
        "model.moe.num_shared_experts > 0",
    )
    if moe.dropless:
        require(
            moe.capacity_factor is None,
            f"model.moe.capacity_factor={moe.capacity_factor}: a capacity drops tokens; set "
            "model.moe.dropless=false to use it (or capacity_factor: null)",
        )
    else:
        require(
            moe.capacity_factor is not None,
            "model.moe.dropless=false: needs model.moe.capacity_factor (e.g. 1.25)",
        )
        positive("model.moe.capacity_factor", moe.capacity_factor)
    tp = cfg.parallel.tensor
    if tp > 1:
        require(
            m.expert_dim % tp == 0,
            f"parallel.tensor={tp}: must divide the expert FFN width "
            f"{m.expert_dim} (model.moe.d_expert)",
        )
        require(
            m.shared_dim % tp == 0,
            f"parallel.tensor={tp}: must divide the shared experts' FFN width {m.shared_dim}",
        )
    if cfg.parallel.pipeline > 1:
        require(
            (moe.aux_loss_coef == 0 and moe.z_loss_coef == 0) or cfg.train.precision != "fp16",
            f"model.moe.aux_loss_coef/z_loss_coef with parallel.pipeline="
            f"{cfg.parallel.pipeline} and train.precision=fp16: the stages' router losses join "
            "the backward unscaled by the fp16 loss scale; use bf16 or set both to 0",
        )
    ep = cfg.parallel.expert
    require(
        cfg.parallel.zero_stage < 3 or ep == 1,
        f"model.moe with parallel.zero_stage=3 and parallel.expert={ep}: DeepSpeed's ZeRO-3 "
        "partitions every parameter over the whole data-parallel group and refuses expert "
        "groups for any MoE layer but its own AutoEP, so each rank's experts would be "
        "assembled from other ranks' different experts; use zero_stage 1 or 2 (they partition "
        "experts over their expert-data group) or parallel.expert=1",
    )
