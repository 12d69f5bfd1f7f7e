"""Model parallelism: how one model is split over ranks.

The TP x CP x DP x PP process grid, with expert parallelism (EP) carved out of DP (``topology``),
tensor-parallel layers and the plan that swaps them in (``layers``, ``plan``), the dropout RNG
streams under tensor parallelism (``random``), context parallelism's sequence split and ring /
all-to-all attention (``context``), pipeline stages on DeepSpeed's pipeline engine (``pipeline``),
activation recomputation (``recompute``), FP8 training of the blocks' linear layers (``fp8``), the
global gradient norm (``grad_norm``), expert parallelism's all-to-all dispatch (``experts``) and
the one model builder (``build``).
"""
