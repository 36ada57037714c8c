"""Soak: 500 sharded training steps on 3 gloo ranks behind an emulated link whose latency jitters at
random, per collective and per rank: no hang, and the same losses, bit for bit, as without jitter.

Jitter changes only *when* each collective completes (and so which waits block, for how long, and
how far prefetches and reduce-scatters overlap compute), never what is computed: the per-group
collective order is fixed by program order on every rank ([Note: same collectives, same order, on
every rank] in ``overlap.sharding``), so any difference in the losses, or a hang, is a bug.

The jitter is a subclass of ``overlap.testing.EmulatedLink`` (``JitteryLink``): each collective's
link time is ``latency + bytes / bandwidth + U(0, jitter)``, drawn from a per-rank seeded generator,
so the ranks see different delays for the same collective.

Slow (``pytest -m slow tests/reliability/test_soak.py``): two runs of 500 steps. The ranks pack with the torch
fallback (``TRITON_INTERPRET=0``): the Triton interpreter costs ~0.4 s per step.
"""
from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import overlap
from overlap.testing import EmulatedLink
from models import SMALL_SIZES, TinyLM, single_threaded, small_step

STEPS = 500
WORLD = 3
BATCH = 6  # divisible by the world size
GBPS, LATENCY_US, JITTER_US = 0.05, 100.0, 2000.0  # 1.3 KiB moves in ~0.2 ms; jitter up to 2 ms


class JitteryLink(EmulatedLink):
    """An emulated link whose per-collective time gets a uniform random extra of up to ``jitter_us``."""

    def __init__(self, gbps: float, latency_us: float, jitter_us: float, seed: int) -> None:
        super().__init__(gbps, latency_us)
        self.jitter_us = jitter_us
        self._rng = random.Random(seed)
        self.jitters: list[float] = []

    def transfer_seconds(self, wire_bytes: float, group: Any = None) -> float:
        extra = self._rng.uniform(0.0, self.jitter_us) * 1e-6
        self.jitters.append(extra)
        return super().transfer_seconds(wire_bytes, group) + extra


def _soak_rank(rank: int, world: int, steps: int, jitter_us: float) -> dict[str, Any]:
    """Train ``steps`` steps behind the link; return the global loss per step and link facts."""
    link = JitteryLink(GBPS, LATENCY_US, jitter_us, seed=1000 + rank)
    with single_threaded(), link:
        torch.manual_seed(0)
        model = TinyLM(**SMALL_SIZES)
        for block in model.blocks:  # a fixed depth: the runs compare collective counts, which
            overlap.shard(block, prefetch=1)  # prefetch="auto"'s timed choice could change with the jitter
        overlap.shard(model, prefetch=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        losses = []
        for step in range(steps):
            total = torch.tensor([small_step(model, opt, step, rank, world, BATCH)])  # float32: exact
            torch.distributed.all_reduce(total)
            losses.append(total.item())
        return {"losses": losses, "collectives": link.stats().count, "max_jitter_s": max(link.jitters, default=0.0),
                "inflight_after": overlap.inflight_bytes()}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_jittery_link_soak_changes_nothing(distributed, monkeypatch: pytest.MonkeyPatch) -> None:
    """500 steps on 3 ranks, with and without latency jitter: both finish, with identical losses."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("OVERLAP_TEST_START_METHOD", "spawn")  # fork-server ranks keep the first call's mode
    steady = distributed(_soak_rank, WORLD, STEPS, 0.0, timeout=540)
    jittery = distributed(_soak_rank, WORLD, STEPS, JITTER_US, timeout=540)
    for rank, (a, b) in enumerate(zip(steady, jittery)):
        assert len(a["losses"]) == len(b["losses"]) == STEPS
        assert a["losses"] == b["losses"], f"rank {rank}: losses differ with jitter"
        assert a["losses"] == steady[0]["losses"], f"rank {rank}: ranks disagree on the global loss"
        assert a["collectives"] == b["collectives"] >= STEPS * 7, rank  # >= 6 runtime collectives + the loss, per step
        assert b["max_jitter_s"] > JITTER_US * 1e-6 / 2 and a["max_jitter_s"] == 0.0, rank
        assert a["inflight_after"] == b["inflight_after"] == 0, rank
    assert steady[0]["losses"][-1] < steady[0]["losses"][0], "the soak run did not train"
