"""Learning-rate schedules at hand-computed points."""

import math

import pytest

from megaformer.config import TrainConfig
from megaformer.training.schedule import lr_at


def cfg(**kw):
    base = dict(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    base.update(kw)
    return TrainConfig(**base)


def test_warmup_is_linear():
    t = cfg()
    assert [lr_at(s, t) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])


def test_cosine():
    t = cfg(lr_schedule="cosine")
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(55, t) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, t) == pytest.approx(0.1)


def test_linear():
    t = cfg(lr_schedule="linear")
    assert lr_at(55, t) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(100, t) == pytest.approx(0.1)


def test_wsd_holds_then_decays():
    t = cfg(lr_schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, t) == 1.0 and lr_at(79, t) == 1.0
    assert lr_at(90, t) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(100, t) == pytest.approx(0.1)


def test_constant():
    t = cfg(lr_schedule="constant")
    assert lr_at(10, t) == lr_at(99, t) == 1.0
