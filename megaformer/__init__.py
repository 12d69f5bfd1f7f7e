"""megaformer: distributed pretraining of decoder-only Transformers on PyTorch + DeepSpeed.

Layering: each layer imports only from the layers below it (tests/unit/test_layering.py checks every
import, including those inside functions)::

    cli, __main__        the command line
    training             the DeepSpeed engine, the loop, resume, schedules, signals
    analysis, evaluation FLOPs, memory, planner, throughput, bench (never an engine) |
                         lm-evaluation-harness on megaformer's model (checkpoint or live)
    diagnostics          residual-stream and weight diagnostics, plots
    generation           text generation from a model or a checkpoint
    checkpoint           save / resume / reshard, Hugging Face adapters, resume compatibility
    data                 tokenizers, indexed datasets, packing and blending, data setup
    config.preflight     the checks of a config against the world size and the device, once
    parallel, runtime    the TP x CP x DP x PP topology (EP inside DP), tensor-parallel plan,
                         context and expert parallelism, pipeline stages, recomputation, FP8,
                         build_model, gradient norm | optimizer, host allocator, run-directory lock
    model                plain PyTorch layers of the Transformer
    kernels              one function per op that owns its backend choice
    errors, config, accelerators, comm, deepspeed_attrs, safe_files
                         user errors, the typed config (all but its preflight), the peak table, communication
                         primitives, DeepSpeed's parameter attributes, safe file writes

``parallel`` and ``runtime`` do not import each other; nor do ``analysis`` and ``evaluation``.
"""

__version__ = "0.2.0"
