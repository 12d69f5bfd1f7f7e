"""The end-of-run text sample comes from the training model itself: no second model is built, the
text is the one a whole copy of the trained weights generates, and the model is left in train
mode."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, _cli_environment, tiny_overrides

pytestmark = pytest.mark.slow


def test_sample_from_the_training_model(tmp_path, monkeypatch):
    from megaformer.config import load_config
    from megaformer.generation import generate_text
    from megaformer.parallel.build import build_model
    from megaformer.parallel.plan import full_state_dict
    from megaformer.training import trainer as trainer_module

    builds = []

    def counted(*a, **kw):
        builds.append(kw.get("training", True))
        return build_model(*a, **kw)

    monkeypatch.setattr(trainer_module, "build_model", counted)
    cfg = load_config(
        ROOT / "configs/quickstart.yaml",
        tiny_overrides(
            **{
                "train.steps": 2,
                "log.sample_tokens": 12,
                "eval.interval": 0,
                "eval.at_end": "false",
            }
        ),
    )
    with _cli_environment(None, None):
        t = trainer_module.Trainer(cfg, tmp_path / "run")
        try:
            t.setup()
            result = t.run()
            assert builds == [True]  # the training model only
            assert t.engine.module.training
            # the text a whole copy of the trained weights generates (how it was made before)
            copy = build_model(
                t.cfg,
                weights=full_state_dict(t.engine.module, t.topo),
                weights_source="test",
                training=False,
            ).model
            expected = generate_text(
                copy,
                t.tokenizer,
                t.cfg.log.sample_prompt,
                12,
                temperature=0.8,
                top_k=40,
                seed=t.cfg.train.seed,
            )
        finally:
            t.run_lock.release()
    assert result.sample == expected and result.sample.startswith(t.cfg.log.sample_prompt)
