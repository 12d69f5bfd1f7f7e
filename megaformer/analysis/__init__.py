"""Analysis: parameter counts (FLOPs, memory and planning arrive alongside)."""

from megaformer.analysis.params import count_parameters

__all__ = ["count_parameters"]
