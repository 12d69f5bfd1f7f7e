"""Analysis: parameter counts, FLOPs and MFU, peaks, memory estimates, the planner, reports, bench."""

from megaformer.analysis.params import count_parameters

__all__ = ["count_parameters"]
