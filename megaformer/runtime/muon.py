"""Muon on the blocks' matrices, AdamW on everything else (Jordan et al. 2024; Liu et al. 2025).

For a weight matrix W (m x n) with gradient G, one step is (Nesterov form, as in Moonlight)::

    M <- mu M + G                      momentum ("momentum" in the checkpoint)
    U <- G + mu M                      (U <- M without Nesterov)
    O <- NS_k(U)                       k Newton-Schulz steps: O ~ U (U^T U)^(-1/2), the
                                       orthogonal factor of U (singular values pushed to ~1)
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(m, n)) O

NS_k: X_0 = U / ||U||_F (transposed when m > n, so X X^T is the smaller Gram matrix), then
X_{i+1} = a X_i + (b A + c A^2) X_i with A = X_i X_i^T and the quintic's coefficients
(a, b, c) = (3.4445, -4.7750, 2.0315). An orthogonal m x n matrix has RMS 1/sqrt(max(m, n)); the
factor 0.2 sqrt(max(m, n)) brings the update to RMS ~0.2, AdamW's typical update RMS, so AdamW's
learning rate and weight decay carry over. Expert weights [E, m, n] are E matrices, orthogonalised
each on its own (one batched iteration).

Embeddings, the output head, norms, biases, the router and the shared-expert gate (and whatever
``train.muon_adamw_params`` names) take AdamW: torch's AdamW over the same parameter groups,
sharing this optimizer's ``state``.

Layouts:

* Tensor parallelism: the matrices are divided among the TP ranks by size; one all-to-all brings
  each matrix's shards of U to the rank that orthogonalises it, whole, and one more takes each
  rank's shard of O back (per bucket of at most 256 MB of whole matrices, so the gathered copies
  never hold the whole model). Each rank iterates on 1/tp of the matrices; sent per rank and step:
  (tp - 1) / tp of its shards of the owned matrices each way, fp32.
* ZeRO-1/2 (``distribute``): each whole parameter is owned by one rank of its data-parallel group
  (the replica group; experts: the expert-data group), assigned greedily by state bytes so the
  group's ranks hold about equal shares. Only the owner keeps the parameter's optimizer state and updates
  it; then each rank broadcasts the parameters it owns (one coalesced broadcast per rank). So the
  state is 1/DP per rank and no rank orthogonalises every matrix. Gradients arrive all-reduced
  (DeepSpeed runs without its own ZeRO partitioning under Muon).
* Pipeline parallelism: each stage's optimizer holds its own parameters. Expert parallelism: each
  rank's experts, per expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megaformer.comm import all_to_all, broadcast_tensor, rank, size

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
RMS_MATCH = 0.2
NS_BUCKET_BYTES = 256 << 20  # whole fp32 matrices gathered and orthogonalised at a time
ADAMW_ALWAYS = ("embeddings", "lm_head", "router", "shared_gate")
STATE_KEYS = ("momentum",)


def newton_schulz(u: torch.Tensor, steps: int) -> torch.Tensor:
    """NS_k(U) of every matrix in ``u`` (``[..., m, n]``), fp32."""
    a, b, c = NS_COEFFICIENTS
    x = u.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def update_scale(shape: tuple[int, ...]) -> float:
    """0.2 sqrt(max(m, n)) for matrices of ``shape`` ``[..., m, n]``: the update's RMS is AdamW's."""
    return RMS_MATCH * math.sqrt(max(shape[-2], shape[-1]))


def uses_muon(name: str, p: torch.Tensor, adamw_params: tuple[str, ...] = ()) -> bool:
    """A block matrix (2-D, or 3-D stacked experts) not named for AdamW."""
    return (
        name.startswith("layers.")
        and p.dim() >= 2
        and not any(s in name for s in (*ADAMW_ALWAYS, *adamw_params))
    )


@dataclass
class MuonGroups:
    """The process groups Muon's step talks over (None: a group of one)."""

    tp: Any = None  # gathers each split matrix for its Newton-Schulz iteration
    replica: Any = None  # owners of the dense parameters (DP x CP)
    expert_data: Any = None  # owners of the expert parameters (ranks holding the same experts)
    distribute: bool = False  # ZeRO-1/2: each parameter's state and update on one owner


def is_expert(p: torch.Tensor) -> bool:
    return getattr(p, "allreduce", True) is False


def assign_owners(costs: list[int], ranks: int) -> list[int]:
    """Owner rank of each item of ``costs`` (its state's bytes): largest first onto the
    least-loaded rank (ties: lowest rank), the same on every rank since it depends only on the
    costs and their order."""
    load = [0] * ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon`` (keys ``lr``, ``weight_decay``, ``momentum``,
    ``nesterov``, ``ns_steps``), torch's AdamW on the others (``adamw``: its keyword arguments)."""

    def __init__(self, groups: list[dict], adamw: dict, comm: Optional[MuonGroups] = None) -> None:
        super().__init__(groups, {"use_muon": False, "weight_decay": 0.0})
        self.comm = comm or MuonGroups()
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        self.adamw: Optional[torch.optim.AdamW] = None
        if adam_groups:
            self.adamw = torch.optim.AdamW(adam_groups, **adamw)
            self.adamw.param_groups = adam_groups  # the same dicts: one LR schedule for both
            self.adamw.state = self.state
        self._pools = self._ownership()
        self._muon = {p: g["use_muon"] for g in self.param_groups for p in g["params"]}
        self.steps = 0.0  # steps taken (AdamW's step count, whichever parameters this rank owns)

    # ------------------------------------------------------------------------- ownership

    def _ownership(self) -> list[tuple[Any, list[list[torch.Tensor]]]]:
        """(group, the parameters each of its ranks owns) for the dense and the expert
        parameters, where the group has more than one rank."""
        params = [p for g in self.param_groups for p in g["params"]]
        # the bytes of each parameter's state: one moment for Muon's, two for AdamW's
        cost = {
            p: p.numel() * (1 if g["use_muon"] else 2)
            for g in self.param_groups
            for p in g["params"]
        }
        self._owner: dict[torch.Tensor, bool] = {}
        pools = []
        for group, members in (
            (self.comm.replica, [p for p in params if not is_expert(p)]),
            (self.comm.expert_data, [p for p in params if is_expert(p)]),
        ):
            k = size(group) if self.comm.distribute and group is not None else 1
            owners = assign_owners([cost[p] for p in members], k)
            me = rank(group) if k > 1 else 0
            for p, r in zip(members, owners):
                self._owner[p] = r == me
            if k > 1:
                pools.append(
                    (group, [[p for p, o in zip(members, owners) if o == r] for r in range(k)])
                )
        return pools

    def owns(self, p: torch.Tensor) -> bool:
        """This rank keeps ``p``'s optimizer state and computes its update."""
        return self._owner.get(p, True)

    def state_keys(self, p: torch.Tensor) -> tuple[str, ...]:
        """The names of ``p``'s optimizer state (besides its master weight)."""
        return STATE_KEYS if self._muon[p] else ("exp_avg", "exp_avg_sq")

    # ------------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                params = [p for p in group["params"] if p.grad is not None and self.owns(p)]
                self._muon_group(group, params)
        if self.adamw is not None:
            hidden = [
                (p, p.grad)
                for g in self.adamw.param_groups
                for p in g["params"]
                if p.grad is not None and not self.owns(p)
            ]
            for p, _ in hidden:  # another rank updates these
                p.grad = None
            self.adamw.step()
            for p, grad in hidden:
                p.grad = grad
        self._share_updates()
        self.steps += 1
        return loss

    def _muon_group(self, group: dict, params: list[torch.Tensor]) -> None:
        if not params:
            return
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        grads = [p.grad.float() for p in params]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum" not in state:
                state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
            bufs.append(state["momentum"])
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        for lo, hi in self._buckets(params):  # whole matrices at most NS_BUCKET_BYTES at a time
            ps, gs, ms = params[lo:hi], grads[lo:hi], bufs[lo:hi]
            us = torch._foreach_add(gs, ms, alpha=mu) if group["nesterov"] else ms
            updates = self._orthogonalise_shards(ps, us, group["ns_steps"])
            scales = [-lr * update_scale(self._whole_shape(p)) for p in ps]
            if wd:
                torch._foreach_mul_(ps, 1 - lr * wd)
            torch._foreach_mul_(updates, scales)
            torch._foreach_add_(ps, updates)

    def _buckets(self, params: list[torch.Tensor]) -> list[tuple[int, int]]:
        """Consecutive ranges of ``params`` whose whole (TP-gathered) fp32 matrices fill at most
        :data:`NS_BUCKET_BYTES` (a larger matrix alone): the transient memory of the gathered
        matrices and their iteration stays bounded, whatever the model's size."""
        tp = size(self.comm.tp)
        out, lo, filled = [], 0, 0
        for i, p in enumerate(params):
            nbytes = 4 * p.numel() * (tp if self._split(p) else 1)
            if i > lo and filled + nbytes > NS_BUCKET_BYTES:
                out.append((lo, i))
                lo, filled = i, 0
            filled += nbytes
        out.append((lo, len(params)))
        return out

    def _split(self, p: torch.Tensor) -> bool:
        return bool(getattr(p, "tensor_model_parallel", False)) and size(self.comm.tp) > 1

    def _whole_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        """``p``'s shape whole over tensor parallelism."""
        shape = list(p.shape)
        if self._split(p):
            shape[p.partition_dim] *= size(self.comm.tp)
        return tuple(shape)

    def _orthogonalise_shards(
        self, params: list[torch.Tensor], us: list[torch.Tensor], steps: int
    ) -> list[torch.Tensor]:
        """This rank's shard of NS_k(U) for each of ``params`` (U: this rank's shard ``us``).

        A tensor-parallel matrix is orthogonalised whole by one rank of the TP group (its
        matrices assigned by size): one all-to-all brings each matrix's shards to that rank, one
        more takes the shards of NS_k(U) back. Per rank and step that moves the (tp - 1) / tp
        of its own matrices' shards each way, and each rank iterates on 1/tp of the matrices.
        A matrix not split over TP is orthogonalised where it is."""
        tp = size(self.comm.tp)
        split = [i for i, p in enumerate(params) if self._split(p)]
        local = [i for i in range(len(us)) if i not in set(split)]
        updates: list[torch.Tensor] = list(us)
        for i, o in zip(local, orthogonalise([us[i] for i in local], steps)):
            updates[i] = o
        if not split:
            return updates
        me = rank(self.comm.tp)
        doer = assign_owners([us[i].numel() for i in split], tp)
        send = [[i for i, r in zip(split, doer) if r == q] for q in range(tp)]  # by rank
        sizes = [sum(us[i].numel() for i in idx) for idx in send]
        mine, theirs = send[me], [sizes[me]] * tp
        # each matrix's shards to the rank that orthogonalises it
        flat = torch.cat([us[i].reshape(-1) for idx in send for i in idx])
        parts = all_to_all(flat, theirs, sizes, self.comm.tp, kind="muon_tp").view(tp, -1)
        whole, at = [], 0
        for i in mine:
            n, dim = us[i].numel(), params[i].partition_dim
            whole.append(
                torch.cat([parts[q, at : at + n].view(us[i].shape) for q in range(tp)], dim)
            )
            at += n
        # and each rank's shard of NS_k(U) back to it
        pieces = [
            o.narrow(params[i].partition_dim, q * self._local(params[i]), self._local(params[i]))
            for q in range(tp)
            for i, o in zip(mine, orthogonalise(whole, steps))
        ]
        back = torch.cat([x.reshape(-1) for x in pieces]) if pieces else flat.new_empty(0)
        ret = all_to_all(back, sizes, theirs, self.comm.tp, kind="muon_tp")
        at = 0
        for i in (i for idx in send for i in idx):
            updates[i] = ret[at : at + us[i].numel()].view(us[i].shape)
            at += us[i].numel()
        return updates

    @staticmethod
    def _local(p: torch.Tensor) -> int:
        """The size of ``p``'s tensor-parallel shard along its split dimension."""
        return p.shape[p.partition_dim]

    def _share_updates(self) -> None:
        """Each rank's owned parameters to the rest of its group: one broadcast per owner."""
        for group, owned in self._pools:
            for r, mine in enumerate(owned):
                if not mine:
                    continue
                flat = _flatten_dense_tensors([p.data for p in mine])
                broadcast_tensor(flat, r, group)
                for p, v in zip(mine, _unflatten_dense_tensors(flat, [p.data for p in mine])):
                    p.data.copy_(v)


def orthogonalise(us: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """NS_k of each tensor of ``us``, those of one shape stacked into one batched iteration."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, u in enumerate(us):
        by_shape.setdefault(tuple(u.shape), []).append(i)
    out: list[Optional[torch.Tensor]] = [None] * len(us)
    for shape, idx in by_shape.items():
        stacked = torch.stack([us[i] for i in idx]) if len(idx) > 1 else us[idx[0]].unsqueeze(0)
        orth = newton_schulz(stacked, steps)
        for j, i in enumerate(idx):
            out[i] = orth[j]
    return out  # type: ignore[return-value]
