"""``megaformer convert``: megaformer checkpoint <-> Hugging Face model folder, streamed.

Export (``--to hf``) reads a checkpoint's ``model.safetensors`` (unsharded and unpadded whatever
TP/PP/DP/ZeRO layout trained it), ``config.yaml`` and ``tokenizer.json`` and writes a folder that
``transformers.AutoModelForCausalLM.from_pretrained`` loads: safetensors shard(s) (+ index),
``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``.

Import (``--to megaformer``) reads a Hugging Face folder (safetensors only; ``config.json``,
``tokenizer.json``) and writes a run directory holding a weights-only checkpoint
(``checkpoints/step_0000000``) plus ``config.yaml`` and ``tokenizer.json``, so that
``megaformer train DST/config.yaml --run-dir DST`` continues pretraining at the chosen TP/PP.

Both directions write into a temporary sibling of DST and rename it when complete; an existing,
non-empty DST is refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from megaformer import __version__
from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import weights as ckpt_weights
from megaformer.checkpoint.hf.arch import Architecture
from megaformer.checkpoint.hf.deepseek import DeepseekV3
from megaformer.checkpoint.hf.gpt2 import GPT2
from megaformer.checkpoint.hf.gpt_neox import OUT_NAMES, GPTNeoX
from megaformer.checkpoint.hf.llama import Llama, LlamaFamily
from megaformer.checkpoint.hf.mistral import Mistral
from megaformer.checkpoint.hf.moe import Mixtral, Qwen2Moe, Qwen3Moe
from megaformer.checkpoint.hf.qwen import Qwen2, Qwen3
from megaformer.checkpoint.hf.stream import (
    Entry,
    TensorSource,
    check_inputs,
    output_specs,
    run_plan,
)
from megaformer.checkpoint.hf.tokenizer_files import read_hf_tokenizer, write_hf_tokenizer
from megaformer.checkpoint.hf.verify import DEFAULT_TOLERANCE
from megaformer.checkpoint.hf.verify import verify as verify_logits
from megaformer.checkpoint.router_state import read_router_state, write_router_state
from megaformer.checkpoint.sharded import ShardedWeights
from megaformer.config import (
    PRECISIONS,
    Config,
    ConfigError,
    config_from_dict,
    precision_dtype,
    validate,
)
from megaformer.data.tokenizer import NONE as NO_TOKENIZER
from megaformer.data.tokenizer import load_tokenizer
from megaformer.errors import CheckpointError, ConversionError
from megaformer.runtime.run_lock import check_not_owned
from megaformer.safe_files import check_file, current_umask, read_text_bounded, unreadable_reason

MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_TOKENIZER_BYTES = 1 << 30

log = logging.getLogger("megaformer")

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Llama(),
        GPT2(),
        GPTNeoX(),
        Mistral(),
        Qwen2(),
        Qwen3(),
        Mixtral(),
        Qwen3Moe(),
        Qwen2Moe(),
        DeepseekV3(),
    )
}
BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}
_DTYPE_LABEL = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# a sharded checkpoint holds fp32 master weights: exported in the precision the model trained in


@contextlib.contextmanager
def staged_output(dst: Path) -> Iterator[Path]:
    """A temporary folder beside ``dst`` that becomes ``dst`` when the block succeeds (removed if
    it fails). ``dst`` may not exist yet or be an empty folder; anything else is refused."""
    if dst.is_symlink() or (dst.exists() and (not dst.is_dir() or any(dst.iterdir()))):
        raise ConversionError(f"{dst}: already exists and is not empty; not overwriting it")
    check_not_owned(dst, "convert")  # never into a run directory a live training job owns
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{ckpt_layout.TMP_PREFIX}{dst.name}.", dir=dst.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp's 0700, widened to what mkdir would give
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        dst.rmdir()
    os.rename(tmp, dst)


def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in PRECISIONS:
        raise ConversionError(f"--dtype {name}: expected one of {', '.join(PRECISIONS)}")
    return precision_dtype(name)


def _read_megaformer(src: Path) -> tuple[Path, Config]:
    ckpt = ckpt_layout.resolve_checkpoint(src)
    cfg = ckpt_layout.read_config(ckpt)
    if cfg.model.vocab_size is None:
        raise CheckpointError(f"{ckpt / ckpt_layout.CONFIG}: model.vocab_size is not resolved")
    return ckpt, cfg


def choose_architecture(cfg: Config, arch: Optional[str]) -> Architecture:
    """The requested architecture if it can express the model (else every reason, by name), or the
    first of llama, gpt2, gpt-neox, mistral, qwen2, qwen3, mixtral, qwen3_moe, qwen2_moe,
    deepseek_v3 that can."""
    m = cfg.model
    if arch is not None:
        if arch not in ARCHITECTURES:
            raise ConversionError(f"--arch {arch}: expected one of {', '.join(ARCHITECTURES)}")
        reasons = ARCHITECTURES[arch].all_refusals(m)
        if reasons:
            raise ConversionError("; ".join(reasons))
        return ARCHITECTURES[arch]
    for a in ARCHITECTURES.values():
        if not a.all_refusals(m):
            return a
    firsts = "; ".join(a.all_refusals(m)[0] for a in ARCHITECTURES.values())
    raise ConversionError(f"no Hugging Face class can express this model: {firsts}")


def export_to_hf(
    src: Path,
    dst: Path,
    arch: Optional[str] = None,
    dtype: Optional[str] = None,
    max_shard_size: Optional[int] = None,
    verify: bool = False,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Path:
    """megaformer checkpoint (or run directory: its latest) -> Hugging Face folder ``dst``;
    with ``verify``, both run one batch in fp32 first (:mod:`.verify`) and a logit difference
    above ``tolerance`` leaves nothing behind."""
    ckpt, cfg = _read_megaformer(src)
    adapter = choose_architecture(cfg, arch)
    m = cfg.model
    if m.dropout and isinstance(adapter, LlamaFamily):
        log.warning(
            "model.dropout=%s is a training-time setting %s has no key for; "
            "it does not change the exported function",
            m.dropout,
            adapter.hf_class,
        )
    ckpt_weights.check_weights(ckpt, m)  # shapes against config.yaml, before anything is allocated
    tokenizer = None
    if (ckpt / "tokenizer.json").exists() or (ckpt / "tokenizer.json").is_symlink():
        check_file(ckpt / "tokenizer.json", MAX_TOKENIZER_BYTES, ConversionError)
        tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    else:
        log.warning(
            "%s has no tokenizer.json (converted without one): the export has no tokenizer files",
            ckpt,
        )
    source = (
        TensorSource(ckpt)
        if (ckpt / ckpt_layout.WEIGHTS).exists()
        else ShardedWeights(ckpt, precision_dtype(cfg.train.precision))
    )
    plan = adapter.export_plan(m) + router_bias_entries(adapter, m, ckpt)
    if m.mtp_depth > 0:
        log.warning(
            "the %d multi-token prediction modules are training-only: not exported", m.mtp_depth
        )
    out_dtype = _dtype(dtype)
    label = _DTYPE_LABEL.get(out_dtype or source.meta(plan[0].inputs[0]).dtype, "float32")
    with staged_output(dst) as tmp:
        run_plan(
            plan,
            source,
            tmp,
            out_dtype,
            max_shard_size,
            metadata={"megaformer_version": __version__},
            ignore=lambda name: (
                (m.tie_embeddings and name == "lm_head.weight") or name.startswith("mtp.")
            ),
        )
        special = write_hf_tokenizer(tokenizer, tmp, m.max_seq_len) if tokenizer else {}
        config = {
            "architectures": [adapter.hf_class],
            "model_type": adapter.model_type,
            "vocab_size": m.vocab_size,
            **adapter.hf_config(m),
            **special,
            "dtype": label,
            "use_cache": True,
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({**special}, indent=2) + "\n")
        if verify:
            verify_logits(ckpt, tmp, tolerance)
    log.info("exported %s as %s to %s", ckpt, adapter.hf_class, dst)
    return dst


def _read_hf_config(src: Path, arch: Optional[str]) -> tuple[dict, Architecture]:
    path = src / "config.json"
    if not path.is_file():
        raise ConversionError(f"{src}: no config.json (not a Hugging Face model folder)")
    try:
        hf = json.loads(read_text_bounded(path, MAX_JSON_BYTES, ConversionError))
    except (OSError, ValueError, RecursionError) as e:
        raise ConversionError(f"{path}: not a JSON file ({unreadable_reason(e)})") from None
    if not isinstance(hf, dict):
        raise ConversionError(f"{path}: not a JSON object")
    model_type = hf.get("model_type")
    if model_type not in BY_MODEL_TYPE:
        raise ConversionError(
            f"{path}: model_type={model_type!r} is not supported (supported: "
            f"{', '.join(BY_MODEL_TYPE)})"
        )
    adapter = BY_MODEL_TYPE[model_type]
    if arch is not None and arch != adapter.name:
        raise ConversionError(
            f"--arch {arch}: {path} describes a {adapter.hf_class} ({adapter.name})"
        )
    return with_transformers_defaults(hf, model_type, path), adapter


def with_transformers_defaults(hf: dict, model_type: str, path: Path) -> dict:
    """The config as transformers reads it: through the model type's own config class
    (``from_dict``, local, no remote code), so keys the file leaves out take transformers'
    defaults and legacy keys their current form (e.g. ``rope_scaling`` -> ``rope_parameters``)."""
    try:
        from transformers import CONFIG_MAPPING
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ConversionError(
            f"{path}: reading a Hugging Face config needs transformers "
            "(pip install 'megaformer[hf]')"
        ) from None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes on odd but valid values are not errors here
    try:
        config = CONFIG_MAPPING[model_type].from_dict(
            {k: v for k, v in hf.items() if k not in ("auto_map", "trust_remote_code")}
        )
        full = config.to_dict()
    except (
        Exception
    ) as e:  # transformers' validation raises ValueError, TypeError, StrictDataclass...
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ConversionError(
            f"{path}: transformers cannot read this {model_type} config ({first})"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return full


def import_config(
    hf: dict,
    adapter: Architecture,
    tensor: int,
    pipeline: int,
    tokenizer_path: Optional[Path],
    name: str,
) -> Config:
    """megaformer config of the HF model at TP=tensor, PP=pipeline (validated: one-line errors);
    without a tokenizer, ``data.tokenizer: none`` (training asks for one by name)."""
    fields = {**adapter.model_fields(hf), "vocab_size": hf["vocab_size"]}
    raw = {
        "model": fields,
        "parallel": {"tensor": tensor, "pipeline": pipeline},
        "data": {"tokenizer": str(tokenizer_path) if tokenizer_path else NO_TOKENIZER},
    }
    try:
        cfg = config_from_dict(raw, name=name)
        validate(cfg)
    except ConfigError as e:
        raise ConversionError(f"--tp {tensor} --pp {pipeline}: {e}") from None
    return cfg


def import_from_hf(
    src: Path,
    dst: Path,
    tensor: int = 1,
    pipeline: int = 1,
    arch: Optional[str] = None,
    dtype: Optional[str] = None,
    tokenizer: Optional[Path] = None,
    verify: bool = False,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Path:
    """Hugging Face folder -> a megaformer run directory ``dst`` with a weights-only checkpoint.

    ``tokenizer``: a tokenizer.json or SentencePiece tokenizer.model to use instead of the
    folder's; a folder with neither converts with a warning (``data.tokenizer: none``).
    ``verify``: as in :func:`export_to_hf`."""
    if not src.is_dir():
        raise ConversionError(f"{src}: no such Hugging Face model folder")
    hf, adapter = _read_hf_config(src, arch)
    dst = dst.resolve()
    if (src / "tokenizer.json").exists() or (src / "tokenizer.json").is_symlink():
        check_file(src / "tokenizer.json", MAX_TOKENIZER_BYTES, ConversionError)
    tok = read_hf_tokenizer(src, tokenizer)
    if tok is None:
        log.warning(
            "%s has no tokenizer.json or tokenizer.model: converting the weights only "
            "(give one with --tokenizer PATH, or set data.tokenizer before training)",
            src,
        )
    cfg = import_config(
        hf, adapter, tensor, pipeline, dst / "tokenizer.json" if tok else None, dst.name
    )
    if tok is not None and tok.vocab_size > cfg.model.vocab_size:
        raise ConversionError(
            f"{tok.name}: {tok.vocab_size} tokens, more than the model's "
            f"vocab_size {cfg.model.vocab_size}"
        )
    out_dtype = _dtype(dtype)
    source, plan, ignore = import_plan(src, cfg.model, adapter, out_dtype)
    expected = ckpt_weights.expected_shapes(cfg.model)

    def write_weights(path: Path) -> None:
        run_plan(
            plan,
            source,
            path.parent,
            out_dtype,
            metadata={"megaformer_version": __version__},
            ignore=ignore,
            expected_out=expected,
        )
        biases = adapter.router_bias_names(cfg.model)  # the aux-loss-free biases: router state
        write_router_state(path.parent, {ours: source.get(hf) for ours, hf in biases.items()})

    with staged_output(dst) as tmp:
        ckpt_weights.save_weights_checkpoint(
            tmp,
            0,
            write_weights,
            cfg.to_yaml(),
            tok if tok is not None else _NoTokenizer(),
            {"converted_from": adapter.hf_class, "source": str(src)},
        )
        (tmp / ckpt_layout.CONFIG).write_text(cfg.to_yaml())
        if tok is not None:
            tok.save(tmp / "tokenizer.json")
        if verify:
            verify_logits(tmp, src, tolerance)
    log.info(
        "imported %s (%s) into %s at tensor=%d pipeline=%d",
        src,
        adapter.hf_class,
        dst,
        tensor,
        pipeline,
    )
    return dst


def import_plan(
    src: Path, m: Any, adapter: Architecture, dtype: Optional[torch.dtype] = None
) -> tuple[TensorSource, list[Entry], Callable[[str], bool]]:
    """(tensors, plan, which source tensors may go unread) of Hugging Face folder ``src`` as
    megaformer's model ``m``: every input present, none dropped unread, every output's shape the
    config's, checked on headers alone (nothing read or allocated)."""
    source = TensorSource(src)  # headers only
    names = set(source.keys())
    if m.n_layers > len(names):  # every block has tensors: bounds the plan and meta model
        raise ConversionError(
            f"{src}: {len(names)} tensors cannot hold the {m.n_layers} blocks config.json describes"
        )
    expected = ckpt_weights.expected_shapes(m)  # on the meta device: nothing allocated
    plan = adapter.import_plan(m, names)
    tied_out = {"lm_head.weight", *OUT_NAMES} if m.tie_embeddings else set()

    def ignore(n: str) -> bool:
        return adapter.ignore_on_import(n) or n in tied_out or adapter.beyond_blocks(m, n)

    beyond = [n for n in names if adapter.beyond_blocks(m, n)]
    if beyond:
        log.warning(
            "%s: %d tensors of modules after the %d blocks (multi-token prediction) are not "
            "imported",
            src,
            len(beyond),
            m.n_layers,
        )
    missing_bias = sorted(set(adapter.router_bias_names(m).values()) - names)
    if missing_bias:
        raise ConversionError(f"{src}: missing {missing_bias[0]}")
    check_inputs(plan, source, ignore)
    ckpt_weights.check_shapes(
        [(n, shape) for n, shape, _ in output_specs(plan, source, dtype)],
        expected,
        str(src),
        ConversionError,
    )
    return source, plan, ignore


def router_bias_entries(adapter: Architecture, m: Any, ckpt: Path) -> list[Entry]:
    """The class's tensors of the MoE blocks' aux-loss-free biases, from the checkpoint's router
    state (zeros for a block it does not hold)."""
    names = adapter.router_bias_names(m)
    if not names:
        return []
    saved = read_router_state(ckpt)

    def const(t: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: t.clone()

    return [
        Entry(hf, (), const(saved.get(ours, torch.zeros(m.moe.num_experts)).float()))
        for ours, hf in names.items()
    ]


class _NoTokenizer:
    """Stands for the tokenizer of a weights-only conversion: saves nothing."""

    def save(self, path: Path) -> None:
        pass


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / ckpt_layout.META).is_file()
