"""Kernels, each with a torch fallback and chosen at run time (the choice is logged once):

    attention.py       attention dispatch (FlashAttention FA3/FA2/FA4 -> torch SDPA -> reference),
                       document masking for packed sequences
    activations.py     fused SwiGLU and bias-GELU (Triton forward + backward)
    norm.py            fused RMSNorm / LayerNorm (apex, Triton or torch native, measured)
    cross_entropy.py   cross-entropy fused with the output projection over chunks of tokens
                       (vocab-parallel under tensor parallelism)
    triton_support.py  when the Triton kernels run (CUDA, or Triton's interpreter on CPU)

Import from the submodules: ``from megaformer.kernels.attention import attention, resolve_backend``
(the package does not re-export ``attention`` so that ``megaformer.kernels.attention`` stays the module).
"""
