"""The demo's link calibration (``overlap.demo.training``): the bandwidth at which a step's
communication takes as long as its compute side, sized on the steps after the warm-up.

``calibrate_link`` is run on a fake step that advances a fake clock (the one ``settled_step`` reads),
with ``measure_traffic`` replaced by a fixed count, so the expected bandwidth is exact arithmetic.
"""
from __future__ import annotations

import types

import pytest

from overlap.demo import training
from overlap.demo.training import calibrate_link, calibrated_gbps
from overlap.testing import exposed

COLLECTIVES, WIRE_BYTES = 4, 1e6
"""What the fake step "sends" per step (``measure_traffic``'s answer)."""


def test_calibrated_gbps_leaves_the_latency_out_of_the_transfer_time():
    # 4 collectives x 100 us latency out of 10 ms: 9.6 ms for 1e6 bytes
    assert calibrated_gbps(0.010, 4, 1e6, 100.0) == pytest.approx(1e6 * 8 / 9.6e-3 / 1e9, rel=1e-12)
    # compute shorter than the latency: at least 1 ms is left for the bytes
    assert calibrated_gbps(0.0001, 4, 1e6, 100.0) == pytest.approx(1e6 * 8 / 1e-3 / 1e9, rel=1e-12)
    with pytest.raises(ValueError, match="moved 0"):
        calibrated_gbps(0.01, 4, 0, 100.0)


@pytest.mark.parametrize("warmup", [0, 2, 5])
def test_calibration_times_only_the_steps_after_its_warmup(monkeypatch, warmup):
    """The first ``slow`` calls take 30 ms (a schedule recording its costs), the rest 10 ms: with
    the warm-up covering the slow calls the link is sized to 10 ms, never to the slow ones."""
    slow = 2
    now = [0.0]
    calls = [0]

    def step():
        now[0] += 0.030 if calls[0] < slow else 0.010
        calls[0] += 1

    monkeypatch.setattr(exposed, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(training, "measure_traffic", lambda s: (COLLECTIVES, WIRE_BYTES))

    gbps = calibrate_link(step, latency_us=100.0, steps=3, warmup=warmup)

    timed = [0.030 if i < slow else 0.010 for i in range(warmup, warmup + 3)]
    expected = calibrated_gbps(sorted(timed)[1], COLLECTIVES, WIRE_BYTES, 100.0)
    assert gbps == pytest.approx(expected, rel=1e-12)
    if warmup >= slow:
        assert gbps == pytest.approx(calibrated_gbps(0.010, COLLECTIVES, WIRE_BYTES, 100.0), rel=1e-12)
    assert calls[0] == warmup + 3  # no step beyond the warm-up and the timed ones (traffic is faked)
