"""overlap.testing.device_time: a callable's GPU time with its host time hidden, or None when it syncs.

The GPU cases skip without a CUDA device (``pytest -m gpu`` runs them on a GPU machine). Their
callable spends 2 ms on the host and queues about 0.1 ms of GPU work: a timer that let the host's
time in would read at least 2 ms per call, one that hides it reads the sleep. The bounds (0.03 to
0.6 ms) are wide because ``torch.cuda._sleep``'s cycles run at the clock of the moment, not the
calibration's; they still sit more than 3x from the host's 2 ms.

On CPU the same function runs against a scripted GPU (``_ScriptedGpu``: events read a clock the
callable advances, and the gate says whether the queue held), which checks what it does with the
events: the per-call times and their quantiles, the retries with 4x longer sleeps and ``None``
after the last, fewer calls where the host is slow.
"""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from conftest import requires_cuda
from overlap.testing.device_time import device_ms
from overlap.testing.emulated_link.cuda_sleep import cuda_sleep


def test_bad_arguments_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="device must be a CUDA torch.device"):
        device_ms(lambda: None, torch.device("cpu"))
    with pytest.raises(ValueError, match="device must be a CUDA torch.device"):
        device_ms(lambda: None, "cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="calls must be an int >= 2"):
        device_ms(lambda: None, torch.device("cuda"), calls=1)


def _host_then_gpu(device: torch.device) -> None:
    deadline = time.perf_counter() + 2e-3
    while time.perf_counter() < deadline:
        pass
    cuda_sleep(1e-4, device)


@pytest.mark.gpu
@requires_cuda
def test_the_host_time_of_a_call_is_hidden() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    timed = device_ms(lambda: _host_then_gpu(device), device, calls=10)
    assert timed is not None, "a callable that never waits on the GPU must be timed"
    median, p20, p80 = timed
    assert p20 <= median <= p80
    assert 0.03 < median < 0.6, f"{median:.3f} ms: the 2 ms of host time per call leaked in"


@pytest.mark.gpu
@requires_cuda
def test_a_callable_that_waits_for_the_gpu_has_no_device_time() -> None:
    device = torch.device("cuda", torch.cuda.current_device())

    def syncs() -> None:
        cuda_sleep(1e-4, device)
        torch.cuda.synchronize(device)

    assert device_ms(syncs, device, calls=4) is None


class _ScriptedGpu:
    """The CUDA calls ``device_ms`` makes, on CPU: a GPU clock that ``fn`` advances by its device
    time, events that read it when recorded, and a gate event whose ``query`` says, attempt by
    attempt, whether the GPU had got past the sleep before the host queued the last call."""

    def __init__(self, gate_passed: list[bool]) -> None:
        self.clock_ms = 0.0
        self.gate_passed = gate_passed
        self.sleeps: list[float] = []
        self.timing_events = 0
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at = None
                gpu.timing_events += enable_timing

            def record(self) -> None:
                self.at = gpu.clock_ms

            def query(self) -> bool:
                return gpu.gate_passed.pop(0)

            def elapsed_time(self, end: "Event") -> float:
                return end.at - self.at

        self.Event = Event

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from overlap.testing import device_time

        monkeypatch.setattr(device_time, "_Event", self.Event)
        monkeypatch.setattr(device_time, "_synchronize", lambda device: None)
        monkeypatch.setattr(device_time, "_device_context", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(device_time, "_sleep", lambda seconds, device: self.sleeps.append(seconds))
        monkeypatch.setattr(device_time, "_cold_cache", lambda device: torch.empty(8, dtype=torch.int8))


CUDA = torch.device("cuda", 0)


def test_a_held_queue_gives_each_calls_device_time(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = _ScriptedGpu(gate_passed=[False])
    gpu.install(monkeypatch)
    durations = iter([0.0] * 4 + [0.1 * (i + 1) for i in range(10)])  # 4 untimed calls, then 0.1 .. 1.0 ms

    def fn() -> None:
        gpu.clock_ms += next(durations)

    median, p20, p80 = device_ms(fn, CUDA, calls=10)
    assert (median, p20, p80) == pytest.approx((0.55, 0.28, 0.82))
    assert len(gpu.sleeps) == 1 and gpu.timing_events == 20


def test_a_queue_never_held_gives_none_after_longer_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    from overlap.testing import device_time

    gpu = _ScriptedGpu(gate_passed=[True] * device_time.ATTEMPTS)
    gpu.install(monkeypatch)
    assert device_ms(lambda: None, CUDA, calls=4) is None
    assert len(gpu.sleeps) == device_time.ATTEMPTS
    grown = [s - 1e-3 for s in gpu.sleeps]
    assert all(b == pytest.approx(4 * a) for a, b in zip(grown, grown[1:])), gpu.sleeps


def test_a_call_whose_host_time_is_long_is_timed_fewer_times(monkeypatch: pytest.MonkeyPatch) -> None:
    from overlap.testing import device_time

    gpu = _ScriptedGpu(gate_passed=[False])
    gpu.install(monkeypatch)
    host_s = device_time.MAX_HOLD_SECONDS / 4  # 40 calls would need 20x the first sleep's bound
    assert device_ms(lambda: time.sleep(host_s), CUDA, calls=40) is not None
    assert gpu.timing_events == 2 * 2  # two calls (the least), a start and an end event each
    assert gpu.sleeps[0] < 2 * device_time.MAX_HOLD_SECONDS
