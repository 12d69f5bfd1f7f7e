"""``megaformer generate`` samples by default (greedy on request) with a thread count that does
not oversubscribe the cores."""

from __future__ import annotations

import os

import pytest

from megaformer import generation


def test_generate_samples_by_default_greedy_on_request():
    from megaformer.cli import build_parser
    from megaformer.cli.generate import sampling_temperature

    parser = build_parser()
    args = parser.parse_args(["generate", "runs/x"])
    assert (sampling_temperature(args), args.top_k, args.greedy) == (0.8, 40, False)
    assert sampling_temperature(parser.parse_args(["generate", "runs/x", "--greedy"])) == 0.0
    assert (
        sampling_temperature(parser.parse_args(["generate", "runs/x", "--temperature", "0"])) == 0
    )
    assert sampling_temperature(parser.parse_args(["generate", "runs/x", "--pp", "2"])) == 0.0


@pytest.mark.parametrize(
    "omp,load,cores,expected",
    [
        ("3", 0.0, 8, 3),  # OMP_NUM_THREADS wins
        (None, 0.2, 8, 8),  # idle machine: every physical core
        (None, 5.6, 8, 2),  # 8 cores, load 5.6: the 2 idle ones
        (None, 7.9, 2, 1),  # busier than its cores: one thread, never zero
        (None, 1.0, 2, 1),
    ],
)
def test_decoding_threads(monkeypatch, omp, load, cores, expected):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(generation, "physical_cores", lambda: cores)
    env = {} if omp is None else {"OMP_NUM_THREADS": omp}
    assert generation.decoding_threads(env) == expected


def test_cpu_threads_restores_the_count():
    import torch

    before = torch.get_num_threads()
    with generation.cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with generation.cpu_threads(None):
        assert torch.get_num_threads() == before
