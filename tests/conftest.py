"""Shared test set-up.

Without a GPU, Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``); it must be set
before ``triton.jit`` decorates anything, so it is set here, before test modules import ``overlap_kernels``.
Spawned ranks inherit it through the environment.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Most tests are single-threaded (the Triton interpreter, graph passes) or partly wait (ranks behind
# the emulated link, process start-up), so one worker per core leaves cores idle: on the 2-core CI box
# with warm compile caches (torch 2.13, 2026-12-03) two workers took 596 s, three 497 s with the cores
# 98% busy. In `.ci/run`, whose caches start empty and whose cores are busy compiling, three workers
# were not shown faster (four runs against one with two, within the box's drift). More than
# four would start up to 16 rank processes at once (a multi-rank test starts up to four).
MAX_TEST_WORKERS = 4


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one), as torch counts them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compile_threads_for_worker(cpus: int, workers: int) -> int:
    """Inductor's compile-worker pool size for each compiling process of one xdist worker: the
    worker's share of the CPUs, at least 2 (torch's own default on 2 cores; 1 would compile in-process,
    which made the suite slower: [Note: Inductor's per-process start-up in tests])."""
    return max(2, cpus // max(1, workers))


# Under pytest-xdist the workers share the cores: the ranks a test starts take the harness's
# cpu_count // world_size threads each unless OMP_NUM_THREADS says otherwise, which on a 16-core
# machine with 14 workers put up to 224 threads on 16 cores. Three timing tests of the emulated link
# and the profiler failed on such a machine (the H100's host, 2026-11-26) and pass on 2 cores, where
# every rank has one thread; oversubscription is the likely cause, not yet confirmed there. So each
# worker's ranks get the worker's share: one thread on 2 cores, as before. The same goes for
# Inductor's compile workers and ISA probes: [Note: Inductor's per-process start-up in tests].
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_WORKER_ENV = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS", "OVERLAP_TEST_FORKSERVER_PRELOAD")
INHERITED_FROM_CALLER = frozenset(name for name in _WORKER_ENV if name in os.environ)  # left as they are
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // (2 * _WORKERS))))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(compile_threads_for_worker(usable_cpus(), _WORKERS)))
    # The ranks' fork server makes Inductor's ISA pick once; the ranks inherit it (the note below).
    os.environ.setdefault("OVERLAP_TEST_FORKSERVER_PRELOAD", "overlap.testing.inductor_isa_preload")


# [Note: Inductor's per-process start-up in tests]
# Every process that compiles with Inductor (each xdist worker, each rank a compile test starts, each
# demo subprocess) pays two start-up costs, both sized by the machine rather than by the test:
# - The ISA probe. It first probes which SIMD ISAs its C++ compiler can build and load: it builds a
#   small kernel per ISA and, on torch 2.11 and 2.13, loads each in a fresh ``python -c "import
#   torch; ..."`` subprocess, about six torch imports per compiling process: 10-50 s of a loaded 2-core
#   box each (2026-11-27; torch 2.15 keeps the verdict on disk, a ``.load_ok`` marker, and probes
#   once). Even with ``TORCHINDUCTOR_VEC_ISA_OK=1`` torch 2.11 and 2.13 check AVX512's bf16 / VNNI
#   extensions (and AMX's, on a CPU with AMX, as the GPU hosts' may have) in each process: 3 loads
#   per process on this box's AVX512 CPU, up to 7 with AMX.
# - The compile-worker pool. At its first ``torch.compile`` a process starts Inductor's pool of
#   ``min(32, cpus)`` subprocess workers (torch's default): 2 on the 2-core CI box, but 16 on the
#   GPU host's 16 cores, for every compiling rank of every one of its 14 xdist workers.
# On that GPU host (one H100, 16 cores, ``pytest -n 14``, torch 2.11, 2026-11-27) this made a process
# storm at compile time: a 4-rank compile test timed out after 120 s with three ranks waiting for the
# fourth, still inside its first compile's ISA probe (``check_build``'s subprocess); the same test had
# passed there a day earlier, under other load. So under xdist:
# - The controller probes once, honestly, in a thread while its workers start and collect; each
#   worker waits for the verdict before its first test, and when the probe accepts every ISA the CPU
#   reports (what ``TORCHINDUCTOR_VEC_ISA_OK=1`` assumes) it sets that variable, which its ranks and
#   subprocesses inherit: they skip the base ISAs' loads (the first compile in a 2-rank run went from
#   55-57 s to 22-42 s on torch 2.11, loaded box). Where the probe rejects one, nothing is set.
# - The ranks' fork server (``overlap.testing.run_distributed``) makes Inductor's whole ISA pick once
#   per worker, extensions included, before it forks any rank (``OVERLAP_TEST_FORKSERVER_PRELOAD``
#   names overlap/testing/inductor_isa_preload.py): the verdicts are cached in its memory, so a rank it forks
#   compiles without a probe process of its own (tests/tools/test_suite_environment.py counts them).
#   That one pick costs the worker a few seconds before its first multi-rank test, outside any test's
#   timeout. Ranks started with ``spawn`` and demo subprocesses still probe for themselves. That
#   import asks ``torch.cuda.is_available()`` on a host with a CUDA toolkit, so the server asks NVML
#   (the harness sets ``PYTORCH_NVML_BASED_CUDA_CHECK``): answered by the CUDA runtime, it would
#   initialize CUDA in the server and no forked rank could use the GPU (the H100 run of 2026-11-27).
# - Each worker's processes get a compile-worker pool of the worker's share of the CPUs, at least 2
#   (``TORCHINDUCTOR_COMPILE_THREADS``, :func:`compile_threads_for_worker`): 2 on the 16-core host
#   with 14 workers instead of 16, and still 2 on the 2-core box, torch's own default there. Not 1:
#   with compiles forced into the compiling process the whole suite took 591 s on torch 2.15 and 589 s
#   on 2.11 (``.ci/run``, 2 cores, fresh compile caches), against 429 s and 517 s with a pool of 2.
# Without workers (``-n 0``, one file) none of this is set up: most files never compile. It changes
# nothing of what is compiled; a variable already set by the caller is left alone.
_ISA_VERDICT_ENV = "OVERLAP_TEST_ISA_VERDICT"  # the controller's verdict file, for its workers
ISA_PROBE_WAIT_S = 600.0  # how long a worker waits for the verdict before probing for itself


def _torch_keeps_the_isa_verdict() -> bool:
    """Whether this torch's ISA probe leaves a ``.load_ok`` marker (2.15) and so probes once per cache
    dir by itself; read from its source file, so nothing is imported."""
    import importlib.util

    spec = importlib.util.find_spec("torch._inductor.cpu_vec_isa")
    if spec is None or spec.origin is None:
        return False
    with open(spec.origin) as source:
        return ".load_ok" in source.read()


def _probe_accepts_every_reported_isa() -> bool:
    """Inductor's honest ISA probe (builds and loads) gives the list that ``TORCHINDUCTOR_VEC_ISA_OK=1``
    assumes from the CPU's flags alone."""
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor import cpu_vec_isa

        probe = cpu_vec_isa.valid_vec_isa_list
        probed = [str(isa) for isa in probe()]
        probe.cache_clear()
        with inductor_config.patch({"cpp.vec_isa_ok": True}):
            assumed = [str(isa) for isa in probe()]
        probe.cache_clear()
    except (ImportError, AttributeError):  # another torch's internals: every process probes for itself
        return False
    return probed == assumed


def _start_isa_probe(config: pytest.Config) -> None:
    """In an xdist controller, before its workers start: the probe in a thread, its verdict ("1" or
    "0") written to a file named by ``OVERLAP_TEST_ISA_VERDICT``, which the workers inherit
    ([Note: Inductor's per-process start-up in tests])."""
    import shutil
    import tempfile
    import threading

    if "TORCHINDUCTOR_VEC_ISA_OK" in os.environ or _ISA_VERDICT_ENV in os.environ:
        return  # set by the caller, or this is a worker (it inherited the variable)
    if not isinstance(getattr(config.option, "numprocesses", None), int) or config.option.numprocesses < 1:
        return
    if _torch_keeps_the_isa_verdict():
        return
    folder = tempfile.mkdtemp(prefix="overlap-isa-probe-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    verdict = os.path.join(folder, "verdict")
    os.environ[_ISA_VERDICT_ENV] = verdict

    def probe() -> None:
        accepted = False
        try:
            accepted = _probe_accepts_every_reported_isa()
        finally:
            with open(verdict + ".partial", "w") as out:
                out.write("1" if accepted else "0")
            os.replace(verdict + ".partial", verdict)

    threading.Thread(target=probe, name="inductor-isa-probe", daemon=True).start()


@pytest.fixture(scope="session", autouse=True)
def _adopt_the_isa_verdict() -> None:
    """In an xdist worker, before its first test: wait for the controller's verdict and, when it
    accepts, set ``TORCHINDUCTOR_VEC_ISA_OK=1`` here (and in Inductor's config if already imported)."""
    import sys
    import time

    path = os.environ.get(_ISA_VERDICT_ENV)
    if path is None or "PYTEST_XDIST_WORKER" not in os.environ or "TORCHINDUCTOR_VEC_ISA_OK" in os.environ:
        return
    deadline = time.monotonic() + ISA_PROBE_WAIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        with open(path) as f:
            accepted = f.read() == "1"
    except OSError:  # no verdict in time: this worker's processes probe for themselves
        return
    if accepted:
        os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "1"
        inductor_config = sys.modules.get("torch._inductor.config")
        if inductor_config is not None:
            inductor_config.cpp.vec_isa_ok = True


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """The worker count of ``-n auto`` (pyproject's default): one per CPU this process may run on and
    one more (see ``MAX_TEST_WORKERS``), at most ``MAX_TEST_WORKERS``."""
    return auto_workers(usable_cpus())


def auto_workers(cpus: int) -> int:
    """``-n auto``'s worker count on ``cpus`` CPUs: ``cpus + 1``, at most ``MAX_TEST_WORKERS``."""
    return min(cpus + 1, MAX_TEST_WORKERS)


# [Note: longest files first]
# Test files run on the xdist workers one whole file at a time (``--dist loadfile``), each worker
# taking the next file in the queue when it finishes one. xdist orders that queue by the number of
# tests per file, most first, which sent the few-test compile files (one ~90 s test each on torch
# 2.11) to the end, where one ran alone for 1-2 minutes while the other worker idled (2026-11-27).
# So the queue keeps pytest's collection order (``loadscopereorder`` off), and the files below, the
# longest ones measured on 2 cores (torch 2.13, 2026-12-03, with test_inductor_tp.py's module fixture
# first: 92 s on 2.15), are collected first, longest first: the run ends on short files. A file
# missing here only starts later; tests/tools/test_suite_order.py checks that every name still exists.
LONGEST_FILES_FIRST = (
    "scheduling/test_inductor_tp.py",
    "packing/test_kernels_ops.py",
    "clients/test_clients.py",
    "shard/test_hsdp_compression.py",
    "packing/test_quantized_kernels.py",
    "tools/test_demo.py",
    "packing/test_aot_compile.py",
    "packing/test_kernels_alignment.py",
    "shard/test_shard_numerics.py",
    "shard/test_shard_runtime.py",
    "parallel/test_fsdp_tp_compression.py",
    "scheduling/test_compiled_step.py",
    "shard/test_deferred_steps.py",
    "clients/test_client_compile.py",
    "shard/test_prefetch_auto.py",
    "shard/test_owned_lists.py",
    "tools/test_gpu_check.py",
    "scheduling/test_cpu_all_gather.py",
    "scheduling/test_inductor_hook.py",
    "packing/test_kernels_library.py",
)
_TESTS_ROOT = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    _start_isa_probe(config)
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.7 ([Note: longest files first])
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """:data:`LONGEST_FILES_FIRST` first, in its order; the rest after, in collection order."""
    position = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}

    def file_position(item: pytest.Item) -> int:
        try:
            name = item.path.relative_to(_TESTS_ROOT).as_posix()
        except ValueError:  # a test outside tests/
            return len(position)
        return position.get(name, len(position))

    items.sort(key=file_position)  # stable: a file's tests keep their order


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
    from overlap_kernels._launch import torch_fallback_on_cpu

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
