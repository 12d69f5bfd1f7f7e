"""Config: every shipped config loads; every bad value is refused with the key and the rule."""

from __future__ import annotations

import dataclasses

import pytest

from megaformer.analysis.params import count_parameters
from megaformer.config import (
    SECTIONS,
    Config,
    apply_overrides,
    config_from_dict,
    describe_keys,
    load_config,
    validate_for_world,
)
from megaformer.errors import ConfigError
from tests.helpers import ROOT, assert_one_line_error, cli_main, run_cli

PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "llama-1b": 1_235_814_400,
    "llama-7b": 6_738_415_616,
    "llama-70b": 68_976_648_192,
}


@pytest.mark.parametrize("name", ["quickstart", "gpt2-124m", "llama-1b", "llama-7b", "llama-70b"])
def test_shipped_configs_load_and_count(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert cfg.name == name
    if name in PUBLISHED:
        assert count_parameters(cfg.model)["total"] == PUBLISHED[name]
    else:
        vocab = dataclasses.replace(cfg.model, vocab_size=257)
        assert 5_000_000 <= count_parameters(vocab)["total"] <= 20_000_000


def test_overrides_are_typed_and_applied():
    cfg = load_config(
        ROOT / "configs/quickstart.yaml",
        [
            "model.n_layers=4",
            "train.steps=50",
            "train.lr=1e-3",
            "log.interval=5",
            "checkpoint.interval=7",
            "eval.interval=3",
            "parallel.zero_stage=2",
            "train.seed=9",
            "model.n_kv_heads=null",
            "parallel.tensor=1",
            "parallel.pipeline=1",
        ],
    )
    assert (cfg.model.n_layers, cfg.train.steps, cfg.train.lr) == (4, 50, 1e-3)
    assert (cfg.log.interval, cfg.checkpoint.interval, cfg.eval.interval) == (5, 7, 3)
    assert cfg.parallel.zero_stage == 2 and cfg.train.seed == 9 and cfg.model.n_kv_heads is None
    assert cfg.model.kv_heads == cfg.model.n_heads


def test_defaults_follow_the_paper():
    m = Config().model
    assert m.head_dim * m.n_heads == m.d_model
    gelu = dataclasses.replace(m, activation="gelu")
    assert gelu.ffn_dim == 4 * gelu.d_model


BAD = [
    ({"model": {"bogus": 1}}, "unknown config key 'model.bogus'"),
    ({"modle": {}}, "unknown config section 'modle'"),
    ({"model": {"d_model": "big"}}, "model.d_model='big': expected int"),
    ({"model": {"d_model": 1.5}}, "model.d_model=1.5: expected int"),
    ({"train": {"lr": True}}, "train.lr=True: expected float"),
    (
        {"model": {"d_model": 100, "n_heads": 3}},
        "model.d_model=100: must be divisible by model.n_heads=3",
    ),
    (
        {"model": {"n_heads": 4, "n_kv_heads": 3, "d_model": 64}},
        "model.n_heads=4: must be divisible by model.n_kv_heads=3",
    ),
    ({"model": {"position": "alibi"}}, "model.position='alibi': must be one of"),
    (
        {"model": {"max_seq_len": 64}, "data": {"seq_len": 128}},
        "data.seq_len=128: longer than model.max_seq_len=64",
    ),
    (
        {"train": {"micro_batch_size": 3, "global_batch_size": 8}},
        "train.global_batch_size=8: must be a multiple of train.micro_batch_size=3",
    ),
    ({"train": {"steps": 0}}, "train.steps=0: must be > 0"),
    ({"parallel": {"zero_stage": 4}}, "parallel.zero_stage=4: must be one of 0, 1, 2, 3"),
    (
        {"parallel": {"tensor": 3}, "model": {"d_model": 64, "n_heads": 4}},
        "parallel.tensor=3: must divide model.n_heads=4",
    ),
    (
        {"parallel": {"tensor": 4}, "model": {"d_model": 64, "n_heads": 8, "n_kv_heads": 2}},
        "must divide the key/value heads (model.n_kv_heads=2)",
    ),
    (
        {"parallel": {"tensor": 2}, "model": {"d_model": 64, "n_heads": 4, "d_ffn": 129}},
        "must divide the FFN width 129",
    ),
    (
        {
            "parallel": {"tensor": 2, "sequence_parallel": True},
            "model": {"d_model": 64, "n_heads": 4, "max_seq_len": 64},
            "data": {"seq_len": 33},
        },
        "sequence length 33 must be divisible by parallel.tensor=2",
    ),
    (
        {"parallel": {"tensor": 2, "zero_stage": 3}, "model": {"d_model": 64, "n_heads": 4}},
        "ZeRO-3",
    ),
    (
        {"parallel": {"pipeline": 2, "zero_stage": 2}},
        "does not support ZeRO-2/3; use parallel.zero_stage=1",
    ),
    ({"parallel": {"pipeline": 8}, "model": {"n_layers": 4}}, "more stages than model.n_layers=4"),
    ({"parallel": {"pipeline": 2}, "train": {"precision": "bf16"}}, "needs parallel.zero_stage=1"),
    (
        {"parallel": {"pipeline": 2, "pipeline_partition": "3,2"}, "model": {"n_layers": 4}},
        "parallel.pipeline_partition='3,2'",
    ),
    (
        {"parallel": {"pipeline": 2, "pipeline_schedule": "dualpipev"}, "model": {"n_layers": 3}},
        "more stages than model.n_layers=3 (dualpipev cuts the blocks into 2 * pipeline = 4",
    ),
    (
        {
            "parallel": {
                "pipeline": 2,
                "pipeline_schedule": "interleaved",
                "pipeline_virtual_stages": 3,
            },
            "model": {"n_layers": 4},
        },
        "more stages than model.n_layers=4 (interleaved cuts the blocks into 3 * pipeline = 6",
    ),
    (
        {
            "parallel": {
                "pipeline": 2,
                "pipeline_schedule": "interleaved",
                "pipeline_virtual_stages": 1,
            }
        },
        "parallel.pipeline_virtual_stages=1: the interleaved schedule needs at least 2 stages",
    ),
    (
        {
            "parallel": {"pipeline": 2, "pipeline_schedule": "interleaved"},
            "model": {"n_layers": 6},
        },
        "cuts model.n_layers=6 into pipeline * virtual stages = 4 stages of equal work",
    ),
    (
        {"parallel": {"pipeline_schedule": "interleaved"}},
        "parallel.pipeline_schedule=interleaved: needs a pipeline (parallel.pipeline > 1)",
    ),
    (
        {
            "parallel": {
                "pipeline": 2,
                "pipeline_schedule": "dualpipev",
                "pipeline_partition": "2,2",
            }
        },
        "expected 'layers', 'parameters' or 4 positive block counts",
    ),
    ({"parallel": {"pipeline_schedule": "dualpipev"}}, "needs a pipeline (parallel.pipeline > 1)"),
    ({"parallel": {"pipeline_schedule": "zb"}}, "parallel.pipeline_schedule"),
    (
        {
            "parallel": {"pipeline": 2, "pipeline_schedule": "dualpipev"},
            "deepspeed": {"pipeline": {"pipe_partitioned": True}},
        },
        "dualpipev with deepspeed.pipeline.pipe_partitioned/grad_partitioned: this schedule sends",
    ),
    (
        {
            "parallel": {"pipeline": 2},
            "train": {"precision": "fp16"},
            "model": {"moe": {"interval": 1, "aux_loss_coef": 0.01}},
        },
        "unscaled by the fp16 loss scale",
    ),
    (
        {"parallel": {"pipeline": 2, "context": 2}, "model": {"document_mask": True}},
        "use one of pipeline or context parallelism",
    ),
    ({"model": {"dropout": 1.0}}, "model.dropout=1.0: must be in [0, 1)"),
    ({"deepspeed": {"train_batch_size": 4}}, "deepspeed.train_batch_size: derived by megaformer"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "set parallel.zero_stage instead"),
    ({"train": {"lr": 1e-3, "min_lr": 1e-2}}, "train.min_lr=0.01: must not exceed train.lr=0.001"),
]


@pytest.mark.parametrize("raw,message", BAD)
def test_bad_values_are_refused_with_key_and_rule(raw, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("schedule", ["interleaved", "dualpipev"])
def test_diagnostics_and_task_evaluation_run_under_every_schedule(schedule):
    """Both walk the stages in order whatever schedule holds them: no refusal."""
    cfg = config_from_dict(
        {
            "model": {"n_layers": 4},
            "parallel": {"pipeline": 2, "pipeline_schedule": schedule},
            "log": {"diagnostics": True},
            "eval": {"tasks": ["x"]},
        }
    )
    assert cfg.log.diagnostics and cfg.eval.tasks == ["x"]


def test_world_size_checks():
    cfg = config_from_dict({"train": {"micro_batch_size": 2, "global_batch_size": 8}})
    assert validate_for_world(cfg, 1) == 4
    assert validate_for_world(cfg, 2) == 2
    with pytest.raises(ConfigError, match="micro_batch_size \\* data-parallel size = 2 \\* 3 = 6"):
        validate_for_world(cfg, 3)


def test_interleaved_needs_a_multiple_of_pipeline_micro_batches():
    cfg = config_from_dict(
        {
            "parallel": {"pipeline": 2, "pipeline_schedule": "interleaved"},
            "train": {"micro_batch_size": 2, "global_batch_size": 12},
        }
    )
    assert validate_for_world(cfg, 2) == 6  # 6 micro-batches: a multiple of pipeline = 2
    with pytest.raises(ConfigError) as e:
        validate_for_world(cfg, 4)  # DP 2: 3 micro-batches per step
    assert "needs a multiple of pipeline = 2 micro-batches per step, got 3" in str(e.value)
    assert "\n" not in str(e.value)


def test_dualpipev_needs_two_micro_batches_per_rank():
    cfg = config_from_dict(
        {
            "parallel": {"pipeline": 2, "pipeline_schedule": "dualpipev"},
            "train": {"micro_batch_size": 2, "global_batch_size": 8},
        }
    )
    assert validate_for_world(cfg, 2) == 4  # 4 micro-batches = 2 * pipeline
    with pytest.raises(ConfigError) as e:
        validate_for_world(cfg, 4)  # DP 2: 2 micro-batches per step
    assert "needs at least 2 * pipeline = 4 micro-batches per step, got 2" in str(e.value)
    assert "\n" not in str(e.value)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["train.steps"])
    with pytest.raises(ConfigError, match="key must be dotted"):
        apply_overrides({}, ["steps=5"])


def test_every_key_is_documented():
    rows = describe_keys()
    n_fields = sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    from megaformer.config import MLAConfig, MoEConfig

    n_fields += len(dataclasses.fields(MoEConfig)) - 1  # model.moe: a row per nested key
    n_fields += len(dataclasses.fields(MLAConfig)) - 1  # model.mla too
    assert len(rows) == n_fields + 1
    assert all(doc.strip() for _, _, _, doc in rows)
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = [key for key, *_ in rows if f"`{key}`" not in reference]
    assert not missing, f"docs/configuration.md lacks config keys: {missing}"


def test_resolved_config_round_trips():
    cfg = load_config(ROOT / "configs/llama-70b.yaml")
    import yaml

    again = config_from_dict(yaml.safe_load(cfg.to_yaml()), name=cfg.name)
    assert again == cfg


def test_cli_config_errors_are_one_line(tmp_path):
    assert_one_line_error(cli_main("train", str(tmp_path / "nope.yaml")), "config file not found")
    assert_one_line_error(
        cli_main("train", "configs/quickstart.yaml", "model.d_model=100"),
        "model.d_model=100",
        "divisible",
    )
    assert_one_line_error(
        cli_main("train", "configs/quickstart.yaml", "model.layers=3"),
        "unknown config key 'model.layers'",
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    assert_one_line_error(cli_main("train", str(bad)), "not valid YAML")


def test_cli_config_error_exit_code_in_a_fresh_process(tmp_path):
    """The contract as a shell sees it: exit status 2, one line on stderr, no traceback."""
    assert_one_line_error(
        run_cli("train", "configs/quickstart.yaml", "model.layers=3", fresh=True),
        "unknown config key 'model.layers'",
    )


def test_cli_dry_run_reports_parameter_count():
    out = cli_main("train", "configs/llama-7b.yaml", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "6,738,415,616 total" in out.stdout


def test_help_lists_config_keys():
    out = cli_main("train", "--help-config")
    assert out.returncode == 0
    for key, *_ in describe_keys():
        assert key in out.stdout


# ----------------------------------------------------------------------------- the package's shape


def test_a_misspelled_choice_is_one_line_naming_the_allowed_values():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"position": "ropes"}})
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (
        "model.position='ropes': must be one of sinusoidal, learned, rope, none, "
        "did you mean 'rope'?"
    )
    with pytest.raises(ConfigError, match=r"^parallel.zero_stage=4: must be one of 0, 1, 2, 3$"):
        config_from_dict({"parallel": {"zero_stage": 4}})
    assert_one_line_error(
        cli_main("train", "configs/quickstart.yaml", "train.precision=bf61", "--dry-run"),
        "train.precision='bf61'",
        "must be one of fp32, bf16, fp16",
        "did you mean 'bf16'?",
    )


def test_choices_are_declared_once_as_literal_types():
    import typing

    from megaformer.config.fields import choices

    declared = {}
    moe = typing.get_type_hints(SECTIONS["model"])["moe"]
    for section, cls in {**SECTIONS, "model.moe": moe}.items():
        for f in dataclasses.fields(cls):
            assert "choices" not in f.metadata  # the annotation is the one declaration
            allowed = choices(typing.get_type_hints(cls)[f.name])
            if allowed:
                declared[f"{section}.{f.name}"] = allowed
    assert len(declared) == 21  # model.attention: mha | mla among them
    assert declared["parallel.pipeline_schedule"] == ("1f1b", "interleaved", "dualpipev")
    assert declared["model.attention"] == ("mha", "mla")
    assert declared["train.precision"] == ("fp32", "bf16", "fp16")
    assert declared["parallel.expert_dispatch"] == ("auto", "splits", "padded")
    assert declared["parallel.zero_stage"] == (0, 1, 2, 3)
    reference = {key: doc for key, _, _, doc in describe_keys()}
    for key, allowed in declared.items():  # the reference (and --help-config) lists them
        assert reference[key].endswith(" One of: " + ", ".join(map(str, allowed)) + ".")


def test_head_dim_is_a_property_of_the_class():
    from megaformer.config import ModelConfig

    prop = vars(ModelConfig)["head_dim"]
    assert isinstance(prop, property) and prop.fget.__qualname__ == "ModelConfig.head_dim"
    m = ModelConfig(d_model=64, n_heads=4)
    assert (m.head_dim, m.configured_head_dim) == (16, None)
    wide = ModelConfig(d_model=64, n_heads=4, head_dim=32)
    assert (wide.head_dim, wide.configured_head_dim) == (32, 32)
    assert ModelConfig(**m.__dict__) == m and ModelConfig(**m.__dict__).configured_head_dim is None
    assert Config(model=m).to_dict()["model"]["head_dim"] is None


def test_one_map_from_precision_to_dtype():
    import ast

    import torch

    from megaformer.config import precision_dtype

    assert [precision_dtype(p) for p in ("fp32", "bf16", "fp16")] == [
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ]
    maps = []
    for path in sorted((ROOT / "megaformer").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Dict)
                and any(isinstance(k, ast.Constant) and k.value == "bf16" for k in node.keys)
                and any(isinstance(v, ast.Attribute) and v.attr == "bfloat16" for v in node.values)
            ):
                maps.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert maps == ["megaformer/config/train.py:24"]


def test_the_old_kernels_key_is_read_with_one_warning(caplog):
    import megaformer.config.loading as loading

    loading._warned.clear()
    with caplog.at_level("WARNING", logger="megaformer"):
        saved = config_from_dict({"model": {"fused_kernels": "torch"}})  # e.g. a checkpoint's
        assert caplog.records == []
        first = load_config(ROOT / "configs" / "quickstart.yaml", ["model.fused_kernels=torch"])
        again = load_config(ROOT / "configs" / "quickstart.yaml", ["model.fused_kernels=torch"])
    assert saved.model.kernels == first.model.kernels == again.model.kernels == "torch"
    warnings = [r.getMessage() for r in caplog.records if "fused_kernels" in r.getMessage()]
    assert warnings == [
        "model.fused_kernels is now called model.kernels; the old name will stop "
        "working in a later release"
    ]
    assert "fused_kernels" not in saved.to_yaml() and "kernels: torch" in saved.to_yaml()
    with pytest.raises(ConfigError, match="model.fused_kernels and model.kernels: the same key"):
        config_from_dict({"model": {"fused_kernels": "torch", "kernels": "auto"}})
    with pytest.raises(
        ConfigError, match=r"^model.fused_kernels='cuda': must be one of auto, torch"
    ):
        config_from_dict({"model": {"fused_kernels": "cuda"}})


def test_preflight_runs_once_per_train(tmp_path, monkeypatch):
    """``megaformer train`` checks the world and the device once: preflight, and inside it the
    DeepSpeed rule and the FP8 device check, each exactly once (wherever a module imported them)."""
    import sys

    import megaformer.config.preflight as pf
    from megaformer.parallel import fp8
    from tests.helpers import tiny_overrides

    calls = {
        "preflight": 0,
        "validate_for_training": 0,
        "validate_for_world": 0,
        "check_fp8_device": 0,
        "model_plan": 0,
    }
    originals = {
        "preflight": pf.preflight,
        "validate_for_training": pf.validate_for_training,
        "validate_for_world": pf.validate_for_world,
        "check_fp8_device": fp8.check_fp8_device,
        "model_plan": pf.model_plan,
    }

    def counting(name):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return wrapper

    for module in [m for name, m in sys.modules.items() if name.startswith("megaformer")]:
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counting(name))
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        "train.steps=1",
        "eval.at_end=false",
        "checkpoint.save_at_end=false",
        "train.device=cpu",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert calls == {
        "preflight": 1,
        "validate_for_training": 1,
        "validate_for_world": 1,
        "check_fp8_device": 1,
        "model_plan": 1,
    }
