"""megaformer: distributed pretraining of decoder-only Transformers on PyTorch + DeepSpeed."""

__version__ = "0.1.0"
