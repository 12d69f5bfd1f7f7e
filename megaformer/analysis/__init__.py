"""Analysis: parameter counts, FLOPs and MFU, memory estimates, the planner, reports, bench, check."""

from megaformer.analysis.params import count_parameters

__all__ = ["count_parameters"]
