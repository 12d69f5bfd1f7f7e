"""Loads the JSONL files beside this file (paths resolve relative to the task YAMLs, not to the
working directory): ``custom_dataset: !function local_data.<name>`` in a task YAML."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _jsonl(name: str, **_: object) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(HERE / name)})


def mc(**kwargs: object) -> datasets.DatasetDict:
    return _jsonl("code_mc.jsonl", **kwargs)


def ppl(**kwargs: object) -> datasets.DatasetDict:
    return _jsonl("code_ppl.jsonl", **kwargs)


def gen(**kwargs: object) -> datasets.DatasetDict:
    return _jsonl("code_gen.jsonl", **kwargs)
