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
    package_data={"megaformer.kernels": ["cpu_native.c"]},  # built on first use (kernels/native.py)
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19,<0.20",
        "numpy>=1.24",
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "tensorboard>=2.14",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        "datasets>=2.19",
        "matplotlib>=3.7",
    ],
    extras_require={
        # transformers: Hugging Face parity tests and `bench --compare-hf`; matplotlib: reports;
        # triton: its interpreter runs the fused kernels on CPU in the tests (TRITON_INTERPRET=1).
        "test": ["pytest>=8", "pytest-timeout>=2.3", "transformers>=4.44", "matplotlib>=3.7",
                 "triton>=3.5; platform_system == 'Linux'"],
        # Optional accelerators: flash-attn (CUDA) and NVIDIA apex (built from source, never the
        # unrelated PyPI package called "apex") are used when importable.
        "gpu": ["flash-attn>=2.5", "triton>=3.5"],
    },
    entry_points={"console_scripts": ["megaformer=megaformer.cli:main"]},
)
