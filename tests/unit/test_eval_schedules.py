"""``megaformer eval``/``generate`` build a checkpoint's pipeline at the schedule asked for
(--schedule, --virtual-stages), whichever trained it; impossible requests are one-line errors."""

from __future__ import annotations

import pytest

from megaformer.config import config_from_dict
from megaformer.errors import UserError
from megaformer.evaluation.checkpoint import eval_layout
from megaformer.parallel.topology import Degrees
from tests.helpers import assert_one_line_error, cli_main


def _trained(schedule: str) -> object:
    """4 blocks trained at PP = 2 under ``schedule``, split explicitly into its stages."""
    split = "2,2" if schedule == "1f1b" else "1,1,1,1"
    return config_from_dict(
        {
            "model": {"n_layers": 4},
            "parallel": {
                "pipeline": 2,
                "pipeline_schedule": schedule,
                "pipeline_partition": split,
            },
        }
    )


@pytest.mark.parametrize("trained", ["1f1b", "dualpipev", "interleaved"])
@pytest.mark.parametrize("asked", ["1f1b", "interleaved", "dualpipev"])
def test_the_checkpoint_is_laid_out_at_the_schedule_asked(trained, asked):
    p = eval_layout(_trained(trained), Degrees(pp=2), asked, 2).parallel
    assert (p.pipeline, p.pipeline_schedule, p.pipeline_virtual_stages) == (2, asked, 2)
    assert p.pipeline_partition == "layers"  # the training split names other stages


@pytest.mark.parametrize(
    "pp,schedule,v,message",
    [
        (1, "dualpipev", 2, "pipeline schedule 'dualpipev' at pipeline size 1: use 1f1b"),
        (2, "interleaved", 1, "1 virtual stages: the interleaved schedule needs 2 or more"),
        (4, "dualpipev", 2, "--pp 4 under the dualpipev schedule: 8 stages for the checkpoint's 4"),
        (2, "interleaved", 3, "6 stages for the checkpoint's 4 blocks"),
        (2, "zb", 2, "pipeline schedule 'zb'"),
    ],
)
def test_impossible_layouts_are_one_line_errors(pp, schedule, v, message):
    with pytest.raises(UserError) as e:
        eval_layout(_trained("1f1b"), Degrees(pp=pp), schedule, v)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_multi_token_prediction_is_refused_under_dualpipev_as_in_training():
    cfg = config_from_dict({"model": {"n_layers": 4, "mtp_depth": 1}})
    assert eval_layout(cfg, Degrees(pp=2), "interleaved").parallel.pipeline_virtual_stages == 2
    with pytest.raises(UserError, match="dualpipev schedule with multi-token prediction"):
        eval_layout(cfg, Degrees(pp=2), "dualpipev")


def test_the_flags_are_checked_before_anything_starts(tmp_path):
    for command in (["eval", str(tmp_path), "--tasks", "x"], ["generate", str(tmp_path)]):
        assert_one_line_error(
            cli_main(*command, "--schedule", "interleaved"),
            "--schedule interleaved: needs a pipeline (--pp 2 or more)",
        )
        assert_one_line_error(
            cli_main(*command, "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "1"),
            "--virtual-stages 1: --schedule interleaved needs 2 or more",
        )
