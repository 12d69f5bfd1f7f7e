"""The ``data`` section: where the tokens come from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaformer.config.fields import option
from megaformer.errors import ConfigError


@dataclass
class DataConfig:
    """Where the tokens come from."""

    source: str = option(
        "stdlib",
        "Training text: 'stdlib' (the .py files of the running Python's standard library, "
        "always present), a folder (its .txt/.md/.py/.json/.jsonl files), or one .txt or "
        ".jsonl file.",
    )
    tokenizer: str = option(
        "byte",
        "'byte' (256 byte values + end-of-document), 'bpe:N' (byte-level BPE with N tokens "
        "trained on the source with HF tokenizers), or a path to a HF tokenizer.json.",
    )
    text_field: str = option("text", "Field holding the text in .json/.jsonl records.")
    seq_len: Optional[int] = option(None, "Training sequence length; null = model.max_seq_len.")
    valid_fraction: float = option(0.05, "Fraction of documents held out for validation.")
    max_bytes: Optional[int] = option(
        None,
        "Read at most this many characters of text (null = all): of data.source, and of "
        "each data.paths source prepared on the fly (not of already prepared .bin/.idx).",
    )
    paths: Optional[list[str]] = option(
        None,
        "The Megatron-style pipeline: a list of prepared datasets (PREFIX of PREFIX.bin + "
        "PREFIX.idx, from `megaformer prepare-data`, Megatron-LM or GPT-NeoX) or sources that are "
        "prepared on the fly with data.tokenizer and cached under data.cache_dir (local "
        ".json/.jsonl/.parquet/.txt/.arrow files, globs or folders, 'stdlib', or a Hugging Face "
        "hub dataset hf:NAME[:CONFIG][@SPLIT], streamed: only the hf: prefix reaches the "
        "network, an entry naming nothing local is an error). Samples of "
        "seq_len + 1 tokens are packed across documents and shuffled per epoch. "
        "null or [] = the in-memory path over data.source.",
    )
    weights: Optional[list[float]] = option(
        None,
        "Blend weights, one per data.paths entry (normalised to sum 1; each dataset's count in "
        "any prefix of the sample stream stays within one sample of weight * length); null = "
        "proportional to each dataset's tokens.",
    )
    split: Optional[str] = option(
        None,
        "data.paths only: train,valid,test ratios over each dataset's documents (contiguous "
        "ranges, Megatron style, e.g. '969,30,1'); null = (1 - valid_fraction), valid_fraction, 0.",
    )
    cache_dir: Optional[str] = option(
        None,
        "data.paths only: folder for the cached document/sample/shuffle indices and the data "
        "prepared on the fly (keyed by a hash of the settings; share it between runs); "
        "null = RUN_DIR/data_cache.",
    )
    prefetch: int = option(
        2,
        "Optimizer steps of batches a background thread reads ahead (0 = read in the loop); "
        "on CUDA the thread also pins them, so the copies to the GPU are asynchronous.",
    )

    def __post_init__(self) -> None:
        if self.paths is not None and any(not p.strip() for p in self.paths):
            raise ConfigError(f"data.paths={self.paths!r}: entries must be non-empty")
        if self.weights is not None:
            n = len(self.paths or [])
            if len(self.weights) != n:
                raise ConfigError(
                    f"data.weights={self.weights!r}: needs one weight per data.paths entry ({n})"
                )
            if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise ConfigError(
                    f"data.weights={self.weights!r}: weights must be >= 0 with a positive sum"
                )
        if self.split is not None:
            try:
                ratios = [float(x) for x in self.split.split(",")]
            except ValueError:
                ratios = []
            if not 1 <= len(ratios) <= 3 or any(r < 0 for r in ratios) or sum(ratios) <= 0:
                raise ConfigError(
                    f"data.split={self.split!r}: expected up to three non-negative "
                    "ratios train,valid,test, e.g. '969,30,1'"
                )
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.prefetch}: must be >= 0")
