"""The command line takes what people type: overrides and flags in any order, typo suggestions."""

from __future__ import annotations

import pytest

from tests.helpers import cli_main


@pytest.mark.parametrize(
    "args",
    [
        ["train", "configs/quickstart.yaml", "--dry-run", "train.steps=7", "model.n_layers=3"],
        ["train", "configs/quickstart.yaml", "train.steps=7", "--dry-run", "model.n_layers=3"],
        ["train", "--dry-run", "configs/quickstart.yaml", "train.steps=7", "model.n_layers=3"],
    ],
)
def test_overrides_and_flags_in_any_order(args):
    proc = cli_main(*args)
    assert proc.returncode == 0, proc.stderr
    assert "steps: 7" in proc.stdout and "n_layers: 3" in proc.stdout


def test_flops_takes_overrides_after_flags():
    proc = cli_main("flops", "configs/quickstart.yaml", "--json", "model.n_layers=3")
    assert proc.returncode == 0, proc.stderr
    proc2 = cli_main("flops", "configs/quickstart.yaml", "model.n_layers=3", "--json")
    assert proc2.returncode == 0 and proc.stdout == proc2.stdout


def test_typo_gets_did_you_mean_and_unknown_flags_are_named():
    proc = cli_main("train", "configs/quickstart.yaml", "--dry-run", "model.n_layer=2")
    assert proc.returncode == 2
    assert "did you mean 'model.n_layers'?" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli_main("train", "configs/quickstart.yaml", "--dry-run", "train.steps=5", "--bogus")
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr
    proc = cli_main("train", "configs/quickstart.yaml", "--dry-run", "trian.steps=5")
    assert proc.returncode == 2 and "did you mean 'train'?" in proc.stderr
