"""megaformer: distributed pretraining of decoder-only Transformers (PyTorch + DeepSpeed)."""

from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec((Path(__file__).parent / "megaformer" / "__init__.py").read_text(), version)

setup(
    name="megaformer",
    version=version["__version__"],
    description="Distributed pretraining of decoder-only Transformers on PyTorch and DeepSpeed",
    long_description=(Path(__file__).parent / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megaformer", "megaformer.*"]),
    # C sources built on first use (kernels/native.py)
    package_data={"megaformer.kernels": ["cpu_native.c"], "megaformer.data": ["blend.c"]},
    install_requires=[
        # torch 2.10 closes the known ways to run code through torch.load(weights_only=True)
        # (CVE-2025-32434 fixed in 2.6, CVE-2026-24747 in 2.10); megaformer loads every .pt file so.
        "torch>=2.10",
        "deepspeed>=0.19,<0.20",
        "numpy>=1.24",
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "tensorboard>=2.14",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        # datasets 4 never runs a hub dataset's Python loading script (data only).
        "datasets>=4.0",
        "matplotlib>=3.7",
    ],
    extras_require={
        # transformers: Hugging Face parity tests and `bench --compare-hf`; matplotlib: reports;
        # triton: its interpreter runs the fused kernels on CPU in the tests (TRITON_INTERPRET=1);
        # mkdocs + mkdocs-material: the documentation site, built with --strict by the tests.
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "transformers>=4.44",
            "matplotlib>=3.7",
            "sentencepiece>=0.2",
            "torchao>=0.13",
            "lm-eval>=0.4.9",
            "wandb>=0.19",
            "triton>=3.5; platform_system == 'Linux'",
            "mkdocs>=1.6",
            "mkdocs-material>=9.5",
            "ruff>=0.6",
        ],
        # Optional accelerators: flash-attn (CUDA) and NVIDIA apex (built from source, never the
        # unrelated PyPI package called "apex") are used when importable.
        "gpu": ["flash-attn>=2.5", "triton>=3.5"],
        # `megaformer convert` from Hugging Face: config.json read through transformers' config
        # classes, --verify, SentencePiece tokenizer.model files (Llama 2, Mistral)
        "hf": ["transformers>=4.44", "sentencepiece>=0.2"],
        # train.fp8: torchao's float8 training (Hopper and newer; emulated elsewhere for tests)
        "fp8": ["torchao>=0.13"],
        # `megaformer eval` and eval.tasks: EleutherAI's lm-evaluation-harness
        "eval": ["lm-eval>=0.4.9"],
        # log.wandb: Weights & Biases
        "wandb": ["wandb>=0.19"],
    },
    entry_points={"console_scripts": ["megaformer=megaformer.cli:main"]},
)
