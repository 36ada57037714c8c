"""Planning on paper: the predicted step time and exposed communication of full sharding vs HSDP.

``overlap.plan.predict(model, topology, strategy)`` replays the sharded runtime's schedule for one
training step of ``model`` (``blocks`` equal blocks; see :class:`ModelCost`) on ``topology`` (nodes
x GPUs per node, an intra-node and an inter-node link) and returns a :class:`Prediction`.
``overlap.plan.table(...)`` prints the comparison over a range of cluster sizes.

[Note: the step model]
Resources: one compute stream, and one FIFO link per process group, which serves that group's
collectives one at a time in issue order (the emulated link's model, ``overlap.testing``). A
collective over ``w`` ranks on a link of bandwidth ``B`` and per-hop latency ``a`` takes
``hops * a + wire_bytes / B`` with ring costs: an all-gather or reduce-scatter moves ``(w-1)/w`` of
the full buffer per rank in ``w-1`` hops, an all-reduce twice that in ``2(w-1)`` hops. A group whose
ranks span nodes runs at the inter-node link's speed (its ring crosses it); each GPU has its own
inter-node bandwidth (one NIC per GPU, as on current GPU nodes).
Full sharding: one group of every GPU. HSDP: a shard group per node (intra-node link) and a
replicate group per local rank across nodes (inter-node link); the gradient's all-reduce moves the
``1/G`` shard.
The schedule is the runtime's at a fixed prefetch depth ``d`` (``prefetch``, default 1: FSDP2's;
``overlap.shard``'s default chooses ``d`` from measured costs), replayed by the one model behind the
runtime's own schedule choices (``scheduler.replayed_step``, [Note: replaying a step on a FIFO link]),
from a cold start: forward issues block ``i``'s all-gather and the ``d`` after it, waits for ``i``'s,
computes; the last block and the ``d`` before it stay gathered into backward ([Note: kept for
backward] in ``overlap/sharding.py``); backward runs the blocks in reverse, re-gathering ``d`` ahead,
then queues each block's reduce-scatter, then (HSDP) its all-reduce on the replicate link once the
reduce-scatter is done; the step ends when the last reduction lands. Not modelled: the root group
(embedding, head), the optimizer step, contention between tiers, congestion, and tree or
hierarchical algorithms that NCCL may pick at scale (so latency-bound predictions at thousands of
GPUs are pessimistic).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

from scheduler.replayed_step import step_ends

__all__ = ["LinkCost", "Topology", "ModelCost", "Prediction", "predict", "table"]

STRATEGIES = ("full", "hsdp")


def _check_positive(value: object, name: str, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """One tier of the network, per GPU: bandwidth in Gbit/s and latency per ring hop in µs
    (``per_hop=False``: one latency per collective, the emulated link's model, for validating the
    plan against emulated runs)."""

    gbps: float
    latency_us: float = 10.0
    per_hop: bool = True

    def __post_init__(self) -> None:
        _check_positive(self.gbps, "LinkCost.gbps")
        _check_positive(self.latency_us, "LinkCost.latency_us", allow_zero=True)
        if not isinstance(self.per_hop, bool):
            raise TypeError(f"LinkCost.per_hop must be a bool, got {self.per_hop!r}")

    def seconds(self, wire_bytes: float, hops: int) -> float:
        latencies = hops if self.per_hop else min(hops, 1)
        return latencies * self.latency_us * 1e-6 + wire_bytes * 8 / (self.gbps * 1e9)


@dataclasses.dataclass(frozen=True)
class Topology:
    """``nodes`` x ``gpus_per_node`` GPUs; ``intra`` links GPUs of a node, ``inter`` crosses nodes."""

    nodes: int
    gpus_per_node: int
    intra: LinkCost
    inter: LinkCost

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be an int >= 1, got {value!r}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """A model of ``blocks`` equal sharded blocks: bytes all-gathered per block (parameters in the
    gather dtype), bytes reduce-scattered per block (gradients in the reduce dtype; default: the
    same), and the compute time of one block's forward and backward (default backward: 2x forward)."""

    blocks: int
    param_bytes: float
    forward_seconds: float
    grad_bytes: Optional[float] = None
    backward_seconds: Optional[float] = None

    def __post_init__(self) -> None:
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 1:
            raise ValueError(f"ModelCost.blocks must be an int >= 1, got {self.blocks!r}")
        _check_positive(self.param_bytes, "ModelCost.param_bytes", allow_zero=True)
        _check_positive(self.forward_seconds, "ModelCost.forward_seconds", allow_zero=True)
        if self.grad_bytes is not None:
            _check_positive(self.grad_bytes, "ModelCost.grad_bytes", allow_zero=True)
        if self.backward_seconds is not None:
            _check_positive(self.backward_seconds, "ModelCost.backward_seconds", allow_zero=True)

    @property
    def reduce_bytes(self) -> float:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes

    @property
    def backward(self) -> float:
        return 2 * self.forward_seconds if self.backward_seconds is None else self.backward_seconds


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One step: its time, the compute in it, the busy time of each group's link, and what of the
    communication was not hidden (``step - compute``: the compute stream waited)."""

    strategy: str
    gpus: int
    step_seconds: float
    compute_seconds: float
    shard_link_seconds: float
    replicate_link_seconds: float

    @property
    def exposed_seconds(self) -> float:
        return self.step_seconds - self.compute_seconds

    @property
    def comm_seconds(self) -> float:
        return self.shard_link_seconds + self.replicate_link_seconds

    @property
    def hidden_share(self) -> float:
        """Share of the link time that ran under compute (1.0 with no communication)."""
        comm = self.comm_seconds
        return 1.0 if comm == 0 else max(0.0, 1.0 - self.exposed_seconds / comm)


def _collective_costs(model: ModelCost, topology: Topology, strategy: str) -> tuple[float, float, float]:
    """Seconds of one block's all-gather, reduce-scatter and cross-replica all-reduce (0: none)."""
    if strategy == "full":
        w, link, replicas = topology.gpus, (topology.inter if topology.nodes > 1 else topology.intra), 1
    else:
        w, link, replicas = topology.gpus_per_node, topology.intra, topology.nodes
    share = (w - 1) / w
    gather = link.seconds(share * model.param_bytes, w - 1) if w > 1 else 0.0
    reduce = link.seconds(share * model.reduce_bytes, w - 1) if w > 1 else 0.0
    all_reduce = 0.0
    if replicas > 1:
        shard_bytes = model.reduce_bytes / w
        all_reduce = topology.inter.seconds(2 * (replicas - 1) / replicas * shard_bytes, 2 * (replicas - 1))
    return gather, reduce, all_reduce


def predict(model: ModelCost, topology: Topology, strategy: str = "full", prefetch: int = 1) -> Prediction:
    """Replay one step of the runtime's schedule at prefetch depth ``prefetch`` (an int >= 0; see
    [Note: the step model])."""
    if not isinstance(model, ModelCost):
        raise TypeError(f"predict: model must be an overlap.plan.ModelCost, got {type(model).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"predict: topology must be an overlap.plan.Topology, got {type(topology).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"predict: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"predict: prefetch must be an int >= 0 (blocks gathered ahead), got {prefetch!r}")
    gather, reduce, all_reduce = _collective_costs(model, topology, strategy)
    n = model.blocks
    (step,) = step_ends([model.forward_seconds] * n, [gather] * n, prefetch, backward=[model.backward] * n,
                        reduce=[reduce] * n, replicate=[all_reduce] * n if all_reduce else None)
    regathered = max(0, n - 1 - prefetch)  # all but the blocks kept gathered into backward
    shard_busy = (n + regathered) * gather + n * reduce
    compute = n * (model.forward_seconds + model.backward)
    return Prediction(strategy, topology.gpus, step, compute, shard_busy, n * all_reduce)


def table(model: ModelCost, gpus_per_node: int, intra: LinkCost, inter: LinkCost,
          gpus: Iterable[int] = (8, 32, 128, 512, 1024, 4096)) -> str:
    """A text table: for each cluster size, full sharding vs HSDP (step time, exposed, hidden share)."""
    lines = [f"{'GPUs':>6} {'nodes':>6}  {'full: step ms':>13} {'exposed ms':>10} {'hidden':>7}"
             f"  {'HSDP: step ms':>13} {'exposed ms':>10} {'hidden':>7}  {'HSDP/full':>9}"]
    for total in gpus:
        if total % gpus_per_node:
            raise ValueError(f"table: {total} GPUs is not a multiple of gpus_per_node={gpus_per_node}")
        topology = Topology(total // gpus_per_node, gpus_per_node, intra, inter)
        full, hsdp = predict(model, topology, "full"), predict(model, topology, "hsdp")
        lines.append(f"{total:>6} {topology.nodes:>6}  {full.step_seconds * 1e3:>13.2f} "
                     f"{full.exposed_seconds * 1e3:>10.2f} {full.hidden_share:>7.1%}  "
                     f"{hsdp.step_seconds * 1e3:>13.2f} {hsdp.exposed_seconds * 1e3:>10.2f} "
                     f"{hsdp.hidden_share:>7.1%}  {hsdp.step_seconds / full.step_seconds:>9.2f}")
    return "\n".join(lines)
