"""What the suite gives the processes of an xdist worker: Inductor's compile-worker pool sized from the
worker's share of the CPUs, and ranks that inherit Inductor's ISA pick from their fork server instead
of probing for it ([Note: Inductor's per-process start-up in tests] in tests/conftest.py)."""
from __future__ import annotations

import os
import subprocess

import pytest

import conftest

UNDER_XDIST = "PYTEST_XDIST_WORKER" in os.environ and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
"""Several xdist workers: tests/conftest.py sets the worker's share up only then (not with ``-n 1``)."""


def test_compile_threads_are_torchs_default_on_two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the 2-core CI box (3 workers) the share is what torch picks by itself there, so nothing
    changes where forcing 1 thread made the suite slower."""
    from torch._inductor import config

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert conftest.compile_threads_for_worker(conftest.usable_cpus(), conftest.auto_workers(2)) == config.decide_compile_threads()


def test_compile_threads_are_the_workers_share_on_a_big_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU host (16 cores, ``-n 14``) torch alone would give every compiling process a pool of
    16 workers; the worker's share is 2, never fewer (1 compiles in-process), and grows with the box."""
    from torch._inductor import config

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert config.decide_compile_threads() == 16, "torch's own pool size on 16 cores"
    assert conftest.compile_threads_for_worker(conftest.usable_cpus(), 14) == 2
    assert conftest.compile_threads_for_worker(64, 4) == 16
    assert conftest.compile_threads_for_worker(2, 1) == 2


def test_auto_workers_are_one_more_than_the_cpus_up_to_the_cap() -> None:
    """``-n auto`` on 2 cores runs 3 workers (the cores sat partly idle with 2), never more than the
    cap on a big box, and 2 on one CPU."""
    assert [conftest.auto_workers(cpus) for cpus in (1, 2, 3, 16)] == [2, 3, conftest.MAX_TEST_WORKERS, conftest.MAX_TEST_WORKERS]


def _rank_inductor_start_up(rank: int, world_size: int) -> dict:
    """The processes a compile in this rank would start for Inductor's ISA pick (counted, then run),
    and this rank's compile-worker pool size."""
    from torch._inductor import config, cpu_vec_isa

    probes: list = []
    popen = subprocess.Popen

    class CountingPopen(popen):  # what both subprocess.check_call (torch 2.11) and .run (2.13) start
        def __init__(self, args, *rest, **kwargs) -> None:
            probes.append(args)
            super().__init__(args, *rest, **kwargs)

    subprocess.Popen = CountingPopen
    try:
        isa = str(cpu_vec_isa.pick_vec_isa())
    finally:
        subprocess.Popen = popen
    return {"probes": probes, "isa": isa, "compile_threads": config.compile_threads,
            "env": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")}


@pytest.mark.skipif(not UNDER_XDIST, reason="the worker's share and the fork server's ISA pick are set up "
                    "only under pytest-xdist with several workers (tests/conftest.py); run with -n 2")
def test_ranks_inherit_the_isa_pick_and_the_workers_compile_share(distributed) -> None:
    """Each rank compiles without a ``python -c 'import torch; ...'`` probe of its own (on torch 2.11
    and 2.13 an unprepared process starts one per ISA extension, 3 to 7 on x86), and with the worker's
    compile-thread share."""
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    share = os.environ["TORCHINDUCTOR_COMPILE_THREADS"]
    if "TORCHINDUCTOR_COMPILE_THREADS" not in conftest.INHERITED_FROM_CALLER:
        assert share == str(conftest.compile_threads_for_worker(conftest.usable_cpus(), workers))
    for rank, r in enumerate(distributed(_rank_inductor_start_up, 2, timeout=60)):
        assert r["probes"] == [], f"rank {rank} probed ISAs itself: {r['probes']}"
        assert r["env"] == share and r["compile_threads"] == int(share), (rank, r, share)
