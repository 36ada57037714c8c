"""Testing helpers: run a function on several ranks, and an emulated interconnect for timing.

- :func:`run_distributed` — spawn ``world_size`` ranks with a process group, return per-rank results.
- :func:`emulated_link` — while active, ``torch.distributed`` collectives complete no sooner than a
  modelled link (latency + bytes / bandwidth) allows, without burning CPU.
- :func:`paired_steps` — a step timed without and with the link delay: its exposed communication
  (:func:`interleaved_steps`: behind any number of links, interleaved; :func:`settled_step`: one
  step timed after untimed ones of its kind, back to back; :func:`profiled_steps`: steps under
  ``overlap.profile`` after a warm-up step it records but does not report).
- :func:`over_ranks` — a figure reduced over every rank (by default the slowest rank's).
- ``overlap.testing.gpu_check`` — ``python -m overlap check-gpu``: prove a GPU machine (imported on use).
"""
from overlap.testing.emulated_link import EmulatedLink, EmulatedWork, LinkStats, current_link, emulated_link
from overlap.testing.exposed import (PROFILE_WARMUP_STEPS, PairedTimes, interleaved_steps, over_ranks, paired_steps,
                                     profiled_steps, settled_step)
from overlap.testing.harness import DistributedTestError, DistributedTimeoutError, RankFailure, run_distributed

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "EmulatedLink",
    "EmulatedWork",
    "LinkStats",
    "PROFILE_WARMUP_STEPS",
    "PairedTimes",
    "RankFailure",
    "current_link",
    "emulated_link",
    "interleaved_steps",
    "over_ranks",
    "paired_steps",
    "profiled_steps",
    "run_distributed",
    "settled_step",
]
