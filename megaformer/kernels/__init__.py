"""Kernels: one public function per op, each owning every backend choice for that op.

    op (function)                         module            implementations
    attention(q, k, v, ...)               attention.py      FlashAttention FA3/FA2/FA4, torch SDPA,
                                                            native CPU FlashAttention-2, reference
    block_forward / block_backward        attention_block.py aten FlashAttention (CPU, CUDA),
      (one key block with its lse: ring)                    memory-efficient (CUDA, masked pairs)
    swiglu(g, u), swiglu_packed(gu)       activations.py    Triton, native CPU, fewer-pass CPU, torch
    bias_gelu(h, b)                       activations.py    Triton, torch
    rms_norm(x, w), layer_norm(x, w, b)   norm.py           apex, Triton, torch native, native CPU, torch
    rope(x, cos, sin)                     rope.py           native CPU, fewer-pass CPU, torch
    dropout(x, p)                         dropout.py        native CPU, int16 CPU, torch
    cross_entropy(z, y, V)                cross_entropy.py  native CPU, torch; chunked_cross_entropy
                                                            fused with the output projection
    linear(x, w, b)                       gemm.py           oneDNN (fp32 CPU), torch

Which implementation runs for an op, device, dtype and kernel mode -- and why -- is answered in one
place, :mod:`megaformer.kernels.selection` (also used by the trainer's start-up summary, the bench
and the tests); :mod:`megaformer.kernels.capabilities` probes what this process can run;
:mod:`megaformer.kernels.native` builds and calls the native CPU kernels; ``cpu_eager.py`` holds
the CPU autograd functions around them.

Import from the submodules (``from megaformer.kernels.attention import attention``): the package
does not re-export the functions, so ``megaformer.kernels.attention`` stays the module. This package
depends only on torch, :mod:`megaformer.errors` and :mod:`megaformer.comm`.
"""
