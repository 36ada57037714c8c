"""Inductor's CPU ISA pick, made once in the test ranks' fork server so that every rank inherits it.

Imported by ``overlap.testing.run_distributed``'s fork server when ``OVERLAP_TEST_FORKSERVER_PRELOAD``
names it (tests/conftest.py does, under pytest-xdist: [Note: Inductor's per-process start-up in
tests] there); nothing else imports it. It lives in the package, not in ``tests/``, because the fork
server of Python 3.11 does not get the caller's ``sys.path``, only what a fresh interpreter finds
(``PYTHONPATH``, installed packages). Importing it runs
:func:`pick_inductor_vec_isa`: that import-time work is the module's whole purpose, since a fork
server runs nothing but its preload imports before it forks the ranks.
"""
from __future__ import annotations


def pick_inductor_vec_isa() -> str | None:
    """Run Inductor's ISA pick in this process (the probes it needs included) and return the ISA's
    name; ``None`` where this torch has no such pick. Its verdicts are cached in this process's memory
    (``functools.cache`` on the ISA list and on each ISA's checks), so processes forked from this one
    compile without probing again. Never raises: a fork server dies on any preload error but
    ``ImportError``, and a rank that probes for itself is slower, not wrong."""
    try:
        from torch._inductor import cpu_vec_isa

        return str(cpu_vec_isa.pick_vec_isa())
    except Exception:  # noqa: BLE001 (another torch's internals, a missing compiler: ranks probe as before)
        return None


PICKED_ISA = pick_inductor_vec_isa()
