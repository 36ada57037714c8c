"""Non-finite gradients found where they start (opt-in): ``overlap.set_check_finite`` / ``OVERLAP_CHECK_FINITE``.

Contract
--------
* Off (the default), the sharded runtime pays one flag read per group per reduction.
* On, before a group's reduce-scatter spreads its gradients, one reduction over the packed
  reduce-scatter input (``torch.linalg.vector_norm(rs_input, inf)``: its largest magnitude, NaN if any
  element is NaN, inf if any is infinite) is written into this rank's slot of a small flag vector
  (one float64 per data-parallel rank), which is all-reduced over the group right behind the
  reduce-scatter (and over the replicas with HSDP, behind their all-reduce). Before the reduced
  gradients are copied out, every rank reads the flags: if any rank's slot is not finite, **every
  rank** raises :class:`NonFiniteError`, at the same group, before writing that group's gradients
  (no sharded ``.grad`` of it changes, no post-accumulate-grad hook or optimizer-in-backward step
  runs for it). The rank that produced the values names the first parameter (its fqn from the root)
  and every parameter whose local gradient was non-finite, found on this slow path only; the other
  ranks name the producing rank(s), whose error names the parameters.
* The values checked are the packed local gradients as the reduce-scatter sends them: in the reduce
  dtype, after the pre-scale that fp16 reductions take, so a gradient that overflows in the cast to
  the reduce dtype is reported too. At world size 1 (nothing is reduced) the gradients moved to the
  shards are checked (one ``_foreach_norm``), and the error is raised before they are moved.
* On, epilogues run at the end of backward, after every reduce-scatter of the step is issued (not
  early, under backward: ``ParamGroup.finishes_early``), so every rank has issued the same
  collectives when it raises, and the flags are read on the host (one small host wait per group).
  Cost: the reduction, one small all-reduce per group, and the reduce-scatter input kept until its
  epilogue.
* ``step`` in the error counts the group's reductions while the check was on (1: the first).
* Every rank must use the same setting (the flag all-reduce is a collective). ``OVERLAP_CHECK_FINITE``
  takes the values of every boolean flag (``scheduler.env_flags``) and is read at the first reduction
  (and again after ``set_check_finite(None)``). Debug mode (``overlap.debug``) does not turn it on.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional, Sequence

import torch

from overlap.inflight_work import InflightWork
from scheduler.env_flags import Switch

__all__ = ["CHECK_FINITE_ENV", "NonFiniteError", "check_finite", "check_finite_enabled", "set_check_finite"]

CHECK_FINITE_ENV = "OVERLAP_CHECK_FINITE"

SWITCH = Switch(CHECK_FINITE_ENV, "set_check_finite")
"""The setting. The runtime reads ``SWITCH.on`` once per reduction and calls ``SWITCH.resolve()``
only when it is True (before the first reduction, or when on)."""


class NonFiniteError(FloatingPointError):
    """A gradient was NaN or infinite on some rank before a reduce-scatter would have spread it.

    ``ranks``: the global ranks whose local gradients were non-finite; ``step``: the group's reduction
    count while checking (1 = the first); ``fqns``: on a producing rank, the parameters (fqn from the
    root) whose local gradient was non-finite, first one first; elsewhere empty.
    """

    def __init__(self, message: str, ranks: Sequence[int] = (), step: int = 0, fqns: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.step = step
        self.fqns = tuple(fqns)


def set_check_finite(on: Optional[bool]) -> Optional[bool]:
    """Turn the finite check on or off for this process (``None``: follow ``OVERLAP_CHECK_FINITE`` again).

    Returns the previous explicit setting (``None`` if it followed the environment). Every rank must
    use the same setting.
    """
    return SWITCH.set(on)


def check_finite(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """The finite check on (or off) inside the block; the previous setting is restored on exit."""
    if not isinstance(on, bool):
        raise TypeError(f"check_finite: on must be True or False, got {on!r}")
    return SWITCH.scoped(on)


def check_finite_enabled() -> bool:
    """Is the finite check on (explicitly, or through ``OVERLAP_CHECK_FINITE``)?"""
    return SWITCH.resolve()


@dataclasses.dataclass
class FiniteCheck:
    """One reduction's check: the flags (this rank's slot written, all-reduced by ``work``), and
    what the slow path needs to name the parameters."""

    flags: torch.Tensor  # float64[data-parallel ranks]: each rank's largest |gradient| (NaN/inf: non-finite)
    work: Optional[InflightWork]  # the flags' all-reduce (None: nothing to wait)
    packed: torch.Tensor  # the reduce-scatter input, rank-major slots
    slot: int  # this rank's slot in ``flags``
    global_ranks: tuple[int, ...]  # the global rank of each slot
    step: int


def local_flags(packed: torch.Tensor, slot: int, size: int) -> torch.Tensor:
    """``float64[size]``, zeros but for ``slot``: the largest magnitude in ``packed`` (one reduction)."""
    flags = torch.zeros(size, dtype=torch.float64, device=packed.device)
    if packed.numel():
        flags[slot] = torch.linalg.vector_norm(packed, math.inf)
    return flags


def bad_slots(flags: torch.Tensor) -> list[int]:
    """The slots whose flag is NaN or infinite (reads the flags on the host)."""
    return torch.nonzero(~torch.isfinite(flags.cpu())).flatten().tolist()


def raise_non_finite(check: FiniteCheck, bad: list[int], local_fqns: list[str], module_fqn: str) -> None:
    """Raise the :class:`NonFiniteError` for a reduction whose flags name ``bad`` slots; ``local_fqns``
    are this rank's parameters with non-finite local gradients (empty when it is not among them);
    ``module_fqn`` names the sharded module whose group it is ('': the root)."""
    ranks = [check.global_ranks[s] for s in bad]
    me = check.global_ranks[check.slot]
    listed = ", ".join(str(r) for r in ranks)
    module = f"module {module_fqn!r}" if module_fqn else "the root module"
    where = f"step {check.step} (counted in reductions of {module}'s group since the check was on)"
    if check.slot in bad:
        shown = ", ".join(repr(f) for f in local_fqns[:8]) + (f" and {len(local_fqns) - 8} more" if len(local_fqns) > 8 else "")
        message = (f"overlap: non-finite gradient (NaN or inf) on rank {me} at {where}: parameter "
                   f"{local_fqns[0]!r} first (non-finite here: {shown}), found before the reduce-scatter "
                   f"spread it; ranks with non-finite gradients: {listed}. No gradient of this group was "
                   f"written on any rank.")
    else:
        message = (f"overlap: non-finite gradient (NaN or inf) on rank(s) {listed} at {where}, found before "
                   f"the reduce-scatter spread it; this rank's were finite (rank {listed.split(',')[0]}'s "
                   f"error names the parameters). No gradient of this group was written on any rank.")
    raise NonFiniteError(message, ranks, check.step, local_fqns)
