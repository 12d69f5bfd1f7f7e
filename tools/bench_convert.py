"""Peak memory of `megaformer convert` against model size (streaming vs loading the whole model).

    python tools/bench_convert.py [--sizes 50M 200M] [--workdir DIR] [--keep]

For each size, a Llama-shaped model with random fp32 weights (untied, vocabulary 32,000) is written
as a megaformer weights-only checkpoint. Each measurement runs in a fresh process and reports that
process's peak resident memory (``VmHWM`` of /proc/self/status, Linux):

* baseline: the same imports (torch, megaformer, the converter), no conversion;
* export:   ``megaformer convert CKPT HF --to hf`` (megaformer -> Hugging Face folder);
* import:   ``megaformer convert HF RUN --to megaformer`` (Hugging Face folder -> megaformer);
* load-all: what a converter that is not streamed needs at least: ``safetensors.torch.load_file``
  of the whole model followed by ``save_file`` of it.

The table shows each peak above the baseline and its ratio to the model's size in bytes, beside the
largest tensor's size (the embedding): a streamed conversion should stay near the largest tensor
(about 1 to 3 of it), not grow with the model.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {  # name: (d_model, n_layers, n_heads, n_kv_heads)
    "50M": (512, 8, 8, 4),
    "200M": (1024, 12, 16, 8),
}
VOCAB = 32000
MB = 1e6

PRELUDE = (
    "import sys; sys.path.insert(0, %r); import torch, safetensors.torch; "
    "import megaformer.cli, megaformer.checkpoint.hf.convert; " % str(ROOT)
)
# VmHWM: the peak resident set of this process's own address space. (getrusage's ru_maxrss is not
# used: on Linux a child inherits its parent's high-water mark across fork + exec.)
EPILOGUE = (
    "; print([int(l.split()[1]) * 1024 for l in open('/proc/self/status') "
    "if l.startswith('VmHWM')][0])"
)


def peak_rss(body: str) -> int:
    """Peak RSS in bytes of a fresh Python process running ``body`` after the common imports."""
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + body + EPILOGUE],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    if out.returncode != 0:
        raise SystemExit(f"measurement failed:\n{out.stderr[-3000:]}")
    return int(out.stdout.strip().splitlines()[-1])


def make_checkpoint(run: Path, size: str) -> tuple[int, int]:
    """A weights-only checkpoint with random weights; returns (parameters, largest tensor bytes)."""
    import torch

    from megaformer.checkpoint.weights import save_weights_checkpoint
    from megaformer.config import config_from_dict
    from megaformer.data.tokenizer import ByteTokenizer
    from megaformer.model.transformer import Transformer

    d, layers, heads, kv = SIZES[size]
    cfg = config_from_dict(
        {
            "model": {
                "vocab_size": VOCAB,
                "d_model": d,
                "n_layers": layers,
                "n_heads": heads,
                "n_kv_heads": kv,
                "tie_embeddings": False,
                "max_seq_len": 1024,
            }
        },
        name=size,
    )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(cfg.model).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    save_weights_checkpoint(run, 0, weights, cfg.to_yaml(), ByteTokenizer(), {"bench": size})
    return sum(w.numel() for w in weights.values()), max(w.numel() * 4 for w in weights.values())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the written models")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    work.mkdir(parents=True, exist_ok=True)
    base = peak_rss("pass")
    rows = []
    for size in args.sizes:
        run, hf, back = work / f"mf_{size}", work / f"hf_{size}", work / f"back_{size}"
        for p in (run, hf, back):
            shutil.rmtree(p, ignore_errors=True)
        params, largest = make_checkpoint(run, size)
        ckpt = next((run / "checkpoints").glob("step_*"))
        model_bytes = (ckpt / "model.safetensors").stat().st_size
        export = peak_rss(
            f"megaformer.cli.main(['convert', {str(run)!r}, {str(hf)!r}, '--to', 'hf'])"
        )
        imp = peak_rss(
            f"megaformer.cli.main(['convert', {str(hf)!r}, {str(back)!r}, '--to', 'megaformer'])"
        )
        naive = peak_rss(
            f"w = safetensors.torch.load_file({str(ckpt / 'model.safetensors')!r}); "
            f"safetensors.torch.save_file(w, {str(work / 'naive.safetensors')!r})"
        )
        (work / "naive.safetensors").unlink()
        rows.append((size, params, model_bytes, largest, export - base, imp - base, naive - base))
        if not args.keep:
            for p in (run, hf, back):
                shutil.rmtree(p, ignore_errors=True)

    print(f"baseline peak RSS (imports only): {base / MB:,.0f} MB\n")
    print(
        "| model | parameters | weights MB | largest tensor MB | export MB (x model) | "
        "import MB (x model) | load-all MB (x model) |"
    )
    print("|---|---|---|---|---|---|---|")
    for size, params, mb, largest, exp, imp, naive in rows:
        print(
            f"| {size} | {params:,} | {mb / MB:,.0f} | {largest / MB:,.0f} | "
            f"{exp / MB:,.0f} ({exp / mb:.2f}) | {imp / MB:,.0f} ({imp / mb:.2f}) | "
            f"{naive / MB:,.0f} ({naive / mb:.2f}) |"
        )
    print("\npeaks are above the baseline; 'x model' = peak / weights file size")
    if not args.keep and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
