"""The interleaved 1F1B schedule on DeepSpeed's pipeline engine.

:class:`InterleavedModule` is a ``PipelineModule`` cut into v * p stages, of which pipeline rank r
builds the v stages r, r+p, ..., r+(v-1)p ("chunks" 0..v-1, exposed one at a time as the module's
forward, as DeepSpeed's DualPipeV module does with its two). :class:`InterleavedEngine` runs
:class:`InterleavedSchedule` -- the rounds of :mod:`megaformer.parallel.interleaved_schedule` --
with DeepSpeed's own machinery: its forward and backward passes (loss on rank p-1's last chunk,
gradient accumulation, ZeRO-1 and the bf16/fp16 optimizers), its tied-weight and data-parallel
gradient reductions and its optimizer step; the point-to-point exchanges are DualPipeV's, queued
and launched as one batch per round, with the wrap-around from rank p-1 (chunk c) to rank 0
(chunk c+1) as one more neighbour.

Buffers: one slot per (chunk, micro-batch), ``c * m + j``. Rank 0 loads micro-batch j's inputs
into slot j; rank p-1 loads its labels into slot (v-1) m + j, where its last chunk's forward
computes the loss.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from deepspeed import comm as ds_comm
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from megaformer.parallel.interleaved_schedule import check_interleaved, rounds


class InterleavedSchedule(ds_schedule.PipeSchedule):
    """Rank ``stage_id``'s instructions for one step of the interleaved schedule with ``chunks``
    stages per rank: per round, its passes, then its sends and receives of the round (ordered by
    the stage boundary they cross, the same order on every rank, so the first exchange of each
    boundary's tensor shapes never waits in a cycle) and one ``CommitP2P``."""

    def __init__(
        self,
        micro_batches: int,
        stages: int,
        stage_id: int,
        chunks: int,
        forward_only: bool = False,
    ) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.chunks, self.forward_only = chunks, forward_only
        rounds(stages, micro_batches, chunks, forward_only)  # ValueError for a bad layout

    def num_pipe_buffers(self) -> int:
        return self.chunks * self.micro_batches

    def _slot(self, chunk: int, micro_batch: int) -> int:
        return chunk * self.micro_batches + micro_batch

    def steps(self) -> Iterator[list]:
        r, p, v = self.stage_id, self.stages, self.chunks
        last = v * p - 1
        for rnd in rounds(p, self.micro_batches, v, self.forward_only):
            cmds: list = []
            for half in (0, 1):  # each pass of the round, then what the round's passes made
                for kind, c, j in rnd.passes[r][half : half + 1]:
                    slot = self._slot(c, j)
                    if kind == "F":
                        if c * p + r in (0, last):  # the inputs (rank 0), the labels (rank p-1)
                            cmds.append(ds_schedule.LoadMicroBatch(slot))
                        cmds.append(ds_schedule.ForwardPass(slot, phase=c))
                    else:
                        cmds.append(ds_schedule.BackwardPass(slot, phase=c))
                cmds += self._exchange([t for t in rnd.transfers if t.half == half])
            yield cmds
        if not self.forward_only:
            yield [
                ds_schedule.ReduceTiedGrads(),
                ds_schedule.ReduceGrads(),
                ds_schedule.OptimizerStep(),
            ]

    def _exchange(self, transfers: list) -> list:
        """This rank's sends and receives of ``transfers``, in boundary order, and their launch."""
        r, comm = self.stage_id, []
        for t in transfers:
            if t.src == r:
                send = ds_schedule.SendActivation if t.kind == "F" else ds_schedule.SendGrad
                comm.append((t.boundary, send(self._slot(t.chunk, t.micro_batch), phase=t.chunk)))
            if t.dst == r:
                recv = ds_schedule.RecvActivation if t.kind == "F" else ds_schedule.RecvGrad
                slot = self._slot(t.dst_chunk, t.micro_batch)
                comm.append((t.boundary, recv(slot, phase=t.dst_chunk)))
        if not comm:
            return []
        return [cmd for _, cmd in sorted(comm, key=lambda x: x[0])] + [ds_schedule.CommitP2P()]


class InterleavedModule(DualPipeVModule):
    """A ``PipelineModule`` of v * p stages, rank r building stages r + c p as its chunks c.
    Subclasses set ``num_stages``, ``parts`` and ``phase_bounds`` (one (start, stop) per chunk)
    in ``_partition_layers``; DualPipeV's module builds and switches between any number of
    chunks (its ``_build``, ``activate_phase``)."""

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline rank that owns ``layer_idx`` (tied layers: which ranks share a weight)."""
        return PipelineModule.stage_owner(self, layer_idx) % self._topo.get_dim("pipe")

    def _build(self) -> None:
        DualPipeVModule._build(self)  # every chunk; its table of checkpointable layers has two
        self.phase_checkpointable = [[] for _ in self.phase_bounds]

    def _each_chunk(self, method: Any, *args: Any, **kwargs: Any) -> None:
        for c in range(len(self.phase_bounds)):
            self.activate_phase(c)
            method(self, *args, **kwargs)
        self.activate_phase(0)

    def _precompute_checkpointable_values(self) -> None:
        def one_chunk(module: "InterleavedModule") -> None:
            module.is_checkpointable_results_interval = None  # cached per interval, not chunk
            PipelineModule._precompute_checkpointable_values(module)
            module.phase_checkpointable[module.active_phase] = module.is_checkpointable_results

        self._each_chunk(one_chunk)

    def save_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._each_chunk(PipelineModule.save_state_dict, *args, **kwargs)

    def load_state_dir(self, *args: Any, **kwargs: Any) -> None:
        self._each_chunk(PipelineModule.load_state_dir, *args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        self._each_chunk(PipelineModule.compile, *args, **kwargs)


class InterleavedEngine(DualPipeVEngine):
    """DeepSpeed's pipeline engine running :class:`InterleavedSchedule` over an
    :class:`InterleavedModule` (``phase`` in the instructions is the chunk)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # the parent's set-up sees a plain pipeline (is_last_stage: rank p-1); DualPipeV's own
        # __init__ would check DualPipeV's micro-batch rule, the interleaved one is checked below
        self.chunks, self._active_phase = 0, None
        PipelineEngine.__init__(self, *args, **kwargs)
        assert isinstance(self.module, InterleavedModule), "model must be an InterleavedModule"
        assert not (self.is_pipe_partitioned or self.is_grad_partitioned), (
            "the interleaved schedule sends whole activations"
        )
        check_interleaved(self.num_stages, self.micro_batches, len(self.module.phase_bounds))
        self.chunks = len(self.module.phase_bounds)
        self._p2p_ops = []
        self._recv_keys: list[tuple[str, int]] = []  # the buffers the queued receives fill
        self._arriving: dict[tuple[str, int], _Batch] = {}  # buffer -> the batch bringing it
        self._launched: deque = deque()  # the batches not waited for yet, oldest first
        self._first_send = [True] * self.chunks
        self._recv_specs = [None] * self.chunks
        self.pipe_buffers["grads"] = []
        self.pipe_buffers["losses"] = []

    def is_first_stage(self) -> bool:
        """Rank 0 during its first chunk (or outside any chunk: loading the inputs)."""
        return self.stage_id == 0 and (not self.chunks or self._active_phase in (None, 0))

    def is_last_stage(self) -> bool:
        """Rank p-1 during its last chunk (or outside any chunk: loading labels, the loss)."""
        last = self.stage_id == self.num_stages - 1
        if not self.chunks:
            return last
        return last and self._active_phase in (None, self.chunks - 1)

    def _is_loss_stage(self, phase: int) -> bool:
        return self.stage_id == self.num_stages - 1 and phase == self.chunks - 1

    def _loss_stage_global_rank(self) -> int:
        return self.grid.stage_to_global(self.num_stages - 1)

    def _downstream_stage(self, phase: int) -> int:
        return (self.stage_id + 1) % self.num_stages

    def _upstream_stage(self, phase: int) -> int:
        return (self.stage_id - 1) % self.num_stages

    def _train_schedule(self) -> InterleavedSchedule:
        return InterleavedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.chunks)

    def _inference_schedule(self, micro_batches: int) -> InterleavedSchedule:
        return InterleavedSchedule(
            micro_batches, self.num_stages, self.stage_id, self.chunks, forward_only=True
        )

    def reset_activation_shape(self) -> None:
        PipelineEngine.reset_activation_shape(self)
        self._first_send = [True] * self.chunks
        self._recv_specs = [None] * self.chunks

    def _exec_recv_activations(self, buffer_id: int, phase: int) -> None:
        DualPipeVEngine._exec_recv_activations(self, buffer_id, phase)
        self._recv_keys.append(("inputs", buffer_id))

    def _exec_recv_grads(self, buffer_id: int, phase: int) -> None:
        DualPipeVEngine._exec_recv_grads(self, buffer_id, phase)
        self._recv_keys.append(("grads", buffer_id))

    def _exec_commit_p2p(self) -> None:
        """Launch the queued sends and receives as one batch, without waiting: a pass waits for
        the batch that brings its input (:meth:`_arrived`), so a batch crosses while the rank
        computes something else. Batches are waited for, and let go, two launches later (their
        sent tensors freed) and at the end of the schedule."""
        if not self._p2p_ops:
            return
        batch = _Batch(ds_comm.batch_isend_irecv(self._p2p_ops))
        for key in self._recv_keys:
            self._arriving[key] = batch
        self._p2p_ops, self._recv_keys = [], []
        self._launched.append(batch)
        while len(self._launched) > 2:
            self._launched.popleft().wait()

    def _arrived(self, kind: str, buffer_id: int) -> None:
        batch = self._arriving.pop((kind, buffer_id), None)
        if batch is not None:
            batch.wait()

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        try:
            PipelineEngine._exec_schedule(self, pipe_schedule)
        finally:
            while self._launched:
                self._launched.popleft().wait()
            self._arriving.clear()

    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        PipelineEngine._exec_load_micro_batch(self, buffer_id)

    def _exec_forward_pass(self, buffer_id: int, phase: int) -> None:
        self._arrived("inputs", buffer_id)
        with self._phase(phase):
            PipelineEngine._exec_forward_pass(self, buffer_id)
        loss_stage = self._is_loss_stage(phase)
        if loss_stage and torch.is_grad_enabled():
            self.pipe_buffers["losses"][buffer_id] = self.loss
        if not torch.is_grad_enabled():  # no backward: nothing else frees these
            self.pipe_buffers["inputs"][buffer_id] = None
            self.pipe_buffers["labels"][buffer_id] = None
            if loss_stage:
                self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_backward_pass(self, buffer_id: int, phase: int) -> None:
        self._arrived("grads", buffer_id)
        if self._is_loss_stage(phase):
            self.loss = self.pipe_buffers["losses"][buffer_id]
            self.pipe_buffers["losses"][buffer_id] = None
        else:
            self.grad_layer = self.pipe_buffers["grads"][buffer_id]
            self.pipe_buffers["grads"][buffer_id] = None
        with self._phase(phase):
            PipelineEngine._exec_backward_pass(self, buffer_id)
        self.pipe_buffers["outputs"][buffer_id] = None
        if self.stage_id == 0 and phase == 0:  # the first stage sends no gradient
            self.pipe_buffers["inputs"][buffer_id] = None
        if self._is_loss_stage(phase):
            self.pipe_buffers["labels"][buffer_id] = None

    _INSTRUCTION_MAP = {
        **DualPipeVEngine._INSTRUCTION_MAP,
        ds_schedule.RecvActivation: _exec_recv_activations,
        ds_schedule.RecvGrad: _exec_recv_grads,
        ds_schedule.CommitP2P: _exec_commit_p2p,
        ds_schedule.LoadMicroBatch: _exec_load_micro_batch,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
    }


class _Batch:
    """One launched batch of sends and receives, waited for once (gloo's requests block again
    on a second ``wait``)."""

    def __init__(self, reqs: list) -> None:
        self.reqs: Optional[list] = reqs

    def wait(self) -> None:
        """On CUDA the current stream waits for the batch, the host does not."""
        if self.reqs is not None:
            for req in self.reqs:
                req.wait()
            self.reqs = None


@contextmanager
def engine_for(model: Any) -> Iterator[None]:
    """While ``deepspeed.initialize`` runs: an :class:`InterleavedModule` gets the
    :class:`InterleavedEngine` (DeepSpeed picks its DualPipeV engine for any DualPipeV module by
    the name ``deepspeed.DualPipeVEngine``, which this widens to the subclass)."""
    if not isinstance(model, InterleavedModule):
        yield
        return
    import deepspeed

    saved = deepspeed.DualPipeVEngine
    deepspeed.DualPipeVEngine = InterleavedEngine
    try:
        yield
    finally:
        deepspeed.DualPipeVEngine = saved
