"""Shared test set-up.

Without a GPU, Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``); it must be set
before ``triton.jit`` decorates anything, so it is set here, before test modules import ``kernels``.
Spawned ranks inherit it through the environment.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Most tests are single-threaded (the Triton interpreter, graph passes) or mostly wait (ranks behind
# the emulated link), so two workers on 2 cores take about two thirds of one worker's time. More
# than four would start up to 16 rank processes at once (a multi-rank test starts up to four).
MAX_TEST_WORKERS = 4


# Under pytest-xdist the workers share the cores: the ranks a test starts take the harness's
# cpu_count // world_size threads each unless OMP_NUM_THREADS says otherwise, which on a 16-core
# machine with 14 workers put up to 224 threads on 16 cores. Three timing tests of the emulated link
# and the profiler failed on such a machine (the H100's host, 2026-11-26) and pass on 2 cores, where
# every rank has one thread; oversubscription is the likely cause, not yet confirmed there. So each
# worker's ranks get the worker's share: one thread on 2 cores, as before.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (2 * _WORKERS))))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """The worker count of ``-n auto`` (pyproject's default): one per CPU this process may run on, at
    most ``MAX_TEST_WORKERS``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, MAX_TEST_WORKERS))

# Hypothesis profiles for the property tests (test_properties_*.py): "quick" (the default) keeps them
# to ~20 s on 2 cores; "long" (OVERLAP_HYPOTHESIS_PROFILE=long) explores 40x more examples.
# No deadline: the Triton interpreter's first launch of a kernel variant is slow, and timings are
# never asserted.
HYPOTHESIS_PROFILES = {"quick": 50, "long": 2000}  # name: max_examples per test
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the property tests skip themselves without hypothesis (the `test` extra has it)
    pass
else:
    for _name, _examples in HYPOTHESIS_PROFILES.items():
        settings.register_profile(
            _name, max_examples=_examples, deadline=None, print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
    _profile = os.environ.get("OVERLAP_HYPOTHESIS_PROFILE", "quick")
    if _profile not in HYPOTHESIS_PROFILES:
        raise ValueError(
            f"OVERLAP_HYPOTHESIS_PROFILE must be one of {sorted(HYPOTHESIS_PROFILES)}, got {_profile!r}"
        )
    settings.load_profile(_profile)


def _cpu_kernels_for(request: pytest.FixtureRequest):
    """With a ``torch_kernels`` marker, CPU packing runs the torch fallback instead of the Triton
    interpreter (``OVERLAP_CPU_KERNELS=torch``, seen by the ranks the test starts)."""
    from kernels._launch import torch_fallback_on_cpu

    if request.node.get_closest_marker("torch_kernels") is None:
        yield
        return
    with torch_fallback_on_cpu():
        yield


# Module-scoped for the module fixtures that run a module's ranks once (module marker), function-
# scoped for a test's own marker.
_torch_kernels_in_module = pytest.fixture(scope="module", autouse=True)(_cpu_kernels_for)
_torch_kernels_in_test = pytest.fixture(autouse=True)(_cpu_kernels_for)


@pytest.fixture
def distributed():
    """``overlap.testing.run_distributed``: ``distributed(fn, world_size, *args, **kwargs)`` runs
    ``fn(rank, world_size, *args, **kwargs)`` on gloo ranks (``fn`` at module level in the test file)
    and returns the per-rank results."""
    from overlap.testing import run_distributed

    return run_distributed


@pytest.fixture(scope="module")
def single_rank_group():
    """A 1-rank gloo default process group in this process (an in-memory store, no spawn), for the
    tests of one module; destroyed after them (other tests expect no process group here). Yields
    ``torch.distributed.group.WORLD``; an already initialized group is used and left alone."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
