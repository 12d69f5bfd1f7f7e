"""Checkpoints: :class:`~megaformer.checkpoint.checkpointer.Checkpointer` in front of save and resume.

Modules, one concern each (none imports a module that imports it back):

* ``checkpointer``     save and resume of a run, the one entry point of the trainer;
* ``layout``           names and places: tags, ``latest``, complete and half-written checkpoints;
* ``files``            whole-or-absent files, sealing a checkpoint, the background writer;
* ``save``             the collective save protocol (every rank writes its share, rank 0 seals);
* ``rng``              every rank's random-number streams;
* ``weights``          checking, loading and writing model weights (weights-only checkpoints);
* ``sharded``          the sharded, layout-free training state format (boxes, index, reader);
* ``optimizer_state``  this rank's master weights and optimizer state inside DeepSpeed's optimizers
                       (every private-API reach-in of saving and resuming);
* ``staging``          the pinned host arena a rank stages its shard in;
* ``router_state``     the MoE blocks' aux-loss-free biases;
* ``compat``           which checkpoints a config may resume from;
* ``legacy/``          read-only older formats: the first release's layout-free ``optimizer/``
                       (``portable``) and DeepSpeed's per-rank engine files (``engine_files``);
* ``reshard``, ``model_weights``, ``safe_load``, ``safetensors_check``, ``hf/``: offline
  resharding, a model from a checkpoint on one process, safe unpickling, header checks, and the
  Hugging Face adapters.
"""
