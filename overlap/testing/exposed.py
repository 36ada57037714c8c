"""How much communication a step exposes: the same step timed without and with the link's delay.

A step run with no link delay takes its *compute side*: the math plus everything the runtime does
on the host (packing, bookkeeping, and on gloo the real loopback transfers, which burn CPU). Run
behind :class:`~overlap.testing.EmulatedLink`, the same step takes longer by exactly the
communication it failed to hide. Alternating the two kinds of step, medians over many, keeps slow
drifts of a shared machine out of the difference.

Two figures named alike mean different things: :attr:`PairedTimes.hidden_share` divides the hidden
communication by the part compute could have hidden (``min(comm, unlinked)``); the profiler's
``efficiency`` (``overlap.profiler.records.hidden_fraction``) divides it by all the communication.

Across ranks, figures are the slowest rank's: :func:`over_ranks`, the one helper for a value reduced
over every rank (benchmarks use it too).
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from overlap.testing.emulated_link import EmulatedLink

if TYPE_CHECKING:
    from overlap.profiler import Profiler

__all__ = ["PROFILE_WARMUP_STEPS", "PairedTimes", "interleaved_steps", "over_ranks", "paired_steps", "profiled_steps"]

PROFILE_WARMUP_STEPS = 1
""":func:`profiled_steps`' default ``warmup``: one step recorded before the reported ones suffices for
gathers issued one step ahead ([Note: warm-up steps of a profile] in ``overlap/profiler/recorder.py``)."""


@dataclasses.dataclass(frozen=True)
class PairedTimes:
    """Seconds per step without (``unlinked``) and with (``linked``) the link delay, and the link's
    busy time per linked step (``comm``). Figures are medians, of the slowest rank when distributed."""

    unlinked: float
    linked: float
    comm: float

    @property
    def exposed(self) -> float:
        """Communication the step waited for: linked minus unlinked (never negative)."""
        return max(0.0, self.linked - self.unlinked)

    @property
    def hidden_share(self) -> float:
        """Share of the hideable communication (at most the compute side) that was hidden, 0..1 (0.0
        when nothing was hideable). Not the profiler's ``efficiency`` (hidden / all communication)."""
        hideable = min(self.comm, self.unlinked)
        return max(0.0, min(1.0, (self.comm - self.exposed) / hideable)) if hideable > 0 else 0.0


def profiled_steps(step: Callable[[], object], steps: int, warmup: int = PROFILE_WARMUP_STEPS) -> Profiler:
    """``warmup + steps`` calls of ``step`` under ``overlap.profile(warmup=warmup)``, ``prof.step()``
    after each, so the ``steps`` it reports start with what the step before left in flight on their
    link; returns the profiler (``gather`` / ``report`` it)."""
    from overlap.profiler import profile  # on use: the profiler imports the runtime

    with profile(warmup=warmup) as prof:
        for _ in range(warmup + steps):
            step()
            prof.step()
    return prof


def over_ranks(value: float, op: dist.ReduceOp = dist.ReduceOp.MAX) -> float:
    """``value`` reduced with ``op`` over every rank of the default group: by default the slowest
    rank's (the largest). ``value`` itself when torch.distributed is not initialized. A collective:
    every rank calls it, in the same order (gloo or a CPU-capable backend: the value travels on CPU)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def settled_step(step: Callable[[], object], settle: int = 0) -> float:
    """Seconds of one call of ``step``, run right after ``settle`` untimed calls; the ranks line up
    (a barrier, where torch.distributed is initialized) before the first call, not between them.

    The untimed calls are for steps that leave collectives in flight for the next (gathers issued
    at the end of backward); the timed call follows them back to back, as in a training loop: a
    barrier between them would give the gathers still in flight an untimed wait to progress in,
    which the step never pays for. Measured with one (before 2026-12-03), bench_train's MLP with
    the demo's settings, 10 rounds of both ways interleaved: 4 ranks at half the calibrated link
    308.1 ms per step (0.96x the link's own busy time, which no real step can beat) against 334.3 ms
    back to back; at the calibrated link 2 ranks 106.6 vs 110.0 ms, 4 ranks 195.6 vs 227.9 ms."""
    if dist.is_initialized():
        dist.barrier()
    for _ in range(settle):
        step()
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def interleaved_steps(step: Callable[[], object], steps: int, links: Sequence[EmulatedLink | None],
                      warmup: int = 1, settle: int = 0) -> list[float]:
    """Run ``warmup`` untimed steps, then ``steps`` rounds of one step per entry of ``links`` (None:
    no link delay); return the median seconds per step for each entry, of the slowest rank.

    Interleaving keeps a shared machine's slow drifts out of the differences between entries. Every
    rank must call it with the same arguments (each entry's steps start together behind a barrier).
    ``settle``: untimed steps behind the same entry's link before each timed one, for steps that
    leave collectives in flight for the next (gathers issued at the end of backward): without them a
    timed step would use what the step before issued behind another entry's link (each timed step
    is :func:`settled_step`'s).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if isinstance(settle, bool) or not isinstance(settle, int) or settle < 0:
        raise ValueError(f"settle must be an int >= 0, got {settle!r}")

    for _ in range(warmup):
        settled_step(step)
    for link in links:
        if link is not None:
            link.reset_stats()
    times: list[list[float]] = [[] for _ in links]
    for _ in range(steps):
        for link, out in zip(links, times):
            with link if link is not None else contextlib.nullcontext():
                out.append(settled_step(step, settle))
    return [over_ranks(statistics.median(t)) for t in times]


def paired_steps(step: Callable[[], object], steps: int, gbps: float, latency_us: float,
                 warmup: int = 1, link: EmulatedLink | None = None, settle: int = 0) -> PairedTimes:
    """Run ``warmup`` untimed steps, then ``steps`` pairs (no link delay, then the link), each
    timed step after ``settle`` untimed ones of its kind (see :func:`interleaved_steps`).

    ``link``: the link to time behind (e.g. two tiers), instead of a uniform one of ``gbps`` and
    ``latency_us``; its statistics then cover the linked steps. Every rank must call it with the
    same arguments (steps start together behind a barrier).
    """
    if link is None:
        link = EmulatedLink(gbps, latency_us)
    unlinked, linked = interleaved_steps(step, steps, [None, link], warmup, settle)
    return PairedTimes(unlinked, linked, over_ranks(link.stats().emulated_seconds / (steps * (1 + settle))))
