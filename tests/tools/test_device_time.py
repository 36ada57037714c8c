"""overlap.testing.device_time: a callable's GPU time with its host time hidden, or None when it syncs.

The GPU cases skip without a CUDA device (``pytest -m gpu`` runs them on a GPU machine). Their
callable spends 2 ms on the host and queues about 0.1 ms of GPU work: a timer that let the host's
time in would read at least 2 ms per call, one that hides it reads the sleep. The bounds (0.03 to
0.6 ms) are wide because ``torch.cuda._sleep``'s cycles run at the clock of the moment, not the
calibration's; they still sit more than 3x from the host's 2 ms.
"""
from __future__ import annotations

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
