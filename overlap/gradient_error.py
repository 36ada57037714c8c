"""How far compressed reductions move the gradients (opt-in debug): ``overlap.set_measure_gradient_error``
/ ``OVERLAP_MEASURE_GRADIENT_ERROR``.

Contract
--------
* Off (the default), a compressed reduction pays one flag read. Exact reductions never measure
  (their error is zero by definition).
* HSDP (a 2-D mesh, ``reduce="int8"`` or ``"fp8"``): what is compressed is the sum over the
  replicas of the shard group's (exact) reduce-scatter output; on, each such sum also issues an
  exact float32 all-reduce over the replicas of that output right behind its quantized all-gather,
  and each rank logs the dequantized sum against it over its own shards (post-scaled as the
  copy-out scales). The replicas hold the same shards, so over the whole mesh each counts once per
  replica: the ratio of :func:`relative_gradient_error` is unchanged.
* On, every compressed reduction (``overlap.shard(compress=overlap.Compression(reduce=...))``,
  int8 or fp8) also packs this rank's gradients exactly in float32 and issues an **exact** float32
  reduce-scatter of them right behind its all-to-all (a second collective: every rank must use the
  same setting). When the compressed reduction's copy-out runs, the owner compares what it writes
  (the float32 sum of the dequantized slots, averaged: bitwise what reaches ``.grad`` before its
  cast) with the exact average, over its own slot, and appends a :class:`GradientError` to this
  process's log.
* The log holds squared norms as device tensors (no host sync during the step); reading a record's
  floats (``take_gradient_errors``, :attr:`GradientError.relative`) syncs.
* Per step: ``take_gradient_errors()`` after the step returns (and clears) the records since the
  last take; :func:`relative_gradient_error` of them is ``||compressed - exact|| / ||exact||`` over
  all gradients of the step on this rank's shards, or over every rank's when given a process group
  (one all-reduce of two float64s: a collective every rank of the group must call).
* Cost when on: one float32 packing, one exact reduce-scatter and one dequantization of the
  received slots per compressed reduction. A debugging and validation tool, not for production.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from scheduler.env_flags import Switch

__all__ = ["GradientError", "MEASURE_GRADIENT_ERROR_ENV", "measure_gradient_error", "relative_gradient_error",
           "set_measure_gradient_error", "take_gradient_errors"]

MEASURE_GRADIENT_ERROR_ENV = "OVERLAP_MEASURE_GRADIENT_ERROR"

SWITCH = Switch(MEASURE_GRADIENT_ERROR_ENV, "set_measure_gradient_error")
"""The setting; the runtime reads ``SWITCH.on`` once per compressed reduction and calls
``SWITCH.resolve()`` only when it is True."""


@dataclasses.dataclass(frozen=True)
class GradientError:
    """One compressed reduction's error on this rank's slot: ``module`` is the sharded module's fqn
    from its root (``'root'`` for the root), ``error_sq`` = ``||compressed - exact||^2`` and ``exact_sq`` =
    ``||exact||^2`` of the averaged gradients (float64 0-dim tensors)."""

    module: str
    error_sq: torch.Tensor
    exact_sq: torch.Tensor

    @property
    def relative(self) -> float:
        """``||compressed - exact|| / ||exact||`` (0 when both are 0, inf when only the exact is)."""
        return _ratio(float(self.error_sq), float(self.exact_sq))


_LOG: list[GradientError] = []


def record(module: str, compressed: torch.Tensor, exact: torch.Tensor) -> None:
    """Append the error of ``compressed`` against ``exact`` (same shape) to the log (the runtime calls it)."""
    diff = compressed.double() - exact.double()
    _LOG.append(GradientError(module, torch.dot(diff, diff), torch.dot(exact.double(), exact.double())))


def take_gradient_errors() -> list[GradientError]:
    """The records since the last call (one per compressed reduction, in order), and clear the log."""
    taken = list(_LOG)
    _LOG.clear()
    return taken


def relative_gradient_error(records: Sequence[GradientError], group: Optional[dist.ProcessGroup] = None) -> float:
    """``sqrt(sum error_sq / sum exact_sq)`` over ``records`` (e.g. one step's); with ``group``, summed
    over the group's ranks first (an all-reduce every rank of ``group`` must call)."""
    bad = [type(r).__name__ for r in records if not isinstance(r, GradientError)]
    if bad:
        raise TypeError(f"relative_gradient_error: records must be overlap.GradientError objects "
                        f"(from take_gradient_errors), got {bad[:3]}")
    sums = torch.tensor([sum(float(r.error_sq) for r in records), sum(float(r.exact_sq) for r in records)],
                        dtype=torch.float64)
    if group is not None:
        device = records[0].error_sq.device if records else torch.device("cpu")
        sums = sums.to(device)
        dist.all_reduce(sums, group=group)
        sums = sums.cpu()
    return _ratio(float(sums[0]), float(sums[1]))


def set_measure_gradient_error(on: Optional[bool]) -> Optional[bool]:
    """Measure (or not) the error of compressed reductions in this process (``None``: follow
    ``OVERLAP_MEASURE_GRADIENT_ERROR`` again); returns the previous explicit setting. Every rank must
    use the same setting (measuring adds a collective)."""
    return SWITCH.set(on)


def measure_gradient_error(on: bool = True):  # -> contextlib.AbstractContextManager[None]
    """Measuring on (or off) inside the block; the previous setting is restored on exit."""
    if not isinstance(on, bool):
        raise TypeError(f"measure_gradient_error: on must be True or False, got {on!r}")
    return SWITCH.scoped(on)


def _ratio(error_sq: float, exact_sq: float) -> float:
    if exact_sq == 0.0:
        return 0.0 if error_sq == 0.0 else math.inf
    return math.sqrt(error_sq / exact_sq)
