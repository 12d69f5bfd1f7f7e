"""The whole run: the sections, by name, and :class:`Config` that holds one of each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import yaml

from megaformer.config.checkpoint import CheckpointConfig
from megaformer.config.data import DataConfig
from megaformer.config.evaluation import EvalConfig
from megaformer.config.log import LogConfig
from megaformer.config.model import ModelConfig
from megaformer.config.parallel import ParallelConfig
from megaformer.config.train import TrainConfig

SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
}


@dataclass
class Config:
    """The whole run: see each section's class for its keys."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    deepspeed: dict = field(default_factory=dict)
    name: str = "megaformer"

    @property
    def seq_len(self) -> int:
        return self.data.seq_len if self.data.seq_len is not None else self.model.max_seq_len

    def to_dict(self) -> dict:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["model"]["head_dim"] = self.model.configured_head_dim  # as configured (null: d/h)
        out["deepspeed"] = dict(self.deepspeed)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
