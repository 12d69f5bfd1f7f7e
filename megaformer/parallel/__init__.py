"""Model parallelism: how one model is split over ranks.

The TP x PP x DP process grid (``topology``), tensor-parallel layers and the plan that swaps them in
(``layers``, ``plan``), the dropout RNG streams under tensor parallelism (``random``), pipeline
stages on DeepSpeed's pipeline engine (``pipeline``), activation recomputation (``recompute``),
the global gradient norm (``grad_norm``), expert parallelism's all-to-all dispatch (``experts``)
and the one model builder (``build``).
"""
