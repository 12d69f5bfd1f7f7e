"""Kernels: attention dispatch (flash-attn -> torch SDPA -> reference).

Import from the submodule: ``from megaformer.kernels.attention import attention, resolve_backend``
(the package does not re-export ``attention`` so that ``megaformer.kernels.attention`` stays the module).
"""
