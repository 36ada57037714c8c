"""Gather-ahead: which groups' next-step all-gathers to issue in this step's backward, from measured costs.

Contract: pure functions of numbers (no torch, no process groups), so every rank computes the same
answer from the same inputs; the runtime (``overlap.shard`` with ``prefetch="auto"`` and an optimizer
stepped in backward) measures the inputs, agrees the answer across ranks, and applies it.

Inputs, per forward position (the agreed forward order; one group per position):

==============  ================================================================================
``compute``     seconds of the position's forward on the compute stream (with its gather's packing)
``gather``      seconds its all-gather occupies the link (``reduce``: its reduce-scatter's, default the same)
``backward``    seconds of the position's backward (optional: twice ``compute``)
``nbytes``      bytes its all-gather brings in: what a gather issued ahead holds until forward
``depth``       the prefetch depth already chosen (``scheduler.prefetch_depth``)
``budget``      bytes of unsharded parameters the schedule may hold at once (``held_bytes``: the
                root, forward's ``1 + depth`` window and the gathers held across the step
                boundary; [Note: the bytes a plan holds])
==============  ================================================================================

[Note: choosing the gathers issued ahead]
With the optimizer stepped in backward, a group's shards are final once its step ran, right after
its reduce-scatter landed; backward reduces the groups in reverse forward order, so the first ones
stepped are the last ones the next forward needs. Issuing their next-step gathers in this backward
moves them from the forward (where the link is the bottleneck when comm ~ compute) into backward,
where the link otherwise waits on gradients. The plan is ``(count, lag)``: the first ``count``
groups reduced are gathered ahead, each right after the reduce-scatter of the group reduced ``lag``
after it was issued (a program-order point, the same on every rank; the host first waits for the
group's own reduce-scatter and runs its step there if that has not happened yet), and any whose
point does not come in this backward at its end. At the end of backward the next forward's first
``1 + depth`` groups are gathered too (they are stepped by then; the link is empty there).
The link is a FIFO: a gather issued ahead is queued before the re-gathers and reduce-scatters
issued after it, so it can delay backward. The model replays several steps of the runtime's
schedule (``scheduler.replayed_step``, [Note: replaying a step on a FIFO link]: the prefetch
depth's model, run on past the first step, plus the gathers ahead and the host waits for their
reductions) and takes the steady-state step time; with nothing gathered ahead that is the prefetch
model's step. ``(0, 1)``, issue nothing ahead in backward, is the
fallback: another plan is taken only where the model says it is faster by more than ``tolerance``
and its held bytes fit the budget, so the choice never loses to the schedule without it, as far
as the model goes.

The bytes a plan holds are ``scheduler.held_bytes``'s ([Note: the bytes a plan holds]).

[Note: a deeper depth for gathering ahead]
The depth is chosen first, on the prefetch model's cold step (``scheduler.prefetch_depth``), where
every depth past the one that keeps forward's link queue full ties, so ties go to the shallowest.
But a deeper depth keeps more of forward's last groups into backward ([Note: kept for backward] in
``overlap/sharding.py``): fewer re-gathers on backward's link, which leaves room there for gathers
issued ahead, and those shorten the next forward, which is link-bound when comm ~ compute. That
gain is visible only in the steady state with a plan, so ``choose_schedule`` takes the depth
chosen and its plan, then tries each deeper depth the budget allows with its own best plan, and
moves to it only where its steady step is shorter than the choice so far by more than
``tolerance`` (a deeper depth within the tolerance of a shallower one leaves the shallower). On
the demo's recorded costs (2 ranks, small model, the calibrated link, 2026-12-04) the cold choice
was depth 2 with nothing ahead (179.4 ms modelled); depth 3 with the first 2 reduced groups ahead
models 176.2 ms. Interleaved in one run on the 2-core box
(``benchmarks/RESULTS.md``), forced depths with their chosen plans ran 0.93-0.97x the step of the
cold choice; with ``choose_schedule`` in the runtime, ``prefetch="auto"`` chose depth 3 with (2, 1)
and ran 0.88x ``prefetch=1``'s step (``benchmarks/bench_prefetch.py``, 2026-12-05).
"""
from __future__ import annotations

from typing import AbstractSet, Optional, Sequence

from scheduler.held_bytes import held_bytes
from scheduler.prefetch_depth import check_costs
from scheduler.replayed_step import step_ends

__all__ = ["choose_gather_ahead", "choose_schedule", "modelled_steady_step", "held_bytes"]

LAGS = (1, 2, 3)
"""The issue points tried: right after the reduce-scatter of the group reduced 1, 2 or 3 after."""


def modelled_steady_step(compute: Sequence[float], gather: Sequence[float], depth: int, count: int,
                         lag: int = 1, steps: int = 4, backward: Optional[Sequence[float]] = None,
                         loss: float = 0.0, tail: float = 0.0, reduce: Optional[Sequence[float]] = None,
                         backward_gathers: Optional[Sequence[bool]] = None) -> float:
    """Seconds per step in the steady state of ``steps`` replayed steps with the first ``count``
    reduced groups gathered ahead at ``lag`` (see [Note: choosing the gathers issued ahead]): the
    mean of the second half of the steps."""
    ends = step_ends(compute, gather, depth, steps, count, lag, backward, loss, tail, reduce,
                     backward_gathers=backward_gathers)
    if not ends:
        return 0.0
    half = len(ends) // 2
    return (ends[-1] - ends[half - 1]) / (len(ends) - half)


def choose_gather_ahead(compute: Sequence[float], gather: Sequence[float], nbytes: Sequence[int], depth: int,
                        budget: int, tolerance: float = 0.01,
                        backward: Optional[Sequence[float]] = None, loss: float = 0.0,
                        tail: float = 0.0, enclosing: Optional[Sequence[AbstractSet[int]]] = None,
                        reduce: Optional[Sequence[float]] = None,
                        backward_gathers: Optional[Sequence[bool]] = None) -> tuple[int, int]:
    """``(count, lag)``: how many of the first reduced groups to gather ahead in backward, and at
    which issue point (see [Note: choosing the gathers issued ahead]); ``(0, 1)`` where nothing
    modelled is faster by more than ``tolerance`` or fits ``budget``. ``enclosing``: nested groups,
    as ``scheduler.held_bytes.held_bytes`` takes them (None: one after the other);
    ``backward_gathers``: as ``scheduler.replayed_step.step_ends`` takes it."""
    check_costs(compute, gather, nbytes, "position", backward, reduce)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth must be an int >= 0, got {depth!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0 (bytes), got {budget!r}")
    n = len(compute)
    costs = dict(backward=backward, loss=loss, tail=tail, reduce=reduce, backward_gathers=backward_gathers)
    best, plan = modelled_steady_step(compute, gather, depth, 0, **costs), (0, 1)
    fallback = best
    for count in range(1, n + 1):
        if held_bytes(nbytes, depth, count, enclosing) > budget:
            break
        for lag in LAGS:
            t = modelled_steady_step(compute, gather, depth, count, lag, **costs)
            if t < best and t < fallback * (1 - tolerance):
                best, plan = t, (count, lag)
    return plan


def choose_schedule(compute: Sequence[float], gather: Sequence[float], nbytes: Sequence[int], depth: int,
                    budget: int, tolerance: float = 0.01, backward: Optional[Sequence[float]] = None,
                    loss: float = 0.0, tail: float = 0.0,
                    enclosing: Optional[Sequence[AbstractSet[int]]] = None,
                    reduce: Optional[Sequence[float]] = None,
                    backward_gathers: Optional[Sequence[bool]] = None) -> tuple[int, tuple[int, int]]:
    """``(depth, (count, lag))``: the prefetch ``depth`` already chosen with its gather-ahead plan
    (:func:`choose_gather_ahead`), or a deeper depth and its plan within ``budget`` where that models
    a steady step shorter than the choice so far (shallower) by more than ``tolerance`` (see [Note:
    a deeper depth for gathering ahead]). Never shallower than ``depth``."""
    check_costs(compute, gather, nbytes, "position", backward, reduce)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an int >= 1, got {depth!r}")
    costs = dict(backward=backward, loss=loss, tail=tail, reduce=reduce, backward_gathers=backward_gathers)
    plan = choose_gather_ahead(compute, gather, nbytes, depth, budget, tolerance=tolerance, enclosing=enclosing, **costs)
    chosen, best = (depth, plan), modelled_steady_step(compute, gather, depth, *plan, **costs)
    for deeper in range(depth + 1, len(compute)):
        if held_bytes(nbytes, deeper, 0, enclosing) > budget:
            break  # held bytes only grow with the depth
        deeper_plan = choose_gather_ahead(compute, gather, nbytes, deeper, budget, tolerance=tolerance,
                                          enclosing=enclosing, **costs)
        t = modelled_steady_step(compute, gather, deeper, *deeper_plan, **costs)
        if t < best * (1 - tolerance):  # so the choice so far keeps its near-ties
            best, chosen = t, (deeper, deeper_plan)
    return chosen
