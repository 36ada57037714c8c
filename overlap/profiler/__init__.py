"""``overlap.profile()``: where each collective's time went, hidden behind compute or exposed.

.. code-block:: python

    with overlap.profile() as prof:
        for batch in loader:
            train_step(batch)
            prof.step()                      # step boundary, like torch.profiler
    prof.report()                            # prints a table, returns a Report (dataclasses)
    prof.export_chrome_trace("trace.json")   # Perfetto / chrome://tracing
    prof.plot("timeline.png")                # needs matplotlib: pip install 'triton-overlap[plot]'

A loop that issues the next step's gathers at the end of a step (``overlap.prefetch_next_step``)
starts each step with collectives in flight: ``overlap.profile(warmup=1)`` records a first step
without reporting it, so that the reported ones see those gathers ([Note: warm-up steps of a profile]
in ``recorder``).

Across ranks: ``merged = prof.gather()`` (every rank calls it) returns on rank 0 a
:class:`ProfileResult` of every rank's records, which has the same ``report`` /
``export_chrome_trace`` / ``plot``; :func:`merge` combines :class:`RankProfile` objects that reached
one process another way (e.g. returned by ``overlap.testing.run_distributed``).

The package, one concern a module (each module's docstring states its contract):

=========================  ===========================================================================
module                     contract
=========================  ===========================================================================
``recorder``               :class:`Profiler` / :func:`profile` / :func:`merge`: what is recorded per
                           collective and when, the timing model (CPU watchers, CUDA events), cost
                           when off, one profiler at a time
``records``                the plain, picklable records (:class:`CollectiveRecord`, :class:`StepRecord`,
                           :class:`RankProfile`) and the definitions of stall, exposed, hidden,
                           efficiency and bandwidth
``report``                 :class:`ProfileResult`, :class:`Report`, :class:`CommSummary`,
                           :class:`StepSummary`: the figures per kind, label and step, and the table
``export``                 the Chrome trace and the PNG timeline
=========================  ===========================================================================

Every public name is importable from ``overlap.profiler`` itself.
"""
from overlap.profiler.recorder import Profiler, merge, profile
from overlap.profiler.records import CollectiveRecord, RankProfile, StepRecord
from overlap.profiler.report import CommSummary, ProfileResult, Report, StepSummary

__all__ = [
    "CollectiveRecord", "CommSummary", "ProfileResult", "Profiler", "RankProfile", "Report", "StepRecord",
    "StepSummary", "merge", "profile",
]
